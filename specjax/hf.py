"""Hugging Face checkpoints <-> specjax params: the only module that knows HF tensor names.

Key map. Our modules mirror HF attribute names, so a parameter's HF name follows mechanically from
its NNX path: the module path (`model.layers.0.self_attn.q_proj`) is kept, optionally rewritten by a
prefix map or a rename function, and the leaf is translated by a `LeafRule`:

    Linear  `kernel` [in, out]      <-> `weight` [out, in]   (transposed)
    Linear  `bias` [out]            <-> `bias`
    Embed   `embedding` [V, H]      <-> `weight` [V, H]
    RMSNorm `weight` [d]            <-> `weight` [d]

So the target's `model.layers.{i}.self_attn.q_proj.kernel` is HF
`model.layers.{i}.self_attn.q_proj.weight` and `lm_head.kernel` is `lm_head.weight` (absent when
embeddings are tied). Drafters use the same rules with their own `KeyMap` (DeepSpec drafters have
no `model.` prefix: `layers.0...`, `fc.weight`, `markov_head.markov_w1.weight`, ...) that also
stores their `Frozen` copies of the target's embedding and lm_head; the drafter key maps, tensor
names and config.json dialects are documented in the "Drafters" section below (loading and
saving by architecture: `specjax.drafters.registry`).

Loading reads safetensors only (never pickles, never remote code), one tensor at a time, casts each
to the parameter dtype and, given a mesh, places it with the NamedSharding of its `logical_axes`
metadata (via `specjax.sharding`). Modules built with `nnx.eval_shape` are filled in place, so no
random initialisation is ever materialised.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import ConfigError, TargetConfig, read_json

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json")
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

# HF tensors that may be present in a checkpoint but carry no parameters (regexes, full match).
HARMLESS_EXTRA = (r"(.+\.)?rotary_emb\.inv_freq",)


# ----------------------------------------------------------------------------------------------
# Key map
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LeafRule:
    """Our leaf attribute name <-> HF leaf name; `transpose` for 2-D kernels stored [out, in]."""

    ours: str
    hf: str
    transpose: bool = False


DEFAULT_LEAF_RULES = (
    LeafRule("kernel", "weight", transpose=True),  # Linear
    LeafRule("embedding", "weight"),  # Embed
    LeafRule("weight", "weight"),  # RMSNorm
    LeafRule("bias", "bias"),  # Linear bias
)


@dataclasses.dataclass(frozen=True)
class KeyMap:
    """How our NNX param paths map onto HF tensor names.

    `prefix_map` rewrites the leading part of our dotted module path (longest matching prefix
    wins; e.g. {"": "model."} adds a prefix, {"backbone.": ""} strips one). `rename`, applied
    afterwards to the full HF name, may rewrite it or return None to mean "not stored in the
    checkpoint" (the param is skipped on load and export). `ignore_extra` are regexes (full match)
    of HF tensors that may be present without a matching param. `variable_types`: the nnx.Variable
    classes that are checkpoint tensors (default nnx.Param; drafters add their `Frozen` copies of
    the target's embedding and lm_head).
    """

    prefix_map: Mapping[str, str] | None = None
    rename: Callable[[str], str | None] | None = None
    leaf_rules: tuple[LeafRule, ...] = DEFAULT_LEAF_RULES
    ignore_extra: tuple[str, ...] = HARMLESS_EXTRA
    variable_types: tuple[type, ...] = (nnx.Param,)  # which nnx.Variable kinds are stored

    def hf_name(self, path: Sequence[Any]) -> tuple[str | None, bool]:
        """(HF tensor name or None if skipped, transpose) of an NNX param path."""
        parts = [str(p) for p in path]
        leaf = parts[-1]
        rule = next((r for r in self.leaf_rules if r.ours == leaf), None)
        if rule is None:
            raise ValueError(f"param '{'.'.join(parts)}': no key-map rule for leaf '{leaf}' "
                             f"(known leaves: {[r.ours for r in self.leaf_rules]})")
        module = ".".join(parts[:-1])
        if self.prefix_map:
            dotted = module + "." if module else ""
            best = max((p for p in self.prefix_map if dotted.startswith(p)), key=len, default=None)
            if best is not None:
                dotted = self.prefix_map[best] + dotted[len(best):]
            module = dotted[:-1] if dotted.endswith(".") else dotted
        name = f"{module}.{rule.hf}" if module else rule.hf
        if self.rename is not None:
            name = self.rename(name)
        return name, rule.transpose

    def is_harmless(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.ignore_extra)


TARGET_KEY_MAP = KeyMap()


class ParamEntry(NamedTuple):
    path: str  # our dotted param path, e.g. "model.layers.0.self_attn.q_proj.kernel"
    hf_name: str | None  # None: not stored in the checkpoint
    transpose: bool
    variable: nnx.Variable


def param_entries(module: nnx.Module, key_map: KeyMap | None = None) -> list[ParamEntry]:
    """Every stored variable of `module` (nnx.Param, or the key map's `variable_types`; shared
    ones once) with its HF name, in graph order."""
    key_map = key_map or TARGET_KEY_MAP
    out, seen = [], set()
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, key_map.variable_types) or id(node) in seen:
            continue
        seen.add(id(node))
        name, transpose = key_map.hf_name(path)
        out.append(ParamEntry(".".join(str(p) for p in path), name, transpose, node))
    return out


def _hf_shape(shape: Sequence[int], transpose: bool) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if transpose:
        if len(shape) != 2:
            raise ValueError(f"transpose rule needs a 2-D param, got shape {shape}")
        return shape[::-1]
    return shape


# ----------------------------------------------------------------------------------------------
# Reading safetensors
# ----------------------------------------------------------------------------------------------

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _raw_dtype(code: str) -> np.dtype:
    if code == "BF16":
        return jnp.dtype("bfloat16")  # ml_dtypes.bfloat16 as a numpy dtype
    if code not in _ST_DTYPES:
        raise ValueError(f"unsupported safetensors dtype {code}")
    return np.dtype(_ST_DTYPES[code])


def _read_raw(file: str, name: str) -> np.ndarray:
    """Read one tensor by parsing the safetensors header directly (fallback, e.g. for BF16)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        if name not in header:
            raise KeyError(f"tensor '{name}' not in {file}")
        info = header[name]
        begin, end = info["data_offsets"]
        f.seek(8 + n + begin)
        buf = f.read(end - begin)
    dt = _raw_dtype(info["dtype"]).newbyteorder("<")
    return np.frombuffer(buf, dtype=dt).reshape(info["shape"]).copy()


def _refuse_pickles(path: str) -> None:
    pickles = sorted(f for f in os.listdir(path) if f.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(f"{path}: only pickle-format weights found ({', '.join(pickles)}); "
                         f"safetensors is required (pickle files are never loaded)")


class SafetensorsDir(Mapping[str, np.ndarray]):
    """Lazy read-only mapping name -> np.ndarray over one `model.safetensors`, a sharded set
    (`model.safetensors.index.json`) or a single `.safetensors` file. Each lookup reads one
    tensor; nothing else stays in host memory. Use as a context manager (or call `close`)."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open  # noqa: F401  (fail early if missing)

        path = os.fspath(path)
        self.source = path
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}  # tensor name -> file
        if os.path.isfile(path):
            if not path.endswith(".safetensors"):
                if path.endswith(PICKLE_SUFFIXES):
                    raise ValueError(f"{path}: pickle-format weights; safetensors is required "
                                     f"(pickle files are never loaded)")
                raise ValueError(f"{path}: not a .safetensors file")
            self._add_file(path)
            return
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint path does not exist: {path}")
        index = os.path.join(path, SAFE_INDEX)
        single = os.path.join(path, SAFE_WEIGHTS)
        if os.path.exists(index):
            data = read_json(index)
            wmap = data.get("weight_map")
            if not isinstance(wmap, Mapping):
                raise ValueError(f"{index}: missing 'weight_map'")
            for fname in sorted(set(wmap.values())):
                if not os.path.exists(os.path.join(path, fname)):
                    raise FileNotFoundError(f"{index}: shard '{fname}' listed but missing")
            self._where = {k: os.path.join(path, v) for k, v in wmap.items()}
        elif os.path.exists(single):
            self._add_file(single)
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                _refuse_pickles(path)
                raise FileNotFoundError(f"{path}: no {SAFE_WEIGHTS} or {SAFE_INDEX} found")
            for f in files:
                self._add_file(os.path.join(path, f))

    def _add_file(self, file: str) -> None:
        for k in self._open(file).keys():
            if k in self._where:
                raise ValueError(f"tensor '{k}' appears in both {self._where[k]} and {file}")
            self._where[k] = file

    def _open(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open
            self._handles[file] = safe_open(file, framework="numpy")
        return self._handles[file]

    def file_of(self, name: str) -> str:
        return self._where[name]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape from the file header, without reading the data."""
        try:
            return tuple(self._open(self._where[name]).get_slice(name).get_shape())
        except KeyError:
            raise
        except Exception as e:  # name listed in the index but not in the shard
            raise ValueError(f"tensor '{name}': cannot read its header in "
                             f"{self._where[name]} ({e})") from None

    def __getitem__(self, name: str) -> np.ndarray:
        file = self._where[name]
        try:
            return self._open(file).get_tensor(name)
        except (TypeError, ValueError, AttributeError):  # e.g. BF16 without numpy support
            return _read_raw(file, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "SafetensorsDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_safetensors_dir(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) for every tensor of a safetensors checkpoint, one tensor at a time."""
    with SafetensorsDir(path) as reader:
        for name in reader:
            yield name, reader[name]


def _shape_of(tensors: Mapping[str, Any], name: str) -> tuple[int, ...]:
    if hasattr(tensors, "tensor_shape"):
        return tuple(tensors.tensor_shape(name))
    return tuple(np.shape(tensors[name]))


# ----------------------------------------------------------------------------------------------
# Loading into modules
# ----------------------------------------------------------------------------------------------

class LoadReport(NamedTuple):
    loaded: tuple[str, ...]  # HF names read
    skipped: tuple[str, ...]  # our param paths the key map leaves out of the checkpoint
    ignored: tuple[str, ...]  # harmless extra HF tensors present but unused


def _place(arr: np.ndarray, var: nnx.Variable, mesh, rules) -> jax.Array:
    if mesh is None:
        return jnp.asarray(arr)
    try:
        from specjax.sharding import named_sharding
    except ImportError as e:  # pragma: no cover - depends on the sharding module being present
        raise RuntimeError("placing params on a mesh needs specjax.sharding.named_sharding") from e
    axes = var.get_metadata().get("logical_axes") or (None,) * arr.ndim
    rules = "serve" if rules is None else rules
    return jax.device_put(arr, named_sharding(mesh, tuple(axes), tuple(arr.shape), rules))


def load_params_into(module: nnx.Module,
                     tensors: Mapping[str, np.ndarray] | str | os.PathLike, *,
                     key_map: KeyMap | None = None, mesh=None, rules=None, dtype=None,
                     source: str | None = None, allow_extra: Iterable[str] = (),
                     ignore_unexpected: bool = False) -> LoadReport:
    """Fill every nnx.Param of `module` (concrete or from `nnx.eval_shape`) from HF tensors.

    `tensors` is any mapping name -> array (e.g. a lazy `SafetensorsDir`: one tensor in host
    memory at a time) or a checkpoint path (opened as a `SafetensorsDir`). Each tensor is
    shape-checked (errors name the key, expected and got shapes), transposed per the key map,
    cast to `dtype` or the param's own dtype, and placed with the NamedSharding of its
    `logical_axes` when `mesh` is given (`rules`: a `specjax.sharding` preset name or rules
    mapping; default "serve"). Missing tensors and unexpected extras (other than the key map's
    harmless ones and the exact names in `allow_extra`) raise ValueError before any data is read,
    unless `ignore_unexpected` (loading part of a larger checkpoint, e.g. a drafter's frozen
    embedding from the target's file). Returns what was loaded, skipped and ignored.
    """
    if isinstance(tensors, (str, os.PathLike)):
        with SafetensorsDir(tensors) as reader:
            return load_params_into(module, reader, key_map=key_map, mesh=mesh, rules=rules,
                                    dtype=dtype, source=source or os.fspath(tensors),
                                    allow_extra=allow_extra, ignore_unexpected=ignore_unexpected)
    source = source or getattr(tensors, "source", "checkpoint")
    key_map = key_map or TARGET_KEY_MAP
    entries = param_entries(module, key_map)
    allow = set(allow_extra)
    names = set(tensors.keys())
    wanted = [e for e in entries if e.hf_name is not None]
    dup: dict[str, str] = {}
    for e in wanted:
        if e.hf_name in dup:
            raise ValueError(f"key map sends both '{dup[e.hf_name]}' and '{e.path}' "
                             f"to '{e.hf_name}'")
        dup[e.hf_name] = e.path
    missing = [e for e in wanted if e.hf_name not in names]
    if missing:
        listed = ", ".join(f"'{e.hf_name}' (for param {e.path})" for e in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"{source}: missing tensor(s) {listed}{more}")
    extra = sorted(names - set(dup))
    ignored = [n for n in extra if ignore_unexpected or key_map.is_harmless(n) or n in allow]
    unexpected = [n for n in extra if n not in ignored]
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor(s) {unexpected[:8]} with no matching param "
                         f"(checkpoint and config disagree?)")
    for e in wanted:
        expected = _hf_shape(e.variable.get_value().shape, e.transpose)
        got = _shape_of(tensors, e.hf_name)
        if got != expected:
            raise ValueError(f"{source}: tensor '{e.hf_name}' has shape {list(got)}, expected "
                             f"{list(expected)} (param {e.path})")
    for e in wanted:  # one tensor in host memory at a time
        arr = np.asarray(tensors[e.hf_name])
        expected = _hf_shape(e.variable.get_value().shape, e.transpose)
        if arr.shape != expected:  # the mapping's header disagreed with its data
            raise ValueError(f"{source}: tensor '{e.hf_name}' has shape {list(arr.shape)}, "
                             f"expected {list(expected)} (param {e.path})")
        if e.transpose:
            arr = arr.T
        target = jnp.dtype(dtype if dtype is not None else e.variable.get_value().dtype)
        arr = np.ascontiguousarray(arr.astype(target, copy=False))
        e.variable.set_value(_place(arr, e.variable, mesh, rules))
        del arr
    skipped = tuple(e.path for e in entries if e.hf_name is None)
    return LoadReport(tuple(e.hf_name for e in wanted), skipped, tuple(ignored))


def iter_hf_tensors(module: nnx.Module, *, key_map: KeyMap | None = None,
                    dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, host array in HF layout) per param, one at a time; `dtype` casts."""
    for e in param_entries(module, key_map):
        if e.hf_name is None:
            continue
        value = e.variable.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):
            raise ValueError(f"param {e.path} is abstract (never loaded); cannot export it")
        if isinstance(value, jax.Array) and not value.is_fully_addressable:  # multi-host
            from jax.experimental import multihost_utils
            value = multihost_utils.process_allgather(value, tiled=True)
        arr = np.asarray(jax.device_get(value))
        if e.transpose:
            arr = arr.T
        if dtype is not None:
            arr = arr.astype(jnp.dtype(dtype), copy=False)
        yield e.hf_name, np.ascontiguousarray(arr)


def module_to_hf_tensors(module: nnx.Module, *, key_map: KeyMap | None = None,
                         dtype=None) -> dict[str, np.ndarray]:
    """All params of `module` as HF-named host arrays (HF layouts; `dtype` casts)."""
    return dict(iter_hf_tensors(module, key_map=key_map, dtype=dtype))


# ----------------------------------------------------------------------------------------------
# Writing safetensors
# ----------------------------------------------------------------------------------------------

def write_safetensors(out_dir: str | os.PathLike,
                      tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]], *,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      metadata: Mapping[str, str] | None = None) -> list[str]:
    """Write `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json` when the total exceeds `max_shard_bytes`. Holds at most one
    shard in host memory when given an iterator. Stale model weight files in `out_dir` are
    removed first. Returns the written file names."""
    from safetensors.numpy import save_file

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
        if f in (SAFE_WEIGHTS, SAFE_INDEX) or re.fullmatch(r"model-\d+-of-\d+\.safetensors", f):
            os.remove(os.path.join(out_dir, f))
    meta = {"format": "pt", **(metadata or {})}
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    tmp_files: list[tuple[str, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    shard_bytes = total = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        tmp = os.path.join(out_dir, f".model-tmp-{len(tmp_files):05d}.safetensors")
        save_file(shard, tmp, metadata=meta)
        tmp_files.append((tmp, list(shard)))
        shard, shard_bytes = {}, 0

    for name, arr in items:
        if name in seen:
            raise ValueError(f"duplicate tensor name '{name}'")
        seen.add(name)
        arr = np.ascontiguousarray(arr)
        if shard and shard_bytes + arr.nbytes > max_shard_bytes:
            flush()
        shard[name] = arr
        shard_bytes += arr.nbytes
        total += arr.nbytes
    flush()
    if not tmp_files:
        raise ValueError("no tensors to write")
    n = len(tmp_files)
    if n == 1:
        os.replace(tmp_files[0][0], os.path.join(out_dir, SAFE_WEIGHTS))
        return [SAFE_WEIGHTS]
    weight_map, written = {}, []
    for i, (tmp, names) in enumerate(tmp_files):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp, os.path.join(out_dir, fname))
        written.append(fname)
        weight_map.update({k: fname for k in names})
    with open(os.path.join(out_dir, SAFE_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return written + [SAFE_INDEX]


# ----------------------------------------------------------------------------------------------
# The Qwen3 target
# ----------------------------------------------------------------------------------------------

def read_target_config(path: str | os.PathLike) -> TargetConfig:
    """TargetConfig from `<path>/config.json` (both rope dialects)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint directory does not exist: {path}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ConfigError(f"no config.json in {path} (expected {cfg_path})")
    return TargetConfig.from_hf_dict(read_json(cfg_path), source=cfg_path)


def _abstract_target(cfg: TargetConfig, dtype, compute_dtype):
    from specjax.models.decoder import CausalLM

    return nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0), dtype=compute_dtype,
                                                   param_dtype=dtype))


