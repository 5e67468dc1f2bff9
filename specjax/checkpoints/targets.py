"""Target checkpoints: a Hugging Face directory (config.json + safetensors) or a `.gguf` file
(`specjax.checkpoints.gguf`) -> a `CausalLM`; export as a Hugging Face directory; tokenizers.

Target tensor names are the Hugging Face ones of `Qwen3ForCausalLM`, `LlamaForCausalLM` and
`Qwen2ForCausalLM` (they coincide; the families differ in which tensors exist: Qwen3 adds
`self_attn.{q_norm,k_norm}.weight`, Qwen2 `self_attn.{q,k,v}_proj.bias`, a tied model has no
`lm_head.weight`), derived from our module paths by `common.TARGET_KEY_MAP`. The model's fused
`self_attn.qkv_proj` and `mlp.gate_up_proj` kernels are joined from those tensors on load and split
back on export (`layouts.FUSIONS`), so the files are the families' own.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.checkpoints.common import (DEFAULT_MAX_SHARD_BYTES, TARGET_KEY_MAP, KeyMap,
                                        SafetensorsDir, iter_hf_tensors, load_params_into,
                                        param_entries, write_safetensors)
from specjax.checkpoints.gguf import (GGUFFile, is_gguf, load_gguf_tokenizer, open_gguf_target,
                                      read_gguf_config)
from specjax.config import ConfigError, TargetConfig, read_json
from specjax.models.norm_folding import fold_norm_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json")
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
GGUF_CACHE_ENV = "SPECJAX_GGUF_CACHE"
_CACHE_OFF = ("off", "0", "false", "none", "")
_CONVERSION_MARKER = "specjax_gguf_source.json"


def gguf_cache_root() -> str | None:
    """Where float32 Hugging Face copies of loaded `.gguf` targets are kept (parsing a GGUF's
    vocabulary and dequantizing its tensors takes many seconds; a safetensors copy loads in a few):
    `$SPECJAX_GGUF_CACHE` (`off` disables) or `$XDG_CACHE_HOME/specjax/gguf` (~/.cache/...)."""
    env = os.environ.get(GGUF_CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in _CACHE_OFF else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specjax", "gguf")


def _gguf_identity(path: str) -> dict[str, object]:
    st = os.stat(path)
    return {"path": os.path.realpath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def gguf_conversion_dir(path: str | os.PathLike) -> str | None:
    """The cache directory for `path`'s converted copy (keyed by real path, size and mtime), or
    None when the cache is off. It holds a copy only after a float32 load stored one."""
    root = gguf_cache_root()
    if root is None:
        return None
    ident = _gguf_identity(os.fspath(path))
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(root, f"{os.path.basename(os.fspath(path))}-{key}")


def _cached_conversion(path: str) -> str | None:
    d = gguf_conversion_dir(path)
    if d is None or not os.path.isfile(os.path.join(d, _CONVERSION_MARKER)):
        return None
    try:
        with open(os.path.join(d, _CONVERSION_MARKER)) as f:
            if json.load(f) != _gguf_identity(path):
                return None
    except (OSError, ValueError):
        return None
    return d


def _store_conversion(path: str, model, cfg: TargetConfig) -> None:
    """Export a float32 GGUF target (+ its tokenizer) into the cache, all at once (a temporary
    directory renamed into place); a failure only warns, loading already succeeded."""
    d = gguf_conversion_dir(path)
    if d is None or os.path.isdir(d):
        return
    tmp = f"{d}.tmp{os.getpid()}"
    try:
        export_target(model, cfg, tmp, dtype="float32")
        try:
            load_gguf_tokenizer(path).save_pretrained(tmp)
        except Exception:  # noqa: BLE001 - a GGUF without a usable tokenizer: weights only
            pass
        with open(os.path.join(tmp, _CONVERSION_MARKER), "w") as f:
            json.dump(_gguf_identity(path), f)
        os.rename(tmp, d)
    except OSError as e:
        if not os.path.isdir(d):  # else another process stored the same conversion first
            warnings.warn(f"could not cache the converted GGUF in {d}: {e}", stacklevel=3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_target_config(path: str | os.PathLike) -> TargetConfig:
    """TargetConfig from `<path>/config.json` (both rope dialects) or a `.gguf` file's metadata."""
    path = os.fspath(path)
    if is_gguf(path):
        return read_gguf_config(GGUFFile(path))
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint directory does not exist: {path}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ConfigError(f"no config.json in {path} (expected {cfg_path})")
    cfg = TargetConfig.from_hf_dict(read_json(cfg_path), source=cfg_path)
    return _with_generation_eos(cfg, os.path.join(path, "generation_config.json"))


def _with_generation_eos(cfg: TargetConfig, gen_path: str) -> TargetConfig:
    """`cfg` with the eos ids of a `generation_config.json` beside it added (what transformers'
    `generate` and vLLM stop on: e.g. Qwen3's <|endoftext|> besides config.json's <|im_end|>)."""
    if not os.path.exists(gen_path):
        return cfg
    eos = read_json(gen_path).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < cfg.vocab_size for t in ids):
        raise ConfigError(f"{gen_path}: 'eos_token_id' must be a token id or a list of token ids in "
                          f"[0, {cfg.vocab_size}), got {eos!r}")
    return dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys((*cfg.eos_token_ids, *ids))))


