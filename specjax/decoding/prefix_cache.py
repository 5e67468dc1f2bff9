"""Prefix caching over cache slots (vLLM's automatic prefix caching, in a slot engine's form).

A freed slot keeps the cache rows of the request it served: its prompt and output tokens up to the
rows the target committed. A new request goes to the free slot whose kept tokens share the longest
prefix with its prompt, and its prefill restarts at the last shared token: the target's rows before
it stay as they are, and the drafter's state is cut back to them (`Drafter.restart`). A busy slot's
prompt rows serve too (a system prompt shared by concurrent requests): when one shares more than any
free slot, by more than `copy_margin` tokens, its rows and drafter state are first copied into the
slot `evict` picks (`programs.copy_slot`). The restart re-reads one shared token because a pair-cache
drafter (Eagle3, MTP-1) keeps the feature of its last position pending, and a cut state has none;
rows before the restart are the same tokens at the same positions, so every later logit is the one a
whole prefill gives (up to float rounding, as a chunked prefill). Host-side bookkeeping only (numpy);
the engine says when a slot's rows change hands (`hold` once a request's prefill is dispatched, `keep`
when it ends; `forget_all` after anything but a request writes them). A slot given to a request keeps
its free record (never busy) until `hold`: neither free nor busy, it is no one's source. A prompt that
reuses nothing evicts, among the free slots that keep the engine's slots bucket as small as the lowest
free slot does, an empty one first, else the one freed longest ago (least recently used), so the rows of
recent conversations last while the rows in use stay packed.
"""
from __future__ import annotations

import bisect
from typing import Iterable, Sequence

import numpy as np


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class SlotPrefixes:
    """What each slot's cache rows hold: token ids at rows [0, len) (None: nothing reusable), whether
    the slot is busy (its prompt's rows, a copy source) or free (reused in place), and the slots by
    their first two tokens (a restart needs at least two shared)."""

    def __init__(self, slots: int):
        self._kept: list[np.ndarray | None] = [None] * slots
        self._busy = [False] * slots
        self._by_start: dict[tuple[int, int], set[int]] = {}
        self._freed_at = [0] * slots  # when each slot's record was kept (a counter; 0: never)
        self._clock = 0

    def _record(self, slot: int, tokens: Sequence[int], busy: bool) -> None:
        old = self._kept[slot]
        if old is not None:
            self._by_start[(int(old[0]), int(old[1]))].discard(slot)
        self._kept[slot] = np.asarray(tokens, np.int64) if len(tokens) >= 2 else None
        self._busy[slot] = busy
        if len(tokens) >= 2:
            self._by_start.setdefault((int(tokens[0]), int(tokens[1])), set()).add(slot)

    def hold(self, slot: int, prompt_ids: Sequence[int]) -> None:
        """Slot `slot`'s prefill is dispatched: its prompt's rows may be copied from now on."""
        self._record(slot, prompt_ids, busy=True)

    def keep(self, slot: int, tokens: Sequence[int], rows: int) -> None:
        """Slot `slot` was freed holding `tokens` (prompt then output) at its first `rows` cache rows."""
        self._record(slot, tokens[:min(int(rows), len(tokens))], busy=False)
        self._clock += 1
        self._freed_at[slot] = self._clock

    def forget_all(self) -> None:
        for slot in range(len(self._kept)):
            self._record(slot, (), busy=False)

    def evict(self, free: Sequence[int], slots_buckets: Sequence[int] | None = None) -> int:
        """The free slot a prompt that reuses nothing takes (`free`: every free slot, ascending; the rest
        are taken): among those below the slots bucket that holds the highest taken slot and `free[0]`
        (all of them without `slots_buckets`), an empty one, else the least recently freed."""
        limit = len(self._kept)
        if slots_buckets is not None:
            n, k = len(self._kept), len(free)  # free's trailing run up to n - 1: the slots above every taken one
            top = n - 1 - (k - bisect.bisect_left(range(k), True, key=lambda i: free[i] == n - k + i))
            limit = next(b for b in slots_buckets if b > max(top, free[0]))
        return min((s for s in free if s < limit), key=lambda s: (self._kept[s] is not None, self._freed_at[s], s))

    def copies_from(self, prompt_ids: Sequence[int], batch: Iterable[Sequence[int]], free: Sequence[int],
                    copy_margin: int = 0, slots_buckets: Sequence[int] | None = None) -> bool:
        """Whether a prompt would restart later by more than `copy_margin` from the rows of a prompt in
        `batch` (the prefill batch being built, and prompts still being prefilled in chunks) than from
        what slots hold now (`choose`): it then waits, and copies them once that prompt's prefill is
        all dispatched. Cost: one comparison per batch prompt that starts with the same two tokens, none
        for a prompt too short to restart past the margin (admitting a batch of n prompts is not n^2
        array comparisons)."""
        full = len(prompt_ids) - 1  # the longest restart there is
        if full <= copy_margin:
            return False
        prompt, head, most = np.asarray(prompt_ids, np.int64), (int(prompt_ids[0]), int(prompt_ids[1])), 0
        for p in batch:
            if len(p) > copy_margin + 1 and (int(p[0]), int(p[1])) == head:
                most = max(most, shared_prefix(np.asarray(p, np.int64), prompt) - 1)
                if most == full:
                    break
        # `choose` only when a batch prompt could give a copy at all (its restart is never negative)
        return most > copy_margin and most > self.choose(prompt_ids, free, copy_margin, slots_buckets)[1] + copy_margin

    def choose(self, prompt_ids: Sequence[int], free: Sequence[int], copy_margin: int = 0,
               slots_buckets: Sequence[int] | None = None) -> tuple[int, int, int | None]:
        """(slot, restart, source) for a prompt: the free slot with the longest restart (ties: the first
        in `free`) and the prompt position its prefill starts at (0: nothing reused, the slot `evict`
        picks), source None; or, when a busy slot's prompt gives a restart longer by more than
        `copy_margin`, the slot `evict` picks, that restart and the busy slot to copy from."""
        held = self._by_start.get((int(prompt_ids[0]), int(prompt_ids[1]))) if len(prompt_ids) >= 2 else None
        best, restart = None, 0
        if not held:
            return self.evict(free, slots_buckets), restart, None
        prompt, most = np.asarray(prompt_ids, np.int64), len(prompt_ids) - 1
        for slot in free:
            if slot in held and (start := shared_prefix(self._kept[slot], prompt) - 1) > restart:
                best, restart = slot, start  # re-read the last shared token (module docstring)
                if start == most:
                    return best, restart, None
        source, copied = None, restart + copy_margin
        for slot in sorted(s for s in held if self._busy[s]):
            if (start := shared_prefix(self._kept[slot], prompt) - 1) > copied:
                source, copied = slot, start
        if source is not None:
            return self.evict(free, slots_buckets), copied, source
        return (best, restart, None) if best is not None else (self.evict(free, slots_buckets), 0, None)


__all__ = ["SlotPrefixes", "shared_prefix"]
