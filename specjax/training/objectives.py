"""A drafter to train and its loss for `specjax.training.trainer.Trainer`, for any drafter kind.

`make_objective(model_config, target, target_config)` builds the drafter of `model_config.kind`
(`specjax.drafters.registry.KINDS`: the kind's `build`, with the frozen parts copied from the
target) and wraps the kind's own objective into a trainer loss `loss_fn(model, batch, rng, aux)`,
with `aux` the frozen target's parameters (online features) or None (offline cache). Batches are
`{input_ids [B,S], loss_mask [B,S], valid [B]}` (`collate_block_batch`), plus `taps [B,S,L*H]` and
`hidden [B,S,H]` when they come from an offline target cache; the loss mask marks the completion
tokens the drafter is supervised on. The kinds' objectives and their alignment rules are
documented in their modules (`specjax.drafters.dspark_kind`, `eagle3`, `mtp`, `standalone`).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import TargetConfig
from specjax.drafters.registry import KINDS
from specjax.training.config import ModelConfig
from specjax.training.features import target_features

Array = jax.Array


class _Target(NamedTuple):
    """The `specjax.drafters.base.TargetView` of one batch."""

    batch: Mapping[str, Array]
    aux: Any  # the target's parameters (online) or None
    graphdef: Any  # the target's graph definition (online) or None
    tap_layers: tuple[int, ...]

    def features(self, dtype: Any) -> tuple[Array | None, Array]:
        if "hidden" in self.batch:
            return self.batch.get("taps"), self.batch["hidden"]
        if self.graphdef is None:
            raise ValueError("batch has no cached 'taps'/'hidden' and no online target was "
                             "configured")
        return target_features(self.aux, self.graphdef, jnp.asarray(self.batch["input_ids"]),
                               self.batch.get("valid"), tap_layers=self.tap_layers, dtype=dtype)

    def logits(self, hidden_bsh: Array) -> Array:
        if self.graphdef is None:
            raise ValueError("target logits need the online target")
        return nnx.merge(self.graphdef, self.aux).logits(hidden_bsh)


def trainer_loss(kind_loss: Any, *, target_graphdef: Any = None,
                 tap_layers: tuple[int, ...] = ()) -> Any:
    """A `Trainer` loss `(model, batch, rng, aux) -> (loss, metrics)` from a kind's objective
    `(model, batch, rng, target: TargetView)`: the target view reads an offline cache batch, or
    runs the frozen target (`target_graphdef` with parameters `aux`) at `tap_layers`."""
    tap_layers = tuple(tap_layers)

    def loss_fn(model: Any, batch: Mapping[str, Array], rng: Array, aux: Any):
        return kind_loss(model, batch, rng, _Target(batch, aux, target_graphdef, tap_layers))

    return loss_fn


class Objective(NamedTuple):
    drafter: nnx.Module  # the module to train (frozen embedding / lm_head copies included)
    loss_fn: Any  # (model, batch, rng, aux) -> (loss, metrics)
    drafter_config: Any  # the drafter's own config dataclass
    tap_layers: tuple[int, ...]  # target layers read online (() for mtp / standalone)


def make_objective(mc: ModelConfig, target: Any, tcfg: TargetConfig, *, target_graphdef: Any,
                   feature_dtype: Any = jnp.bfloat16, draft_ids: Any = None) -> Objective:
    """The drafter of kind `mc.kind` (frozen parts copied from `target`) and its loss.
    `draft_ids`: the draft vocabulary's target ids, required when the section's
    draft_vocab_size > 0 (`specjax.drafters.vocab.build_draft_vocab` over the training data's
    token counts)."""
    kind = KINDS[mc.kind]
    drafter, dcfg, tap_layers = kind.build(
        mc.section, target, tcfg, rngs=nnx.Rngs(mc.init_seed), dtype=mc.compute_dtype,
        param_dtype=mc.param_dtype, draft_ids=draft_ids)
    loss_fn = trainer_loss(kind.objective(mc.section, feature_dtype=feature_dtype),
                           target_graphdef=target_graphdef, tap_layers=tap_layers)
    return Objective(drafter, loss_fn, dcfg, tap_layers)


__all__ = ["Objective", "make_objective", "trainer_loss"]
