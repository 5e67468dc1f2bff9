"""The online acceptance estimate on the device: draft confidences for the confidence policies from
what verification accepted, for a drafter without a confidence head (or, with
EngineConfig.confidence_source "online", instead of its head's).

Each row keeps one estimate per draft position k, of c_k = P(draft k accepted | drafts < k accepted)
(the quantity a confidence head predicts), as an exponential moving average over its own verified
rounds (vLLM's per-request EMA, weight ROW_ALPHA on the past): a round that verified draft k with
every draft before it accepted adds 1 if draft k was accepted, else 0; other rounds leave it. The
engine keeps the same estimate over every row's rounds (ENGINE_ALPHA per observation), from which
an admitted row starts. Only past rounds enter an estimate, so a policy reading it never looks at
the draft it decides on (non-anticipating).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

ROW_ALPHA = 0.8  # vLLM's adaptive_verification_ema_alpha default
ENGINE_ALPHA = 0.98  # per observation: the engine's estimate moves over ~50 verified drafts
START = 0.8  # the engine's estimate before any round: high enough that the first requests draft and are measured


def init(slots: int, gamma: int) -> tuple[Array, Array]:
    """(rows' estimates [slots, gamma], the engine's [gamma]), at START."""
    return jnp.full((slots, gamma), START, jnp.float32), jnp.full((gamma,), START, jnp.float32)


def observe(rows_bg: Array, engine_g: Array, ell_b: Array, accepted_b: Array, counted_b: Array
            ) -> tuple[Array, Array]:
    """The estimates after a round whose rows verified ell_b drafts and accepted accepted_b of them;
    rows with counted_b False (inactive, or drafting predicted tokens) leave them."""
    k = jnp.arange(rows_bg.shape[1], dtype=jnp.int32)[None, :]
    seen = counted_b[:, None] & (k < ell_b[:, None]) & (k <= accepted_b[:, None])
    hit = (k < accepted_b[:, None]).astype(jnp.float32)
    rows_bg = jnp.where(seen, ROW_ALPHA * rows_bg + (1.0 - ROW_ALPHA) * hit, rows_bg)
    n_g = jnp.sum(seen, axis=0)
    mean_g = jnp.sum(jnp.where(seen, hit, 0.0), axis=0) / jnp.maximum(n_g, 1)
    keep_g = ENGINE_ALPHA ** n_g.astype(jnp.float32)  # n observations at once: n EMA steps toward their mean
    return rows_bg, keep_g * engine_g + (1.0 - keep_g) * mean_g
