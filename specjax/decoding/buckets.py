"""Static shape buckets and the registry of ahead-of-time compiled executables.

Every serving executable has a bucket key: (slots bucket, tokens-per-slot bucket) for draft/verify
rounds and (prompt-length bucket,) for prefill. All keys an engine may execute are compiled at
start-up (`warm`), and calling an unwarmed key raises `UnwarmedBucketError` instead of compiling.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Hashable, Sequence

import jax


class UnwarmedBucketError(RuntimeError):
    """An executable was called with a bucket key that was not compiled at warm-up."""


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


class Executables:
    """Named jitted functions compiled ahead for each bucket key; never compiles on a call."""

    def __init__(self, name: str, fn: Callable[..., Any], *, donate_argnums: tuple[int, ...] = ()):
        self.name = name
        self._jitted = jax.jit(fn, donate_argnums=donate_argnums)
        self._compiled: dict[Hashable, Any] = {}
        self.compile_seconds: dict[Hashable, float] = {}

    def lower(self, key: Hashable, *abstract_args: Any) -> Any:
        """Trace and lower the function for `key` (None when `key` is compiled already)."""
        return None if key in self._compiled else self._jitted.lower(*abstract_args)

    def install(self, key: Hashable, lowered: Any) -> None:
        """Compile a `lower` result for `key`. XLA compiles without holding the GIL, so several
        threads may install different keys at once."""
        if lowered is None:
            return
        t0 = time.perf_counter()
        self._compiled[key] = lowered.compile()
        self.compile_seconds[key] = time.perf_counter() - t0

    def has(self, key: Hashable) -> bool:
        return key in self._compiled

    @property
    def keys(self) -> list[Hashable]:
        return list(self._compiled)

    def __call__(self, key: Hashable, *args: Any) -> Any:
        exe = self._compiled.get(key)
        if exe is None:
            raise UnwarmedBucketError(
                f"{self.name}: bucket {key!r} was not compiled at warm-up (warmed: {sorted(self._compiled, key=str)})")
        return exe(*args)

    def jit_cache_size(self) -> int:
        """Number of traces the underlying jit holds (must not grow while serving)."""
        return self._jitted._cache_size()


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, for lowering."""
    def one(x: Any) -> Any:
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(one, tree)