def load_target(path: str | os.PathLike, *, dtype="float32", compute_dtype=None, mesh=None,
                rules=None):
    """Load a Hugging Face Qwen3 checkpoint directory -> (CausalLM, TargetConfig).

    The model is built abstractly and filled tensor by tensor (cast to `dtype`; computation in
    `compute_dtype`, default `dtype`), each placed with its NamedSharding when `mesh` is given.
    Only safetensors are read.
    """
    path = os.fspath(path)
    cfg = read_target_config(path)
    return load_target_weights(path, cfg, dtype=dtype, compute_dtype=compute_dtype, mesh=mesh,
                               rules=rules), cfg


def load_target_weights(path: str | os.PathLike, cfg: TargetConfig, *, dtype="float32",
                        compute_dtype=None, mesh=None, rules=None):
    """A CausalLM of config `cfg` filled from the safetensors in `path` (see
    `load_target`; the config is given, e.g. parsed from a drafter's config.json)."""
    path = os.fspath(path)
    model = _abstract_target(cfg, dtype, compute_dtype or dtype)
    with SafetensorsDir(path) as reader:
        key_map = TARGET_KEY_MAP
        allow: list[str] = []
        if "model.embed_tokens.weight" not in reader and "embed_tokens.weight" in reader:
            key_map = KeyMap(prefix_map={"model.": ""})  # bare backbone names
        if cfg.tie_word_embeddings:
            allow.append("lm_head.weight")  # tied: HF ignores a stored copy as well
        load_params_into(model, reader, key_map=key_map, mesh=mesh, rules=rules,
                         source=path, allow_extra=allow)
    return model


