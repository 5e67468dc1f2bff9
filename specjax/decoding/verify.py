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

q may come over a subset of the vocabulary: `q_ids_n` [N] names the target token of each of its N
columns (a drafter's draft vocabulary, `specjax.drafters.vocab`), q being zero elsewhere; the
acceptance test reads q at the drafted tokens and the residual scatters only the one row it needs, so
no [B, G, V] q is built. The verifier must use exactly the q the token was drawn from: a bf16 copy of
a float32-sampled q is another q (its p/q ratios and residual off by up to 2^-8 relative). A drafter
computing in bfloat16 therefore rounds q first and draws from the rounded q (`sampling.draft_probs`),
which no longer sums to one: given q in a dtype below float32, the verifier divides the entries it
reads by their rows' sums (`_q_totals`), the distribution the draws came from. Together with the draft
vocabulary (V/N fewer columns, 6x for the shipped drafters) that halves what travels from draft to
verify.

All positions >= ell (tokens, p, q) are padding and never influence the result, even if NaN.
Randomness is per row: u_k comes from fold_in(fold_in(key_b[b], 0), k) and the next token from
fold_in(key_b[b], 1), so a row's outcome depends only on its own key and data, not on the batch
or on the padded block size G.
"""
from __future__ import annotations

import functools
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


def _checked_inputs(key_b, p_bgv, q_bgn, draft_bg, ell_b, stop_ids, q_ids_n, greedy: bool) -> tuple[Array, ...]:
    """`verify_chain`'s inputs as typed keys, float32 p (q as carried: `_q_totals`), int32 drafts,
    lengths clipped to 0..G, stop ids per row [B, E] and int32 column ids (None: q is over the whole
    vocabulary); a shape that does not fit raises ValueError (greedy: q may have no columns)."""
    key_b = _as_typed_key(key_b)
    p_bgv = jnp.asarray(p_bgv, jnp.float32)
    q_bgn = jnp.asarray(q_bgn)
    if not jnp.issubdtype(q_bgn.dtype, jnp.floating):
        q_bgn = q_bgn.astype(jnp.float32)
    draft_bg = jnp.asarray(draft_bg, jnp.int32)
    stop_be = jnp.asarray(stop_ids, jnp.int32)
    if p_bgv.ndim != 3:
        raise ValueError(f"p_bgv must be [B, G+1, V], got shape {p_bgv.shape}")
    b, g1, v = p_bgv.shape
    g = g1 - 1
    n = v if q_ids_n is None else jnp.shape(q_ids_n)[0]
    if q_ids_n is not None:
        if jnp.ndim(q_ids_n) != 1 or not 1 <= n <= v:
            raise ValueError(f"q_ids_n must be [N] target ids with 1 <= N <= V = {v}, got shape {jnp.shape(q_ids_n)}")
        q_ids_n = jnp.asarray(q_ids_n, jnp.int32)
    if q_bgn.shape != (b, g, n) and not (greedy and q_bgn.shape == (b, g, 0)):
        raise ValueError(f"q_bgn must be [B, G, N] = {(b, g, n)}" + (" (or [B, G, 0]: greedy)" if greedy else "")
                         + f", got {q_bgn.shape}")
    if draft_bg.shape != (b, g):
        raise ValueError(f"draft_bg must be [B, G] = {(b, g)}, got {draft_bg.shape}")
    if key_b.shape != (b,):
        raise ValueError(f"key_b must be [B] = ({b},) typed keys, got shape {key_b.shape}")
    if stop_be.ndim <= 1:
        stop_be = jnp.broadcast_to(stop_be.reshape(-1), (b, stop_be.size))
    elif stop_be.ndim != 2 or stop_be.shape[0] != b:
        raise ValueError(f"stop_ids must be [E] or [B, E] with B = {b}, got shape {stop_be.shape}")
    ell_b = jnp.clip(jnp.broadcast_to(jnp.asarray(ell_b, jnp.int32), (b,)), 0, g)
    return key_b, p_bgv, q_bgn, draft_bg, ell_b, stop_be, q_ids_n


def _q_totals(q_bgn: Array) -> Array | None:
    """Row sums [B, G] (float32) of a q rounded below float32 (`sampling.draft_probs`: the drafter
    drew from it normalised, so the verifier divides the entries it reads by them); None for a
    float32 q, taken as normalised. One read of q: the division touches only what is read."""
    if q_bgn.dtype == jnp.float32:
        return None
    total = jnp.sum(q_bgn, axis=-1, dtype=jnp.float32)
    return jnp.where(total > 0, total, 1.0)


def _normalised(q: Array, totals: Array | None) -> Array:
    """Entries of q (float32) divided by their rows' sums when q was rounded (`_q_totals`)."""
    q = q.astype(jnp.float32)
    return q if totals is None else q / totals


def _q_at(q_bgn: Array, tok_bg: Array, q_ids_n: Array | None) -> Array:
    """q at target tokens [B, G] (0 for a token outside q's columns)."""
    if q_ids_n is None:
        return jnp.take_along_axis(q_bgn, tok_bg[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(q_ids_n == tok_bg[..., None], q_bgn, 0.0), axis=-1)  # ids distinct: one term


def _q_row(q_bn: Array, q_ids_n: Array | None, v: int) -> Array:
    """Rows of q [B, N] over the whole vocabulary [B, V] (zero outside q's columns)."""
    if q_ids_n is None:
        return q_bn
    return jnp.zeros((q_bn.shape[0], v), jnp.float32).at[:, q_ids_n].set(q_bn)


def _cut_at_stops(draft_bg: Array, stop_be: Array, n_b: Array) -> tuple[Array, Array]:
    """Accepted counts [B] cut right after the first of its row's stop tokens inside the accepted
    prefix, and whether a row stopped there."""
    stop_b1e = stop_be[:, None, :]
    is_stop_bg = jnp.any((draft_bg[..., None] == stop_b1e) & (stop_b1e >= 0), axis=-1)
    stop_bg = is_stop_bg & (jnp.arange(draft_bg.shape[1])[None, :] < n_b[:, None])
    stopped_b = jnp.any(stop_bg, axis=-1)
    first_stop_b = jnp.sum(jnp.cumprod((~stop_bg).astype(jnp.int32), axis=-1), axis=-1)
    return jnp.where(stopped_b, first_stop_b.astype(jnp.int32) + 1, n_b), stopped_b


def _residual_or_bonus(p_n: Array, q_bgn: Array, totals_bg: Array | None, q_ids_n: Array | None, n_b: Array,
                       ell_b: Array) -> Array:
    """The next token's distribution [B, V] after n_b accepted drafts: the residual of p_n and q at
    the first rejection (q's row n_b, renormalised when rounded), else p_n (`next_token_dist`)."""
    at_n = jnp.minimum(n_b, q_bgn.shape[1] - 1)[:, None]
    q_n = jnp.take_along_axis(q_bgn, at_n[..., None], axis=1)[:, 0]
    q_n = _q_row(_normalised(q_n, None if totals_bg is None else jnp.take_along_axis(totals_bg, at_n, 1)),
                 q_ids_n, p_n.shape[-1])
    return next_token_dist(p_n, q_n, n_b < ell_b)


@functools.partial(jax.jit, static_argnames=("greedy",))
def verify_chain(key_b: Array, p_bgv: Array, q_bgn: Array, draft_bg: Array, ell_b: Array,
                 stop_ids: Array, q_ids_n: Array | None = None, *, greedy: bool = False) -> VerifyResult:
    """Verify one round of chain drafts for a batch of rows (see module docstring).

    Args:
      key_b: [B] typed PRNG keys (one per row, e.g. `sampling.round_key`).
      p_bgv: [B, G+1, V] target probs (already through `probs_from_logits`).
      q_bgn: [B, G, N] draft probs the draft tokens were drawn from, over the target tokens
        `q_ids_n` (N = V and None: the whole vocabulary in order); float32, or rounded to a lower
        precision (`sampling.draft_probs`; renormalised here, as the draws were). Greedy: may be
        [B, G, 0] (not read).
      draft_bg: [B, G] int32 draft tokens.
      ell_b: [B] int32 in 0..G (values outside are clipped): how many drafts each row verifies.
      stop_ids: [E] int32 stop tokens of every row, or [B, E] each row's own (E may be 0; -1 entries
        are padding).
      q_ids_n: [N] int32 distinct target ids of q's columns, or None.
      greedy: (static) p and q one-hot (all rows at temperature 0), q at the draft tokens: decided
        without random bits and without reading q (a greedy drafter need not build it).
    """
    key_b, p_bgv, q_bgn, draft_bg, ell_b, stop_be, q_ids_n = _checked_inputs(key_b, p_bgv, q_bgn, draft_bg, ell_b,
                                                                             stop_ids, q_ids_n, greedy)
    b, g1, v = p_bgv.shape
    g = g1 - 1

    fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
    key_u_b, key_next_b = fold(key_b, 0), fold(key_b, 1)
    pos_g = jnp.arange(g)

    # Acceptance test per position; positions >= ell are masked out.
    def uniforms(k: Array) -> Array:
        return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(k, i)))(pos_g)

    d_bg = jnp.clip(draft_bg, 0, v - 1)
    p_x = jnp.take_along_axis(p_bgv[:, :g], d_bg[..., None], axis=-1)[..., 0]
    live_bg = pos_g[None, :] < ell_b[:, None]
    totals_bg = None
    if greedy:  # one-hot p and q (q at the draft): a draft is accepted iff it is p's token
        acc_bg = live_bg & (p_x > 0)
    else:
        totals_bg, u_bg = _q_totals(q_bgn), jax.vmap(uniforms)(key_u_b)
        acc_bg = live_bg & (u_bg * _normalised(_q_at(q_bgn, d_bg, q_ids_n), totals_bg) < p_x)
    n_b = jnp.sum(jnp.cumprod(acc_bg.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)

    n_b, stopped_b = _cut_at_stops(draft_bg, stop_be, n_b)

    # Next token: residual at the first rejection, else bonus from p_ell; the residual of a rejected
    # one-hot q under a one-hot p elsewhere (greedy) is p itself
    p_n = jnp.take_along_axis(p_bgv, n_b[:, None, None], axis=1)[:, 0]
    dist_bv = p_n if greedy or g == 0 else _residual_or_bonus(p_n, q_bgn, totals_bg, q_ids_n, n_b, ell_b)
    next_b = jnp.where(stopped_b, -1, sample(key_next_b, dist_bv, greedy))

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
