"""A wall-clock budget for the drafter build: the seconds of one build split between its units
(stages; a stage of several drafters splits its weight evenly between them) by fixed weights.

The plan is printed before anything runs. At each unit's start its share is recomputed from the
seconds actually left, over the units still to run, so a unit that finishes early (or is already
complete) leaves its time to the later ones and one that overran takes it from them. A unit whose
share falls below `min_unit_s` is skipped, but the short stages the others need (`ALWAYS`:
prepare, vocab, export) always run; a build whose budget cannot give every other unit
`min_unit_s` is refused before it starts."""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

# relative weights of the stages (the GPU profile: regeneration and training dominate)
WEIGHTS = {"prepare": 2.0, "regenerate": 30.0, "cache": 10.0, "vocab": 2.0, "train": 52.0,
           "calibrate": 10.0, "export": 4.0}

ALWAYS = ("prepare", "vocab", "export")  # short, and needed by what follows: never skipped
UnitRef = tuple[str, str]  # (record key, stage)
CLOCK = time.monotonic  # the build's clock (a test may freeze it; the stages keep their own)


class BudgetError(ValueError):
    """A budget that cannot run the build's units (names the flag)."""


@dataclasses.dataclass
class Budget:
    """`total_s` seconds of wall time from `start` (time.monotonic)."""

    total_s: float
    min_unit_s: float
    start: float = dataclasses.field(default_factory=lambda: CLOCK())

    def left(self) -> float:
        return self.total_s - (CLOCK() - self.start)

    def check(self, units: Sequence[UnitRef]) -> None:
        units = [u for u in units if u[1] not in ALWAYS]
        need = self.min_unit_s * len(units)
        if units and self.total_s < need:
            raise BudgetError(
                f"--budget-s {self.total_s:g} is too small to run any stage: the {len(units)} "
                f"unit(s) to run ({', '.join(k for k, _ in units)}) need at least "
                f"{self.min_unit_s:g} s each ({need:g} s)")

    def skips(self, stage: str, share: float) -> bool:
        """Whether a unit of `stage` with `share` seconds is skipped."""
        return stage not in ALWAYS and share < self.min_unit_s

    @staticmethod
    def weights(units: Sequence[UnitRef]) -> list[float]:
        per_stage: dict[str, int] = {}
        for _, stage in units:
            per_stage[stage] = per_stage.get(stage, 0) + 1
        return [WEIGHTS[stage] / per_stage[stage] for _, stage in units]

    def plan(self, units: Sequence[UnitRef], seconds: float | None = None) -> list[float]:
        """Each unit's share of `seconds` (default: all that is left)."""
        seconds = self.left() if seconds is None else seconds
        w = self.weights(units)
        return [seconds * x / sum(w) for x in w] if units else []

    def share(self, units: Sequence[UnitRef]) -> float:
        """The share of the first of `units` (the units still to run) of the seconds left."""
        return max(0.0, self.plan(units)[0]) if units else 0.0


def format_plan(budget: Budget, units: Sequence[UnitRef]) -> str:
    lines = [f"budget plan: {budget.total_s:.0f} s of wall time over {len(units)} unit(s) "
             f"(each skipped below {budget.min_unit_s:g} s; unspent time passes on)"]
    for (key, stage), s in zip(units, budget.plan(units, budget.total_s)):
        lines.append(f"  {key:<24} {s:7.1f} s" + ("  (short: runs whole)" if stage in ALWAYS else ""))
    return "\n".join(lines)


__all__ = ["ALWAYS", "Budget", "BudgetError", "WEIGHTS", "format_plan"]
