"""Prefix caching over cache slots (vLLM's automatic prefix caching, in a slot engine's form).

A freed slot keeps the cache rows of the request it served: its prompt and output tokens up to the
rows the target committed. A new request goes to the free slot whose kept tokens share the longest
prefix with its prompt, and its prefill restarts at the last shared token: the target's rows before
it stay as they are, and the drafter's state is cut back to them (`Drafter.restart`). The restart
re-reads one shared token because a pair-cache drafter (Eagle3, MTP-1) keeps the feature of its last
position pending, and a cut state has none; rows before the restart are the same tokens at the same
positions, so every later logit is the one a whole prefill gives (up to float rounding, as a chunked
prefill). Host-side bookkeeping only (numpy); the engine decides when a slot's rows stop being valid
(`forget_all` after anything but a request writes them).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class SlotPrefixes:
    """What each slot's cache rows hold: the token ids at rows [0, len) (None: nothing reusable), and
    the slots by their first two tokens (a restart needs at least two shared)."""

    def __init__(self, slots: int):
        self._kept: list[np.ndarray | None] = [None] * slots
        self._by_start: dict[tuple[int, int], set[int]] = {}

    def keep(self, slot: int, tokens: Sequence[int], rows: int) -> None:
        """Slot `slot` was freed holding `tokens` (prompt then output) at its first `rows` cache rows."""
        old = self._kept[slot]
        if old is not None:
            self._by_start[(int(old[0]), int(old[1]))].discard(slot)
        rows = min(int(rows), len(tokens))
        self._kept[slot] = np.asarray(tokens[:rows], np.int64) if rows >= 2 else None
        if rows >= 2:
            self._by_start.setdefault((int(tokens[0]), int(tokens[1])), set()).add(slot)

    def forget_all(self) -> None:
        self._kept = [None] * len(self._kept)
        self._by_start = {}

    def choose(self, prompt_ids: Sequence[int], free: Sequence[int]) -> tuple[int, int]:
        """(slot, restart) for a prompt: the free slot with the longest restart (ties: the first in
        `free`), and the prompt position its prefill starts at (0: nothing reused)."""
        held = self._by_start.get((int(prompt_ids[0]), int(prompt_ids[1]))) if len(prompt_ids) >= 2 else None
        best, restart = free[0], 0
        if not held:
            return best, restart
        prompt = np.asarray(prompt_ids, np.int64)
        for slot in free:
            if slot in held:
                start = shared_prefix(self._kept[slot], prompt) - 1  # re-read the last shared token (module doc)
                if start > restart:
                    best, restart = slot, start
                    if start == len(prompt) - 1:  # no slot can give more
                        break
        return best, restart


__all__ = ["SlotPrefixes", "shared_prefix"]
