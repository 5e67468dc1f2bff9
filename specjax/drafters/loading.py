"""Steps every kind's `load` shares: target checks, the draft vocabulary maps, and filling a
module from safetensors with the frozen target copies a checkpoint leaves out taken from the
target."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import checkpoints
from specjax.config import ConfigError, TargetConfig
from specjax.drafters.common import Frozen
from specjax.drafters.vocab import head_columns


def check_target(check: Callable[[TargetConfig], None], tcfg: TargetConfig | None,
                 source: str) -> None:
    """Run a drafter config's `check_target`, prefixing its error with the config file."""
    if tcfg is None:
        return
    try:
        check(tcfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: drafter is incompatible with the target: {e}") from None


def check_gamma(gamma: int | None, fixed: int, kind: str) -> None:
    """A requested proposal length must equal a kind's fixed one."""
    if gamma is not None and gamma != fixed:
        raise ValueError(f"gamma {gamma} differs from the {kind} drafter's fixed proposal length "
                         f"{fixed} (set by its config.json)")


def _target_frozen_value(leaf: str, target_model: Any, vocab: Any = None) -> jax.Array:
    """The target's input embedding [V, H] ('embedding') or output head [H, V] ('kernel'; only
    the draft vocabulary's columns [H, N] when `vocab` is a `DraftVocab`)."""
    emb_vh = target_model.model.embed_tokens.embedding[...]
    if leaf == "embedding":
        return emb_vh
    head_hv = emb_vh.T if target_model.lm_head is None else target_model.lm_head.kernel[...]
    return head_columns(head_hv, vocab)


def fill(drafter: nnx.Module, path: str, key_map: checkpoints.KeyMap | Callable[[Any], Any], *,
         cfg: Any, target_model: Any, mesh: Any, rules: Any) -> None:
    """Load `drafter`'s stored variables from the safetensors in `path`, with its draft
    vocabulary maps (d2t/t2d, when `cfg.draft_vocab_size` > 0). Frozen copies of the target's
    embedding / lm_head that the checkpoint lacks are taken from `target_model` when given.
    `key_map` may be a function of the tensor names (a kind with several layouts)."""
    with checkpoints.SafetensorsDir(path) as reader:
        ids, maps = checkpoints.draft_vocab_tensors(reader, cfg.vocab_size, cfg.draft_vocab_size,
                                                    path)
        if ids is not None:
            drafter.draft_vocab.set_ids(ids)
        if not isinstance(key_map, checkpoints.KeyMap):
            key_map = key_map(reader.keys())
        vocab = getattr(drafter, "draft_vocab", None)
        if target_model is not None:
            missing = [e for e in checkpoints.param_entries(drafter, key_map)
                       if isinstance(e.variable, Frozen) and e.hf_name is not None
                       and e.hf_name not in reader]
            if missing:
                key_map = checkpoints.skip_tensors(key_map, {e.hf_name for e in missing})
                for e in missing:
                    value = _target_frozen_value(e.path.rsplit(".", 1)[-1], target_model, vocab)
                    want = tuple(e.variable.get_value().shape)
                    if tuple(value.shape) != want:
                        raise ValueError(f"{path}: tensor '{e.hf_name}' is absent and the "
                                         f"target's copy has shape {list(value.shape)}, "
                                         f"expected {list(want)}")
                    e.variable.set_value(jnp.asarray(value, e.variable.get_value().dtype))
        checkpoints.load_params_into(drafter, reader, key_map=key_map, mesh=mesh, rules=rules,
                                     source=path, allow_extra=maps)


__all__ = ["check_gamma", "check_target", "fill"]
