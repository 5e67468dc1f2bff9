"""A drafter's sequential steps: the loop that runs them (`draft_loop`) and what it keeps.

In a greedy round (`SamplingArrays.greedy`) a step's q is the one-hot of its draw, which the greedy
verifier does not read: the loop keeps none and `loop_q` builds it after the loop where a program
returns it (the separate draft program); a fused round's compiler then drops it."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from specjax.sampling import one_hot_q

Array = jax.Array


def draft_loop(step: Callable[[Array, Any], tuple[Any, Array, dict[str, Array]]], carry0: Any, gamma: int
               ) -> tuple[Any, Array, dict[str, Array]]:
    """Run a drafter's `gamma` sequential steps, `step(k, carry) -> (carry, token_b, outs)` with
    `outs` a dict of per-step arrays [B, ...] (`step_outputs`), writing each step's token and outs
    into [B, gamma, ...] buffers in place (no per-step stack to transpose after the loop). Returns
    the last carry, tokens [B, gamma] (int32) and each out as [B, gamma, ...] in its step's dtype."""
    _, tok, outs = jax.eval_shape(step, jnp.int32(0), carry0)

    def body(k: Array, c: tuple[Any, Array, dict[str, Array]]) -> tuple[Any, Array, dict[str, Array]]:
        carry, tok_bg, outs_bg = c
        carry, tok_b, outs_b = step(k, carry)
        put = functools.partial(jax.lax.dynamic_update_index_in_dim, index=k, axis=1)
        return carry, put(tok_bg, tok_b.astype(jnp.int32)), {n: put(outs_bg[n], x) for n, x in outs_b.items()}
    tok_bg = jnp.zeros((tok.shape[0], gamma), jnp.int32)
    outs_bg = {n: jnp.zeros((x.shape[0], gamma, *x.shape[1:]), x.dtype) for n, x in outs.items()}
    return jax.lax.fori_loop(0, gamma, body, (carry0, tok_bg, outs_bg))


def step_outputs(q_bn: Array | None, z_bn: Array, with_logits: bool) -> dict[str, Array]:
    """What a drafting step keeps for after its loop (`draft_loop`): q ("q", unless a greedy round's
    draw left it None) and, when asked, the logits z ("z")."""
    return {**({} if q_bn is None else {"q": q_bn}), **({"z": z_bn} if with_logits else {})}


def loop_q(outs_bg: dict[str, Array], draws_bg: Array, n: int, dtype: Any) -> Array:
    """The q [B, gamma, n] of a drafting loop's draws (indices [B, gamma]): the one it kept, or in a
    greedy round the one-hot of the draws (`sampling.one_hot_q`), built after the loop."""
    return outs_bg["q"] if "q" in outs_bg else one_hot_q(draws_bg, n, dtype)
