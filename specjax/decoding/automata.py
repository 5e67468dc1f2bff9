"""Token automata of guided_regex / guided_json requests, as the engine holds them (numpy only).

A `TokenAutomaton` is a deterministic automaton over the target's token ids (built on the host from
a regular expression by `specjax.grammars`): from its state after the output so far, a token is
allowed where the table gives a next state, and eos where the state accepts. An engine built with
`EngineConfig.guided_regex` keeps one `AutomatonTable` of a fixed number of states for the automata
of its live requests: each is loaded once at its offset (its state ids shifted by it), shared by
every request with the same key, and kept after its last request ends while room allows (the least
recently used unused one is evicted first). The device holds a copy (`Runner.set_automata`), with
each state's allowed tokens also packed 32 to a uint32 word (`pack_allowed`): a sampled position reads
its state's V/32 words, not its V int16 next states (those are read one token at a time).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
    """A request's token automaton: state 0 initial; next_nv [n, V] the state after each token (-1
    where that token is not allowed; int16); final_n [n] the accepting states (eos allowed there). Every
    state either accepts or allows a token. `key` identifies it (same key, same automaton: loaded
    once); `field` names the request field it came from (in refusals)."""

    next_nv: np.ndarray
    final_n: np.ndarray
    key: str
    field: str = "guided_regex"

    def __post_init__(self) -> None:
        nxt, fin = np.asarray(self.next_nv), np.asarray(self.final_n, bool)
        if nxt.ndim != 2 or nxt.shape[0] < 1 or fin.shape != nxt.shape[:1]:
            raise ValueError(f"{self.field}: automaton tables of shape {nxt.shape} and {fin.shape} do not match")
        if nxt.size and (nxt.min() < -1 or nxt.max() >= nxt.shape[0]):
            raise ValueError(f"{self.field}: automaton next states outside [-1, {nxt.shape[0]})")
        dead = np.flatnonzero(~fin & ~np.any(nxt >= 0, axis=1))
        if dead.size:
            raise ValueError(f"{self.field}: automaton state {int(dead[0])} neither accepts nor allows a token")
        if nxt.shape[0] > np.iinfo(np.int16).max:
            raise ValueError(f"{self.field}: {nxt.shape[0]} automaton states; at most {np.iinfo(np.int16).max}")
        object.__setattr__(self, "next_nv", nxt.astype(np.int16, copy=False))
        object.__setattr__(self, "final_n", fin)

    @property
    def states(self) -> int:
        return self.next_nv.shape[0]

    @property
    def vocab(self) -> int:
        return self.next_nv.shape[1]

    def walk(self, tokens: Sequence[int], state: int = 0) -> int:
        """The state after `tokens` from `state`; -1 once a token is not allowed."""
        for t in tokens:
            if state < 0 or not 0 <= t < self.vocab:
                return -1
            state = int(self.next_nv[state, t])
        return state

    def allowed(self, state: int) -> np.ndarray:
        """The token ids allowed from `state` (eos not included: see final_n)."""
        return np.flatnonzero(self.next_nv[state] >= 0)


def pack_allowed(next_nv: np.ndarray) -> np.ndarray:
    """uint32 [n, ceil(V/32)]: bit t % 32 of word t // 32 is set where token t is allowed (next_nv >= 0)."""
    n, v = next_nv.shape
    packed = np.packbits(next_nv >= 0, axis=1, bitorder="little")  # [n, ceil(V/8)] uint8
    words = -(-v // 32)
    out = np.zeros((n, words * 4), np.uint8)
    out[:, :packed.shape[1]] = packed
    return out.view("<u4").astype(np.uint32, copy=False)


@dataclasses.dataclass
class _Loaded:
    offset: int
    states: int
    users: int = 0


class AutomatonTable:
    """The engine's table of `states` automaton states over `vocab` token ids (host copy)."""

    def __init__(self, states: int, vocab: int):
        self.next_nv = np.full((states, vocab), -1, np.int16)
        self.final_n = np.zeros((states,), bool)
        self.allowed_nw = np.zeros((states, -(-vocab // 32)), np.uint32)  # next_nv >= 0, packed (`pack_allowed`)
        self._loaded: collections.OrderedDict[str, _Loaded] = collections.OrderedDict()  # least recent first
        self.changed = False  # written since `changes` last handed it to the device (`Runner.set_automata`)

    @property
    def capacity(self) -> int:
        return self.next_nv.shape[0]

    def acquire(self, automaton: TokenAutomaton) -> int | None:
        """The table id of `automaton`'s initial state for one more request, loading it when it is not
        loaded (evicting unused automata, least recently used first); None when it does not fit
        beside the automata in use (the request waits)."""
        if automaton.vocab != self.next_nv.shape[1] or automaton.states > self.capacity:
            raise ValueError(f"{automaton.field}: an automaton of {automaton.states} states over {automaton.vocab} "
                             f"tokens does not fit the engine's table of {self.capacity} states over "
                             f"{self.next_nv.shape[1]}")
        entry = self._loaded.get(automaton.key)
        if entry is None:
            offset = self._room(automaton.states)
            while offset is None:
                unused = next((k for k, e in self._loaded.items() if e.users == 0), None)
                if unused is None:
                    return None
                del self._loaded[unused]
                offset = self._room(automaton.states)
            nxt = automaton.next_nv
            self.next_nv[offset:offset + automaton.states] = np.where(nxt >= 0, nxt + offset, -1)
            self.final_n[offset:offset + automaton.states] = automaton.final_n
            self.allowed_nw[offset:offset + automaton.states] = pack_allowed(nxt)
            entry = self._loaded[automaton.key] = _Loaded(offset, automaton.states)
            self.changed = True
        entry.users += 1
        self._loaded.move_to_end(automaton.key)
        return entry.offset

    def release(self, automaton: TokenAutomaton) -> None:
        """One request of `automaton` ended (it stays loaded until its room is needed)."""
        self._loaded[automaton.key].users -= 1

    def admit(self, req: Any) -> bool:
        """Acquire an EngineRequest's automaton (if any) and set its `automaton_start`; False when the
        automaton does not fit yet (the request waits)."""
        if req.automaton is None:
            return True
        start = self.acquire(req.automaton)
        req.automaton_start = -1 if start is None else start
        return start is not None

    def end(self, req: Any) -> None:
        """An admitted EngineRequest ended."""
        if req.automaton is not None:
            self.release(req.automaton)

    def changes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The table (next states, accepting states, allowed tokens packed) when written since the last
        call, else None."""
        if not self.changed:
            return None
        self.changed = False
        return self.next_nv, self.final_n, self.allowed_nw

    def users(self) -> dict[str, int]:
        """Requests per loaded automaton key."""
        return {k: e.users for k, e in self._loaded.items()}

    def _room(self, n: int) -> int | None:
        """The lowest offset of n free consecutive states, or None."""
        start = 0
        for e in sorted(self._loaded.values(), key=lambda e: e.offset):
            if e.offset - start >= n:
                return start
            start = e.offset + e.states
        return start if self.capacity - start >= n else None
