"""Config checks shared by every drafter that copies its layer dimensions from the target."""
from __future__ import annotations

from typing import Any

from specjax.config import ConfigError, TargetConfig

_DIM_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim")


def validate_layer_dims(cfg: Any) -> None:
    """Shared checks of a one-layer drafter config's dimensions (ConfigError names the field)."""
    for name in _DIM_FIELDS:
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"field '{name}' must be an integer > 0, got {v!r}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"field 'num_attention_heads' ({cfg.num_attention_heads}) must be a "
                          f"multiple of 'num_key_value_heads' ({cfg.num_key_value_heads})")
    if cfg.rms_norm_eps <= 0:
        raise ConfigError(f"field 'rms_norm_eps' must be > 0, got {cfg.rms_norm_eps}")
    layer_config(cfg)  # validates the rope fields


def layer_config(cfg: Any, num_layers: int = 1) -> TargetConfig:
    """The Qwen3-style layer config a drafter's decoder layer(s) are built from (any target family)."""
    return TargetConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        rope_type=cfg.rope_type, rope_factor=cfg.rope_factor, tie_word_embeddings=False)


def drafter_rope(target: TargetConfig) -> dict[str, Any]:
    """The RoPE fields a drafter's own (Qwen3-style) layers copy from its target.

    The target's theta and linear scaling carry over. Llama 3's frequency smoothing does not: a
    drafter is trained from scratch on positions inside the original context, where llama3 scaling
    leaves the high frequencies unchanged, so its layers use unscaled RoPE with the target's theta.
    """
    if target.rope_type == "llama3":
        return dict(rope_theta=target.rope_theta, rope_type="default", rope_factor=1.0)
    return dict(rope_theta=target.rope_theta, rope_type=target.rope_type,
                rope_factor=target.rope_factor)


def target_dims(target: TargetConfig) -> dict[str, Any]:
    """The layer fields a drafter copies from its target (reference §1)."""
    return dict(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                intermediate_size=target.intermediate_size,
                num_attention_heads=target.num_attention_heads,
                num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                rms_norm_eps=target.rms_norm_eps, **drafter_rope(target))


def check_same_width(cfg: Any, target: TargetConfig) -> None:
    """Raise ConfigError if the drafter's vocabulary or hidden size differ from the target's."""
    for name in ("vocab_size", "hidden_size"):
        if getattr(cfg, name) != getattr(target, name):
            raise ConfigError(f"drafter field '{name}' ({getattr(cfg, name)}) differs from the "
                              f"target's ({getattr(target, name)})")


def validate_tap_layer_ids(ids: Any) -> tuple[int, ...]:
    """`target_layer_ids` as a tuple of distinct ints >= -1 (ConfigError names the field)."""
    ids = tuple(ids)
    if not ids:
        raise ConfigError("field 'target_layer_ids' must name at least one target layer")
    if any(not isinstance(i, int) or isinstance(i, bool) or i < -1 for i in ids):
        raise ConfigError(f"field 'target_layer_ids' must hold ints >= -1, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"field 'target_layer_ids' has duplicates: {ids!r}")
    return ids


def check_tap_layers(ids: tuple[int, ...], target: TargetConfig) -> None:
    """Raise ConfigError if a tap layer id does not exist in `target`."""
    for i in ids:
        if not -1 <= i < target.num_hidden_layers:
            raise ConfigError(f"field 'target_layer_ids': layer {i} out of range "
                              f"[-1, {target.num_hidden_layers})")
