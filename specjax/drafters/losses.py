"""Drafter training losses (jittable, float32 softmaxes, memory bounded over large vocabularies).

* `dspark_loss`: DSpark / DFlash block loss (reference §5.1). Position-weighted means of
  cross-entropy, total variation (full L1, no 1/2) and the confidence-head BCE against the soft label
  c* = clamp(1 - L1/2, 0, 1). DFlash is `alpha_ce=1, alpha_tv=0` without confidence logits.
* `eagle3_loss`: Eagle3 training-time-test soft cross-entropy (reference §4).
* `mtp_loss`: one-token-ahead (MTP style) CE + TV with a padding mask.

Draft vocabularies (`specjax.drafters.vocab`): draft logits are N wide, target logits are the
target's restricted to the same N tokens, and labels are draft indices with -1 for a token outside
the subset. As EAGLE-3 does, the distribution terms compare against the target restricted to the
draft vocabulary and renormalised there, and a label the drafter cannot emit drops out of the
cross-entropy (a -1 label gives CE 0 and is excluded from its weighted mean); without a subset
nothing changes. The TV term (and c*) then measures the gap to the renormalised target: it
overstates the real acceptance probability by at most the target mass outside the subset.

Vocabulary-sized work (log-softmax, two softmaxes, L1) is reduced to one scalar per slot right away;
with `chunk_anchors` (or `chunk_tokens`) it runs over slices of the anchor axis inside a rematerialised
`lax.map`, so neither the forward nor the backward pass holds more than one chunk of float32
`[*, V]` temporaries. Metric names use 1-indexed draft positions: `accept_rate@1` is slot 0, the
first proposed token.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
_EPS = 1e-6


def position_weights(gamma: int, decay: float = 4.0) -> Array:
    """Per-slot loss weights exp(-j / decay) for j = 0..gamma-1, float32 [gamma]."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if not decay > 0:
        raise ValueError(f"decay must be > 0, got {decay}")
    return jnp.exp(-jnp.arange(gamma, dtype=jnp.float32) / jnp.float32(decay))


# ------------------------------------------------------------------------------------------------
# per-slot vocabulary terms


def _ce_l1(z_xv: Array, t_xv: Array, labels_x: Array) -> tuple[Array, Array]:
    """CE(-log p_d[label]) (0 where label < 0: outside a draft vocabulary) and ||p_d - p_t||_1
    per row, all in float32; target side constant."""
    z = z_xv.astype(jnp.float32)
    t = jax.lax.stop_gradient(t_xv.astype(jnp.float32))
    lse = jax.nn.logsumexp(z, axis=-1)
    labels = jnp.clip(labels_x.astype(jnp.int32), 0, z.shape[-1] - 1)
    z_label = jnp.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
    p_d = jnp.exp(z - lse[..., None])
    p_t = jax.nn.softmax(t, axis=-1)
    ce = jnp.where(labels_x >= 0, lse - z_label, 0.0)
    return ce, jnp.sum(jnp.abs(p_d - p_t), axis=-1)


