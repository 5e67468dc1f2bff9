"""Predicted outputs (OpenAI's `prediction`) on the device: each row's predicted tokens, where its
output stands in them, and the drafts they propose.

A row holds up to L predicted tokens (`pred_bl`, -1 padding) and four counters (`ints_4b`, PRED_INTS):
`at`, the index of the predicted token expected next (-1: the output has left the prediction);
`floor`, the index after the last predicted token the output followed (realignment never goes back
before it); `verified` and `accepted`, the row's predicted drafts verified (up to the first rejected
one) and accepted so far. After each emitted token x, `at` advances when x is the expected token;
otherwise the output is realigned to the first place at or after `floor` where the prediction holds
the output's last two tokens (an edit has ended and the output rejoins the prediction), or left
unaligned. While a row is aligned its drafts are the next predicted tokens, q one-hot on them, so
verification stays exact whatever the prediction holds; their confidence is the row's own record,
(accepted + PRIOR_ACCEPTED) / (verified + PRIOR_VERIFIED).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

PRED_INTS = ("at", "floor", "verified", "accepted")
PRIOR_ACCEPTED, PRIOR_VERIFIED = 9.0, 10.0  # a new prediction's confidence: 0.9, worth ten verified drafts
PAST_CONFIDENCE = 0.01  # a drafter's drafts after a row's predicted ones (they continue another text)


def admit(has_prediction_b: Array) -> Array:
    """Counters [4, b] of newly admitted rows: aligned at the first predicted token when they have a
    prediction, else unaligned."""
    at = jnp.where(has_prediction_b, 0, -1).astype(jnp.int32)
    zero = jnp.zeros_like(at)
    return jnp.stack([at, zero, zero, zero])


def advance(pred_bl: Array, ints_4b: Array, last_b: Array, tokens_bt: Array, emitted_b: Array
            ) -> tuple[Array, Array]:
    """(counters [4, b], last output token [b]) after each row emits its first emitted_b tokens of
    tokens_bt [b, T]: `at` and `floor` follow or realign (module docstring); `verified` and
    `accepted` unchanged."""
    length = pred_bl.shape[1]
    idx = jnp.arange(length, dtype=jnp.int32)[None, :]
    before_bl = jnp.concatenate([jnp.full_like(pred_bl[:, :1], -1), pred_bl[:, :-1]], axis=1)  # P[i - 1]
    at, floor = ints_4b[0], ints_4b[1]
    for j in range(tokens_bt.shape[1]):
        x = tokens_bt[:, j].astype(jnp.int32)
        expected = jnp.take_along_axis(pred_bl, jnp.clip(at, 0, length - 1)[:, None], axis=1)[:, 0]
        direct = (at >= 0) & (at < length) & (expected == x)
        hit_bl = (pred_bl == x[:, None]) & (before_bl == last_b[:, None]) & (last_b[:, None] >= 0) \
            & (idx >= jnp.maximum(floor, 1)[:, None])
        found = jnp.any(hit_bl, axis=1)
        new_at = jnp.where(direct, at + 1, jnp.where(found, jnp.argmax(hit_bl, axis=1) + 1, -1)).astype(jnp.int32)
        live = j < emitted_b
        at = jnp.where(live, new_at, at)
        floor = jnp.where(live & (direct | found), new_at, floor)
        last_b = jnp.where(live, x, last_b)
    return ints_4b.at[0].set(at).at[1].set(floor), last_b


def drafts(pred_bl: Array, at_b: Array, g: int) -> Array:
    """[b, g]: the predicted tokens after each row's output (from index `at`), -1 where there are none
    (an unaligned row, or past the prediction's end)."""
    length = pred_bl.shape[1]
    idx = at_b[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]
    tok = jnp.take_along_axis(pred_bl, jnp.clip(idx, 0, length - 1), axis=1)
    return jnp.where((at_b[:, None] >= 0) & (idx < length) & (tok >= 0), tok, -1)


def confidence(ints_4b: Array) -> Array:
    """[b]: each row's predicted drafts' acceptance so far, with the prior (module docstring)."""
    return (ints_4b[3].astype(jnp.float32) + PRIOR_ACCEPTED) / (ints_4b[2].astype(jnp.float32) + PRIOR_VERIFIED)


def tally(pred_bl: Array, ints_4b: Array, draft_bg: Array, ell_b: Array, accepted_b: Array
          ) -> tuple[Array, Array, Array]:
    """A verified round's predicted drafts: the leading drafts of each row's first ell_b that are its
    predicted tokens from `at` (drafted), of which the verifier accepted accepted_b. Returns (counters
    with `verified` += the predicted drafts verified up to the first rejected one and `accepted` +=
    those accepted, accepted predicted drafts [b], predicted drafts verified [b])."""
    g = draft_bg.shape[1]
    predicted = drafts(pred_bl, ints_4b[0], g)
    same = (predicted == draft_bg) & (predicted >= 0) & (jnp.arange(g)[None, :] < ell_b[:, None])
    drafted = jnp.sum(jnp.cumprod(same, axis=1), axis=1).astype(jnp.int32)
    accepted = jnp.minimum(accepted_b, drafted).astype(jnp.int32)
    tried = jnp.minimum(drafted, accepted + 1)
    return ints_4b.at[2].add(tried).at[3].add(accepted), accepted, drafted