def export_target(model, config: TargetConfig, out_dir: str | os.PathLike, *,
                  tokenizer_dir: str | os.PathLike | None = None, dtype="float32",
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write `config.json` + safetensors (+ tokenizer files from `tokenizer_dir`) so that
    `transformers.Qwen3ForCausalLM.from_pretrained(out_dir)` loads the model. Returns out_dir."""
    out_dir = os.fspath(out_dir)
    expected = {e.path: tuple(e.variable.get_value().shape)
                for e in param_entries(_abstract_target(config, "float32", "float32"))}
    got = {e.path: tuple(e.variable.get_value().shape) for e in param_entries(model)}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:6]
        raise ValueError(f"model params do not match the config (first differences: {diff})")
    os.makedirs(out_dir, exist_ok=True)
    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(jnp.dtype(dtype))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    write_safetensors(out_dir, iter_hf_tensors(model, dtype=dtype), max_shard_bytes=max_shard_bytes)
    if tokenizer_dir is not None:
        tokenizer_dir = os.fspath(tokenizer_dir)
        if not os.path.isdir(tokenizer_dir):
            raise FileNotFoundError(f"tokenizer_dir does not exist: {tokenizer_dir}")
        for fname in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, fname)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, fname))
    return out_dir


def load_tokenizer(path: str | os.PathLike):
    """A transformers tokenizer from local files only (no remote code); None if `path` has none."""
    path = os.fspath(path)
    if not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, f))
                                          for f in _TOKENIZER_MARKERS):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


# ----------------------------------------------------------------------------------------------
# Drafters: key maps and config.json dialects
# ----------------------------------------------------------------------------------------------
#
# A drafter directory is `config.json` + safetensors (`specjax.drafters.registry` reads and writes
# them; it dispatches on `architectures[0]`). Tensor names, all without a `model.` prefix:
#
# DSpark / DFlash, architectures ["Qwen3DSparkModel"] (DeepSpec's names, reference §2.6):
#   embed_tokens.weight [V,H] (frozen copy), fc.weight [H, L*H], hidden_norm.weight [H],
#   layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q_norm,k_norm}.weight [hd],
#   layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.{input,post_attention}_layernorm.weight,
#   norm.weight [H], lm_head.weight [V,H] (frozen copy), markov_head.markov_w1.weight [V,r],
#   markov_head.markov_w2.weight [V,r], confidence_head.proj.{weight [1,H(+r)], bias [1]};
#   the RNN head adds markov_head.joint_proj.{weight [3r, 2r+H], bias [3r]}. DFlash has neither
#   Markov nor confidence tensors.
# Eagle3, architectures ["Qwen3Eagle3Model"] (DeepSpec; also read: "Eagle3DraftModel", and
#   SpecForge's "LlamaForCausalLMEagle3" with its `midlayer.` names): embed_tokens.weight,
#   fc.weight [H, L*H], layers.0.{hidden_norm,input_layernorm,post_attention_layernorm}.weight,
#   layers.0.self_attn.{q,k,v}_proj.weight [*, 2H], layers.0.self_attn.o_proj.weight,
#   layers.0.self_attn.{q_norm,k_norm}.weight, layers.0.mlp.*, norm.weight, lm_head.weight.
#   (Our module calls the layer `midlayer`; the key map renames it.)
# MTP-1, architectures ["SpecjaxMTPDrafter"] (DeepSeek-V3 MTP layer names): embed_tokens.weight,
#   enorm.weight, hnorm.weight, eh_proj.weight [H, 2H], input_layernorm.weight, self_attn.*,
#   post_attention_layernorm.weight, mlp.*, shared_head.norm.weight, shared_head.head.weight.
# Standalone draft LM: a plain CausalLM checkpoint (model.*, lm_head.weight) whose
#   config.json adds `"specjax_drafter": "standalone"` (architectures ["Qwen3ForCausalLM"], so
#   transformers loads it as is; "SpecjaxStandaloneDrafter" is read too).
# N-gram, architectures ["SpecjaxNGramDrafter"]: config.json only, no tensors.
#
# config.json: the target's Qwen3 config deep-copied (both rope dialects are read: transformers
# 5's `rope_parameters` and the older top-level `rope_theta`/`rope_scaling`; the target's dialect
# is kept on write) with num_hidden_layers = draft layers, tie_word_embeddings false, layer_types
# all "full_attention", sliding windows off, plus the drafter's fields: DeepSpec's
# `block_size, mask_token_id, target_layer_ids, num_anchors, num_target_layers, markov_rank,
# markov_head_type, enable_confidence_head, confidence_head_with_markov` for DSpark/DFlash and
# `target_layer_ids, ttt_length, step_loss_decay, draft_num_hidden_layers, num_target_layers` for
# Eagle3. Ours: `num_speculative_tokens` (proposal length of Eagle3 / standalone / n-gram) and
# `confidence_temperatures` (the STS calibration of a DSpark confidence head: one temperature per
# block slot; absent = all ones; `set_confidence_temperatures` updates it in place). These have
# no tensors, so a checkpoint with them still loads in DeepSpec, which ignores unknown fields.

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
EAGLE3_ARCHITECTURE = "Qwen3Eagle3Model"
EAGLE3_ARCHITECTURE_ALIASES = ("Eagle3DraftModel", "LlamaForCausalLMEagle3")
MTP_ARCHITECTURE = "SpecjaxMTPDrafter"
STANDALONE_ARCHITECTURE = "SpecjaxStandaloneDrafter"
STANDALONE_FIELD = "specjax_drafter"  # value "standalone" on a CausalLM config
NGRAM_ARCHITECTURE = "SpecjaxNGramDrafter"
GAMMA_FIELD = "num_speculative_tokens"
CONFIDENCE_TEMPERATURES_FIELD = "confidence_temperatures"
DEFAULT_NUM_ANCHORS = 512
_EAGLE3_VOCAB_MAPS = ("d2t", "t2d")  # SpecForge/EAGLE3 reduced-vocabulary maps


def _drafter_variable_types() -> tuple[type, ...]:
    from specjax.drafters.block import Frozen

    return (nnx.Param, Frozen)


def dspark_key_map() -> KeyMap:
    """DSpark/DFlash drafter <-> DeepSpec `Qwen3DSparkModel` names (our paths mirror them)."""
    return KeyMap(variable_types=_drafter_variable_types())


def eagle3_key_map(layout: str = "deepspec") -> KeyMap:
    """Eagle3 drafter <-> `layers.0.*` (layout "deepspec") or `midlayer.*` ("midlayer")."""
    if layout == "deepspec":
        return KeyMap(prefix_map={"midlayer.": "layers.0."}, variable_types=_drafter_variable_types())
    if layout == "midlayer":
        return KeyMap(variable_types=_drafter_variable_types())
    raise ValueError(f"unknown Eagle3 layout {layout!r} (known: 'deepspec', 'midlayer')")


def eagle3_layout(names: Iterable[str]) -> str:
    """"midlayer" if a checkpoint's tensors use SpecForge's `midlayer.` names, else "deepspec"."""
    return "midlayer" if any(n.startswith("midlayer.") for n in names) else "deepspec"


def mtp_key_map() -> KeyMap:
    """MTP-1 drafter <-> DeepSeek-V3 MTP layer names (our paths mirror them)."""
    return KeyMap(variable_types=_drafter_variable_types())


def standalone_key_map() -> KeyMap:
    """Standalone drafter (its LM held as `model`) <-> plain CausalLM names."""
    return KeyMap(prefix_map={"model.": ""})


def skip_tensors(key_map: KeyMap, names: Iterable[str]) -> KeyMap:
    """`key_map` with the HF tensors `names` marked "not stored" (left out on load and export)."""
    skip = frozenset(names)
    inner = key_map.rename

    def rename(name: str) -> str | None:
        name = inner(name) if inner is not None else name
        return None if name in skip else name

    return dataclasses.replace(key_map, rename=rename)


def eagle3_vocab_map_extras(tensors: Mapping[str, np.ndarray], vocab_size: int,
                            source: str) -> list[str]:
    """Names of SpecForge `d2t`/`t2d` tensors that may be ignored: only identity maps over the full
    vocabulary are accepted (a reduced draft vocabulary is not supported: ValueError)."""
    out = []
    for name in _EAGLE3_VOCAB_MAPS:
        if name not in tensors:
            continue
        arr = np.asarray(tensors[name])
        identity = (arr.shape == (vocab_size,) and
                    (not np.any(arr) if name == "d2t" else bool(np.all(arr))))
        if not identity:
            raise ValueError(f"{source}: tensor '{name}' {list(arr.shape)} maps a reduced draft "
                             f"vocabulary; only the full vocabulary ({vocab_size}) is supported")
        out.append(name)
    return out


# -- config.json reading -----------------------------------------------------------------------

def read_drafter_config(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """(config.json mapping, its path) of a drafter directory; ConfigError names what is missing."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ConfigError(f"drafter directory does not exist: {path}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ConfigError(f"no config.json in drafter directory {path} (expected {cfg_path})")
    d = read_json(cfg_path)
    if not isinstance(d, dict):
        raise ConfigError(f"{cfg_path}: top level must be a JSON object")
    return d, cfg_path


def drafter_architecture(d: Mapping[str, Any], source: str = "config.json") -> str:
    """The drafter kind of a config.json: "dspark" (DSpark or DFlash), "eagle3", "mtp",
    "standalone" or "ngram"; ConfigError names an unknown `architectures[0]`."""
    archs = d.get("architectures")
    if not isinstance(archs, (list, tuple)) or not archs or not isinstance(archs[0], str):
        raise ConfigError(f"{source}: field 'architectures' must be a non-empty list of names, "
                          f"got {archs!r}")
    arch = archs[0]
    if arch == DSPARK_ARCHITECTURE:
        return "dspark"
    if arch == EAGLE3_ARCHITECTURE or arch in EAGLE3_ARCHITECTURE_ALIASES:
        return "eagle3"
    if arch == MTP_ARCHITECTURE:
        return "mtp"
    if arch == NGRAM_ARCHITECTURE:
        return "ngram"
    if arch == STANDALONE_ARCHITECTURE or arch == "Qwen3ForCausalLM":
        return "standalone"
    known = [DSPARK_ARCHITECTURE, EAGLE3_ARCHITECTURE, *EAGLE3_ARCHITECTURE_ALIASES,
             MTP_ARCHITECTURE, STANDALONE_ARCHITECTURE, "Qwen3ForCausalLM", NGRAM_ARCHITECTURE]
    raise ConfigError(f"{source}: unsupported drafter architecture {arch!r} "
                      f"(supported: {', '.join(known)})")


def _require(d: Mapping[str, Any], source: str, *names: str) -> None:
    missing = [n for n in names if d.get(n) is None]
    if missing:
        raise ConfigError(f"{source}: missing field(s) {missing}")


def _int_field(d: Mapping[str, Any], name: str, source: str, *, minimum: int | None = None) -> int:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or \
            (minimum is not None and v < minimum):
        at_least = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"{source}: field '{name}' must be an integer{at_least}, got {v!r}")
    return int(v)


