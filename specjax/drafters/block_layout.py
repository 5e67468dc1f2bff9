"""The training layout of a block drafter (reference §2.4), jittable.

Per sequence, up to A anchors a are sampled among the completion tokens; each anchor opens a block
of K slots: slot j sits at position a + j, is labelled ids[a + j + 1] and sees the context t < a and
its own block. Dummy blocks (fewer candidates than A) have anchor 0 and keep False. The A blocks
of a sequence lie back to back, so block slot j of anchor i is query index i*K + j.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

def anchor_candidates(loss_mask_bs: Any) -> Array:
    """bool [B, S]: a is a candidate iff a <= S-2 and loss_mask[a] = loss_mask[a+1] = 1."""
    m = jnp.asarray(loss_mask_bs) > 0
    if m.ndim != 2:
        raise ValueError(f"loss_mask_bs must be [B, S], got shape {m.shape}")
    nxt = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)
    return m & nxt


def _finish_anchors(cand_idx_ba: Array, is_cand_ba: Array, seq_len: int, num_anchors: int,
                    ) -> tuple[Array, Array]:
    """Sort chosen candidates ascending (kept first), dummies -> anchor 0, keep False; pad to A."""
    key = jnp.where(is_cand_ba, cand_idx_ba, seq_len)
    key = jnp.sort(key, axis=1)
    pad = num_anchors - key.shape[1]
    if pad > 0:
        key = jnp.pad(key, ((0, 0), (0, pad)), constant_values=seq_len)
    keep = key < seq_len
    return jnp.where(keep, key, 0).astype(jnp.int32), keep


def sample_anchors(key: Any, loss_mask_bs: Any, num_anchors: int) -> tuple[Any, Any]:
    """Up to `num_anchors` anchors per row, uniform without replacement among the candidates.

    `key` is a jax PRNG key (jittable; what training uses) or a numpy Generator (host side).
    Returns (anchors int32 [B, A], keep bool [B, A]): the kept anchors sorted ascending, then the
    dummies (anchor 0, keep False) when a row has fewer than A candidates. Numpy in, numpy out for
    the Generator path.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if isinstance(key, np.random.Generator):
        m = np.asarray(loss_mask_bs) > 0
        if m.ndim != 2:
            raise ValueError(f"loss_mask_bs must be [B, S], got shape {m.shape}")
        cand = m & np.concatenate([m[:, 1:], np.zeros_like(m[:, :1])], axis=1)
        b, s = cand.shape
        scores = np.where(cand, key.random((b, s)), -1.0)
        k = min(num_anchors, s)
        idx = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        chosen = np.take_along_axis(cand, idx, axis=1)
        order = np.sort(np.where(chosen, idx, s), axis=1)
        order = np.pad(order, ((0, 0), (0, num_anchors - k)), constant_values=s)
        keep = order < s
        return np.where(keep, order, 0).astype(np.int32), keep
    cand = anchor_candidates(loss_mask_bs)
    b, s = cand.shape
    scores = jnp.where(cand, jax.random.uniform(key, (b, s)), -1.0)
    k = min(num_anchors, s)
    top, idx = jax.lax.top_k(scores, k)
    return _finish_anchors(idx, top >= 0.0, s, num_anchors)


def _label_index(anchors_ba: Array, gamma: int) -> Array:
    return jnp.asarray(anchors_ba, jnp.int32)[..., None] + jnp.arange(1, gamma + 1, dtype=jnp.int32)


def block_labels(input_ids_bs: Any, anchors_ba: Any, keep_ba: Any, gamma: int) -> Array:
    """int32 [B, A, K]: slot j of anchor a is labelled input_ids[a + j + 1] (index clamped to S-1);
    dummy blocks get 0."""
    ids = jnp.asarray(input_ids_bs)
    b, s = ids.shape
    a = jnp.asarray(anchors_ba)
    idx = jnp.minimum(_label_index(a, gamma), s - 1)
    labels = jnp.take_along_axis(ids, idx.reshape(b, -1), axis=1).reshape(idx.shape)
    return jnp.where(jnp.asarray(keep_ba)[..., None], labels, 0).astype(jnp.int32)


def eval_mask(loss_mask_bs: Any, anchors_ba: Any, keep_ba: Any, gamma: int) -> Array:
    """bool [B, A, K]: slot j valid iff a+j+1 < S, loss_mask[a+j+1] = 1 and the block is kept, then
    cumulative-product along j (only the contiguous valid prefix of each block counts)."""
    m = jnp.asarray(loss_mask_bs) > 0
    b, s = m.shape
    raw = _label_index(jnp.asarray(anchors_ba), gamma)
    idx = jnp.minimum(raw, s - 1)
    lm = jnp.take_along_axis(m, idx.reshape(b, -1), axis=1).reshape(idx.shape)
    valid = (raw < s) & lm & jnp.asarray(keep_ba, bool)[..., None]
    return jnp.cumprod(valid.astype(jnp.int32), axis=-1) > 0


def block_positions(anchors_ba: Any, gamma: int) -> Array:
    """int32 [B, A*K]: RoPE position a + j of block slot j (query i*K + j)."""
    a = jnp.asarray(anchors_ba, jnp.int32)
    pos = a[..., None] + jnp.arange(gamma, dtype=jnp.int32)
    return pos.reshape(a.shape[0], -1)


def block_attention_mask(anchors_ba: Any, keep_ba: Any, seq_len: int, gamma: int) -> Array:
    """bool [B, A*K, S + A*K]: which keys each block query may see (reference §2.4).

    Keys 0..S-1 are the context (query of block b sees t < anchor_b), keys S.. are the blocks (a
    query sees all slots of its own block). Rows of dummy blocks are all False: an attention kernel
    must guard them (their outputs are masked by the loss).
    """
    a = jnp.asarray(anchors_ba, jnp.int32)
    keep = jnp.asarray(keep_ba, bool)
    n_blocks = a.shape[1]
    q_block = jnp.arange(n_blocks * gamma) // gamma  # [Q]
    a_q = a[:, q_block]  # [B, Q]
    keep_q = keep[:, q_block]
    ctx = jnp.arange(seq_len)[None, None, :] < a_q[..., None]  # [B, Q, S]
    same = q_block[:, None] == q_block[None, :]  # [Q, Q]
    blk = jnp.broadcast_to(same[None], (a.shape[0],) + same.shape)
    return jnp.concatenate([ctx, blk], axis=-1) & keep_q[..., None]
