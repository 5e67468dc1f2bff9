"""Drafter checkpoints: load a drafter directory by its `architectures`, save any drafter.

A drafter directory is Hugging Face style: `config.json` + safetensors (`model.safetensors`, or
shards with `model.safetensors.index.json`). `load_drafter` dispatches on `architectures[0]`:

    "Qwen3DSparkModel"                     -> DSparkDrafter (DFlash when markov_rank is 0 and
                                              there is no confidence head), DeepSpec's names
    "Qwen3Eagle3Model" (DeepSpec; also "Eagle3DraftModel" and SpecForge's
    "LlamaForCausalLMEagle3")              -> Eagle3Drafter
    "SpecjaxMTPDrafter"                    -> MTPDrafter (MTP-1)
    "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM" (written with
    `"specjax_drafter": "standalone"`; a plain checkpoint of these works too) or
    "SpecjaxStandaloneDrafter"             -> StandaloneDrafter
    "SpecjaxNGramDrafter"                  -> NGramDrafter (config.json only, no tensors)

Tensor names and config fields are documented (and implemented) in
`specjax.checkpoints.drafters`; `specjax.checkpoints` is the only package that knows external
names. `save_drafter` writes the same layouts, so save -> load is exact.
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import checkpoints
from specjax.config import ConfigError, TargetConfig

DRAFTER_KINDS = ("dspark", "eagle3", "mtp", "standalone", "ngram")


# ------------------------------------------------------------------------------------------------
# helpers


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


def _check_target(check: Callable[[TargetConfig], None], tcfg: TargetConfig | None,
                  source: str) -> None:
    """Run a drafter config's `check_target`, prefixing its error with the config file."""
    if tcfg is None:
        return
    try:
        check(tcfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: drafter is incompatible with the target: {e}") from None


def _check_gamma(gamma: int | None, fixed: int, kind: str) -> None:
    if gamma is not None and gamma != fixed:
        raise ValueError(f"gamma {gamma} differs from the {kind} drafter's fixed proposal length "
                         f"{fixed} (set by its config.json)")


def _target_frozen_value(leaf: str, target_model: Any, vocab: Any = None) -> jax.Array:
    """The target's input embedding [V, H] ('embedding') or output head [H, V] ('kernel'; only
    the draft vocabulary's columns [H, N] when `vocab` is a `DraftVocab`)."""
    from specjax.drafters.vocab import head_columns

    emb_vh = target_model.model.embed_tokens.embedding[...]
    if leaf == "embedding":
        return emb_vh
    head_hv = emb_vh.T if target_model.lm_head is None else target_model.lm_head.kernel[...]
    return head_columns(head_hv, vocab)


def _read_draft_vocab(drafter: nnx.Module, reader: checkpoints.SafetensorsDir, cfg: Any,
                      source: str) -> list[str]:
    """Install a checkpoint's draft vocabulary maps (d2t/t2d) into `drafter`; returns the names
    of the map tensors present (they are not module parameters)."""
    ids, present = checkpoints.draft_vocab_tensors(reader, cfg.vocab_size, cfg.draft_vocab_size,
                                                   source)
    if ids is not None:
        drafter.draft_vocab.set_ids(ids)
    return present


def _fill(module: nnx.Module, reader: checkpoints.SafetensorsDir, key_map: checkpoints.KeyMap, *,
          source: str, target_model: Any, mesh: Any, rules: Any, allow_extra=(),
          vocab: Any = None) -> None:
    """Load `module`'s stored variables from `reader`. Frozen copies of the target's embedding /
    lm_head that the checkpoint lacks are taken from `target_model` when it is given."""
    from specjax.drafters.block import Frozen

    if target_model is not None:
        missing = [e for e in checkpoints.param_entries(module, key_map)
                   if isinstance(e.variable, Frozen) and e.hf_name is not None
                   and e.hf_name not in reader]
        if missing:
            key_map = checkpoints.skip_tensors(key_map, {e.hf_name for e in missing})
            for e in missing:
                value = _target_frozen_value(e.path.rsplit(".", 1)[-1], target_model, vocab)
                want = tuple(e.variable.get_value().shape)
                if tuple(value.shape) != want:
                    raise ValueError(f"{source}: tensor '{e.hf_name}' is absent and the target's "
                                     f"copy has shape {list(value.shape)}, expected {list(want)}")
                e.variable.set_value(jnp.asarray(value, e.variable.get_value().dtype))
    checkpoints.load_params_into(module, reader, key_map=key_map, mesh=mesh, rules=rules,
                                 source=source, allow_extra=allow_extra)


def _check_concrete(module: nnx.Module, source: str) -> None:
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable) and isinstance(node.get_value(), jax.ShapeDtypeStruct):
            raise RuntimeError(f"{source}: variable '{'.'.join(map(str, path))}' was not loaded")