def _int_list_field(d: Mapping[str, Any], name: str, source: str) -> tuple[int, ...]:
    v = d.get(name)
    if not isinstance(v, (list, tuple)) or not v or any(
            isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in v):
        raise ConfigError(f"{source}: field '{name}' must be a non-empty list of integers, "
                          f"got {v!r}")
    return tuple(int(i) for i in v)


def _bool_field(d: Mapping[str, Any], name: str, source: str) -> bool:
    v = d.get(name)
    if not isinstance(v, bool):
        raise ConfigError(f"{source}: field '{name}' must be true or false, got {v!r}")
    return v


def _qwen3_layers_from_hf(d: Mapping[str, Any], source: str) -> TargetConfig:
    """The Qwen3 layer fields of a drafter config.json (both rope dialects) as a TargetConfig;
    rejects what the drafter layers cannot run (sliding windows, attention biases, other MLPs)."""
    if d.get("model_type", "qwen3") not in ("qwen3", None):
        raise ConfigError(f"{source}: unsupported model_type {d.get('model_type')!r} (need 'qwen3')")
    if d.get("hidden_act", "silu") not in ("silu", None):
        raise ConfigError(f"{source}: field 'hidden_act' must be 'silu', got {d.get('hidden_act')!r}")
    if d.get("attention_bias"):
        raise ConfigError(f"{source}: field 'attention_bias' true is not supported")
    if d.get("use_sliding_window"):
        raise ConfigError(f"{source}: field 'use_sliding_window' true is not supported "
                          f"(drafter layers use full attention)")
    types = d.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise ConfigError(f"{source}: field 'layer_types' must be all 'full_attention', "
                          f"got {sorted(set(types))}")
    return TargetConfig.from_hf_dict({**d, "architectures": ["Qwen3ForCausalLM"]}, source=source)