def abstract_target(cfg: TargetConfig, dtype, compute_dtype):
    """A `CausalLM` of `cfg` built with `nnx.eval_shape` (no weights materialised)."""
    from specjax.models.decoder import CausalLM

    return nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0), dtype=compute_dtype,
                                           param_dtype=dtype))


def load_target(path: str | os.PathLike, *, dtype="float32", compute_dtype=None, mesh=None,
                rules=None, fold_norms: bool = True):
    """Load a Qwen3 / Llama / Qwen2 target -> (CausalLM, TargetConfig) from a Hugging Face
    checkpoint directory or a `.gguf` file (dequantized to float32 on load).

    The model is built abstractly and filled tensor by tensor (cast to `dtype`; computation in
    `compute_dtype`, default `dtype`), each placed with its NamedSharding when `mesh` is given.
    Only safetensors and GGUF are read (never pickles). A `.gguf` loaded in float32 is also
    stored as a Hugging Face copy in the user cache (`gguf_cache_root`), which later loads read.
    With `fold_norms` (the default) each layer's norm weights are then folded into the projections
    that read them (`models.norm_folding`: fewer kernels per layer; exports divide them back out).
    """
    path = os.fspath(path)
    if is_gguf(path):
        cached = _cached_conversion(path) if os.path.isfile(path) else None
        if cached is not None:  # the float32 copy a previous load stored (see gguf_cache_root)
            return load_target(cached, dtype=dtype, compute_dtype=compute_dtype, mesh=mesh, rules=rules,
                               fold_norms=fold_norms)
        cfg, tensors = open_gguf_target(path)
        model = abstract_target(cfg, dtype, compute_dtype or dtype)
        load_params_into(model, tensors, mesh=mesh, rules=rules, source=path)
        if jnp.dtype(dtype) == jnp.float32 and jax.process_count() == 1:
            _store_conversion(path, model, cfg)
        if fold_norms:
            fold_norm_weights(model)
        return model, cfg
    cfg = read_target_config(path)
    return load_target_weights(path, cfg, dtype=dtype, compute_dtype=compute_dtype, mesh=mesh,
                               rules=rules, fold_norms=fold_norms), cfg


def load_target_weights(path: str | os.PathLike, cfg: TargetConfig, *, dtype="float32",
                        compute_dtype=None, mesh=None, rules=None, fold_norms: bool = False):
    """A CausalLM of config `cfg` filled from the safetensors in `path` (see
    `load_target`; the config is given, e.g. parsed from a drafter's config.json). Norm weights
    are folded only when asked: a model that trains (the standalone drafter) keeps the plain form."""
    path = os.fspath(path)
    model = abstract_target(cfg, dtype, compute_dtype or dtype)
    with SafetensorsDir(path) as reader:
        key_map = TARGET_KEY_MAP
        allow: list[str] = []
        if "model.embed_tokens.weight" not in reader and "embed_tokens.weight" in reader:
            key_map = KeyMap(prefix_map={"model.": ""})  # bare backbone names
        if cfg.tie_word_embeddings:
            allow.append("lm_head.weight")  # tied: HF ignores a stored copy as well
        load_params_into(model, reader, key_map=key_map, mesh=mesh, rules=rules,
                         source=path, allow_extra=allow)
    if fold_norms:
        fold_norm_weights(model)
    return model


def export_target(model, config: TargetConfig, out_dir: str | os.PathLike, *,
                  tokenizer_dir: str | os.PathLike | None = None, dtype="float32",
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write `config.json` + safetensors (+ the tokenizer of `tokenizer_dir`: a tokenizer
    directory, whose files are copied, or a `.gguf` file, whose tokenizer and chat template are
    saved) so that transformers' `AutoModelForCausalLM.from_pretrained(out_dir)` loads the model
    as its family's `{Qwen3,Llama,Qwen2}ForCausalLM`. Returns out_dir. Norm weights folded at load
    are divided back out of the kernels (equal to the stored tensors to float32 rounding; a target
    loaded with `fold_norms=False` is written bit for bit)."""
    out_dir = os.fspath(out_dir)
    expected = {e.path: tuple(e.variable.get_value().shape)
                for e in param_entries(abstract_target(config, "float32", "float32"))}
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
    if tokenizer_dir is not None and is_gguf(tokenizer_dir):
        load_gguf_tokenizer(tokenizer_dir).save_pretrained(out_dir)
    elif tokenizer_dir is not None:
        tokenizer_dir = os.fspath(tokenizer_dir)
        if not os.path.isdir(tokenizer_dir):
            raise FileNotFoundError(f"tokenizer_dir does not exist: {tokenizer_dir}")
        for fname in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, fname)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, fname))
    return out_dir


def load_tokenizer(path: str | os.PathLike):
    """A transformers tokenizer from local files only (no remote code): a tokenizer directory, or
    the tokenizer and chat template stored in a `.gguf` file; None if a directory has none."""
    path = os.fspath(path)
    if is_gguf(path):
        cached = _cached_conversion(path) if os.path.isfile(path) else None
        tok = load_tokenizer(cached) if cached is not None else None
        return tok if tok is not None else load_gguf_tokenizer(path)
    if not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, f))
                                          for f in _TOKENIZER_MARKERS):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
