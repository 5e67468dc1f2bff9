"""The table of drafter kinds, and loading / saving a drafter directory by its `architectures`.

`KINDS[kind]` is a `specjax.drafters.base.Kind`: (config, build, load, save, objective, ...), each
kind's own, declared by its module as `KINDS = (Kind(...), ...)`. Every module of this package
that declares one is in the table, so a new kind is its module (and its training config YAML):

    "dspark", "dflash"   specjax.drafters.dspark_kind   (DSparkDrafter; files "Qwen3DSparkModel")
    "eagle3"             specjax.drafters.eagle3        ("Qwen3Eagle3Model", "Eagle3DraftModel",
                                                          "LlamaForCausalLMEagle3")
    "mtp"                specjax.drafters.mtp           ("SpecjaxMTPDrafter")
    "standalone"         specjax.drafters.standalone    ("SpecjaxStandaloneDrafter" and plain
                                                          Qwen3 / Llama / Qwen2 CausalLMs)
    "ngram"              specjax.drafters.ngram         ("SpecjaxNGramDrafter"; no tensors)

A drafter directory is Hugging Face style: `config.json` + safetensors. `load_drafter` dispatches
on `architectures[0]`; `save_drafter` on the drafter's class, writing the same layouts, so
save -> load is exact.
"""
from __future__ import annotations

import importlib
import itertools
import os
import pkgutil
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import checkpoints
from specjax.config import ConfigError, TargetConfig
from specjax.drafters.base import Kind
from specjax.drafters.dspark_kind import DEFAULT_NUM_ANCHORS


def _collect_kinds() -> dict[str, Kind]:
    """Every `Kind` declared by a module of this package (module name order)."""
    import specjax.drafters as package

    kinds: dict[str, Kind] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name == "registry":
            continue
        for kind in getattr(importlib.import_module(f"{package.__name__}.{info.name}"),
                            "KINDS", ()):
            if kind.name in kinds:
                raise RuntimeError(f"drafter kind {kind.name!r} is declared twice")
            kinds[kind.name] = kind
    return kinds


KINDS: dict[str, Kind] = _collect_kinds()
# kinds with files of their own ("dflash" files are DSpark's)
DRAFTER_KINDS = tuple(k for k, v in KINDS.items() if v.architectures)
TRAINING_KINDS = tuple(k for k, v in KINDS.items() if v.config is not None)
CACHE_KINDS = tuple(k for k, v in KINDS.items() if v.cache)


def kind_of_architecture(d: Mapping[str, Any], source: str = "config.json") -> str:
    """The kind of a drafter config.json mapping, by `architectures[0]` (ConfigError names an
    unknown one and the supported ones)."""
    arch = checkpoints.drafters.architecture(d, source)
    for name, kind in KINDS.items():
        if arch in kind.architectures:
            return name
    known = [a for kind in KINDS.values() for a in kind.architectures]
    raise ConfigError(f"{source}: unsupported drafter architecture {arch!r} "
                      f"(supported: {', '.join(known)})")


def kind_of_drafter(drafter: nnx.Module) -> Kind:
    """The kind whose `save` writes `drafter` (by its class)."""
    for kind in KINDS.values():
        if kind.architectures and isinstance(drafter, kind.drafter_type):
            return kind
    names = ", ".join(k.drafter_type.__name__ for k in KINDS.values() if k.architectures)
    raise ValueError(f"save_drafter: unsupported drafter type {type(drafter).__name__} "
                     f"(supported: {names})")


def _target_parts(target: Any) -> tuple[TargetConfig | None, Any]:
    """(target config, target model or None) from a CausalLM, a TargetConfig or None."""
    if target is None:
        return None, None
    if isinstance(target, TargetConfig):
        return target, None
    cfg = getattr(target, "config", None)
    if isinstance(cfg, TargetConfig):
        return cfg, target
    raise ValueError(f"target must be a CausalLM or a TargetConfig, got "
                     f"{type(target).__name__}")


def _check_concrete(module: nnx.Module, source: str) -> None:
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable) and isinstance(node.get_value(), jax.ShapeDtypeStruct):
            raise RuntimeError(f"{source}: variable '{'.'.join(map(str, path))}' was not loaded")


def drafter_kind(path: str | os.PathLike) -> str:
    """The kind ("dspark", "eagle3", "mtp", "standalone", "ngram") of a drafter directory."""
    d, source = checkpoints.read_drafter_config(path)
    return kind_of_architecture(d, source)