def _layer_dims(tc: TargetConfig) -> dict[str, Any]:
    return dict(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                intermediate_size=tc.intermediate_size,
                num_attention_heads=tc.num_attention_heads,
                num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
                rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, rope_type=tc.rope_type,
                rope_factor=tc.rope_factor)


def _check_layer_ids_vs_count(ids: Sequence[int], d: Mapping[str, Any], source: str) -> None:
    n = d.get("num_target_layers")
    if n is None:
        return
    n = _int_field(d, "num_target_layers", source, minimum=1)
    bad = [i for i in ids if not -1 <= i < n]
    if bad:
        raise ConfigError(f"{source}: field 'target_layer_ids' has {bad} outside [-1, "
                          f"num_target_layers={n})")


def block_drafter_config_from_hf(d: Mapping[str, Any], *, source: str = "config.json"):
    """A `BlockDrafterConfig` from a DeepSpec `Qwen3DSparkModel` config.json mapping.

    DeepSpec writes `markov_head_type` only when markov_rank > 0 and `confidence_head_with_markov`
    only when the confidence head is on; both are then required."""
    from specjax.drafters.block import MARKOV_HEAD_TYPES, BlockDrafterConfig

    if drafter_architecture(d, source) != "dspark":
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not "
                          f"{DSPARK_ARCHITECTURE!r}")
    tc = _qwen3_layers_from_hf(d, source)
    _require(d, source, "target_layer_ids", "mask_token_id", "block_size", "markov_rank",
             "enable_confidence_head")
    if d.get("enable_d2_feature"):
        raise ConfigError(f"{source}: field 'enable_d2_feature' true is not supported")
    rank = _int_field(d, "markov_rank", source, minimum=0)
    head_type = "vanilla"
    if rank > 0:
        _require(d, source, "markov_head_type")
        head_type = str(d["markov_head_type"]).lower()
        if head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"{source}: field 'markov_head_type' {d['markov_head_type']!r} is not "
                              f"supported (supported: {', '.join(MARKOV_HEAD_TYPES)})")
    conf = _bool_field(d, "enable_confidence_head", source)
    if conf:
        _require(d, source, "confidence_head_with_markov")
    with_markov = (_bool_field(d, "confidence_head_with_markov", source)
                   if d.get("confidence_head_with_markov") is not None else rank > 0)
    ids = _int_list_field(d, "target_layer_ids", source)
    _check_layer_ids_vs_count(ids, d, source)
    try:
        return BlockDrafterConfig(
            **_layer_dims(tc), target_layer_ids=ids,
            mask_token_id=_int_field(d, "mask_token_id", source, minimum=0),
            num_draft_layers=tc.num_hidden_layers,
            block_size=_int_field(d, "block_size", source, minimum=1), markov_rank=rank,
            markov_head_type=head_type, confidence_head=conf,
            confidence_head_with_markov=with_markov)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def confidence_temperatures_from_hf(d: Mapping[str, Any], gamma: int,
                                    source: str = "config.json") -> np.ndarray | None:
    """The STS temperatures [gamma] stored in a DSpark config.json, or None when absent."""
    v = d.get(CONFIDENCE_TEMPERATURES_FIELD)
    if v is None:
        return None
    try:
        t = np.asarray(v, np.float64)
    except (TypeError, ValueError):
        t = np.zeros((0,))
    if t.shape != (gamma,) or not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ConfigError(f"{source}: field '{CONFIDENCE_TEMPERATURES_FIELD}' must be {gamma} "
                          f"finite values > 0 (one per block slot), got {v!r}")
    return t.astype(np.float32)


