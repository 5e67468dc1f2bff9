"""The drafter protocol.

A drafter is an `nnx.Module` (parameters may be empty, as for the n-gram drafter) plus an explicit
per-slot state pytree (its context cache). The engine splits the module once and calls these methods
inside its jitted round, so every method must be traceable with static shapes:

* `init_state(slots, max_len)` -> state pytree whose leaves have a leading `slots` axis, except the
  key/value buffers of a `specjax.models.cache.KVCache` in it ([2, slots, ...]; `cache.slot_axes`).
* `propose(state, anchor_b, position_b, sampling, key_b)` -> DraftBlock for rows [0:B] of the state
  (B <= slots; other rows are untouched). `anchor_b` is each row's last committed token, at position
  `position_b`; the block proposes tokens for positions position+1 .. position+gamma. Draft tokens
  MUST be sampled from exactly the `q` returned, after the same sampling transform the target gets
  (`specjax.sampling.probs_from_logits`), in float32 or rounded to the drafter's compute dtype
  (`sampling.draft_probs`: the verifier renormalises a rounded q, from which the draws came). The
  attribute `dtype` names q's dtype (float32 when absent): the engine compiles its verify round
  for it. A drafter with a draft vocabulary (attribute
  `draft_vocab`) also returns q's columns of it (`DraftBlock.q_draft`): that is what the engine
  carries from draft to verify. A drafter whose `propose` also takes `attention=` (static: how it
  attends over its context, e.g. "pallas" for a kernel) lists the names it takes in the attribute
  `attention_implementations`; the engine passes its `EngineConfig.attention` when listed (likewise
  `mlp=`, `mlp_implementations` and `EngineConfig.mlp`: how it computes its MLPs). A drafter whose
  blocks carry confidences (a confidence head) sets the attribute `has_confidence` True; for one
  without, the confidence policies read the engine's online acceptance estimate
  (`specjax.decoding.acceptance`).
* `commit(state, update)` -> state: append committed positions (write, then mask: never copy), for
  rows [0:B] where B = update.tokens.shape[0].

`ContextUpdate` rows hold `n_valid[b]` real entries (the rest is padding): the committed tokens at
their positions with the target's hidden taps there (concatenated in `tap_layers` order) and the
final-normed target hidden state there. At prefill these are the prompt tokens; after a verify round
they are the anchor plus the accepted draft tokens (the new anchor comes next round).

`Kind` is what a drafter kind's module declares for `specjax.drafters.registry.KINDS` (its
config, build, load, save and objective); `TargetView` is what a kind's training objective sees
of the frozen target.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax

Array = jax.Array


class DraftBlock(NamedTuple):
    tokens: Array  # [B, gamma] int32
    q: Array  # [B, gamma, V] float32 or the drafter's dtype: the distribution each token was drawn from
    confidence: Array | None  # [B, gamma] float32 in (0, 1): P(slot k accepted | slots < k accepted)
    # [B, gamma, N] (q's dtype): a drafter with a draft vocabulary (`draft_vocab`, N tokens) sets q's
    # columns of it here (q is zero elsewhere); the engine carries this one from draft to verify
    q_draft: Array | None = None


class ContextUpdate(NamedTuple):
    tokens: Array  # [B, T] int32
    positions: Array  # [B, T] int32
    taps: Array | None  # [B, T, L*H] target hidden taps at the drafter's tap layers, or None
    hidden: Array | None  # [B, T, H] final-normed target hidden state, or None
    n_valid: Array  # [B] int32


@runtime_checkable
class Drafter(Protocol):
    gamma: int  # largest block it proposes
    tap_layers: tuple[int, ...]  # target layer ids it reads (() if none)
    needs_hidden: bool  # whether commit needs the target's final hidden state

    def init_state(self, slots: int, max_len: int) -> Any: ...

    def propose(self, state: Any, anchor_b: Array, position_b: Array, sampling: Any,
                key_b: Array, kv_len: int | None = None, guide: Any = None) -> DraftBlock:
        """A block for rows [0:B]. `kv_len` (static): every row's committed context lies in state
        rows [0:kv_len) (the target's attention bucket), so a drafter may read only those; None: all.
        `guide` (a `drafting.DraftGuide`, rows following token automata): a drafter may draw from its
        q renormalised over the tokens each row's automaton allows (the q it returns)."""
        ...

    def commit(self, state: Any, update: ContextUpdate) -> Any: ...

    # optional, for prefix caching (an engine turns it off for a drafter without it):
    # restart(state, start_b [B]) -> state whose rows [0:B] continue with a prefill chunk at position start_b,
    # keeping what they committed before it (the token at start_b is the one they committed there)


class TargetView(Protocol):
    """What a kind's training objective sees of the frozen target for one batch (built by
    `specjax.training.objectives`): features from an offline cache or computed online."""

    def features(self, dtype: Any) -> tuple[Array | None, Array]:
        """(taps [B, S, L*H] at the kind's tap layers or None without any, final-normed hidden
        [B, S, H]): as stored in an offline cache batch, else run online in `dtype` (None: the
        target's compute dtype)."""

    def logits(self, hidden_bsh: Array) -> Array:
        """The target's own output logits of final-normed hidden states (online only)."""


class Kind(NamedTuple):
    """One drafter kind: everything the library knows about it, owned by the kind's module and
    collected by `specjax.drafters.registry.KINDS`.

    name: the kind (`model.kind` in training configs).
    architectures: config.json `architectures[0]` values it reads (the first is written); () for
        a kind that only trains (e.g. "dflash", whose files are the DSpark architecture's).
    drafter_type: the module class `save` writes.
    load(path, d, source, target_config, target_model, *, dtype, compute_dtype, gamma, mesh,
        rules) -> drafter.
    save(drafter, target_config, *, dtype, extra, num_anchors) -> (config.json mapping, key map or
        None when the kind stores no tensors).
    config: the training section dataclass (the `model:` fields of this kind), or None.
    build(section, target, target_config, *, rngs, dtype, param_dtype, draft_ids) -> (drafter,
        drafter config, tap layers read online).
    objective(section, *, feature_dtype) -> loss(model, batch, rng, target: TargetView).
    cache: whether it can train from an offline target cache.
    """

    name: str
    architectures: tuple[str, ...]
    drafter_type: type | None
    load: Any
    save: Any
    config: type | None = None
    build: Any = None
    objective: Any = None
    cache: bool = False
