"""What the Pallas kernels (pallas_attention.py, pallas_mlp.py) share: Triton's smallest matmul
block and the platform switch that lowers a kernel through Triton on CUDA and runs it in Pallas'
interpreter elsewhere (for tests)."""
from __future__ import annotations

from typing import Any, Callable

import jax

TRITON_MIN_DOT = 16  # Triton's matmul: every side of a block product >= 16


def power_of_two_block(n: int, cap: int) -> int:
    """The largest power of two dividing n, capped at `cap` (a block that tiles n exactly)."""
    return min(cap, n & -n)


def on_platform(call: Callable[[bool], Any]) -> Any:
    """`call(interpret)` for the platform the program is lowered for: Triton (interpret False) on
    CUDA, Pallas' interpreter on any other."""
    return jax.lax.platform_dependent(cuda=lambda: call(False), default=lambda: call(True))