def eagle3_config_from_hf(d: Mapping[str, Any], *, source: str = "config.json"):
    """An `Eagle3Config` from an Eagle3 config.json mapping (DeepSpec `Qwen3Eagle3Model`; the tap
    layers may also come from SpecForge's `eagle_config.eagle_aux_hidden_state_layer_ids`).
    gamma = `num_speculative_tokens`, else `ttt_length` (DeepSpec proposes ttt_length tokens)."""
    from specjax.drafters.eagle3 import Eagle3Config

    if drafter_architecture(d, source) != "eagle3":
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not an Eagle3 "
                          f"architecture")
    tc = _qwen3_layers_from_hf(d, source)
    if tc.num_hidden_layers != 1:
        raise ConfigError(f"{source}: field 'num_hidden_layers' must be 1 for an Eagle3 drafter, "
                          f"got {tc.num_hidden_layers}")
    draft_vocab = d.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != tc.vocab_size:
        raise ConfigError(f"{source}: field 'draft_vocab_size' ({draft_vocab}) differs from "
                          f"'vocab_size' ({tc.vocab_size}); a reduced draft vocabulary is not "
                          f"supported")
    src = d
    if d.get("target_layer_ids") is None and isinstance(d.get("eagle_config"), Mapping) and \
            d["eagle_config"].get("eagle_aux_hidden_state_layer_ids") is not None:
        src = {"target_layer_ids": d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]}
    _require(src, source, "target_layer_ids")
    ids = _int_list_field(src, "target_layer_ids", source)
    _check_layer_ids_vs_count(ids, d, source)
    ttt = _int_field(d, "ttt_length", source, minimum=1) if d.get("ttt_length") is not None else 7
    decay = d.get("step_loss_decay", 0.8)
    if isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise ConfigError(f"{source}: field 'step_loss_decay' must be a number, got {decay!r}")
    gamma = _int_field(d, GAMMA_FIELD, source, minimum=1) if d.get(GAMMA_FIELD) is not None else ttt
    try:
        return Eagle3Config(**_layer_dims(tc), target_layer_ids=ids, gamma=gamma, ttt_length=ttt,
                            step_loss_decay=float(decay))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def mtp_config_from_hf(d: Mapping[str, Any], *, source: str = "config.json"):
    """An `MTPConfig` from a `SpecjaxMTPDrafter` config.json mapping."""
    from specjax.drafters.mtp import MTPConfig

    if drafter_architecture(d, source) != "mtp":
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not "
                          f"{MTP_ARCHITECTURE!r}")
    tc = _qwen3_layers_from_hf(d, source)
    if tc.num_hidden_layers != 1:
        raise ConfigError(f"{source}: field 'num_hidden_layers' must be 1 for an MTP-1 drafter, "
                          f"got {tc.num_hidden_layers}")
    try:
        return MTPConfig(**_layer_dims(tc))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def standalone_config_from_hf(d: Mapping[str, Any], *, source: str = "config.json",
                              default_gamma: int = 4) -> tuple[TargetConfig, int]:
    """(the draft LM's TargetConfig, gamma) of a standalone drafter config.json: a CausalLM
    config (with or without `specjax_drafter: "standalone"`); gamma = `num_speculative_tokens`
    or `default_gamma`."""
    if drafter_architecture(d, source) != "standalone":
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not a standalone "
                          f"draft LM")
    marker = d.get(STANDALONE_FIELD)
    if marker is not None and marker != "standalone":
        raise ConfigError(f"{source}: field '{STANDALONE_FIELD}' must be 'standalone', "
                          f"got {marker!r}")
    tc = TargetConfig.from_hf_dict({**d, "architectures": ["Qwen3ForCausalLM"]}, source=source)
    if d.get(GAMMA_FIELD) is not None:
        return tc, _int_field(d, GAMMA_FIELD, source, minimum=1)
    return tc, default_gamma


