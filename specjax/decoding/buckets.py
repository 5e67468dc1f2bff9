"""Static shape buckets: the sizes an engine compiles and the smallest bucket covering a value.

Every serving executable has a bucket key: (slots bucket,) or (slots bucket, tokens-per-slot bucket)
for rounds and (prompts bucket, prompt-length bucket) for prefill (see decoding/runner.py); the
programs that run the target over its cache also carry an attention bucket: the cache rows [0:L]
they attend to, L covering the longest participating row plus the tokens it writes.
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


ATTENTION_FLOOR = 512  # smallest default attention bucket: below it the cache read is a small share


def attention_buckets(max_len: int) -> tuple[int, ...]:
    """Default attention buckets: powers of two from max(ATTENTION_FLOOR, max_len / 8) up to max_len
    (at most 4 sizes; one when max_len <= ATTENTION_FLOOR)."""
    return pow2_buckets(min(max_len, max(ATTENTION_FLOOR, next_pow2(max_len // 8))), max_len)


@dataclasses.dataclass(frozen=True)
class BucketSet:
    """The shapes an engine compiles: slots, tokens per slot (verify), prefill lengths and attended
    cache rows."""

    slots: tuple[int, ...]
    tokens: tuple[int, ...]
    prefill: tuple[int, ...]
    attention: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("slots", "tokens", "prefill", "attention"):
            v = getattr(self, name)
            if not v or list(v) != sorted(set(v)) or v[0] < 1:
                raise ValueError(f"bucket field '{name}' must be a non-empty increasing list of "
                                 f"positive ints, got {v!r}")
