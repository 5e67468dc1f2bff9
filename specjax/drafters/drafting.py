"""A drafter's sequential steps: the loop that runs them (`draft_loop`), the draws it makes and what it keeps.

Each step computes its logits z over the drafter's columns (its draft vocabulary, or the target's) and
draws from them with the `draw` the loop hands it. With a `DraftGuide` (rows following a token automaton:
guided_regex / guided_json) the loop walks each row's automaton over the drafts and a draw sees only the
columns the row's state allows (or a stop id where it accepts), so q is the drafter's distribution
renormalised over them: verification stays exact (every draft is drawn from the q it carries) and drafts
the target could never accept are not proposed.

In a greedy round (`SamplingArrays.greedy`) a step's q is the one-hot of its draw, which the greedy
verifier does not read: the loop keeps none and `loop_q` builds it after the loop where a program
returns it (the separate draft program); a fused round's compiler then drops it."""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from specjax.sampling import SamplingArrays, draft_draw, one_hot_q, round_key

Array = jax.Array
Draw = Callable[[Array], tuple[Array, Array | None]]  # logits z [B, N] float32 -> (draft index [B], q [B, N] | None)


class DraftGuide(NamedTuple):
    """The rows' token automata a drafting loop follows (an engine serving guided_regex)."""

    next_nv: Array  # int16 [S, V]: the engine's automaton table, the state after each token, -1: not allowed
    allowed_sw: Array  # uint32 [S, ceil(V/32)]: next_nv >= 0, 32 tokens to a word (decoding.automata.pack_allowed)
    final_n: Array  # bool [S]: accepting states (a stop id is allowed there)
    stop_be: Array  # int32 [B, E]: each row's stop ids, -1 padding
    state_b: Array  # int32 [B]: each row's state after its committed output (the anchor included), -1: none