def ngram_config_from_hf(d: Mapping[str, Any], *,
                         source: str = "config.json") -> dict[str, int | None]:
    """The n-gram drafter's fields: {vocab_size (or None), gamma, max_ngram, min_ngram}."""
    if drafter_architecture(d, source) != "ngram":
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not "
                          f"{NGRAM_ARCHITECTURE!r}")
    out: dict[str, int | None] = {"vocab_size": None, "gamma": 4, "max_ngram": 3, "min_ngram": 1}
    if d.get("vocab_size") is not None:
        out["vocab_size"] = _int_field(d, "vocab_size", source, minimum=1)
    for ours, field in (("gamma", GAMMA_FIELD), ("max_ngram", "max_ngram"),
                        ("min_ngram", "min_ngram")):
        if d.get(field) is not None:
            out[ours] = _int_field(d, field, source, minimum=1)
    if out["min_ngram"] > out["max_ngram"]:
        raise ConfigError(f"{source}: field 'min_ngram' ({out['min_ngram']}) exceeds "
                          f"'max_ngram' ({out['max_ngram']})")
    return out


# -- config.json writing -----------------------------------------------------------------------

def target_hf_base(target_config: Any) -> tuple[dict[str, Any] | None, TargetConfig | None]:
    """(a deep copy of the target's HF config mapping or None, the target's TargetConfig or None)
    from a TargetConfig, an HF config mapping, a checkpoint directory or config.json path, a
    CausalLM (its `.config`) or None."""
    import copy

    if target_config is None:
        return None, None
    if isinstance(target_config, TargetConfig):
        return target_config.to_hf_dict(), target_config
    if isinstance(target_config, (str, os.PathLike)):
        p = os.fspath(target_config)
        p = os.path.join(p, "config.json") if os.path.isdir(p) else p
        d = read_json(p)
        return copy.deepcopy(d), TargetConfig.from_hf_dict(d, source=p)
    if isinstance(target_config, Mapping):
        d = copy.deepcopy(dict(target_config))
        return d, TargetConfig.from_hf_dict(d, source="target_config")
    cfg = getattr(target_config, "config", None)
    if isinstance(cfg, TargetConfig):
        return cfg.to_hf_dict(), cfg
    raise ValueError(f"target_config must be a TargetConfig, an HF config mapping, a checkpoint "
                     f"path or a target model, got {type(target_config).__name__}")


def _set_rope(d: dict[str, Any], theta: float, rope_type: str, factor: float) -> None:
    """Write RoPE settings in the dialect `d` already uses (transformers 5's `rope_parameters`
    when present, else top-level `rope_theta` / `rope_scaling`)."""
    if isinstance(d.get("rope_parameters"), Mapping):
        rp: dict[str, Any] = {"rope_type": rope_type, "rope_theta": float(theta)}
        if rope_type != "default":
            rp["factor"] = float(factor)
        d["rope_parameters"] = rp
        d.pop("rope_theta", None)
        d.pop("rope_scaling", None)
    else:
        d["rope_theta"] = float(theta)
        d["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type,
                                                                 "factor": float(factor)}


def _draft_layers_dict(base: dict[str, Any] | None, cfg: Any, num_layers: int,
                       architecture: str, dtype: Any) -> dict[str, Any]:
    """The target's config (or a fresh Qwen3 one) with the draft layers' fields set."""
    if base is None:
        base = TargetConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_hidden_layers=num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_type=cfg.rope_type,
            rope_factor=cfg.rope_factor).to_hf_dict()
    d = dict(base)
    d.update(architectures=[architecture], model_type="qwen3", vocab_size=cfg.vocab_size,
             hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
             num_attention_heads=cfg.num_attention_heads,
             num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
             rms_norm_eps=cfg.rms_norm_eps, hidden_act="silu", attention_bias=False,
             num_hidden_layers=num_layers, layer_types=["full_attention"] * num_layers,
             sliding_window=None, use_sliding_window=False, tie_word_embeddings=False)
    d.setdefault("max_window_layers", num_layers)
    _set_rope(d, cfg.rope_theta, cfg.rope_type, cfg.rope_factor)
    d["torch_dtype"] = str(jnp.dtype(dtype))
    if "dtype" in d:
        d["dtype"] = d["torch_dtype"]
    return d


