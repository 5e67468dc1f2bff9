"""Prompt-lookup (n-gram) drafter: no parameters, no training.

It keeps each slot's token history and proposes the gamma tokens that followed the most recent
earlier occurrence of the current suffix (longest n-gram first, n from `max_ngram` down to
`min_ngram`). Its q is one-hot on the proposed token, so verification stays exact.

Checkpoint: architectures ["SpecjaxNGramDrafter"], config.json only (`vocab_size`,
`num_speculative_tokens`, `max_ngram`, `min_ngram`), no tensors.
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


class NGramDrafter(nnx.Module):
    """Prompt-lookup decoding (the n-gram proposer of vLLM / HF `prompt_lookup_num_tokens`)."""

    tap_layers: tuple[int, ...] = ()
    needs_hidden: bool = False

    def __init__(self, vocab_size: int, *, gamma: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.vocab_size = vocab_size
        self.gamma = gamma
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def init_state(self, slots: int, max_len: int) -> NGramState:
        return NGramState(jnp.zeros((slots, max_len), jnp.int32), jnp.zeros((slots,), jnp.int32))

    def commit(self, state: NGramState, update: ContextUpdate) -> NGramState:
        b = update.tokens.shape[0]
        lengths = state.lengths[:b]
        hist = kvc.write(state.history[:, None, :, None], update.tokens[:, :, None, None], lengths)[:, 0, :, 0]
        return NGramState(hist, state.lengths.at[:b].add(update.n_valid.astype(jnp.int32)))

    def restart(self, state: NGramState, start_b: Array) -> NGramState:
        """Rows [0:B] cut back to their first start_b history tokens (prefix caching)."""
        return state._replace(lengths=state.lengths.at[:start_b.shape[0]].set(start_b.astype(jnp.int32)))

    def propose(self, state: NGramState, anchor_b: Array, position_b: Array, sampling, key_b: Array,
                kv_len: int | None = None, guide: Any = None) -> DraftBlock:
        """Continue the latest earlier match of the longest suffix n-gram (history rows [0:kv_len)).
        The proposals are copies of earlier text: a `guide` (rows' automata) does not change them."""
        b = anchor_b.shape[0]
        hist = state.history[:b, :kv_len]  # kv_len None: every row
        m = hist.shape[1]
        length = state.lengths[:b]  # the anchor sits at index `length`
        seq = jnp.concatenate([hist, jnp.zeros((b, 1), jnp.int32)], axis=1)  # [B, M+1]
        seq = seq.at[jnp.arange(b), length].set(anchor_b.astype(jnp.int32))
        idx = jnp.arange(m + 1)
        best_end = jnp.full((b,), -1, jnp.int32)
        for n in range(self.min_ngram, self.max_ngram + 1):  # larger n overrides smaller on a match
            match = (idx[None, :] < length[:, None]) & (idx[None, :] >= n - 1)
            for i in range(n):
                shifted = jnp.roll(seq, i, axis=1)  # shifted[:, e] = seq[:, e - i]
                suffix_tok = jnp.take_along_axis(seq, jnp.maximum(length - i, 0)[:, None], axis=1)
                match = match & (shifted == suffix_tok)
            enough = length >= n  # the suffix of n tokens exists (anchor + n-1 history tokens)
            last = jnp.max(jnp.where(match, idx[None, :], -1), axis=1)
            best_end = jnp.where(enough & (last >= 0), last, best_end)
        offs = jnp.arange(1, self.gamma + 1)
        src = jnp.where(best_end[:, None] >= 0, best_end[:, None] + offs[None, :], length[:, None])
        src = jnp.minimum(src, length[:, None])
        tokens = jnp.take_along_axis(seq, src, axis=1)
        q = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        return DraftBlock(tokens.astype(jnp.int32), q, None)


# ------------------------------------------------------------------------------------------------
# checkpoint format


def config_from_hf(d: Mapping[str, Any], *,
                   source: str = "config.json") -> dict[str, int | None]:
    """The n-gram drafter's fields: {vocab_size (or None), gamma, max_ngram, min_ngram}."""
    if hf.architecture(d, source) != ARCHITECTURE:
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not "
                          f"{ARCHITECTURE!r}")
    out: dict[str, int | None] = {"vocab_size": None, "gamma": 4, "max_ngram": 3, "min_ngram": 1}
    if d.get("vocab_size") is not None:
        out["vocab_size"] = hf.int_field(d, "vocab_size", source, minimum=1)
    for ours, field in (("gamma", hf.GAMMA_FIELD), ("max_ngram", "max_ngram"),
                        ("min_ngram", "min_ngram")):
        if d.get(field) is not None:
            out[ours] = hf.int_field(d, field, source, minimum=1)
    if out["min_ngram"] > out["max_ngram"]:
        raise ConfigError(f"{source}: field 'min_ngram' ({out['min_ngram']}) exceeds "
                          f"'max_ngram' ({out['max_ngram']})")
    return out


def hf_config(vocab_size: int, gamma: int, max_ngram: int, min_ngram: int, *,
              extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `SpecjaxNGramDrafter` config.json mapping (no tensors)."""
    d = {"architectures": [ARCHITECTURE], "vocab_size": int(vocab_size),
         hf.GAMMA_FIELD: int(gamma), "max_ngram": int(max_ngram), "min_ngram": int(min_ngram)}
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
                        max_ngram=f["max_ngram"], min_ngram=f["min_ngram"])


def _save(drafter: NGramDrafter, target_config: Any, *, dtype: Any,
          extra: Mapping[str, Any] | None, num_anchors: int) -> tuple[dict[str, Any], None]:
    del target_config, dtype, num_anchors
    return hf_config(drafter.vocab_size, drafter.gamma, drafter.max_ngram, drafter.min_ngram,
                     extra=extra), None


KINDS = (Kind("ngram", (ARCHITECTURE,), NGramDrafter, _load, _save),)

__all__ = ["ARCHITECTURE", "KINDS", "NGramDrafter", "NGramState", "config_from_hf", "hf_config"]