# ------------------------------------------------------------------------------------------------
# loaders, one per kind: (path, config mapping, config path, target config, target model, options)


def _load_dspark(path: str, d: Mapping[str, Any], source: str, tcfg, tmodel, *, dtype,
                 compute_dtype, gamma, mesh, rules):
    from specjax.drafters.dspark import DSparkDrafter

    cfg = checkpoints.block_drafter_config_from_hf(d, source=source)
    _check_target(cfg.check_target, tcfg, source)
    _check_gamma(gamma, cfg.block_size, cfg.variant)
    temps = checkpoints.confidence_temperatures_from_hf(d, cfg.block_size, source) \
        if cfg.confidence_head else None
    drafter = nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0), dtype=compute_dtype,
                                                   param_dtype=dtype))
    with checkpoints.SafetensorsDir(path) as reader:
        maps = _read_draft_vocab(drafter, reader, cfg, path)
        _fill(drafter, reader, checkpoints.dspark_key_map(), source=path, target_model=tmodel,
              mesh=mesh, rules=rules, allow_extra=maps, vocab=drafter.draft_vocab)
    if cfg.confidence_head:
        drafter.confidence_temperatures.set_value(jnp.ones((cfg.block_size,), jnp.float32))
        if temps is not None:
            drafter.set_confidence_temperatures(temps)
    return drafter


def _load_eagle3(path: str, d: Mapping[str, Any], source: str, tcfg, tmodel, *, dtype,
                 compute_dtype, gamma, mesh, rules):
    import dataclasses

    from specjax.drafters.eagle3 import Eagle3Drafter

    cfg = checkpoints.eagle3_config_from_hf(d, source=source)
    if gamma is not None:
        cfg = dataclasses.replace(cfg, gamma=int(gamma))
    _check_target(cfg.check_target, tcfg, source)
    drafter = nnx.eval_shape(lambda: Eagle3Drafter(cfg, rngs=nnx.Rngs(0), dtype=compute_dtype,
                                                   param_dtype=dtype))
    with checkpoints.SafetensorsDir(path) as reader:
        maps = _read_draft_vocab(drafter, reader, cfg, path)
        key_map = checkpoints.eagle3_key_map(checkpoints.eagle3_layout(reader.keys()))
        _fill(drafter, reader, key_map, source=path, target_model=tmodel, mesh=mesh, rules=rules,
              allow_extra=maps, vocab=drafter.draft_vocab)
    return drafter


def _load_mtp(path: str, d: Mapping[str, Any], source: str, tcfg, tmodel, *, dtype,
              compute_dtype, gamma, mesh, rules):
    from specjax.drafters.mtp import MTPDrafter

    cfg = checkpoints.mtp_config_from_hf(d, source=source)
    _check_target(cfg.check_target, tcfg, source)
    _check_gamma(gamma, 1, "MTP-1")
    drafter = nnx.eval_shape(lambda: MTPDrafter(cfg, rngs=nnx.Rngs(0), dtype=compute_dtype,
                                                param_dtype=dtype))
    with checkpoints.SafetensorsDir(path) as reader:
        maps = _read_draft_vocab(drafter, reader, cfg, path)
        _fill(drafter, reader, checkpoints.mtp_key_map(), source=path, target_model=tmodel,
              mesh=mesh, rules=rules, allow_extra=maps, vocab=drafter.draft_vocab)
    return drafter


def _load_standalone(path: str, d: Mapping[str, Any], source: str, tcfg, tmodel, *, dtype,
                     compute_dtype, gamma, mesh, rules):
    from specjax.drafters.standalone import StandaloneDrafter

    lm_cfg, saved_gamma = checkpoints.standalone_config_from_hf(d, source=source)
    if tcfg is not None and lm_cfg.vocab_size != tcfg.vocab_size:
        raise ConfigError(f"{source}: drafter is incompatible with the target: draft model field "
                          f"'vocab_size' ({lm_cfg.vocab_size}) differs from the target's "
                          f"({tcfg.vocab_size})")
    model = checkpoints.load_target_weights(path, lm_cfg, dtype=dtype,
                                            compute_dtype=compute_dtype, mesh=mesh, rules=rules)
    return StandaloneDrafter(model, int(gamma) if gamma is not None else saved_gamma)


