"""The drafter protocol.

A drafter is an `nnx.Module` (parameters may be empty, as for the n-gram drafter) plus an explicit
per-slot state pytree (its context cache). The engine splits the module once and calls these methods
inside its jitted round, so every method must be traceable with static shapes:

* `init_state(slots, max_len)` -> state pytree whose leaves have a leading `slots` axis.
* `propose(state, anchor_b, position_b, sampling, key_b)` -> DraftBlock for rows [0:B] of the state
  (B <= slots; other rows are untouched). `anchor_b` is each row's last committed token, at position
  `position_b`; the block proposes tokens for positions position+1 .. position+gamma. Draft tokens
  MUST be sampled from exactly the `q` returned (float32, after the same sampling transform the
  target gets: `specjax.sampling.probs_from_logits`).
* `commit(state, update)` -> state: append committed positions (write, then mask: never copy), for
  rows [0:B] where B = update.tokens.shape[0].

`ContextUpdate` rows hold `n_valid[b]` real entries (the rest is padding): the committed tokens at
their positions with the target's hidden taps there (concatenated in `tap_layers` order) and the
final-normed target hidden state there. At prefill these are the prompt tokens; after a verify round
they are the anchor plus the accepted draft tokens (the new anchor comes next round).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax

Array = jax.Array


class DraftBlock(NamedTuple):
    tokens: Array  # [B, gamma] int32
    q: Array  # [B, gamma, V] float32: the distribution each token was drawn from
    confidence: Array | None  # [B, gamma] float32 in (0, 1): P(slot k accepted | slots < k accepted)


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
                key_b: Array) -> DraftBlock: ...

    def commit(self, state: Any, update: ContextUpdate) -> Any: ...
