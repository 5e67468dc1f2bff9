"""Preemption under priority scheduling (vLLM's, by recompute): when a waiting request outranks a
running one and no slot is free, the running request with the lowest priority (the highest value;
the latest arrival among equals) leaves its slot and waits again, before waiting requests of its
priority that arrived after it. Readmitted, it prefills its prompt and the output it has so far as
one context (with prefix caching, only what its old slot no longer holds) and continues: its tokens
are the target's given that context, as they would have been in its slot; with a fresh sampling key,
so a preempted seeded request does not repeat the tokens of a run without preemption.

A request whose slot state follows its output cannot restart from a prefill that treats the output
as prompt: presence and frequency penalties (they count output tokens only), bad words (matched
over the output), guided choices and automata (their state), predicted outputs (their position).
Those keep their slots; so do requests still prefilling or whose first token the host has not read.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence


def preemptible(req: Any) -> bool:
    """Whether a running `EngineRequest` can leave its slot and restart from its prompt and output."""
    return not (req.presence_penalty or req.frequency_penalty or req.bad_words or req.guided_choice
                or req.automaton is not None or req.prediction_ids)


def victims(waiting: Iterable[int], running: Sequence[tuple[int, int, float]], free: int) -> list[int]:
    """Slots to free for waiting requests (their priorities, in queue order, read only as far as needed):
    each takes a free slot while there is one, else the slot of the preemptible running request (slot,
    priority, arrival) with the highest priority value, the latest arrival among equals, when that value
    is above its own; the first waiting request that outranks none stops the search."""
    order = sorted(running, key=lambda r: (r[1], r[2]))  # the last is the first to go
    out: list[int] = []
    for priority in waiting:
        if free:
            free -= 1
        elif order and order[-1][1] > priority:
            out.append(order.pop()[0])
        else:
            break
    return out


__all__ = ["preemptible", "victims"]