def allowed_tokens(words_xw: Array, ids_n: Array | None, v: int) -> Array:
    """bool [..., N]: the bits of packed allowed-token words [..., ceil(V/32)] (bit t % 32 of word
    t // 32: token t) at token ids ids_n, or at every token 0..v-1 (N = v) when ids_n is None."""
    if ids_n is None:
        shifts = jnp.arange(32, dtype=jnp.uint32)
        bits = (words_xw[..., :, None] >> shifts) & jnp.uint32(1)  # [..., W, 32]
        return bits.reshape(*words_xw.shape[:-1], -1)[..., :v] != 0
    ids = ids_n.astype(jnp.int32)
    return ((jnp.take(words_xw, ids // 32, axis=-1) >> (ids % 32).astype(jnp.uint32)) & jnp.uint32(1)) != 0


def automaton_mask(allowed_sw: Array, final_n: Array, state_bx: Array, stop_be: Array, ids_n: Array | None,
                   v: int) -> tuple[Array, Array]:
    """(allowed [b, ..., N], guided [b, ...]) at states state_bx [b, ...] (-1: none): the tokens
    `ids_n` (or all v) a state allows (packed table allowed_sw, `allowed_tokens`), and the row's stop
    ids stop_be [b, E] (-1 padding) where it accepts (final_n); guided where there is a state and it
    allows one of them (a position that is not guided is left free)."""
    s = allowed_sw.shape[0]
    st = jnp.clip(state_bx, 0, s - 1)
    ids = jnp.arange(v, dtype=jnp.int32) if ids_n is None else ids_n.astype(jnp.int32)
    stop_bn = jnp.any((stop_be[:, :, None] == ids[None, None, :]) & (stop_be[:, :, None] >= 0), axis=1)
    stop = stop_bn.reshape(stop_bn.shape[:1] + (1,) * (state_bx.ndim - 1) + stop_bn.shape[1:])
    allowed = allowed_tokens(allowed_sw[st], ids_n, v) | (final_n[st][..., None] & stop)
    return allowed, (state_bx >= 0) & jnp.any(allowed, axis=-1)


def next_state(next_nv: Array, state_x: Array, token_x: Array) -> Array:
    """The automaton states after tokens token_x from state_x (next_nv [S, V], -1 where not allowed);
    -1 (none) from -1, after a token the state does not allow, or after a token id outside the table
    (a stop id)."""
    s, v = next_nv.shape
    ok = (state_x >= 0) & (token_x >= 0) & (token_x < v)
    nxt = next_nv[jnp.clip(state_x, 0, s - 1), jnp.clip(token_x, 0, v - 1)].astype(jnp.int32)
    return jnp.where(ok, nxt, -1)


def draft_loop(step: Callable[[Array, Any, Draw], tuple[Any, Array, dict[str, Array]]], carry0: Any, gamma: int,
               sampling: SamplingArrays, key_b: Array, dtype: Any, guide: DraftGuide | None = None,
               cols_n: Array | None = None) -> tuple[Any, Array, dict[str, Array]]:
    """Run a drafter's `gamma` sequential steps, `step(k, carry, draw) -> (carry, d_b, outs)`: d_b the
    draft index [B] `draw(z_bn)` returned, `outs` a dict of per-step arrays [B, ...] (`step_outputs`),
    each step's index and outs written into [B, gamma, ...] buffers in place (no per-step stack to
    transpose after the loop). `draw` is `sampling.draft_draw` with step k's keys (`round_key(key_b, k)`,
    q in `dtype`), under `guide` when given (`cols_n`: the target ids of z's columns, None: all V).
    Returns the last carry, draft indices [B, gamma] (int32) and each out as [B, gamma, ...]."""
    def draw_at(k: Array, allowed_bn: Array | None) -> Draw:
        def draw(z_bn: Array) -> tuple[Array, Array | None]:
            z_bn = z_bn if allowed_bn is None else jnp.where(allowed_bn, z_bn, -jnp.inf)
            return draft_draw(round_key(key_b, k), z_bn, sampling, dtype)
        return draw
    _, tok, outs = jax.eval_shape(lambda k, c: step(k, c, draw_at(k, None)), jnp.int32(0), carry0)

    def body(k: Array, c: tuple[Any, Array, dict[str, Array], Array | None]) -> tuple:
        carry, tok_bg, outs_bg, state_b = c
        allowed_bn = None
        if guide is not None:  # a row with no state, or none of the columns allowed, drafts freely
            allowed, guided = automaton_mask(guide.allowed_sw, guide.final_n, state_b, guide.stop_be, cols_n,
                                             guide.next_nv.shape[1])
            allowed_bn = allowed | ~guided[:, None]
        carry, tok_b, outs_b = step(k, carry, draw_at(k, allowed_bn))
        if guide is not None:
            tok_b = tok_b.astype(jnp.int32)
            state_b = next_state(guide.next_nv, state_b, tok_b if cols_n is None else cols_n.astype(jnp.int32)[tok_b])
        put = functools.partial(jax.lax.dynamic_update_index_in_dim, index=k, axis=1)
        return carry, put(tok_bg, tok_b.astype(jnp.int32)), {n: put(outs_bg[n], x) for n, x in outs_b.items()}, state_b
    tok_bg = jnp.zeros((tok.shape[0], gamma), jnp.int32)
    outs_bg = {n: jnp.zeros((x.shape[0], gamma, *x.shape[1:]), x.dtype) for n, x in outs.items()}
    state0 = None if guide is None else guide.state_b.astype(jnp.int32)
    carry, tok_bg, outs_bg, _ = jax.lax.fori_loop(0, gamma, body, (carry0, tok_bg, outs_bg, state0))
    return carry, tok_bg, outs_bg


def step_outputs(q_bn: Array | None, z_bn: Array, with_logits: bool) -> dict[str, Array]:
    """What a drafting step keeps for after its loop (`draft_loop`): q ("q", unless a greedy round's
    draw left it None) and, when asked, the logits z ("z")."""
    return {**({} if q_bn is None else {"q": q_bn}), **({"z": z_bn} if with_logits else {})}


def loop_q(outs_bg: dict[str, Array], draws_bg: Array, n: int, dtype: Any) -> Array:
    """The q [B, gamma, n] of a drafting loop's draws (indices [B, gamma]): the one it kept, or in a
    greedy round the one-hot of the draws (`sampling.one_hot_q`), built after the loop."""
    return outs_bg["q"] if "q" in outs_bg else one_hot_q(draws_bg, n, dtype)
