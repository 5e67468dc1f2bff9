"""Drafter construction and online-feature loss functions for every drafter kind.

`make_objective(model_config, target, target_config)` returns the drafter to train, its loss
function for `specjax.training.trainer.Trainer` (`loss_fn(model, batch, rng, aux)`, with `aux` the
frozen target's parameters) and the target graph to split them from. Every loss runs the frozen
target inside the jitted step (online features) on a batch of
`{input_ids [B,S], loss_mask [B,S], valid [B]}` (`collate_block_batch`); the loss mask marks the
completion tokens the drafter is supervised on.

    dspark / dflash   block_drafter_loss (reference §5.1): anchors, block labels, CE + TV (+ BCE)
    eagle3            ttt_forward over `block_size` steps + eagle3_loss (soft CE vs the target)
    mtp               train_forward on the target's final hidden + mtp_loss (CE + TV vs target)
    standalone        the draft LM's next-token logits + mtp_loss (CE + TV vs target): distillation;
                      with alpha_tv 0, lm_loss (CE on the text alone; the target is not run)

Alignment (S = sequence length, `lm` = loss mask, `hid` = the target's final-normed hidden):
    eagle3 / mtp: row t predicts ids[t+2]; target logits lm_head(hid[t+1]); weight lm[t+2].
    standalone:   row t predicts ids[t+1]; target logits lm_head(hid[t]);   weight lm[t+1].

Draft vocabulary (`draft_vocab_size` N > 0, `draft_ids` from `specjax.drafters.vocab`): the
drafter's frozen head has the target head's N columns, so "target logits" are the target's
restricted to the draft tokens (EAGLE-3's rule; see `specjax.training.losses`). Eagle3 drops a
position whose label lies outside the subset from every TTT step (EAGLE-3 masks by the target's
top token; the label is what the training text holds); dspark / dflash / mtp leave such slots out
of the cross-entropy only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.drafters import vocab as dv
from specjax.training.config import BLOCK_KINDS, ModelConfig
from specjax.training.features import target_features

Array = jax.Array


def shift_left(x_bs: Array, k: int, fill: Any = 0) -> Array:
    """x[:, t + k] at t (fill past the end); works for [B, S] and [B, S, ...]."""
    if k == 0:
        return x_bs
    pad = [(0, 0), (0, k)] + [(0, 0)] * (x_bs.ndim - 2)
    return jnp.pad(x_bs[:, k:], pad, constant_values=fill)


def _features(batch: Mapping[str, Array], aux: Any, graphdef: Any, ids_bs: Array,
              valid_b: Array | None, tap_layers: tuple[int, ...]) -> tuple[Array | None, Array]:
    """(taps concatenated [B,S,L*H] or None without tap layers, final-normed hidden [B,S,H]):
    from the batch when it comes from an offline target cache, else from the frozen target."""
    if "hidden" in batch:
        return (batch["taps"] if tap_layers else None), batch["hidden"]
    if graphdef is None:
        raise ValueError("batch has no cached 'hidden' and no online target was configured")
    return target_features(aux, graphdef, ids_bs, valid_b, tap_layers=tap_layers, dtype=None)


def _batch_arrays(batch: Mapping[str, Array]) -> tuple[Array, Array, Array | None]:
    ids = jnp.asarray(batch["input_ids"], jnp.int32)
    lm = jnp.asarray(batch["loss_mask"]).astype(jnp.float32)
    return ids, lm, batch.get("valid")


def eagle3_objective(*, target_graphdef: Any, tap_layers: tuple[int, ...], horizon: int,
                     decay: float = 0.8, chunk_tokens: int | None = None,
                     feature_dtype: Any = jnp.bfloat16):
    """Eagle3 training-time-test loss over `horizon` steps (reference §4) on cached or online taps."""
    from specjax.training import losses

    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")

    def loss_fn(model: Any, batch: Mapping[str, Array], rng: Array, aux: Any):
        del rng
        ids, lm, valid = _batch_arrays(batch)
        taps_bsf, hid = _features(batch, aux, target_graphdef, ids, valid, tuple(tap_layers))
        taps_bsf = taps_bsf.astype(feature_dtype)
        step_logits = model.ttt_forward(taps_bsf, ids, horizon)  # [K, B, S, N]
        t_logits = model.lm_head(shift_left(hid.astype(feature_dtype), 1))  # [B, S, N]
        in_vocab = dv.draft_labels(model.draft_vocab, shift_left(ids, 2)) >= 0
        mask = shift_left(lm, 2) * in_vocab.astype(jnp.float32)
        return losses.eagle3_loss(step_logits, t_logits, mask, decay=decay,
                                  chunk_tokens=chunk_tokens)

    return loss_fn


def mtp_objective(*, target_graphdef: Any, alpha_ce: float = 0.1, alpha_tv: float = 0.9,
                  chunk_tokens: int | None = None, feature_dtype: Any = jnp.bfloat16):
    """MTP-1: (hidden[t], ids[t+1]) -> ids[t+2], matched to lm_head(hidden[t+1]) (the final hidden
    from an offline cache or the frozen target)."""
    from specjax.training import losses

    def loss_fn(model: Any, batch: Mapping[str, Array], rng: Array, aux: Any):
        del rng
        ids, lm, valid = _batch_arrays(batch)
        _, hid = _features(batch, aux, target_graphdef, ids, valid, ())
        hid = hid.astype(feature_dtype)
        z = model.train_forward(hid, ids)  # [B, S, N]
        t_logits = model.shared_head.head(shift_left(hid, 1))
        labels = dv.draft_labels(model.draft_vocab, shift_left(ids, 2))
        return losses.mtp_loss(z, t_logits, labels, shift_left(lm, 2),
                               alpha_ce=alpha_ce, alpha_tv=alpha_tv, chunk_tokens=chunk_tokens)

    return loss_fn


def standalone_objective(*, target_graphdef: Any, alpha_ce: float = 0.1, alpha_tv: float = 0.9,
                         chunk_tokens: int | None = None):
    """A small LM distilled from the target: next-token CE + TV against the target's logits. With
    `alpha_tv` 0 it is the cross-entropy on the training text alone (`losses.lm_loss`): the frozen
    target is not run, so a step costs only the draft LM (sequence-level distillation on the
    target's regenerated answers, plus any other text listed)."""
    from specjax.training import losses

    def loss_fn(model: Any, batch: Mapping[str, Array], rng: Array, aux: Any):
        del rng
        ids, lm, valid = _batch_arrays(batch)
        b, s = ids.shape
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        vb = None if valid is None else jnp.asarray(valid, jnp.int32)
        if alpha_tv == 0:
            hid = model.model.forward(ids, pos, valid_b=vb, logits="none").hidden
            loss, metrics = losses.lm_loss(hid, model.model.logits, shift_left(ids, 1), shift_left(lm, 1),
                                           chunk_tokens=chunk_tokens)
            return alpha_ce * loss, {**metrics, "loss": alpha_ce * loss}
        z = model.model.forward(ids, pos, valid_b=vb, logits="all").logits
        _, hid = target_features(aux, target_graphdef, ids, valid, tap_layers=(), dtype=None)
        t_logits = jax.lax.stop_gradient(nnx.merge(target_graphdef, aux).logits(hid))
        return losses.mtp_loss(z, t_logits, shift_left(ids, 1), shift_left(lm, 1),
                               alpha_ce=alpha_ce, alpha_tv=alpha_tv, chunk_tokens=chunk_tokens)

    return loss_fn


class Objective(NamedTuple):
    drafter: nnx.Module  # the module to train (frozen embedding / lm_head copies included)
    loss_fn: Any  # (model, batch, rng, aux) -> (loss, metrics)
    drafter_config: Any  # the drafter's own config dataclass
    tap_layers: tuple[int, ...]  # target layers read online (() for mtp / standalone)


def standalone_config(mc: ModelConfig, tcfg: TargetConfig) -> TargetConfig:
    """The standalone draft LM's config: the target's family, vocab, RoPE and EOS with `draft_*` dims."""
    return dataclasses.replace(
        tcfg, hidden_size=mc.draft_hidden_size,
        intermediate_size=mc.draft_intermediate_size or tcfg.intermediate_size,
        num_hidden_layers=mc.num_draft_layers, num_attention_heads=mc.draft_num_attention_heads,
        num_key_value_heads=mc.draft_num_key_value_heads, head_dim=mc.draft_head_dim,
        tie_word_embeddings=True)


def _maybe_init_norm(mc: ModelConfig, norm: Any, target: Any) -> None:
    if mc.init_norm_from_target:
        from specjax.drafters.block import copy_output_norm_from_target

        copy_output_norm_from_target(norm, target)


def make_objective(mc: ModelConfig, target: Any, tcfg: TargetConfig, *, target_graphdef: Any,
                   feature_dtype: Any = jnp.bfloat16, draft_ids: Any = None) -> Objective:
    """The drafter of kind `mc.kind` (frozen parts copied from `target`) and its online loss.
    `draft_ids`: the draft vocabulary's target ids, required when mc.draft_vocab_size > 0
    (`specjax.drafters.vocab.build_draft_vocab` over the training data's token counts)."""
    rngs = nnx.Rngs(mc.init_seed)
    kw = dict(dtype=mc.compute_dtype, param_dtype=mc.param_dtype)
    width = {"intermediate_size": mc.draft_intermediate_size} if mc.draft_intermediate_size else {}
    if mc.kind != "standalone":
        kw["draft_ids"] = draft_ids
    elif draft_ids is not None:
        raise ConfigError("draft_ids were given for kind 'standalone' (no draft vocabulary)")
    if mc.kind in BLOCK_KINDS:
        from specjax.drafters.block import BlockDrafterConfig, default_target_layer_ids
        from specjax.drafters.dspark import make_block_drafter
        from specjax.training.trainer import block_drafter_loss

        layer_ids = tuple(mc.target_layer_ids) or default_target_layer_ids(tcfg.num_hidden_layers)
        dcfg = BlockDrafterConfig.from_target(
            tcfg, target_layer_ids=layer_ids, mask_token_id=mc.mask_token_id,
            num_draft_layers=mc.num_draft_layers, block_size=mc.block_size,
            markov_rank=mc.markov_rank, markov_head_type=mc.markov_head_type,
            confidence_head=mc.confidence_head,
            confidence_head_with_markov=mc.confidence_head_with_markov and mc.markov_rank > 0,
            draft_vocab_size=mc.draft_vocab_size, **width)
        drafter = make_block_drafter(target, tcfg, dcfg, rngs=rngs, **kw)
        _maybe_init_norm(mc, drafter.norm, target)
        if mc.init_layer_from_target is not None:
            from specjax.drafters.warm_start import copy_layer_from_target

            copy_layer_from_target(drafter, target, mc.init_layer_from_target)
        loss_fn = block_drafter_loss(
            num_anchors=mc.num_anchors, alpha_ce=mc.alpha_ce, alpha_tv=mc.alpha_tv,
            alpha_conf=mc.alpha_conf if mc.confidence_head else 0.0, decay=mc.loss_decay,
            chunk_anchors=mc.chunk_anchors, target_graphdef=target_graphdef,
            tap_layers=layer_ids, feature_dtype=feature_dtype)
        return Objective(drafter, loss_fn, dcfg, layer_ids)
    if mc.kind == "eagle3":
        from specjax.drafters.block import default_target_layer_ids
        from specjax.drafters.eagle3 import Eagle3Config, make_eagle3_drafter

        if mc.num_draft_layers != 1:
            raise ConfigError(f"field 'num_draft_layers' must be 1 for kind 'eagle3' (one "
                              f"midlayer), got {mc.num_draft_layers}")
        layer_ids = tuple(mc.target_layer_ids) or default_target_layer_ids(
            tcfg.num_hidden_layers, 3)
        ecfg = Eagle3Config.from_target(tcfg, target_layer_ids=layer_ids, gamma=mc.block_size,
                                        ttt_length=mc.block_size, step_loss_decay=mc.ttt_decay,
                                        draft_vocab_size=mc.draft_vocab_size, **width)
        drafter = make_eagle3_drafter(target, ecfg, rngs, **kw)
        _maybe_init_norm(mc, drafter.norm, target)
        loss_fn = eagle3_objective(target_graphdef=target_graphdef, tap_layers=layer_ids,
                                   horizon=mc.block_size, decay=mc.ttt_decay,
                                   chunk_tokens=mc.chunk_anchors, feature_dtype=feature_dtype)
        return Objective(drafter, loss_fn, ecfg, layer_ids)
    if mc.kind == "mtp":
        from specjax.drafters.mtp import MTPConfig, make_mtp_drafter

        mcfg = MTPConfig.from_target(tcfg, draft_vocab_size=mc.draft_vocab_size, **width)
        drafter = make_mtp_drafter(target, mcfg, rngs, **kw)
        _maybe_init_norm(mc, drafter.shared_head.norm, target)
        loss_fn = mtp_objective(target_graphdef=target_graphdef, alpha_ce=mc.alpha_ce,
                                alpha_tv=mc.alpha_tv, chunk_tokens=mc.chunk_anchors,
                                feature_dtype=feature_dtype)
        return Objective(drafter, loss_fn, mcfg, ())
    if mc.kind == "standalone":
        from specjax.drafters.standalone import StandaloneDrafter

        scfg = standalone_config(mc, tcfg)
        drafter = StandaloneDrafter.from_config(scfg, mc.block_size, rngs=rngs, **kw)
        loss_fn = standalone_objective(target_graphdef=target_graphdef, alpha_ce=mc.alpha_ce,
                                       alpha_tv=mc.alpha_tv, chunk_tokens=mc.chunk_anchors)
        return Objective(drafter, loss_fn, scfg, ())
    raise ConfigError(f"field 'kind': unknown drafter kind {mc.kind!r}")


__all__ = ["Objective", "eagle3_objective", "make_objective", "mtp_objective", "shift_left",
           "standalone_config", "standalone_objective"]
