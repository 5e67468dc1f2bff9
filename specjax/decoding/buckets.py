"""Static shape buckets: the sizes an engine compiles and the smallest bucket covering a value.

Every serving executable has a bucket key: (slots bucket,) or (slots bucket, tokens-per-slot bucket)
for rounds and (prompts bucket, prompt-length bucket) for prefill (see decoding/runner.py).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= n, and at least `minimum`."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo up to hi, with hi itself always included."""
    if lo < 1 or hi < lo:
        raise ValueError(f"bad bucket range [{lo}, {hi}]")
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def pick(buckets: Sequence[int], n: int, *, what: str = "value") -> int:
    """Smallest bucket >= n; a clear error naming the limit when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{what} {n} exceeds the largest bucket {max(buckets)}")


@dataclasses.dataclass(frozen=True)
class BucketSet:
    """The shapes an engine compiles: slots, tokens per slot (verify) and prefill lengths."""

    slots: tuple[int, ...]
    tokens: tuple[int, ...]
    prefill: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("slots", "tokens", "prefill"):
            v = getattr(self, name)
            if not v or list(v) != sorted(set(v)) or v[0] < 1:
                raise ValueError(f"bucket field '{name}' must be a non-empty increasing list of "
                                 f"positive ints, got {v!r}")
