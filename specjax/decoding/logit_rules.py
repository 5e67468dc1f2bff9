"""Per-row rules applied to the target's logits before a position is sampled (prefill's first token,
every verified position of a round), so target and verification see the same distribution:
`add_bias` (logit_bias, allowed_token_ids and one-token bad words as a per-row [V] bias, -inf for a
banned token), `ban_bad_words` (a multi-token bad word's last token at -inf where the output before
it ends with the word's other tokens; `push_tail` keeps each row's last output tokens it reads),
`guide_choices` (guided_choice: only the next token of a choice the output so far begins, or a stop
id where it is a whole choice; `advance_choices` keeps the choices each row's output still begins),
`guide_automaton` (guided_regex and guided_json: only the tokens a row's token automaton allows
from its state after the output so far, or a stop id in an accepting state; `automaton_path` walks
the drafts, `advance_automaton` the emitted tokens), `hold_stops` (min_tokens: a row's stop ids at -inf until it has emitted that many tokens) and
`penalize` (vLLM's presence, frequency and repetition penalties from the row's prompt and its output up
to each position, drafts included); `count_emitted` keeps the output counts the penalties read.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.drafting import automaton_mask, next_state

Array = jax.Array

ROW_BAD_WORDS = 16  # multi-token bad words a row holds on the device (each tokenization counts)
BAD_WORD_TOKENS = 8  # tokens of a bad word, the banned last one included (a row's tail keeps one fewer)
ROW_CHOICES = 16  # guided_choice: choices a row holds on the device
CHOICE_TOKENS = 16  # tokens of each


def add_bias(logits_btv: Array, bias_bv: Array) -> Array:
    """logits [b, t, V] plus each row's bias [b, V] at every position (-inf bans a token)."""
    return logits_btv + bias_bv[:, None, :]


def ban_bad_words(logits_btv: Array, words_bwl: Array, tail_bl: Array, drafts_bk: Array) -> Array:
    """Multi-token bad words (vLLM's rule): position j's logit of a word's last token is -inf when the
    row's output before j ends with the word's other tokens. words_bwl [b, W, L]: right-aligned token
    ids, -1 padding (a word of -1 only is none); tail_bl [b, L-1]: the row's last output tokens, the
    anchor last, -1 where the output is shorter; drafts_bk [b, t-1]: position j's output also holds
    d_1..d_j. Windows of [b, t, L-1] and a scatter of [b, t, W] (no [b, t, V] array)."""
    b, t, v = logits_btv.shape
    tails = tail_bl.shape[1]
    seq = jnp.concatenate([tail_bl, drafts_bk.astype(tail_bl.dtype)], axis=1)  # [b, L-1 + t-1]
    window_btl = seq[:, jnp.arange(t)[:, None] + jnp.arange(tails)[None, :]]  # the L-1 tokens before j
    prefix_bwl, last_bw = words_bwl[:, :, :-1], words_bwl[:, :, -1]
    same = (prefix_bwl[:, None] == window_btl[:, :, None]) | (prefix_bwl[:, None] < 0)  # [b, t, W, L-1]
    hit_btw = jnp.all(same, axis=-1) & (last_bw[:, None, :] >= 0)
    cols = jnp.where(hit_btw, last_bw[:, None, :], v)  # a word that does not hit is dropped
    return logits_btv.at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], cols].set(-jnp.inf, mode="drop")


def push_tail(tail_sl: Array, tokens_bt: Array, emitted_b: Array) -> Array:
    """tail_sl with each row's first emitted_b tokens of tokens_bt appended (rows [0:b]), keeping the last L-1."""
    b, tails = tokens_bt.shape[0], tail_sl.shape[1]
    seq = jnp.concatenate([tail_sl[:b], tokens_bt.astype(tail_sl.dtype)], axis=1)
    kept = jnp.take_along_axis(seq, emitted_b[:, None] + jnp.arange(tails)[None, :], axis=1)
    return tail_sl.at[:b].set(kept)


def hold_stops(logits_btv: Array, stop_bs: Array, min_left_b: Array) -> Array:
    """min_tokens: logits [b, t, V] with the stop ids stop_bs [b, S] (-1 padding) of each row at -inf at
    the positions t < min_left_b [b] (position t emits the row's next min_left-th token or later)."""
    t, v = logits_btv.shape[1:]
    ban_bv = jnp.any(stop_bs[:, :, None] == jnp.arange(v, dtype=jnp.int32), axis=1)  # no scatter: fuses
    held_bt = jnp.arange(t, dtype=jnp.int32)[None, :] < min_left_b[:, None]
    return jnp.where(held_bt[:, :, None] & ban_bv[:, None, :], -jnp.inf, logits_btv)