def _load_ngram(path: str, d: Mapping[str, Any], source: str, tcfg, tmodel, *, dtype,
                compute_dtype, gamma, mesh, rules):
    from specjax.drafters.ngram import NGramDrafter

    f = checkpoints.ngram_config_from_hf(d, source=source)
    vocab = f["vocab_size"]
    if tcfg is not None:
        if vocab is not None and vocab != tcfg.vocab_size:
            raise ConfigError(f"{source}: drafter is incompatible with the target: field "
                              f"'vocab_size' ({vocab}) differs from the target's "
                              f"({tcfg.vocab_size})")
        vocab = tcfg.vocab_size
    if vocab is None:
        raise ConfigError(f"{source}: missing field(s) ['vocab_size'] (or pass target=...)")
    return NGramDrafter(vocab, gamma=int(gamma) if gamma is not None else f["gamma"],
                        max_ngram=f["max_ngram"], min_ngram=f["min_ngram"])


_LOADERS = {"dspark": _load_dspark, "eagle3": _load_eagle3, "mtp": _load_mtp,
            "standalone": _load_standalone, "ngram": _load_ngram}


# ------------------------------------------------------------------------------------------------
# public API


def drafter_kind(path: str | os.PathLike) -> str:
    """The kind ("dspark", "eagle3", "mtp", "standalone", "ngram") of a drafter directory."""
    d, source = checkpoints.read_drafter_config(path)
    return checkpoints.drafter_architecture(d, source)


def load_drafter(path: str | os.PathLike, *, target: Any = None, dtype: Any = "float32",
                 compute_dtype: Any = None, gamma: int | None = None, mesh: Any = None,
                 rules: Any = None) -> nnx.Module:
    """Load the drafter in directory `path`, choosing its class from config.json `architectures`.

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
    kind = checkpoints.drafter_architecture(d, source)
    tcfg, tmodel = _target_parts(target)
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer))
                              or gamma < 1):
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
    drafter = _LOADERS[kind](path, d, source, tcfg, tmodel, dtype=dtype,
                             compute_dtype=compute_dtype or dtype, gamma=gamma, mesh=mesh,
                             rules=rules)
    _check_concrete(drafter, path)
    return drafter


def _param_dtype(module: nnx.Module) -> Any:
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param):
            return node.get_value().dtype
    return jnp.float32


def save_drafter(drafter: nnx.Module, out_dir: str | os.PathLike, *, target_config: Any = None,
                 dtype: Any = None, extra_config: Mapping[str, Any] | None = None,
                 num_anchors: int = checkpoints.DEFAULT_NUM_ANCHORS,
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
    from specjax.drafters.block import BlockBackbone
    from specjax.drafters.eagle3 import Eagle3Drafter
    from specjax.drafters.mtp import MTPDrafter
    from specjax.drafters.ngram import NGramDrafter
    from specjax.drafters.standalone import StandaloneDrafter

    out_dir = os.fspath(out_dir)
    file_dtype = dtype if dtype is not None else _param_dtype(drafter)
    if isinstance(drafter, NGramDrafter):
        d = checkpoints.ngram_hf_config(drafter.vocab_size, drafter.gamma, drafter.max_ngram,
                                        drafter.min_ngram, extra=extra_config)
        checkpoints.write_config_json(out_dir, d)
        return out_dir
    if isinstance(drafter, BlockBackbone):
        temps = None
        if drafter.confidence_head is not None:
            temps = np.asarray(jax.device_get(drafter.confidence_temperatures[...]), np.float64)
            temps = None if np.all(temps == 1.0) else temps.tolist()
        d = checkpoints.block_drafter_hf_config(drafter.config, target_config, dtype=file_dtype,
                                                num_anchors=num_anchors,
                                                confidence_temperatures=temps, extra=extra_config)
        key_map = checkpoints.dspark_key_map()
    elif isinstance(drafter, Eagle3Drafter):
        d = checkpoints.eagle3_hf_config(drafter.config, target_config, dtype=file_dtype,
                                         extra=extra_config)
        key_map = checkpoints.eagle3_key_map("deepspec")
    elif isinstance(drafter, MTPDrafter):
        d = checkpoints.mtp_hf_config(drafter.config, target_config, dtype=file_dtype,
                                      extra=extra_config)
        key_map = checkpoints.mtp_key_map()
    elif isinstance(drafter, StandaloneDrafter):
        if target_config is not None:
            tcfg = checkpoints.target_hf_base(target_config)[1]
            drafter.check_target(tcfg)
        d = checkpoints.standalone_hf_config(drafter.model.config, drafter.gamma,
                                             dtype=file_dtype, extra=extra_config)
        key_map = checkpoints.standalone_key_map()
    else:
        raise ValueError(f"save_drafter: unsupported drafter type {type(drafter).__name__} "
                         f"(supported: DSparkDrafter/DFlash, Eagle3Drafter, MTPDrafter, "
                         f"StandaloneDrafter, NGramDrafter)")
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


__all__ = ["DRAFTER_KINDS", "drafter_kind", "export_drafter", "load_drafter", "save_drafter"]