def load_drafter(path: str | os.PathLike, *, target: Any = None, dtype: Any = "float32",
                 compute_dtype: Any = None, gamma: int | None = None, mesh: Any = None,
                 rules: Any = None) -> nnx.Module:
    """Load the drafter in directory `path`, choosing its kind from config.json `architectures`.

    target: the CausalLM (or its TargetConfig) the drafter will serve. When given, the
        drafter must match it (vocabulary and hidden size, tap layer ids below its layer count;
        a ConfigError names the field), and frozen embedding / lm_head tensors that a checkpoint
        leaves out are copied from it.
    dtype: parameter dtype (tensors are cast on load); compute_dtype: activations (default dtype).
    gamma: proposal length for drafters where it is free (Eagle3, standalone, n-gram; default from
        config.json); for DSpark/DFlash and MTP-1 it must equal the fixed one if given.
    mesh, rules: place each tensor with the NamedSharding of its logical axes
        (see `specjax.checkpoints.load_params_into`).
    """
    path = os.fspath(path)
    d, source = checkpoints.read_drafter_config(path)
    kind = KINDS[kind_of_architecture(d, source)]
    tcfg, tmodel = _target_parts(target)
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer))
                              or gamma < 1):
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
    drafter = kind.load(path, d, source, tcfg, tmodel, dtype=dtype,
                        compute_dtype=compute_dtype or dtype, gamma=gamma, mesh=mesh, rules=rules)
    _check_concrete(drafter, path)
    return drafter


def _param_dtype(module: nnx.Module) -> Any:
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param):
            return node.get_value().dtype
    return jnp.float32


def key_map_of(drafter: nnx.Module) -> checkpoints.KeyMap | None:
    """The key map `save_drafter` writes `drafter`'s tensors with (None: it has none)."""
    return kind_of_drafter(drafter).save(drafter, None, dtype=jnp.float32, extra=None,
                                         num_anchors=DEFAULT_NUM_ANCHORS)[1]


def save_drafter(drafter: nnx.Module, out_dir: str | os.PathLike, *, target_config: Any = None,
                 dtype: Any = None, extra_config: Mapping[str, Any] | None = None,
                 num_anchors: int = DEFAULT_NUM_ANCHORS,
                 max_shard_bytes: int = checkpoints.DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write `drafter` to `out_dir` as config.json + safetensors; returns out_dir.

    target_config: the target's TargetConfig, HF config mapping, checkpoint directory or model.
        DSpark/DFlash/Eagle3/MTP configs are a deep copy of it (DeepSpec's convention; the
        drafter is checked against it); without it a Qwen3 config is built from the drafter's
        own dimensions (and `num_target_layers` is left out).
    dtype: tensor dtype in the file (default: each parameter's own, so save -> load is exact).
    extra_config: extra config.json fields (e.g. provenance); a conflicting value raises.
    num_anchors: DeepSpec's training field for DSpark/DFlash (its model class requires it).
    A DSpark confidence head's STS temperatures go to config.json `confidence_temperatures`; a
    draft vocabulary goes to `draft_vocab_size` and the `d2t` / `t2d` tensors.
    """
    out_dir = os.fspath(out_dir)
    kind = kind_of_drafter(drafter)
    file_dtype = dtype if dtype is not None else _param_dtype(drafter)
    d, key_map = kind.save(drafter, target_config, dtype=file_dtype, extra=extra_config,
                           num_anchors=num_anchors)
    if key_map is not None:
        tensors = checkpoints.iter_hf_tensors(drafter, key_map=key_map, dtype=dtype)
        vocab = getattr(drafter, "draft_vocab", None)
        if vocab is not None:  # EAGLE-3's d2t / t2d maps
            tensors = itertools.chain(tensors, checkpoints.draft_vocab_hf_tensors(
                vocab.draft_ids(), vocab.vocab_size))
        checkpoints.write_safetensors(out_dir, tensors, max_shard_bytes=max_shard_bytes)
    checkpoints.write_config_json(out_dir, d)
    return out_dir


def export_drafter(drafter: nnx.Module, config: Any, out_dir: str | os.PathLike,
                   **kwargs: Any) -> str:
    """`save_drafter` after checking that `config` (if given) is the drafter's own config
    (a trainer's export: the config it trained with must be what the file describes)."""
    own = getattr(drafter, "config", None)
    if config is not None and own is not None and config != own:
        raise ValueError(f"config {config} is not the drafter's own config {own}")
    return save_drafter(drafter, out_dir, **kwargs)


__all__ = ["CACHE_KINDS", "DRAFTER_KINDS", "KINDS", "TRAINING_KINDS", "drafter_kind",
           "export_drafter", "key_map_of", "kind_of_architecture", "kind_of_drafter",
           "load_drafter", "save_drafter"]