def penalty(logits: Array, count: Array, in_prompt: Array, pens_3b: Array) -> Array:
    """vLLM's penalties of logits [b, ...] for tokens with output `count` and prompt flag `in_prompt`
    (same shape), pens_3b = (presence, frequency, repetition) per row."""
    pres, freq, rep = (pens_3b[i].reshape((-1,) + (1,) * (logits.ndim - 1)) for i in range(3))
    n = count.astype(jnp.float32)
    seen = in_prompt | (count > 0)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * n - pres * (count > 0)


def penalize(logits_btv: Array, counts_bv: Array, prompt_bv: Array, pens_3b: Array, toks_bt: Array) -> Array:
    """Penalised logits of a verify pass over toks [anchor, d_1..d_{t-1}]: position j's output so far
    is the row's committed output (counts_bv, the anchor included) and the drafts d_1..d_j. Every token
    takes its committed count; the drafts' own entries are then recomputed with the drafts before
    each position (a gather and a scatter of [b, t, t-1], no [b, t, V] count array)."""
    b, t, v = logits_btv.shape
    base = penalty(logits_btv, counts_bv[:, None, :], prompt_bv[:, None, :], pens_3b)
    if t == 1:
        return base
    d_bk = toks_bt[:, 1:]  # [b, t-1] the drafts
    ids = jnp.clip(d_bk, 0, v - 1)
    same_bkk = d_bk[:, :, None] == d_bk[:, None, :]  # [b, k, k']: draft k' is the same token as draft k
    upto_tk = jnp.arange(1, t)[None, :] <= jnp.arange(t)[:, None]  # [t, k']: draft k' precedes position j's token
    extra_btk = jnp.einsum("bkc,tc->btk", same_bkk.astype(jnp.int32), upto_tk.astype(jnp.int32))
    count_btk = jnp.take_along_axis(counts_bv, ids, axis=1)[:, None, :] + extra_btk
    prompt_btk = jnp.take_along_axis(prompt_bv, ids, axis=1)[:, None, :]
    raw_btk = jnp.take_along_axis(logits_btv, jnp.broadcast_to(ids[:, None, :], (b, t, t - 1)), axis=2)
    fixed = penalty(raw_btk, count_btk, jnp.broadcast_to(prompt_btk, count_btk.shape), pens_3b)
    rows = jnp.arange(b)[:, None, None]
    pos = jnp.arange(t)[None, :, None]
    cols = jnp.where(d_bk >= 0, d_bk, v)[:, None, :]  # a negative draft id is dropped
    return base.at[rows, pos, cols].set(fixed, mode="drop")


def count_emitted(counts_sv: Array, tokens_bt: Array, emitted_b: Array) -> Array:
    """counts_sv with each row's first emitted_b tokens of tokens_bt added (rows [0:b])."""
    b, t = tokens_bt.shape
    v = counts_sv.shape[1]
    valid = (jnp.arange(t)[None, :] < emitted_b[:, None]) & (tokens_bt >= 0)
    cols = jnp.where(valid, tokens_bt, v)
    return counts_sv.at[jnp.arange(b)[:, None], cols].add(1, mode="drop")


def _choice_tokens(choices_bcl: Array, index_bt: Array) -> Array:
    """Each choice's token at output index index_bt [b, t]: [b, t, C], -1 past its end."""
    length = choices_bcl.shape[2]
    at = jnp.take_along_axis(choices_bcl[:, None, :, :], jnp.clip(index_bt, 0, length - 1)[:, :, None, None], axis=3)
    return jnp.where((index_bt < length)[:, :, None], at[..., 0], -1)


def guide_choices(logits_btv: Array, choices_bcl: Array, alive_bc: Array, pos_b: Array, drafts_bk: Array,
                  stop_be: Array) -> Array:
    """guided_choice: position j keeps only the tokens that continue a choice the row's output so far
    begins (its committed pos_b tokens, of which alive_bc the choices [b, C] they begin, then drafts
    d_1..d_j), and the stop ids stop_be [b, E] where that output is a whole choice; every other
    logit is -inf. choices_bcl [b, C, L]: token ids, -1 past each choice's end. A position no choice
    reaches (after a draft outside them all: it is never sampled) and a row without choices are left alone."""
    b, t, v = logits_btv.shape
    need_btc = _choice_tokens(choices_bcl, pos_b[:, None] + jnp.arange(t)[None, :])
    alive_btc = jnp.broadcast_to(alive_bc[:, None, :], need_btc.shape)
    if t > 1:  # position j's output also holds d_1..d_j: each must be its choice's token
        kept = jnp.cumprod(drafts_bk[:, :, None] == need_btc[:, :-1, :], axis=1).astype(bool)
        alive_btc = alive_btc & jnp.concatenate([jnp.ones_like(kept[:, :1]), kept], axis=1)
    cols = jnp.where(alive_btc & (need_btc >= 0), need_btc, v)
    allowed = jnp.zeros((b, t, v), bool).at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], cols].set(
        True, mode="drop")
    whole_bt = jnp.any(alive_btc & (need_btc < 0), axis=-1)
    stop_bv = jnp.any(stop_be[:, :, None] == jnp.arange(v, dtype=jnp.int32), axis=1)
    allowed = allowed | (whole_bt[:, :, None] & stop_bv[:, None, :])
    guided_bt = jnp.any(alive_btc, axis=-1)
    return jnp.where(guided_bt[:, :, None] & ~allowed, -jnp.inf, logits_btv)


