"""Prompt-lookup (n-gram) drafter: no parameters, no training.

It keeps each slot's token history and proposes the gamma tokens that followed the most recent
earlier occurrence of the current suffix (longest n-gram first, n from `max_ngram` down to
`min_ngram`). Its q is one-hot on the proposed token, so verification stays exact. A slot reused by
prefix caching (`restart`) keeps the text it held past the restart as a stale tail, searched first
(its match nearest the anchor) until the new request's tokens overwrite it: a prompt asked again
drafts the earlier answer while the two agree.

The stale tail and other slots (`cross_slot`, below) serve greedy rows only: a seeded sampled
request's tokens depend on its drafts, and must not depend on what other requests left in the engine.

With `cross_slot` the other slots of the round's slots bucket are searched too (a corpus of other
requests' text, as suffix decoding's): running requests' histories and the rows a freed slot still
holds (its last request's prompt and answer). A longer n-gram wins wherever it is; at equal length the
request's own history wins, then the latest position of the highest slot. A row's corpus is its
history before its anchor, and a continuation stops at that row's last history token. The search costs
slots_bucket^2 x attention bucket comparisons per n-gram token per round (the own-row search: one
slots_bucket factor less): cheap at a few slots, not at hundreds.

Checkpoint: architectures ["SpecjaxNGramDrafter"], config.json only (`vocab_size`,
`num_speculative_tokens`, `max_ngram`, `min_ngram`, optional `cross_slot`), no tensors.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.checkpoints import drafters as hf
from specjax.config import ConfigError, TargetConfig
from specjax.drafters.base import ContextUpdate, DraftBlock, Kind
from specjax.models import cache as kvc

Array = jax.Array
ARCHITECTURE = "SpecjaxNGramDrafter"


class NGramState(NamedTuple):
    history: Array  # [slots, max_len] int32
    lengths: Array  # [slots] int32
    stale_end: Array  # [slots] int32: history [lengths, stale_end) is text held before a restart


class NGramDrafter(nnx.Module):
    """Prompt-lookup decoding (the n-gram proposer of vLLM / HF `prompt_lookup_num_tokens`)."""

    tap_layers: tuple[int, ...] = ()
    needs_hidden: bool = False

    def __init__(self, vocab_size: int, *, gamma: int = 4, max_ngram: int = 3, min_ngram: int = 1,
                 cross_slot: bool = False):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.vocab_size = vocab_size
        self.gamma = gamma
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.cross_slot = bool(cross_slot)

    def init_state(self, slots: int, max_len: int) -> NGramState:
        return NGramState(jnp.zeros((slots, max_len), jnp.int32), jnp.zeros((slots,), jnp.int32),
                          jnp.zeros((slots,), jnp.int32))

    def commit(self, state: NGramState, update: ContextUpdate) -> NGramState:
        b = update.tokens.shape[0]
        # only the valid tokens are written: past them the row keeps its stale tail (not padding, not rejected drafts)
        hist = kvc.write(state.history[:, None, :, None], update.tokens[:, :, None, None], state.lengths[:b],
                         n_valid_b=update.n_valid)[:, 0, :, 0]
        return state._replace(history=hist, lengths=state.lengths.at[:b].add(update.n_valid.astype(jnp.int32)))

    def restart(self, state: NGramState, start_b: Array) -> NGramState:
        """Rows [0:B] cut back to their first start_b history tokens (prefix caching); what they held past
        that stays readable as a stale tail."""
        b = start_b.shape[0]
        stale = jnp.maximum(state.stale_end[:b], state.lengths[:b])
        return state._replace(lengths=state.lengths.at[:b].set(start_b.astype(jnp.int32)),
                              stale_end=state.stale_end.at[:b].set(stale))

    def propose(self, state: NGramState, anchor_b: Array, position_b: Array, sampling, key_b: Array,
                kv_len: int | None = None, guide: Any = None) -> DraftBlock:
        """Continue the match of the longest suffix n-gram (history rows [0:kv_len)) nearest the anchor in
        the row's own history (a greedy row's stale tail first) or, for a greedy row with `cross_slot`, in
        any row's. The proposals are copies of earlier text: a `guide` (rows' automata) does not change
        them."""
        b = anchor_b.shape[0]
        hist = state.history[:b, :kv_len]  # kv_len None: every row
        m = hist.shape[1]
        length = state.lengths[:b]  # the anchor sits at index `length`
        held = jnp.concatenate([hist, jnp.zeros((b, 1), jnp.int32)], axis=1)  # [B, M+1]: the stale tail's view
        seq = held.at[jnp.arange(b), length].set(anchor_b.astype(jnp.int32))
        stale_end = jnp.minimum(state.stale_end[:b], m)[:, None]
        greedy_b = jnp.ones((b,), bool) if sampling.greedy else sampling.temperature[:b] <= 0  # module docstring
        idx = jnp.arange(m + 1)
        rows = jnp.arange(b)
        corpus_end = jnp.minimum(length, m)[None, :, None]  # [1, B, 1]: another row's history, this bucket
        cross = self.cross_slot and b > 1
        best_row, best_end = rows, jnp.full((b,), -1, jnp.int32)
        for n in range(self.min_ngram, self.max_ngram + 1):  # larger n overrides smaller on a match
            suffix_bn = jnp.take_along_axis(seq, jnp.maximum(length[:, None] - jnp.arange(n)[None, :], 0), axis=1)
            match = (idx[None, :] < length[:, None]) & (idx[None, :] >= n - 1)
            match_s = ((idx[None, :] >= length[:, None]) & (idx[None, :] + 1 < stale_end) & (idx[None, :] >= n - 1)
                       & greedy_b[:, None])
            match_x = ((idx[None, None, :] + 1 < corpus_end) & (idx >= n - 1)
                       & (rows[:, None, None] != rows[None, :, None]) & greedy_b[:, None, None]) if cross else None
            # match_x: [B(r), B(s), M+1]
            for i in range(n):
                shifted = jnp.roll(seq, i, axis=1)  # shifted[:, e] = seq[:, e - i]
                match = match & (shifted == suffix_bn[:, i:i + 1])
                match_s = match_s & (jnp.roll(held, i, axis=1) == suffix_bn[:, i:i + 1])
                if cross:
                    match_x = match_x & (shifted[None] == suffix_bn[:, i, None, None])
            enough = length >= n  # the suffix of n tokens exists (anchor + n-1 history tokens)
            # the match nearest the anchor: in the stale tail the first (at the anchor's own position when the
            # two texts agree there), else the latest earlier one
            first_s = jnp.min(jnp.where(match_s, idx[None, :], m + 1), axis=1)
            last = jnp.where(first_s <= m, first_s, jnp.max(jnp.where(match, idx[None, :], -1), axis=1))
            own = enough & (last >= 0)
            best_row, best_end = jnp.where(own, rows, best_row), jnp.where(own, last, best_end)
            if cross:  # the latest match of the highest other slot: flat index s * (M + 1) + e
                flat = jnp.max(jnp.where(match_x, rows[None, :, None] * (m + 1) + idx, -1), axis=(1, 2))
                other = enough & ~own & (flat >= 0)
                best_row = jnp.where(other, flat // (m + 1), best_row)
                best_end = jnp.where(other, flat % (m + 1), best_end)
        offs = jnp.arange(1, self.gamma + 1)
        # a continuation stops at the anchor in the row's own history (the stale tail's end past it), at the
        # last history token in another's
        stop = jnp.where(best_row != rows, jnp.minimum(length[best_row], m) - 1,
                         jnp.where(best_end >= length, stale_end[:, 0] - 1, length))
        src = jnp.where(best_end[:, None] >= 0, best_end[:, None] + offs[None, :], length[:, None])
        src = jnp.minimum(src, stop[:, None])
        tokens = seq[best_row[:, None], src]
        q = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        return DraftBlock(tokens.astype(jnp.int32), q, None)


# ------------------------------------------------------------------------------------------------
# checkpoint format


def config_from_hf(d: Mapping[str, Any], *,
                   source: str = "config.json") -> dict[str, Any]:
    """The n-gram drafter's fields: {vocab_size (or None), gamma, max_ngram, min_ngram, cross_slot}."""
    if hf.architecture(d, source) != ARCHITECTURE:
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not "
                          f"{ARCHITECTURE!r}")
    out: dict[str, Any] = {"vocab_size": None, "gamma": 4, "max_ngram": 3, "min_ngram": 1, "cross_slot": False}
    if d.get("vocab_size") is not None:
        out["vocab_size"] = hf.int_field(d, "vocab_size", source, minimum=1)
    for ours, field in (("gamma", hf.GAMMA_FIELD), ("max_ngram", "max_ngram"),
                        ("min_ngram", "min_ngram")):
        if d.get(field) is not None:
            out[ours] = hf.int_field(d, field, source, minimum=1)
    if d.get("cross_slot") is not None:
        if not isinstance(d["cross_slot"], bool):
            raise ConfigError(f"{source}: field 'cross_slot' must be true or false, got {d['cross_slot']!r}")
        out["cross_slot"] = d["cross_slot"]
    if out["min_ngram"] > out["max_ngram"]:
        raise ConfigError(f"{source}: field 'min_ngram' ({out['min_ngram']}) exceeds "
                          f"'max_ngram' ({out['max_ngram']})")
    return out


