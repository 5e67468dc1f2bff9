"""Lossless chain verification (speculative rejection sampling), batched and jittable.

One round for one row, with target distributions p_0..p_ell (p_k = after the anchor and the first k
draft tokens), draft distributions q_1..q_ell and draft tokens x_1..x_ell:

* for k = 1..ell, left to right, draw u_k ~ U[0, 1) and accept x_k iff u_k * q_k(x_k) < p_{k-1}(x_k),
  i.e. with probability min(1, p_{k-1}(x_k) / q_k(x_k)) (1 if q_k(x_k) = 0 < p_{k-1}(x_k), 0 if
  p_{k-1}(x_k) = 0); n = length of the accepted prefix;
* if n < ell the next token is drawn from normalise(max(0, p_n - q_{n+1})), or from p_n if that mass
  is <= 1e-8; if n = ell the bonus token is drawn from p_ell;
* if an accepted draft token is a stop token, acceptance ends right after the first such token and
  the row emits no next token.

All positions >= ell (tokens, p, q) are padding and never influence the result, even if NaN.
Randomness is per row: u_k comes from fold_in(fold_in(key_b[b], 0), k) and the next token from
fold_in(key_b[b], 1), so a row's outcome depends only on its own key and data, not on the batch
or on the padded block size G.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.sampling import _as_typed_key, sample

Array = jax.Array

RESIDUAL_EPS = 1e-8  # residual mass at or below this falls back to p_n


class VerifyResult(NamedTuple):
    num_accepted: Array  # [B] int32: accepted draft tokens n (a stop token, if any, is the last)
    next_token: Array  # [B] int32: corrected or bonus token; -1 when the row stopped on a draft
    tokens: Array  # [B, G+1] int32: x_1..x_n then next_token, -1 padding
    num_emitted: Array  # [B] int32: n + 1, or n when stopped on a draft token
    stopped_on_draft: Array  # [B] bool: an accepted draft token was a stop token


def acceptance_prob(p_x: Array, q_x: Array) -> Array:
    """min(1, p_x / q_x) elementwise, as realised by the test u * q_x < p_x with u ~ U[0, 1)."""
    safe_q = jnp.where(q_x > 0, q_x, 1.0)
    return jnp.where(q_x > 0, jnp.minimum(1.0, p_x / safe_q), jnp.where(p_x > 0, 1.0, 0.0))


def next_token_dist(p_v: Array, q_v: Array, use_residual: Array) -> Array:
    """Distribution of the token after the accepted prefix, [..., V] float32.

    `use_residual` True (a draft token was rejected): normalise(max(0, p - q)), or p when that mass
    is <= RESIDUAL_EPS. False (every proposed token accepted): p itself (the bonus distribution).
    NaN in `q_v` never leaks when `use_residual` is False.
    """
    use_residual = jnp.asarray(use_residual)[..., None]
    residual = jnp.maximum(p_v - q_v, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    ok = use_residual & (mass > RESIDUAL_EPS)
    return jnp.where(ok, residual / jnp.where(ok, mass, 1.0), p_v)


@jax.jit
def chain_round_probs(p_gv: Array, q_gv: Array, draft_g: Array, ell: Array | int
                      ) -> tuple[Array, Array]:
    """Exact per-row law of one verification round (ignoring stop tokens), for enumeration.

    Args: p_gv [G+1, V] target probs, q_gv [G, V] draft probs, draft_g [G] tokens, ell in 0..G.
    Returns (accept_g [G], next_nv [G+1, V]): accept_g[k-1] = P(accept x_k | x_1..x_{k-1} accepted)
    (0 for k > ell); next_nv[n] = distribution of the next token when exactly n drafts were
    accepted (residual for n < ell, p_ell for n = ell, zeros for n > ell). So
    P(n accepted, next = y) = prod(accept_g[:n]) * (1 - accept_g[n] if n < ell else 1) * next_nv[n, y].
    """
    p_gv = jnp.asarray(p_gv, jnp.float32)
    q_gv = jnp.asarray(q_gv, jnp.float32)
    g1, v = p_gv.shape
    g = g1 - 1
    ell = jnp.clip(jnp.asarray(ell, jnp.int32), 0, g)
    pos_g = jnp.arange(g)
    d_g = jnp.clip(jnp.asarray(draft_g, jnp.int32), 0, v - 1)
    p_x = jnp.take_along_axis(p_gv[:g], d_g[:, None], axis=-1)[:, 0]
    q_x = jnp.take_along_axis(q_gv, d_g[:, None], axis=-1)[:, 0]
    accept_g = jnp.where(pos_g < ell, acceptance_prob(p_x, q_x), 0.0)
    n_n = jnp.arange(g1)
    q_pad = jnp.concatenate([q_gv, jnp.zeros((1, v), jnp.float32)], axis=0)  # q_{n+1} for n < G
    next_nv = next_token_dist(p_gv, q_pad, n_n < ell)
    next_nv = jnp.where((n_n <= ell)[:, None], next_nv, 0.0)
    return accept_g, next_nv


def _checked_inputs(key_b, p_bgv, q_bgv, draft_bg, ell_b, stop_ids) -> tuple[Array, ...]:
    """`verify_chain`'s inputs as typed keys, float32 probs, int32 drafts, lengths clipped to 0..G and
    flat stop ids; a shape that does not fit raises ValueError."""
    key_b = _as_typed_key(key_b)
    p_bgv = jnp.asarray(p_bgv, jnp.float32)
    q_bgv = jnp.asarray(q_bgv, jnp.float32)
    draft_bg = jnp.asarray(draft_bg, jnp.int32)
    stop_e = jnp.asarray(stop_ids, jnp.int32).reshape(-1)
    if p_bgv.ndim != 3:
        raise ValueError(f"p_bgv must be [B, G+1, V], got shape {p_bgv.shape}")
    b, g1, v = p_bgv.shape
    g = g1 - 1
    if q_bgv.shape != (b, g, v):
        raise ValueError(f"q_bgv must be [B, G, V] = {(b, g, v)}, got {q_bgv.shape}")
    if draft_bg.shape != (b, g):
        raise ValueError(f"draft_bg must be [B, G] = {(b, g)}, got {draft_bg.shape}")
    if key_b.shape != (b,):
        raise ValueError(f"key_b must be [B] = ({b},) typed keys, got shape {key_b.shape}")
    ell_b = jnp.clip(jnp.broadcast_to(jnp.asarray(ell_b, jnp.int32), (b,)), 0, g)
    return key_b, p_bgv, q_bgv, draft_bg, ell_b, stop_e


@jax.jit
def verify_chain(key_b: Array, p_bgv: Array, q_bgv: Array, draft_bg: Array, ell_b: Array,
                 stop_ids: Array) -> VerifyResult:
    """Verify one round of chain drafts for a batch of rows (see module docstring).

    Args:
      key_b: [B] typed PRNG keys (one per row, e.g. `sampling.round_key`).
      p_bgv: [B, G+1, V] target probs (already through `probs_from_logits`).
      q_bgv: [B, G, V] draft probs the draft tokens were drawn from.
      draft_bg: [B, G] int32 draft tokens.
      ell_b: [B] int32 in 0..G (values outside are clipped): how many drafts each row verifies.
      stop_ids: [E] int32 stop tokens (E may be 0; -1 entries are padding).
    """
    key_b, p_bgv, q_bgv, draft_bg, ell_b, stop_e = _checked_inputs(key_b, p_bgv, q_bgv, draft_bg, ell_b, stop_ids)
    b, g1, v = p_bgv.shape
    g = g1 - 1

    fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
    key_u_b, key_next_b = fold(key_b, 0), fold(key_b, 1)
    pos_g = jnp.arange(g)

    # Acceptance test per position; positions >= ell are masked out.
    def uniforms(k: Array) -> Array:
        return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(k, i)))(pos_g)

    u_bg = jax.vmap(uniforms)(key_u_b)
    d_bg = jnp.clip(draft_bg, 0, v - 1)
    p_x = jnp.take_along_axis(p_bgv[:, :g], d_bg[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q_bgv, d_bg[..., None], axis=-1)[..., 0]
    live_bg = pos_g[None, :] < ell_b[:, None]
    acc_bg = live_bg & (u_bg * q_x < p_x)
    n_b = jnp.sum(jnp.cumprod(acc_bg.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)

    # Stop tokens inside the accepted prefix cut it right after the first one.
    is_stop_bg = jnp.any((draft_bg[..., None] == stop_e) & (stop_e >= 0), axis=-1)
    stop_bg = is_stop_bg & (pos_g[None, :] < n_b[:, None])
    stopped_b = jnp.any(stop_bg, axis=-1)
    first_stop_b = jnp.sum(jnp.cumprod((~stop_bg).astype(jnp.int32), axis=-1), axis=-1)
    n_b = jnp.where(stopped_b, first_stop_b.astype(jnp.int32) + 1, n_b)

    # Next token: residual at the first rejection, else bonus from p_ell.
    p_n = jnp.take_along_axis(p_bgv, n_b[:, None, None], axis=1)[:, 0]
    if g > 0:
        q_n = jnp.take_along_axis(q_bgv, jnp.minimum(n_b, g - 1)[:, None, None], axis=1)[:, 0]
    else:
        q_n = jnp.zeros_like(p_n)
    dist_bv = next_token_dist(p_n, q_n, n_b < ell_b)
    next_b = jnp.where(stopped_b, -1, sample(key_next_b, dist_bv))

    j = jnp.arange(g1)[None, :]
    draft_pad = jnp.concatenate([draft_bg, jnp.full((b, 1), -1, jnp.int32)], axis=1)
    tokens = jnp.where(j < n_b[:, None], draft_pad,
                       jnp.where((j == n_b[:, None]) & ~stopped_b[:, None], next_b[:, None], -1))
    return VerifyResult(num_accepted=n_b, next_token=next_b.astype(jnp.int32),
                        tokens=tokens.astype(jnp.int32),
                        num_emitted=n_b + (~stopped_b).astype(jnp.int32),
                        stopped_on_draft=stopped_b)


__all__ = ["VerifyResult", "verify_chain", "chain_round_probs", "acceptance_prob",
           "next_token_dist", "RESIDUAL_EPS"]
