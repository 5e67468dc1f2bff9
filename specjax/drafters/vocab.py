"""Draft vocabularies: a drafter may propose over N of the target's V tokens (EAGLE-3's d2t/t2d).

The subset is the N most frequent tokens of the training data (`token_counts`,
`build_draft_vocab`, which reports the coverage: the fraction of counted tokens inside it). A
drafter with a draft vocabulary has an N-wide lm_head (the target head's columns of those tokens)
and N-wide sequential heads; it samples a draft index d from its N-wide q and proposes the target
token `d2t[d]`. The q it hands to verification is scattered into the full vocabulary with zeros
elsewhere (`full_probs`), so it is exactly the distribution the token was drawn from, and lossless
verification stays exact; tokens outside the subset are simply never proposed.

`DraftVocab` holds the maps as `VocabMap` variables (part of the module state, never trained):
`d2t` [N] the target id of each draft index, `t2d` [V] the draft index of each target id (N for a
token outside the subset, which is also the row of the "other token" entry of a sequential head's
input table). Checkpoints use EAGLE-3's convention (`d2t_offsets`, `t2d_mask`): `d2t` int64 [N]
holds offsets (target id = draft id + d2t[draft id]) and `t2d` bool [V] marks the subset.

Every helper takes `vocab=None` for a full-vocabulary drafter and is then the identity.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import ConfigError

Array = jax.Array


class VocabMap(nnx.Variable):
    """An integer map between draft and target token ids (not trained; not a Param)."""


def validate_draft_vocab_size(n: object, vocab_size: int) -> None:
    """`draft_vocab_size`: 0 (the full vocabulary) or an integer in [1, vocab_size)."""
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < vocab_size:
        raise ConfigError(f"field 'draft_vocab_size' must be 0 (full vocabulary) or an integer in "
                          f"[1, vocab_size={vocab_size}), got {n!r}")


# ------------------------------------------------------------------------------------------------
# building the subset (host side)


def token_counts(sequences: Iterable[np.ndarray], vocab_size: int,
                 masks: Iterable[np.ndarray] | None = None) -> np.ndarray:
    """Occurrences of each token id, int64 [vocab_size]; with `masks`, only where mask != 0
    (e.g. the loss mask: the tokens a drafter must predict)."""
    counts = np.zeros((vocab_size,), np.int64)
    mask_it = iter(masks) if masks is not None else None
    for i, seq in enumerate(sequences):
        ids = np.asarray(seq).reshape(-1)
        if mask_it is not None:
            m = np.asarray(next(mask_it)).reshape(-1)
            if m.shape != ids.shape:
                raise ValueError(f"sequence {i}: mask shape {m.shape} differs from ids {ids.shape}")
            ids = ids[m != 0]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"sequence {i}: token ids must lie in [0, {vocab_size}), got "
                             f"[{ids.min()}, {ids.max()}]")
        counts += np.bincount(ids.astype(np.int64), minlength=vocab_size)
    return counts


class DraftVocabChoice(NamedTuple):
    draft_ids: np.ndarray  # int64 [N], ascending target ids
    coverage: float  # fraction of the counted tokens inside the subset


def coverage(counts_v: np.ndarray, draft_ids: np.ndarray) -> float:
    """Fraction of the counted tokens whose id is in `draft_ids` (1.0 when nothing was counted)."""
    total = int(np.sum(counts_v))
    return 1.0 if total == 0 else float(np.sum(np.asarray(counts_v)[draft_ids]) / total)


def build_draft_vocab(counts_v: np.ndarray, size: int, *, always: Iterable[int] = ()
                      ) -> DraftVocabChoice:
    """The `size` most frequent ids (ties: the lower id first), always including `always`
    (e.g. EOS and the chat template's end-of-turn tokens), ascending as EAGLE-3 stores them."""
    counts_v = np.asarray(counts_v, np.int64)
    v = counts_v.shape[0]
    if counts_v.ndim != 1 or np.any(counts_v < 0):
        raise ValueError(f"counts must be a non-negative vector [V], got shape {counts_v.shape}")
    if not 1 <= size <= v:
        raise ValueError(f"draft vocabulary size must be in [1, {v}], got {size}")
    forced = sorted({int(t) for t in always})
    if any(not 0 <= t < v for t in forced):
        raise ValueError(f"'always' ids must lie in [0, {v}), got {forced}")
    if len(forced) > size:
        raise ValueError(f"{len(forced)} required ids do not fit a draft vocabulary of {size}")
    order = np.lexsort((np.arange(v), -counts_v))  # most frequent first, then the lower id
    rest = order[~np.isin(order, forced)][: size - len(forced)]
    ids = np.sort(np.concatenate([np.asarray(forced, np.int64), rest.astype(np.int64)]))
    return DraftVocabChoice(ids, coverage(counts_v, ids))


def check_draft_ids(draft_ids: np.ndarray, vocab_size: int, size: int | None = None,
                    source: str = "draft_ids") -> np.ndarray:
    """`draft_ids` as int64 [N]: distinct target ids in [0, vocab_size) (N = size when given)."""
    ids = np.asarray(draft_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or ids.size == 0:
        raise ValueError(f"{source} must be a non-empty integer vector, got dtype {ids.dtype} "
                         f"shape {ids.shape}")
    if size is not None and ids.size != size:
        raise ValueError(f"{source} has {ids.size} ids, expected draft_vocab_size={size}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{source} must lie in [0, vocab_size={vocab_size}), got "
                         f"[{ids.min()}, {ids.max()}]")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"{source} has repeated ids")
    return ids.astype(np.int64)


# ------------------------------------------------------------------------------------------------
# checkpoint convention (EAGLE-3 / SpecForge): d2t offsets [N], t2d mask [V]


def d2t_offsets(draft_ids: np.ndarray) -> np.ndarray:
    """EAGLE-3's `d2t` tensor: int64 [N] with target id = draft id + d2t[draft id]."""
    ids = np.asarray(draft_ids, np.int64)
    return ids - np.arange(ids.size, dtype=np.int64)


def t2d_mask(draft_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """EAGLE-3's `t2d` tensor: bool [V], True for target ids in the draft vocabulary."""
    m = np.zeros((vocab_size,), np.bool_)
    m[np.asarray(draft_ids, np.int64)] = True
    return m


def draft_ids_from_tensors(d2t: np.ndarray, t2d: np.ndarray | None, vocab_size: int,
                           source: str = "checkpoint") -> np.ndarray:
    """Draft ids from stored `d2t` offsets (and, when present, the `t2d` mask they must match)."""
    off = np.asarray(d2t)
    if off.ndim != 1 or not np.issubdtype(off.dtype, np.integer):
        raise ValueError(f"{source}: tensor 'd2t' must be an integer vector [N], got dtype "
                         f"{off.dtype} shape {off.shape}")
    ids = check_draft_ids(off.astype(np.int64) + np.arange(off.size, dtype=np.int64), vocab_size,
                          source=f"{source}: tensor 'd2t' (as target ids)")
    if t2d is not None:
        m = np.asarray(t2d)
        if m.shape != (vocab_size,) or not np.array_equal(m.astype(bool),
                                                           t2d_mask(ids, vocab_size)):
            raise ValueError(f"{source}: tensor 't2d' {list(m.shape)} does not mark exactly the "
                             f"ids of 'd2t'")
    return ids


# ------------------------------------------------------------------------------------------------
# the module


class DraftVocab(nnx.Module):
    """Maps of an N-token draft vocabulary inside a V-token target vocabulary (module docstring).
    Built as the first N ids; `set_ids` installs the real subset."""

    def __init__(self, vocab_size: int, size: int):
        validate_draft_vocab_size(size, vocab_size)
        if size == 0:
            raise ConfigError("DraftVocab needs draft_vocab_size >= 1 (0 means no draft vocabulary)")
        self.vocab_size, self.size = vocab_size, size
        self.d2t = VocabMap(jnp.zeros((size,), jnp.int32), logical_axes=(None,))
        self.t2d = VocabMap(jnp.zeros((vocab_size,), jnp.int32), logical_axes=(None,))
        self.set_ids(np.arange(size))

    def set_ids(self, draft_ids: np.ndarray) -> None:
        """Install the subset: `draft_ids` [N] distinct target ids (draft index i <-> draft_ids[i])."""
        ids = check_draft_ids(draft_ids, self.vocab_size, self.size)
        t2d = np.full((self.vocab_size,), self.size, np.int32)
        t2d[ids] = np.arange(self.size, dtype=np.int32)
        self.d2t.set_value(jnp.asarray(ids, jnp.int32))  # also fills an abstract (eval_shape) module
        self.t2d.set_value(jnp.asarray(t2d))

    def draft_ids(self) -> np.ndarray:
        """The target id of each draft index, int64 [N] (host copy)."""
        return np.asarray(jax.device_get(self.d2t[...]), np.int64)

    def to_draft(self, ids: Array) -> Array:
        """Draft index of target ids (N = not in the draft vocabulary), int32."""
        return jnp.take(self.t2d[...], ids.astype(jnp.int32), axis=0)

    def to_target(self, draft: Array) -> Array:
        """Target ids of draft indices, int32."""
        return jnp.take(self.d2t[...], draft.astype(jnp.int32), axis=0)

    def scatter_probs(self, q_xn: Array) -> Array:
        """[..., N] -> [..., V] float32, zero outside the draft vocabulary."""
        out = jnp.zeros(q_xn.shape[:-1] + (self.vocab_size,), jnp.float32)
        return out.at[..., self.d2t[...]].set(q_xn.astype(jnp.float32))

    def scatter_logits(self, z_xn: Array) -> Array:
        """[..., N] -> [..., V] float32, -inf outside the draft vocabulary."""
        out = jnp.full(z_xn.shape[:-1] + (self.vocab_size,), -jnp.inf, jnp.float32)
        return out.at[..., self.d2t[...]].set(z_xn.astype(jnp.float32))


def install_draft_vocab(drafter: nnx.Module, size: int, draft_ids: np.ndarray | None) -> None:
    """Give a freshly built drafter (attribute `draft_vocab`) its subset: `draft_ids` is required
    exactly when `size` (its config's draft_vocab_size) > 0."""
    if size == 0:
        if draft_ids is not None:
            raise ValueError("draft_ids were given but the drafter's draft_vocab_size is 0")
        return
    if draft_ids is None:
        raise ConfigError(f"draft_vocab_size={size} needs draft_ids (the target ids of the draft "
                          f"vocabulary, e.g. specjax.drafters.vocab.build_draft_vocab over the "
                          f"training data's token counts)")
    drafter.draft_vocab.set_ids(draft_ids)


# ------------------------------------------------------------------------------------------------
# helpers that are the identity without a draft vocabulary


def draft_index(vocab: DraftVocab | None, ids: Array) -> Array:
    """Draft index of target ids (N outside the subset); the ids themselves without a subset."""
    return ids.astype(jnp.int32) if vocab is None else vocab.to_draft(ids)


def draft_labels(vocab: DraftVocab | None, labels: Array) -> Array:
    """Training labels in draft indices: -1 where the target token is outside the subset."""
    if vocab is None:
        return labels.astype(jnp.int32)
    d = vocab.to_draft(labels)
    return jnp.where(d >= vocab.size, -1, d)


def target_ids(vocab: DraftVocab | None, draft: Array) -> Array:
    return draft.astype(jnp.int32) if vocab is None else vocab.to_target(draft)


def full_probs(vocab: DraftVocab | None, q_xn: Array) -> Array:
    return q_xn if vocab is None else vocab.scatter_probs(q_xn)


def full_logits(vocab: DraftVocab | None, z_xn: Array) -> Array:
    return z_xn if vocab is None else vocab.scatter_logits(z_xn)


def head_columns(head_hv: Array, vocab: DraftVocab | None) -> Array:
    """The target head's columns of the draft vocabulary ([H, V] -> [H, N])."""
    return head_hv if vocab is None else jnp.take(head_hv, vocab.d2t[...], axis=1)


__all__ = ["DraftVocab", "DraftVocabChoice", "VocabMap", "build_draft_vocab", "check_draft_ids",
           "coverage", "d2t_offsets", "draft_ids_from_tensors", "draft_index", "draft_labels",
           "full_logits", "full_probs", "head_columns", "install_draft_vocab", "t2d_mask",
           "target_ids", "token_counts", "validate_draft_vocab_size"]
