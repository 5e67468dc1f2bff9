"""A target cache built by several processes: one complete cache per process, read as one.

`python -m train.build_cache` on N processes (one per host, `specjax.distributed`) gives process
i the contiguous samples `part_range(num_samples, i, N)` and writes them as an ordinary cache
(`specjax.training.cache_build.build_cache`, resumable on its own) in `<out>/part-<i>-of-<N>`.
`open_target_cache(<out>)` reads either layout: a single cache, or all N parts in order as one
data set whose sample k is the k-th sample of the input (parts are contiguous ranges).
`open_target_caches([a, b, ...])` reads several such caches (e.g. the target's regenerated answers
and original replies, cached separately) one after another as one data set.
"""
from __future__ import annotations

import os
import re
from typing import Any, Sequence

import numpy as np

from specjax.config import ConfigError
from specjax.training import features as feat

_PART = re.compile(r"^part-(\d+)-of-(\d+)$")


def part_dir(out_dir: str | os.PathLike, index: int, count: int) -> str:
    """The cache directory of process `index` of `count` (`out_dir` itself for one process)."""
    out_dir = os.fspath(out_dir)
    return out_dir if count == 1 else os.path.join(out_dir, f"part-{index}-of-{count}")


def part_range(num_samples: int, index: int, count: int) -> tuple[int, int]:
    """[lo, hi) of the samples process `index` of `count` caches (contiguous, sizes differ by
    at most one)."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"part must satisfy 0 <= index < count, got {index}/{count}")
    return num_samples * index // count, num_samples * (index + 1) // count


class PartedTargetCache:
    """Parts of one cache read in order as one data set (same interface as `TargetCache`:
    `len`, `lengths`, `cache[i]`, `read(indices)`, `tap_layers`, `hidden_size`)."""

    def __init__(self, parts: Sequence[feat.TargetCache]):
        if not parts:
            raise ValueError("a parted cache needs at least one part")
        first = parts[0]
        for p in parts[1:]:
            for field in ("tap_layers", "hidden_size"):
                if getattr(p, field) != getattr(first, field):
                    raise ConfigError(f"{p.path}: field {field!r} is {getattr(p, field)}, but "
                                      f"{first.path} has {getattr(first, field)}")
        self.parts = list(parts)
        self.path = os.path.dirname(first.path)
        self.tap_layers, self.hidden_size = first.tap_layers, first.hidden_size
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate([p.lengths for p in self.parts])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.read([i])[0]

    def read(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Samples at global `indices`, in order (each part reads its own concurrently)."""
        n = len(self)
        where: dict[int, list[tuple[int, int]]] = {}
        for k, i in enumerate(indices):
            i = int(i)
            if not 0 <= i < n:
                raise IndexError(f"sample index {i} out of range [0, {n})")
            part = int(np.searchsorted(self.starts, i, side="right")) - 1
            where.setdefault(part, []).append((k, i - int(self.starts[part])))
        out: list[Any] = [None] * len(indices)
        for part, items in where.items():
            got = self.parts[part].read([j for _, j in items])
            for (k, _), sample in zip(items, got):
                out[k] = sample
        return out


def open_target_cache(path: str | os.PathLike, **expect: Any) -> feat.TargetCache | PartedTargetCache:
    """A complete cache at `path`: a single cache, or every `part-<i>-of-<N>` of a cache built by
    N processes (ConfigError naming the parts that are missing or unfinished). `expect` goes to
    each `TargetCache` (expect_layers, expect_hidden, expect_target, ...)."""
    path = os.path.normpath(os.fspath(path))
    counts = set()
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, feat.MANIFEST)):
        counts = {int(m.group(2)) for d in os.listdir(path) if (m := _PART.match(d))}
    if not counts:
        return feat.TargetCache(path, **expect)
    if len(counts) > 1:
        raise ConfigError(f"{path} holds parts of builds with different process counts "
                          f"{sorted(counts)}; remove the stale parts")
    count = counts.pop()
    dirs = [part_dir(path, i, count) for i in range(count)]
    missing = [d for d in dirs if not os.path.exists(os.path.join(d, feat.MANIFEST))]
    if missing:
        raise ConfigError(f"{path}: parts {[os.path.basename(d) for d in missing]} of {count} are "
                          "missing or unfinished; rerun train.build_cache on every process")
    return PartedTargetCache([feat.TargetCache(d, **expect) for d in dirs])


def open_target_caches(paths: Sequence[str | os.PathLike], **expect: Any
                       ) -> feat.TargetCache | PartedTargetCache:
    """Complete caches at `paths` (each as `open_target_cache` reads it) as one data set: the
    samples of the first, then of the second, and so on. One path gives that cache itself."""
    if not paths:
        raise ValueError("open_target_caches needs at least one cache directory")
    if len(paths) == 1:
        return open_target_cache(paths[0], **expect)
    parts: list[feat.TargetCache] = []
    for p in paths:
        c = open_target_cache(p, **expect)
        parts += c.parts if isinstance(c, PartedTargetCache) else [c]
    return PartedTargetCache(parts)


__all__ = ["PartedTargetCache", "open_target_cache", "open_target_caches", "part_dir",
           "part_range"]
