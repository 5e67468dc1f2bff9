"""The gated MLP's first half in one Pallas kernel (GPU; interpreted elsewhere, for tests).

`gated_projection(x, gate_up, row_scale)` is silu(s * (x @ gate)) * (s * (x @ up)) [M, F] for rows
x [M, H], the gate and up kernels fused as [H, 2, F] (`layers.fuse_gate_up`) or given apart ([H, F]
each), and a per-row factor s [M] (the post-attention norm's, `RMSNorm.factored`; 1 without). XLA
writes the gate/up product [M, 2F] and reads it back for the SiLU product; here each program of the
grid (a block of rows x a block of F columns) keeps both products of its block in float32
accumulators over H (read in blocks of `block_k`) and writes only the gated result, in x's dtype.
At 1,024 rows (a verify round of 128 slots) that is 2 x 2F x M bytes per layer fewer.

Triton's blocks are powers of two and its loads and stores are not bounds-checked: the row block
may overhang x (rows past M are loaded as zeros and never stored); H and F must be multiples of
the key and column blocks (>= 16 each: Triton's matmul).

Lowered for CUDA the kernel goes through Triton; for any other platform it runs in Pallas'
interpreter (slow: there it exists to test the kernel against the XLA ops). It is opt-in
(`EngineConfig.mlp = "pallas"`): its results are tested in the interpreter and it compiles for an
H200 (`bench.round_ops --target h200 --mlp pallas`), but it has not yet run on a GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from specjax.models.pallas_triton import TRITON_MIN_DOT, on_platform, power_of_two_block

Array = jax.Array

MLP_IMPLEMENTATIONS = ("xla", "pallas")  # CausalLM.forward(mlp=...), EngineConfig.mlp
BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64  # the largest blocks used (smaller where M, F or H ask)


def _power_block(n: int, cap: int, what: str) -> int:
    """The largest power of two dividing n up to `cap` (>= Triton's 16, else refused naming `what`)."""
    block = power_of_two_block(n, cap)
    if block < TRITON_MIN_DOT:
        raise ValueError(f"mlp 'pallas' needs {what} to be a multiple of {TRITON_MIN_DOT}, got {n}")
    return block


def check_sizes(hidden: int, inner: int) -> None:
    """Refuse an MLP the kernel cannot block: hidden and MLP sizes must be multiples of 16."""
    _power_block(hidden, BLOCK_K, "the hidden size")
    _power_block(inner, BLOCK_N, "the MLP size")


def _kernel(s_ref, x_ref, *refs, m: int, block_k: int, steps: int) -> None:
    # one (row block, column block): row factors [bm], rows [bm, H], then the gate and up columns
    # as one block [H, 2, bn] of the fused kernel or two [H, bn], and the output block [bm, bn]
    *w_refs, o_ref = refs
    bm, bn = o_ref.shape
    live = m - pl.program_id(0) * bm  # rows of the block inside x (may be < bm in the last block)
    inside = jax.lax.broadcasted_iota(jnp.int32, (bm, block_k), 0) < live

    def step(k: Array, acc: tuple[Array, Array]) -> tuple[Array, Array]:
        at = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        x = pl_triton.load(x_ref.at[:, at], mask=inside, other=0)
        if len(w_refs) == 1:
            gate, up = (w_refs[0][at, part, :].astype(x.dtype) for part in (0, 1))
        else:
            gate, up = (ref[at, :].astype(x.dtype) for ref in w_refs)
        return (acc[0] + jnp.dot(x, gate, preferred_element_type=jnp.float32),
                acc[1] + jnp.dot(x, up, preferred_element_type=jnp.float32))
    zero = jnp.zeros((bm, bn), jnp.float32)
    gate, up = jax.lax.fori_loop(0, steps, step, (zero, zero))
    rows = jax.lax.broadcasted_iota(jnp.int32, (bm,), 0) < live
    s = pl_triton.load(s_ref, mask=rows, other=0)[:, None]
    pl_triton.store(o_ref, (jax.nn.silu(gate * s) * (up * s)).astype(o_ref.dtype),
                    mask=jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < live)


def gated_projection(x_mh: Array, gate_up: Array | tuple[Array, Array], row_scale_m: Array | None = None, *,
                     block_m: int = BLOCK_M, block_n: int = BLOCK_N, block_k: int = BLOCK_K) -> Array:
    """silu(s * (x @ gate)) * (s * (x @ up)) [M, F] in x's dtype: rows x [M, H], `gate_up` the
    kernels fused [H, 2, F] (gate first) or the pair (gate, up) [H, F], `row_scale_m` [M] (float32;
    default 1). Products accumulate in float32; one rounding at the end (XLA's ops round the
    products first). H and F must be multiples of 16."""
    m, h = x_mh.shape
    fused = not isinstance(gate_up, tuple)
    shape = gate_up.shape if fused else gate_up[0].shape
    f = shape[-1]
    if (fused and shape != (h, 2, f)) or (not fused and (shape != (h, f) or gate_up[1].shape != shape)):
        raise ValueError(f"gate_up must be [H, 2, F] or a pair of [H, F] kernels with H = {h} (x's width), got "
                         f"{shape if fused else (gate_up[0].shape, gate_up[1].shape)}")
    if row_scale_m is not None and row_scale_m.shape != (m,):
        raise ValueError(f"row_scale_m must be [M] = {(m,)}, got {row_scale_m.shape}")
    bk, bn = _power_block(h, block_k, "the hidden size"), _power_block(f, block_n, "the MLP size")
    bm = max(TRITON_MIN_DOT, min(block_m, pl.next_power_of_2(m)))
    kernel = functools.partial(_kernel, m=m, block_k=bk, steps=h // bk)
    if fused:  # one operand: the kernel reads each column block's gate and up halves from it
        halves, weights = [pl.BlockSpec((h, 2, bn), lambda i, j: (0, 0, j))], (gate_up,)
    else:
        halves, weights = [pl.BlockSpec((h, bn), lambda i, j: (0, j))] * 2, gate_up
    scale = jnp.ones((m,), jnp.float32) if row_scale_m is None else row_scale_m.astype(jnp.float32)

    def call(interpret: bool) -> Array:
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((m, f), x_mh.dtype), grid=(pl.cdiv(m, bm), f // bn),
            in_specs=[pl.BlockSpec((bm,), lambda i, j: (i,)), pl.BlockSpec((bm, h), lambda i, j: (i, 0)), *halves],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)), interpret=interpret,
            name="specjax_gated_projection",
            compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=3),
        )(scale, x_mh, *weights)
    return on_platform(call)
