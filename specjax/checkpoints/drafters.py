"""Drafter checkpoints: the parts of config.json and safetensors every drafter kind shares.

A drafter directory is `config.json` + safetensors (`model.safetensors`, or shards with
`model.safetensors.index.json`). Each kind's own tensor names (key map) and config.json fields live
in the kind's module under `specjax.drafters`; this module holds what they share: reading the
directory, typed field parsers, the Qwen3 layer fields of a one-or-more-layer drafter, the target's
config as the base of a written config.json (DeepSpec's convention: the target's Qwen3 config
deep-copied, both rope dialects read, the target's dialect kept on write, num_hidden_layers = draft
layers, tie_word_embeddings false, layer_types all "full_attention", sliding windows off), and the
draft vocabulary.

`num_speculative_tokens` (GAMMA_FIELD) is ours: the proposal length of the kinds where it is free.

Draft vocabulary (`specjax.drafters.vocab`): a drafter over N < V target tokens writes
`draft_vocab_size: N` (SpecForge's EAGLE-3 field; for DSpark/DFlash and MTP-1 an extension of
ours: absent means the full vocabulary, so ordinary DeepSpec checkpoints load unchanged) and
EAGLE-3's tensors `d2t` int64 [N] (target id = draft id + d2t[draft id]) and `t2d` bool [V]; its
output head is [N, H]. A file whose `draft_vocab_size` equals `vocab_size` is a full-vocabulary
drafter (its `d2t`/`t2d`, if any, must be identity maps).
"""
from __future__ import annotations

import copy
import os
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from specjax.config import ConfigError, TargetConfig, read_json

GAMMA_FIELD = "num_speculative_tokens"
_EAGLE3_VOCAB_MAPS = ("d2t", "t2d")  # SpecForge/EAGLE3 reduced-vocabulary maps

def draft_vocab_tensors(tensors: Mapping[str, np.ndarray], vocab_size: int,
                        draft_vocab_size: int, source: str) -> tuple[np.ndarray | None, list[str]]:
    """(draft ids [N] or None, names of the `d2t`/`t2d` tensors present) of a checkpoint.

    With draft_vocab_size 0 only identity maps over the full vocabulary may be present; with
    N > 0 `d2t` is required and `t2d`, when present, must mark the same ids (ValueError)."""
    from specjax.drafters import vocab as dv

    present = [n for n in _EAGLE3_VOCAB_MAPS if n in tensors]
    if draft_vocab_size == 0:
        for name in present:
            arr = np.asarray(tensors[name])
            identity = (arr.shape == (vocab_size,) and
                        (not np.any(arr) if name == "d2t" else bool(np.all(arr))))
            if not identity:
                raise ValueError(f"{source}: tensor '{name}' {list(arr.shape)} maps a reduced "
                                 f"draft vocabulary but config.json has no 'draft_vocab_size' "
                                 f"below vocab_size ({vocab_size})")
        return None, present
    if "d2t" not in tensors:
        raise ValueError(f"{source}: config.json sets draft_vocab_size={draft_vocab_size} but the "
                         f"checkpoint has no tensor 'd2t'")
    ids = dv.draft_ids_from_tensors(np.asarray(tensors["d2t"]),
                                    np.asarray(tensors["t2d"]) if "t2d" in tensors else None,
                                    vocab_size, source)
    if ids.size != draft_vocab_size:
        raise ValueError(f"{source}: tensor 'd2t' has {ids.size} entries, config.json "
                         f"draft_vocab_size is {draft_vocab_size}")
    return ids, present


def draft_vocab_hf_tensors(draft_ids: np.ndarray, vocab_size: int) -> list[tuple[str, np.ndarray]]:
    """EAGLE-3's `d2t` (int64 offsets [N]) and `t2d` (bool [V]) tensors of a draft vocabulary."""
    from specjax.drafters import vocab as dv

    return [("d2t", dv.d2t_offsets(draft_ids)), ("t2d", dv.t2d_mask(draft_ids, vocab_size))]


def draft_vocab_size_from_hf(d: Mapping[str, Any], vocab_size: int, source: str) -> int:
    """config.json `draft_vocab_size`: absent or equal to vocab_size -> 0 (full vocabulary)."""
    if d.get("draft_vocab_size") is None:
        return 0
    n = int_field(d, "draft_vocab_size", source, minimum=1)
    if n > vocab_size:
        raise ConfigError(f"{source}: field 'draft_vocab_size' ({n}) exceeds 'vocab_size' "
                          f"({vocab_size})")
    return 0 if n == vocab_size else n


