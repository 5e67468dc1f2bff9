"""How many compiled programs fit in the process's memory-mapping limit on XLA:CPU.

XLA:CPU loads every compiled kernel as its own object, each in three memory mappings (code,
read-only data, data): one round program of a 30-layer target holds ~170 kernels, ~500 mappings.
Linux caps a process's mappings (`vm.max_map_count`, 65,530 by default); past it XLA fails with
"LLVM compilation error: Cannot allocate memory" and the process dies. Accelerator backends load
their kernels on the device and have no such limit. So on XLA:CPU:

- `fits(programs_maps)`: whether programs of these mappings fit under `HEADROOM` of the limit (an
  engine whose programs might not fit at `MAPS_BOUND` each measures one program per family at
  warm-up and picks coarser default buckets when the rest would not fit);
- `WarmupGuard`: stops a warm-up projected, or found while compiling, to pass the limit with an error
  naming it and what to change, before XLA crashes.
"""
from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any, Callable, Sequence

HEADROOM = 0.90  # share of the limit compiled programs may take: the rest is the process's own
MAPS_BOUND = 2500  # no program measured so far took more (SmolLM2 + DSpark drafting round: 765)
ABORT_AT = 0.93  # a warm-up projected or found past this share stops (compilations in flight need the rest)
_LIMIT_FILE = "/proc/sys/vm/max_map_count"
_MAPS_FILE = "/proc/self/maps"
ADVICE = ("compile fewer programs (EngineConfig's slots / tokens / attention buckets, max_logprobs 0 or fewer "
          "sampling_variants; the serving programs' --slots-buckets or --max-num-seqs, --tokens-buckets, "
          "--attention-buckets, --max-logprobs, --sampling-variants) or raise the limit: "
          "sudo sysctl -w vm.max_map_count=262144")


class ProgramBudgetError(RuntimeError):
    """A warm-up whose compiled programs would pass the process's memory-mapping limit."""


def map_limit() -> int | None:
    """The process's memory-mapping limit (Linux `vm.max_map_count`); None where unknown."""
    try:
        with open(_LIMIT_FILE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def mapped_regions() -> int | None:
    """The process's memory mappings now; None where unknown."""
    try:
        with open(_MAPS_FILE, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def fits(programs_maps: Sequence[float]) -> bool:
    """Whether programs taking `programs_maps` mappings each fit under HEADROOM of the limit (True
    where the limit is unknown)."""
    limit, now = map_limit(), mapped_regions()
    if limit is None or now is None:
        return True
    return now + sum(programs_maps) <= HEADROOM * limit


class WarmupGuard:
    """Stops a warm-up of `n_programs` before XLA:CPU runs out of memory mappings: at once when
    `expected_maps` (the mappings the programs are projected to take) would pass ABORT_AT of the
    limit, and after each compiled program (`installed()`, thread-safe) when the mappings held
    pass it (the compilations still running need the rest). Inactive off CPU or where the limit
    is unknown."""

    def __init__(self, n_programs: int, platform: str, expected_maps: float | None = None):
        self.n = n_programs
        self.limit = map_limit() if platform == "cpu" else None
        now = mapped_regions() if self.limit is not None else None
        if now is not None and expected_maps is not None and now + expected_maps > ABORT_AT * self.limit:
            raise self._error(now + expected_maps)
        self._lock = threading.Lock()

    def _error(self, needed: float) -> ProgramBudgetError:
        return ProgramBudgetError(
            f"compiling {self.n} programs on XLA:CPU needs about {int(needed):,} memory mappings (XLA:CPU maps "
            f"each compiled kernel separately), more than this system allows a process (vm.max_map_count = "
            f"{self.limit:,}; past it compilation fails with 'Cannot allocate memory'): {ADVICE}")

    def installed(self) -> None:
        if self.limit is None:
            return
        with self._lock:
            now = mapped_regions()
            if now is not None and now > ABORT_AT * self.limit:
                raise self._error(now)


def coarsen_to_fit(estimate: Callable[[], Sequence[float]],
                   steps: Sequence[tuple[str, object, object, Callable[[], None]]]) -> list[str]:
    """Apply `steps` (what, before, after, apply) in order until the programs `estimate()` returns
    (the mappings each will take) `fits`; each applied step is warned about and returned as a line.
    Steps are coarser defaults the caller may choose (never values a user set)."""
    done: list[str] = []
    for what, before, after, apply in steps:
        programs = estimate()
        if fits(programs):
            break
        apply()
        line = (f"XLA:CPU: {len(programs)} compiled programs would take about {int(sum(programs)):,} of the "
                f"{map_limit():,} memory mappings this process may hold (vm.max_map_count); compiling "
                f"{what} {after} instead of the default {before} (set it explicitly to choose: "
                f"--{what.replace(' ', '-')} in the serving programs)")
        warnings.warn(line, stacklevel=3)
        done.append(line)
    return done


def coarsen_engine(engine: Any, maps_by_family: dict[str, float]) -> list[str]:
    """An engine's (`decoding.engine.Engine`) defaults whose programs, at the memory mappings measured
    per family, would pass the process's limit get coarser, each only while still at its default: one
    attention bucket (the largest), then the sampling variants without "plain" (the "filtered" variant
    is exact for those rows too; variants equal to the default set count as default). Returns the
    warnings given."""
    from specjax.sampling import VARIANTS
    b, cfg = engine.buckets, engine.cfg
    steps = []
    if cfg.attention_buckets is None and len(b.attention) > 1:
        steps.append(("attention buckets", b.attention, b.attention[-1:],
                      lambda: setattr(engine, "buckets", dataclasses.replace(engine.buckets,
                                                                             attention=b.attention[-1:]))))
    if tuple(cfg.sampling_variants) == VARIANTS:
        fewer = tuple(v for v in VARIANTS if v != "plain")
        steps.append(("sampling variants", VARIANTS, fewer,
                      lambda: setattr(engine, "cfg", dataclasses.replace(engine.cfg, sampling_variants=fewer))))
    worst = max(maps_by_family.values())
    return coarsen_to_fit(lambda: [maps_by_family.get(f, worst) for f, _ in engine.warm_keys()], steps)