def map_over_axis1(fn: Callable[..., tuple[Array, ...]], arrays: tuple[Array, ...], chunk: int | None,
                    ) -> tuple[Array, ...]:
    """Apply `fn` (array slices along axis 1 -> outputs [B, c, ...]) in chunks of `chunk` along axis 1.

    The last chunk is shifted back to end at the axis length (it overlaps the previous one), so no
    padding copy is made; each position takes its value from the chunk that owns it. The body is
    rematerialised so the backward pass keeps no per-chunk [*, V] residuals.
    """
    n_axis = arrays[0].shape[1]
    if chunk is None or chunk >= n_axis:
        return fn(*arrays)
    if chunk < 1:
        raise ValueError(f"chunk size must be >= 1, got {chunk}")
    n_chunks = -(-n_axis // chunk)
    starts = jnp.minimum(jnp.arange(n_chunks, dtype=jnp.int32) * chunk, n_axis - chunk)

    @jax.checkpoint
    def body(start: Array, *arrs: Array) -> tuple[Array, ...]:
        # The barrier keeps XLA from hoisting dtype converts of the whole input out of the loop.
        sliced = jax.lax.optimization_barrier(
            tuple(jax.lax.dynamic_slice_in_dim(a, start, chunk, axis=1) for a in arrs))
        return fn(*sliced)

    outs = jax.lax.map(lambda s: body(s, *arrays), starts)  # each [n_chunks, B, chunk, ...]
    pos = jnp.arange(n_axis)
    owner = jnp.minimum(pos // chunk, n_chunks - 1)
    offset = pos - starts[owner]
    return tuple(jnp.moveaxis(o[owner, :, offset], 0, 1) for o in outs)


def dspark_slot_terms(draft_logits_bakv: Array, target_logits_bakv: Array, labels_bak: Array, *,
                      chunk_anchors: int | None = None) -> tuple[Array, Array]:
    """Per-slot cross-entropy and L1 distance, each float32 [B, A, K].

    ce = -log softmax(draft)[label] (0 for a label < 0); l1 = ||softmax(draft) - softmax(target)||_1
    (gradient flows into the draft logits only). `chunk_anchors` bounds the float32 temporaries to
    [B, chunk, K, V].
    """
    _check_ndim("draft_logits_bakv", draft_logits_bakv, 4)
    _check_same_shape("target_logits_bakv", target_logits_bakv, draft_logits_bakv.shape)
    _check_same_shape("labels_bak", labels_bak, draft_logits_bakv.shape[:3])
    return map_over_axis1(_ce_l1, (draft_logits_bakv, target_logits_bakv, labels_bak), chunk_anchors)


# ------------------------------------------------------------------------------------------------
# DSpark / DFlash


def bce_with_logits(logits: Array, labels: Array) -> Array:
    """Elementwise binary cross-entropy of sigmoid(logits) against soft labels in [0, 1]."""
    x = logits.astype(jnp.float32)
    y = labels.astype(jnp.float32)
    return jnp.maximum(x, 0.0) - x * y + jnp.log1p(jnp.exp(-jnp.abs(x)))


def dspark_loss_from_terms(ce_bak: Array, l1_bak: Array, eval_mask_bak: Array,
                           conf_logits_bak: Array | None = None, *, alpha_ce: float = 0.1,
                           alpha_tv: float = 0.9, alpha_conf: float = 1.0, decay: float = 4.0,
                           ce_mask_bak: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """DSpark loss and diagnostics from per-slot terms (see `dspark_loss`). `ce_mask_bak`: slots
    whose label the drafter can emit (labels >= 0 under a draft vocabulary); the CE mean runs
    over those only, and the metric `label_in_vocab` reports their share of the valid slots."""
    _check_ndim("ce_bak", ce_bak, 3)
    _check_same_shape("l1_bak", l1_bak, ce_bak.shape)
    _check_same_shape("eval_mask_bak", eval_mask_bak, ce_bak.shape)
    if conf_logits_bak is not None:
        _check_same_shape("conf_logits_bak", conf_logits_bak, ce_bak.shape)
    gamma = ce_bak.shape[-1]
    mask = eval_mask_bak.astype(jnp.float32)
    w = mask * position_weights(gamma, decay)
    denom = jnp.sum(w) + _EPS
    w_ce = w if ce_mask_bak is None else w * ce_mask_bak.astype(jnp.float32)
    ce = jnp.sum(w_ce * ce_bak) / (jnp.sum(w_ce) + _EPS)
    tv = jnp.sum(w * l1_bak) / denom
    loss = alpha_ce * ce + alpha_tv * tv

    c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1_bak, 0.0, 1.0))
    valid = (mask > 0).astype(jnp.float32)
    n_slot = jnp.sum(valid, axis=(0, 1))  # [K]
    accept_k = jnp.sum(c_star * valid, axis=(0, 1)) / jnp.maximum(n_slot, 1.0)
    survival = jnp.cumprod(c_star * valid, axis=-1)  # [B, A, K]
    blocks = valid[..., 0]  # with a contiguous mask, a block has a valid slot iff slot 0 is valid
    tau = jnp.sum((1.0 + jnp.sum(survival, axis=-1)) * blocks) / jnp.maximum(jnp.sum(blocks), 1.0)

    metrics: dict[str, Array] = {"ce": ce, "tv": tv}
    if ce_mask_bak is not None:
        metrics["label_in_vocab"] = (jnp.sum(valid * ce_mask_bak.astype(jnp.float32))
                                     / jnp.maximum(jnp.sum(valid), 1.0))
    if conf_logits_bak is not None:
        conf = jnp.sum(w * bce_with_logits(conf_logits_bak, c_star)) / denom
        loss = loss + alpha_conf * conf
        pred = jax.nn.sigmoid(conf_logits_bak.astype(jnp.float32))
        n_valid = jnp.maximum(jnp.sum(valid), 1.0)
        metrics["conf"] = conf
        metrics["conf_abs_err"] = jnp.sum(jnp.abs(pred - c_star) * valid) / n_valid
        metrics["conf_bias"] = jnp.sum((pred - c_star) * valid) / n_valid
    metrics["loss"] = loss
    for k in range(gamma):
        metrics[f"accept_rate@{k + 1}"] = accept_k[k]
    metrics["tau_probabilistic"] = tau
    metrics["weight_sum"] = denom - _EPS
    metrics["supervised_slots"] = jnp.sum(valid)
    return loss, metrics


def dspark_loss(draft_logits_bakv: Array, target_logits_bakv: Array, labels_bak: Array,
                eval_mask_bak: Array, conf_logits_bak: Array | None = None, *, alpha_ce: float = 0.1,
                alpha_tv: float = 0.9, alpha_conf: float = 1.0, decay: float = 4.0,
                chunk_anchors: int | None = None) -> tuple[Array, dict[str, Array]]:
    """DSpark / DFlash block loss (reference §5.1).

    Args:
      draft_logits_bakv: draft logits [B, A, K, V] (Markov bias already added), any float dtype.
      target_logits_bakv: target logits [B, A, K, V] for the same slots (target hidden at a + j).
      labels_bak: int [B, A, K] ground-truth ids (input_ids[a + j + 1]); under a draft vocabulary
        draft indices, -1 outside it (excluded from the CE mean).
      eval_mask_bak: [B, A, K] validity (bool or float; 0 excludes prompt, padding, dummy blocks).
      conf_logits_bak: confidence-head logits [B, A, K] or None (no confidence term).
      chunk_anchors: process the vocabulary terms this many anchors at a time (memory bound).

    Returns (loss, metrics): loss = alpha_ce*CE + alpha_tv*TV + alpha_conf*CONF, each a weighted
    mean with weights eval_mask * exp(-j/decay) over their sum + 1e-6. Metrics: ce, tv, conf,
    conf_abs_err, conf_bias (with confidence logits), loss, accept_rate@k (mean c* over valid slots
    at 1-indexed position k), tau_probabilistic, weight_sum, supervised_slots.
    """
    ce, l1 = dspark_slot_terms(draft_logits_bakv, target_logits_bakv, labels_bak,
                               chunk_anchors=chunk_anchors)
    return dspark_loss_from_terms(ce, l1, eval_mask_bak, conf_logits_bak, alpha_ce=alpha_ce,
                                  alpha_tv=alpha_tv, alpha_conf=alpha_conf, decay=decay,
                                  ce_mask_bak=labels_bak >= 0)


def dflash_loss(draft_logits_bakv: Array, target_logits_bakv: Array, labels_bak: Array,
                eval_mask_bak: Array, *, decay: float = 4.0, chunk_anchors: int | None = None,
                ) -> tuple[Array, dict[str, Array]]:
    """DFlash configuration of `dspark_loss`: cross-entropy only, no confidence term."""
    return dspark_loss(draft_logits_bakv, target_logits_bakv, labels_bak, eval_mask_bak, None,
                       alpha_ce=1.0, alpha_tv=0.0, alpha_conf=0.0, decay=decay,
                       chunk_anchors=chunk_anchors)


# ------------------------------------------------------------------------------------------------
# Eagle3 (training-time test)


def _eagle_step_terms(z_bnv: Array, t_bnv: Array) -> tuple[Array, Array, Array]:
    """Soft CE -sum p_t log softmax(z), argmax agreement, sum min(p_d, p_t) per row."""
    z = z_bnv.astype(jnp.float32)
    t = jax.lax.stop_gradient(t_bnv.astype(jnp.float32))
    logp_d = jax.nn.log_softmax(z, axis=-1)
    p_t = jax.nn.softmax(t, axis=-1)
    soft_ce = -jnp.sum(p_t * logp_d, axis=-1)
    agree = (jnp.argmax(z, axis=-1) == jnp.argmax(t, axis=-1)).astype(jnp.float32)
    overlap = jax.lax.stop_gradient(jnp.sum(jnp.minimum(jnp.exp(logp_d), p_t), axis=-1))
    return soft_ce, agree, overlap


def eagle3_loss(step_logits_kbsv: Array, target_logits_bsv: Array, mask_bs: Array, *,
                decay: float = 0.8, chunk_tokens: int | None = None) -> tuple[Array, dict[str, Array]]:
    """Eagle3 TTT loss: sum_k decay^k * loss_k (reference §4).

    Alignment (the caller applies the one-token shift once, the per-step shift happens here):
      * `target_logits_bsv[b, t]` is the target distribution that step 0 at position t must match
        (the target's logits one position ahead, i.e. lm_head(target_last_hidden[t + 1])).
      * `mask_bs[b, t]` is 1 where that step-0 prediction is supervised (0 for prompt/padding and
        where no target exists).
      * Step k at position t is scored against row t + k with weight mask[b, t + k] (0 if t + k >= S);
        the last k positions of step k are ignored.
    loss_k = sum_{b,t} mask * (-sum_v p_t log softmax(z_k)) / (B * S), per-sequence-mean style.

    Returns (loss, metrics): loss, ploss_k, accuracy@k (argmax agreement), accept_rate@k
    (mean sum_v min(p_d, p_t) over supervised positions), tau_greedy and tau_probabilistic
    (1 + sum_k prod_{i<=k} per-position chains, averaged over positions supervised at step 0).
    Positions k are 1-indexed in names (step 0 -> @1).
    """
    _check_ndim("step_logits_kbsv", step_logits_kbsv, 4)
    n_steps, b, s, v = step_logits_kbsv.shape
    _check_same_shape("target_logits_bsv", target_logits_bsv, (b, s, v))
    _check_same_shape("mask_bs", mask_bs, (b, s))
    if n_steps > s:
        raise ValueError(f"step_logits_kbsv has {n_steps} steps for sequence length {s}")
    mask = mask_bs.astype(jnp.float32)
    norm = jnp.float32(b * s)
    total = jnp.float32(0.0)
    metrics: dict[str, Array] = {}
    acc_chain, prob_chain = [], []
    for k in range(n_steps):
        n = s - k
        m = mask[:, k:]
        ce, agree, overlap = map_over_axis1(
            _eagle_step_terms, (step_logits_kbsv[k, :, :n], target_logits_bsv[:, k:]), chunk_tokens)
        loss_k = jnp.sum(m * ce) / norm
        total = total + (decay ** k) * loss_k
        n_m = jnp.maximum(jnp.sum(m), 1.0)
        metrics[f"ploss_{k}"] = loss_k
        metrics[f"accuracy@{k + 1}"] = jnp.sum(m * agree) / n_m
        metrics[f"accept_rate@{k + 1}"] = jnp.sum(m * overlap) / n_m
        pad = ((0, 0), (0, k))
        acc_chain.append(jnp.pad(agree * m, pad))
        prob_chain.append(jnp.pad(overlap * m, pad))
    start = (mask > 0).astype(jnp.float32)
    n_start = jnp.maximum(jnp.sum(start), 1.0)
    for name, chain in (("tau_greedy", acc_chain), ("tau_probabilistic", prob_chain)):
        surv = jnp.cumprod(jnp.stack(chain, axis=-1), axis=-1)  # [B, S, K]
        metrics[name] = jnp.sum((1.0 + jnp.sum(surv, axis=-1)) * start) / n_start
    metrics["loss"] = total
    return total, metrics


# ------------------------------------------------------------------------------------------------
# MTP (one token ahead)


def mtp_loss(draft_logits_btv: Array, target_logits_btv: Array, labels_bt: Array, mask_bt: Array, *,
             alpha_ce: float = 0.1, alpha_tv: float = 0.9, chunk_tokens: int | None = None,
             ) -> tuple[Array, dict[str, Array]]:
    """Masked-mean alpha_ce*CE + alpha_tv*TV for a one-token-ahead drafter.

    `draft_logits_btv[b, t]` predicts `labels_bt[b, t]` and is matched to `target_logits_btv[b, t]`;
    `mask_bt` (bool or float weights) excludes padding; a label < 0 (outside a draft vocabulary)
    is left out of the CE mean only. Metrics: loss, ce, tv, accept_rate (mean clamp(1 - L1/2, 0,
    1) over masked positions).
    """
    _check_ndim("draft_logits_btv", draft_logits_btv, 3)
    _check_same_shape("target_logits_btv", target_logits_btv, draft_logits_btv.shape)
    _check_same_shape("labels_bt", labels_bt, draft_logits_btv.shape[:2])
    _check_same_shape("mask_bt", mask_bt, draft_logits_btv.shape[:2])
    ce, l1 = map_over_axis1(_ce_l1, (draft_logits_btv, target_logits_btv, labels_bt), chunk_tokens)
    w = mask_bt.astype(jnp.float32)
    denom = jnp.sum(w) + _EPS
    w_ce = w * (labels_bt >= 0).astype(jnp.float32)
    ce_m = jnp.sum(w_ce * ce) / (jnp.sum(w_ce) + _EPS)
    tv_m = jnp.sum(w * l1) / denom
    loss = alpha_ce * ce_m + alpha_tv * tv_m
    valid = (w > 0).astype(jnp.float32)
    c_star = jnp.clip(1.0 - 0.5 * jax.lax.stop_gradient(l1), 0.0, 1.0)
    acc = jnp.sum(valid * c_star) / jnp.maximum(jnp.sum(valid), 1.0)
    return loss, {"loss": loss, "ce": ce_m, "tv": tv_m, "accept_rate": acc}


def _ce_top1(z_xv: Array, labels_x: Array) -> tuple[Array, Array]:
    """CE(-log p_d[label]) and whether the label is the argmax, per row, in float32."""
    z = z_xv.astype(jnp.float32)
    labels = jnp.clip(labels_x.astype(jnp.int32), 0, z.shape[-1] - 1)
    z_label = jnp.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
    ce = jax.nn.logsumexp(z, axis=-1) - z_label
    return ce, (jnp.argmax(z, axis=-1) == labels).astype(jnp.float32)


def lm_loss(hidden_bth: Array, head: Callable[[Array], Array], labels_bt: Array, mask_bt: Array, *,
            chunk_tokens: int | None = None) -> tuple[Array, dict[str, Array]]:
    """Masked-mean next-token cross-entropy of a language model on its training text (no target
    logits: sequence-level distillation when the text is the target's own answers). `head` maps
    final hidden states [B, c, H] to logits [B, c, V]; it runs `chunk_tokens` positions at a time,
    so no [B, T, V] array is ever held. Metrics: loss, ce and top1 (the share of masked positions
    whose label is the model's argmax: what a greedy draft of that token would have matched)."""
    _check_ndim("hidden_bth", hidden_bth, 3)
    _check_same_shape("labels_bt", labels_bt, hidden_bth.shape[:2])
    _check_same_shape("mask_bt", mask_bt, hidden_bth.shape[:2])
    ce, top1 = map_over_axis1(lambda h, y: _ce_top1(head(h), y), (hidden_bth, labels_bt), chunk_tokens)
    w = mask_bt.astype(jnp.float32)
    denom = jnp.sum(w) + _EPS
    loss = jnp.sum(w * ce) / denom
    return loss, {"loss": loss, "ce": loss, "top1": jnp.sum(w * top1) / denom}


# ------------------------------------------------------------------------------------------------
# argument checks (trace-time: shapes are static)


def _check_ndim(name: str, x: Array, ndim: int) -> None:
    if getattr(x, "ndim", None) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {getattr(x, 'shape', None)}")


def _check_same_shape(name: str, x: Array, shape: tuple[int, ...]) -> None:
    if tuple(getattr(x, "shape", ())) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {getattr(x, 'shape', None)}")