def set_draft_vocab_size(d: dict[str, Any], n: int) -> None:
    if n:
        d["draft_vocab_size"] = int(n)
    else:
        d.pop("draft_vocab_size", None)


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




def architecture(d: Mapping[str, Any], source: str = "config.json") -> str:
    """`architectures[0]` of a drafter config.json (ConfigError unless a non-empty list of names)."""
    archs = d.get("architectures")
    if not isinstance(archs, (list, tuple)) or not archs or not isinstance(archs[0], str):
        raise ConfigError(f"{source}: field 'architectures' must be a non-empty list of names, "
                          f"got {archs!r}")
    return archs[0]


def require(d: Mapping[str, Any], source: str, *names: str) -> None:
    missing = [n for n in names if d.get(n) is None]
    if missing:
        raise ConfigError(f"{source}: missing field(s) {missing}")


def int_field(d: Mapping[str, Any], name: str, source: str, *, minimum: int | None = None) -> int:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or \
            (minimum is not None and v < minimum):
        at_least = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"{source}: field '{name}' must be an integer{at_least}, got {v!r}")
    return int(v)


def int_list_field(d: Mapping[str, Any], name: str, source: str) -> tuple[int, ...]:
    v = d.get(name)
    if not isinstance(v, (list, tuple)) or not v or any(
            isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in v):
        raise ConfigError(f"{source}: field '{name}' must be a non-empty list of integers, "
                          f"got {v!r}")
    return tuple(int(i) for i in v)


def bool_field(d: Mapping[str, Any], name: str, source: str) -> bool:
    v = d.get(name)
    if not isinstance(v, bool):
        raise ConfigError(f"{source}: field '{name}' must be true or false, got {v!r}")
    return v


def qwen3_layers_from_hf(d: Mapping[str, Any], source: str) -> TargetConfig:
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


def one_layer_from_hf(d: Mapping[str, Any], source: str, kind: str) -> TargetConfig:
    """The layer config of a one-layer drafter (Eagle3, MTP-1); ConfigError names the field."""
    tc = qwen3_layers_from_hf(d, source)
    if tc.num_hidden_layers != 1:
        raise ConfigError(f"{source}: field 'num_hidden_layers' must be 1 for {kind} drafter, "
                          f"got {tc.num_hidden_layers}")
    return tc


def layer_dims_from_hf(tc: TargetConfig) -> dict[str, Any]:
    """The `specjax.drafters.common.LayerDims` fields of a drafter's layer config."""
    return dict(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                intermediate_size=tc.intermediate_size,
                num_attention_heads=tc.num_attention_heads,
                num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
                rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, rope_type=tc.rope_type,
                rope_factor=tc.rope_factor)


def check_layer_ids_vs_count(ids: Sequence[int], d: Mapping[str, Any], source: str) -> None:
    """ConfigError if a tap layer id is outside the `num_target_layers` a config.json records."""
    n = d.get("num_target_layers")
    if n is None:
        return
    n = int_field(d, "num_target_layers", source, minimum=1)
    bad = [i for i in ids if not -1 <= i < n]
    if bad:
        raise ConfigError(f"{source}: field 'target_layer_ids' has {bad} outside [-1, "
                          f"num_target_layers={n})")


# -- config.json writing -----------------------------------------------------------------------

def target_hf_base(target_config: Any) -> tuple[dict[str, Any] | None, TargetConfig | None]:
    """(a deep copy of the target's HF config mapping or None, the target's TargetConfig or None)
    from a TargetConfig, an HF config mapping, a checkpoint directory or config.json path, a
    CausalLM (its `.config`) or None."""
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


def draft_layers_dict(base: dict[str, Any] | None, cfg: Any, num_layers: int,
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


def merge_extra(d: dict[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    for k, v in (extra or {}).items():
        if k in d and d[k] != v:
            raise ValueError(f"extra config field '{k}' ({v!r}) conflicts with the drafter's "
                             f"value {d[k]!r}")
        d[k] = v
    return d


def check_round_trip(back: Any, cfg: Any) -> None:
    """The config read back from a written config.json must be the drafter's own."""
    if back != cfg:
        raise RuntimeError(f"internal error: config.json does not round-trip ({back} != {cfg})")
