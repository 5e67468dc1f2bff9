"""Checkpoint building blocks: key maps, safetensors reading and writing, loading into modules.

Key map. Our modules mirror Hugging Face attribute names, so a parameter's external name follows
mechanically from its NNX path: the module path (`model.layers.0.self_attn.q_proj`) is kept,
optionally rewritten by a prefix map or a rename function, and the leaf is translated by a
`LeafRule`:

    Linear  `kernel` [in, out]      <-> `weight` [out, in]   (transposed)
    Linear  `bias` [out]            <-> `bias`
    Embed   `embedding` [V, H]      <-> `weight` [V, H]
    RMSNorm `weight` [d]            <-> `weight` [d]

So a target's `model.layers.{i}.self_attn.q_proj.kernel` is HF
`model.layers.{i}.self_attn.q_proj.weight` and `lm_head.kernel` is `lm_head.weight` (absent when
embeddings are tied). The target's fused projections (`self_attn.qkv_proj`, `mlp.gate_up_proj`) are
stored as their Hugging Face parts (`layouts.FUSIONS`). Drafters use the same rules with their own `KeyMap`
(`specjax.checkpoints.drafters`).

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
import struct
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.checkpoints.layouts import FUSIONS, Fusion, TensorPlan, plan
from specjax.config import read_json
from specjax.io import write_json_atomic
from specjax.models.norm_folding import unfolded

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
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
    the target's embedding and lm_head). `fusions`: parameters stored as several tensors
    (`layouts.FUSIONS`: the target's fused q/k/v and gate/up projections).
    """

    prefix_map: Mapping[str, str] | None = None
    rename: Callable[[str], str | None] | None = None
    leaf_rules: tuple[LeafRule, ...] = DEFAULT_LEAF_RULES
    ignore_extra: tuple[str, ...] = HARMLESS_EXTRA
    variable_types: tuple[type, ...] = (nnx.Param,)  # which nnx.Variable kinds are stored
    fusions: tuple[Fusion, ...] = FUSIONS

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


def tensor_plan(e: ParamEntry, key_map: KeyMap | None = None) -> TensorPlan:
    """The stored tensors of a param entry (one, or the parts of a fused param)."""
    return plan(e.hf_name, e.transpose, e.variable.get_value().shape,
                (key_map or TARGET_KEY_MAP).fusions)

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


def _check_tensor_names(wanted: list[tuple[str, str]], names: set[str], key_map: KeyMap, source: str,
                        *, allow_extra: set[str], ignore_unexpected: bool) -> list[str]:
    """Raise ValueError for a key map sending two params to one tensor, a missing tensor or an
    unexpected one (`wanted`: (tensor name, param path) pairs); returns the extra tensor names
    that are ignored."""
    dup: dict[str, str] = {}
    for name, path in wanted:
        if name in dup:
            raise ValueError(f"key map sends both '{dup[name]}' and '{path}' to '{name}'")
        dup[name] = path
    missing = [(name, path) for name, path in wanted if name not in names]
    if missing:
        listed = ", ".join(f"'{name}' (for param {path})" for name, path in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"{source}: missing tensor(s) {listed}{more}")
    extra = sorted(names - set(dup))
    ignored = [n for n in extra if ignore_unexpected or key_map.is_harmless(n) or n in allow_extra]
    unexpected = [n for n in extra if n not in ignored]
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor(s) {unexpected[:8]} with no matching param "
                         f"(checkpoint and config disagree?)")
    return ignored


def _check_shape(got: Sequence[int], expected: Sequence[int], name: str, path: str, source: str) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"{source}: tensor '{name}' has shape {list(got)}, expected "
                         f"{list(expected)} (param {path})")


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
    plans = [(e, tensor_plan(e, key_map)) for e in entries if e.hf_name is not None]
    parts = [(name, e.path) for e, p in plans for name in p.names]
    ignored = _check_tensor_names(parts, set(tensors.keys()), key_map, source,
                                  allow_extra=set(allow_extra), ignore_unexpected=ignore_unexpected)
    for e, p in plans:
        for name, expected in zip(p.names, p.shapes):
            _check_shape(_shape_of(tensors, name), expected, name, e.path, source)
    for e, p in plans:  # one param's tensors in host memory at a time
        stored = [np.asarray(tensors[name]) for name in p.names]
        for name, arr, expected in zip(p.names, stored, p.shapes):  # the header may disagree with its data
            _check_shape(arr.shape, expected, name, e.path, source)
        arr = p.to_ours(stored)
        target = jnp.dtype(dtype if dtype is not None else e.variable.get_value().dtype)
        arr = np.ascontiguousarray(arr.astype(target, copy=False))
        e.variable.set_value(_place(arr, e.variable, mesh, rules))
        del arr, stored
    skipped = tuple(e.path for e in entries if e.hf_name is None)
    return LoadReport(tuple(name for name, _ in parts), skipped, tuple(ignored))


def iter_hf_tensors(module: nnx.Module, *, key_map: KeyMap | None = None,
                    dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, host array in HF layout) per param, one at a time; `dtype` casts. Norm
    weights folded into projections (`models.norm_folding`) are divided back out."""
    for e in param_entries(unfolded(module), key_map):
        if e.hf_name is None:
            continue
        value = e.variable.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):
            raise ValueError(f"param {e.path} is abstract (never loaded); cannot export it")
        if isinstance(value, jax.Array) and not value.is_fully_addressable:  # multi-host
            from jax.experimental import multihost_utils
            value = multihost_utils.process_allgather(value, tiled=True)
        p = tensor_plan(e, key_map)
        for name, arr in zip(p.names, p.to_stored(np.asarray(jax.device_get(value)))):
            if dtype is not None:
                arr = arr.astype(jnp.dtype(dtype), copy=False)
            yield name, np.ascontiguousarray(arr)


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


def skip_tensors(key_map: KeyMap, names: Iterable[str]) -> KeyMap:
    """`key_map` with the HF tensors `names` marked "not stored" (left out on load and export)."""
    skip = frozenset(names)
    inner = key_map.rename

    def rename(name: str) -> str | None:
        name = inner(name) if inner is not None else name
        return None if name in skip else name

    return dataclasses.replace(key_map, rename=rename)


def write_config_json(out_dir: str | os.PathLike, d: Mapping[str, Any]) -> str:
    """Write `<out_dir>/config.json` (atomically: a temp file, then rename); returns its path."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "config.json")
    write_json_atomic(path, d, indent=2)
    return path