def _merge_extra(d: dict[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    for k, v in (extra or {}).items():
        if k in d and d[k] != v:
            raise ValueError(f"extra config field '{k}' ({v!r}) conflicts with the drafter's "
                             f"value {d[k]!r}")
        d[k] = v
    return d


def block_drafter_hf_config(cfg: Any, target_config: Any = None, *, dtype: Any = "float32",
                            num_anchors: int = DEFAULT_NUM_ANCHORS,
                            confidence_temperatures: Sequence[float] | None = None,
                            extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpec `Qwen3DSparkModel` config.json mapping of a `BlockDrafterConfig`.

    `target_config` (see `target_hf_base`) is deep-copied as the base, so the target's own fields
    and rope dialect are kept; without it a Qwen3 config is built from the drafter's dimensions
    (and `num_target_layers` is left out). `num_anchors` is DeepSpec's training field (required by
    its model class); `extra` adds fields (a conflicting value raises)."""
    base, tcfg = target_hf_base(target_config)
    if tcfg is not None:
        cfg.check_target(tcfg)
    d = _draft_layers_dict(base, cfg, cfg.num_draft_layers, DSPARK_ARCHITECTURE, dtype)
    d.update(block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
             target_layer_ids=list(cfg.target_layer_ids), num_anchors=int(num_anchors),
             markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
             enable_confidence_head=bool(cfg.confidence_head),
             confidence_head_with_markov=bool(cfg.confidence_head_with_markov))
    if tcfg is not None:
        d["num_target_layers"] = tcfg.num_hidden_layers
    else:
        d.pop("num_target_layers", None)
    d.pop(CONFIDENCE_TEMPERATURES_FIELD, None)
    if confidence_temperatures is not None:
        if not cfg.confidence_head:
            raise ValueError("confidence_temperatures given for a drafter without a confidence head")
        d[CONFIDENCE_TEMPERATURES_FIELD] = [float(t) for t in confidence_temperatures]
        confidence_temperatures_from_hf(d, cfg.block_size, "confidence_temperatures")  # validates
    d = _merge_extra(d, extra)
    back = block_drafter_config_from_hf(d, source="the written config.json")
    if back != cfg:  # the written file must describe exactly this drafter
        raise RuntimeError(f"internal error: config.json does not round-trip ({back} != {cfg})")
    return d


def eagle3_hf_config(cfg: Any, target_config: Any = None, *, dtype: Any = "float32",
                     extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpec `Qwen3Eagle3Model` config.json mapping of an `Eagle3Config` (plus our
    `num_speculative_tokens` = gamma)."""
    base, tcfg = target_hf_base(target_config)
    if tcfg is not None:
        cfg.check_target(tcfg)
    d = _draft_layers_dict(base, cfg, 1, EAGLE3_ARCHITECTURE, dtype)
    d.update(target_layer_ids=list(cfg.target_layer_ids), ttt_length=cfg.ttt_length,
             step_loss_decay=float(cfg.step_loss_decay), draft_num_hidden_layers=1,
             **{GAMMA_FIELD: cfg.gamma})
    if tcfg is not None:
        d["num_target_layers"] = tcfg.num_hidden_layers
    else:
        d.pop("num_target_layers", None)
    d = _merge_extra(d, extra)
    back = eagle3_config_from_hf(d, source="the written config.json")
    if back != cfg:
        raise RuntimeError(f"internal error: config.json does not round-trip ({back} != {cfg})")
    return d


def mtp_hf_config(cfg: Any, target_config: Any = None, *, dtype: Any = "float32",
                  extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `SpecjaxMTPDrafter` config.json mapping of an `MTPConfig` (one layer, gamma 1)."""
    base, tcfg = target_hf_base(target_config)
    if tcfg is not None:
        cfg.check_target(tcfg)
    d = _draft_layers_dict(base, cfg, 1, MTP_ARCHITECTURE, dtype)
    d[GAMMA_FIELD] = 1
    if tcfg is not None:
        d["num_target_layers"] = tcfg.num_hidden_layers
    d = _merge_extra(d, extra)
    back = mtp_config_from_hf(d, source="the written config.json")
    if back != cfg:
        raise RuntimeError(f"internal error: config.json does not round-trip ({back} != {cfg})")
    return d


def standalone_hf_config(model_config: TargetConfig, gamma: int, *, dtype: Any = "float32",
                         extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A CausalLM config.json mapping (loadable by transformers) marked as a standalone
    drafter with its proposal length."""
    d = model_config.to_hf_dict()
    d["torch_dtype"] = str(jnp.dtype(dtype))
    d[STANDALONE_FIELD] = "standalone"
    d[GAMMA_FIELD] = int(gamma)
    return _merge_extra(d, extra)


def ngram_hf_config(vocab_size: int, gamma: int, max_ngram: int, min_ngram: int, *,
                    extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `SpecjaxNGramDrafter` config.json mapping (no tensors)."""
    d = {"architectures": [NGRAM_ARCHITECTURE], "vocab_size": int(vocab_size),
         GAMMA_FIELD: int(gamma), "max_ngram": int(max_ngram), "min_ngram": int(min_ngram)}
    return _merge_extra(d, extra)


def write_config_json(out_dir: str | os.PathLike, d: Mapping[str, Any]) -> str:
    """Write `<out_dir>/config.json` (atomically: a temp file, then rename); returns its path."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "config.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path


def set_confidence_temperatures(path: str | os.PathLike, temps: Sequence[float]) -> None:
    """Store STS temperatures (one per block slot) in a DSpark drafter directory's config.json."""
    d, source = read_drafter_config(path)
    cfg = block_drafter_config_from_hf(d, source=source)
    if not cfg.confidence_head:
        raise ConfigError(f"{source}: the drafter has no confidence head "
                          f"(enable_confidence_head: false)")
    d[CONFIDENCE_TEMPERATURES_FIELD] = [float(t) for t in temps]
    confidence_temperatures_from_hf(d, cfg.block_size, source)
    write_config_json(path, d)


def export_drafter(drafter: Any, config: Any, out_dir: str | os.PathLike, **kwargs: Any) -> str:
    """Write a drafter as `config.json` + safetensors (see `specjax.drafters.registry.save_drafter`
    for `kwargs`); `config`, if given, must be the drafter's own config. Returns out_dir."""
    from specjax.drafters.registry import save_drafter

    own = getattr(drafter, "config", None)
    if config is not None and own is not None and config != own:
        raise ValueError(f"config {config} is not the drafter's own config {own}")
    return save_drafter(drafter, out_dir, **kwargs)