def hf_config(vocab_size: int, gamma: int, max_ngram: int, min_ngram: int, *, cross_slot: bool = False,
              extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `SpecjaxNGramDrafter` config.json mapping (no tensors)."""
    d = {"architectures": [ARCHITECTURE], "vocab_size": int(vocab_size), hf.GAMMA_FIELD: int(gamma),
         "max_ngram": int(max_ngram), "min_ngram": int(min_ngram), "cross_slot": bool(cross_slot)}
    return hf.merge_extra(d, extra)


def _load(path: str, d: Mapping[str, Any], source: str, tcfg: TargetConfig | None, tmodel: Any,
          *, dtype: Any, compute_dtype: Any, gamma: int | None, mesh: Any, rules: Any
          ) -> NGramDrafter:
    del path, tmodel, dtype, compute_dtype, mesh, rules
    f = config_from_hf(d, source=source)
    vocab = f["vocab_size"]
    if tcfg is not None:
        if vocab is not None and vocab != tcfg.vocab_size:
            raise ConfigError(f"{source}: drafter is incompatible with the target: field "
                              f"'vocab_size' ({vocab}) differs from the target's "
                              f"({tcfg.vocab_size})")
        vocab = tcfg.vocab_size
    if vocab is None:
        raise ConfigError(f"{source}: missing field(s) ['vocab_size'] (or pass target=...)")
    return NGramDrafter(vocab, gamma=int(gamma) if gamma is not None else f["gamma"],
                        max_ngram=f["max_ngram"], min_ngram=f["min_ngram"], cross_slot=f["cross_slot"])


def _save(drafter: NGramDrafter, target_config: Any, *, dtype: Any,
          extra: Mapping[str, Any] | None, num_anchors: int) -> tuple[dict[str, Any], None]:
    del target_config, dtype, num_anchors
    return hf_config(drafter.vocab_size, drafter.gamma, drafter.max_ngram, drafter.min_ngram,
                     cross_slot=drafter.cross_slot, extra=extra), None


KINDS = (Kind("ngram", (ARCHITECTURE,), NGramDrafter, _load, _save),)

__all__ = ["ARCHITECTURE", "KINDS", "NGramDrafter", "NGramState", "config_from_hf", "hf_config"]