def forced_choice_tokens(choices_bcl: Array, alive_bc: Array, pos_b: Array, g: int) -> Array:
    """[b, g]: the drafts a row's guided choices force: at draft position j (output index pos + j),
    the token with which every choice the output still begins (the forced drafts before j included)
    continues, while they all agree; -1 from the first position where they do not, where one of
    them ends, or where none is left (rows without choices: all -1). There the target allows that
    token alone, so a forced draft is always accepted."""
    need_bgc = _choice_tokens(choices_bcl, pos_b[:, None] + jnp.arange(g)[None, :])
    alive, forcing, out = alive_bc, jnp.ones(alive_bc.shape[:1], bool), []
    for j in range(g):
        need = need_bgc[:, j]
        hi = jnp.max(jnp.where(alive, need, -2), axis=-1)
        lo = jnp.min(jnp.where(alive, need, jnp.iinfo(jnp.int32).max), axis=-1)
        forcing = forcing & jnp.any(alive, axis=-1) & (hi == lo) & (lo >= 0)
        out.append(jnp.where(forcing, lo, -1))
        alive = alive & (need == lo[:, None])
    return jnp.stack(out, axis=1)


def advance_choices(choices_bcl: Array, alive_bc: Array, pos_b: Array, tokens_bt: Array,
                    emitted_b: Array) -> tuple[Array, Array]:
    """(alive, pos) of rows [0:b] after emitting their first emitted_b tokens of tokens_bt: the
    choices the output still begins (a stop id ends them all) and its length."""
    t = tokens_bt.shape[1]
    need_btc = _choice_tokens(choices_bcl, pos_b[:, None] + jnp.arange(t)[None, :])
    same = (tokens_bt[:, :, None] == need_btc) | (jnp.arange(t)[None, :, None] >= emitted_b[:, None, None])
    return alive_bc & jnp.all(same, axis=1), pos_b + emitted_b


def automaton_path(next_nv: Array, state_b: Array, drafts_bk: Array) -> Array:
    """[b, k+1]: each row's automaton state before position j of a verify pass: state_b [b] (after
    its committed output), then after each of the drafts d_1..d_j (-1 once a draft is not allowed:
    such a position is never sampled). next_nv [N, V]: the engine's table, -1 where not allowed."""
    path = [state_b]
    for j in range(drafts_bk.shape[1]):
        path.append(next_state(next_nv, path[-1], drafts_bk[:, j]))
    return jnp.stack(path, axis=1)


def guide_automaton(logits_btv: Array, allowed_nw: Array, final_n: Array, state_bt: Array, stop_be: Array) -> Array:
    """guided_regex / guided_json: position j keeps only the tokens the row's automaton allows from
    state_bt [b, t] (allowed_nw [N, ceil(V/32)]: the table's allowed tokens packed, `automata.pack_allowed`),
    and the stop ids stop_be [b, E] where that state accepts (final_n [N]); every other logit is -inf.
    A position without a state (-1: a row without an automaton, or after a draft it does not allow:
    never sampled) is left alone, as is a state that allows nothing (the table's automata have none; a
    row that ended may still run a round on a reused state)."""
    allowed, guided_bt = automaton_mask(allowed_nw, final_n, state_bt, stop_be, None, logits_btv.shape[-1])
    return jnp.where(guided_bt[:, :, None] & ~allowed, -jnp.inf, logits_btv)


def advance_automaton(next_nv: Array, state_b: Array, tokens_bt: Array, emitted_b: Array) -> Array:
    """Rows [0:b]'s automaton states after emitting their first emitted_b tokens of tokens_bt."""
    for j in range(tokens_bt.shape[1]):
        state_b = jnp.where(j < emitted_b, next_state(next_nv, state_b, tokens_bt[:, j]), state_b)
    return state_b
