"""Decode attention over the KV cache in one Pallas kernel (GPU; interpreted elsewhere, for tests).

`cached_attention(qkv, kv, limits, cos, sin)` is what `decoder.Attention` computes from its fused
q/k/v projection in a cached forward whose rows are cache slots [0:B] and whose query t of row b sees
keys j <= limits[b, t]: the queries' RMSNorm (Qwen3's q_norm) and RoPE, scores, mask, softmax and the
value product in one kernel per (row, kv head). It reads the queries where the projection wrote them
and keys and values where the layer's key/value buffer [2, slots, kv_heads, max_len, hd] stores them
(no slice, copy or transpose), over rows [0:kv_len) in blocks with a running (online) softmax, and
writes its output in the layout the output projection reads. Softmax in float32 as in
`layers.attend`; every query sees at least key 0 (`cache.cached_mask`), so the first block's maximum
is finite and masked keys weigh exp(finfo.min - max) = 0. Triton's blocks are powers of two and its
loads and stores are not bounds-checked: where a block of queries overhangs its array, the kernel
masks them (`_load`, and the output store).

Lowered for CUDA the kernel goes through Triton; for any other platform it runs in Pallas'
interpreter (slow: there it exists to test the kernel against `layers.attend`). It is opt-in
(`EngineConfig.attention = "pallas"`): its results are tested in the interpreter and it compiles for
an H200 (`bench.round_ops --target h200 --attention pallas`), but it has not yet run on a GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

Array = jax.Array

ATTENTION_IMPLEMENTATIONS = ("xla", "pallas")  # CausalLM.forward(attention=...), EngineConfig.attention
MIN_QUERY_ROWS = 16  # Triton's dot needs >= 16 rows: a kv head's block of queries has at least 16
MIN_KEY_BLOCK = 16  # and >= 16 keys per block
DEFAULT_BLOCK_K = 128
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def check_head_dim(head_dim: int, platform: str) -> None:
    """Refuse a head size the kernel cannot lower for `platform`: on a GPU each half of a head is a
    Triton matmul's inner size, which must be >= 16 (the interpreter elsewhere takes any even size)."""
    if head_dim % 2:
        raise ValueError(f"attention 'pallas' needs an even head_dim (rotate-half RoPE), got {head_dim}")
    if platform in GPU_PLATFORMS and head_dim < 2 * MIN_KEY_BLOCK:
        raise ValueError(f"attention 'pallas' on {platform} needs head_dim >= {2 * MIN_KEY_BLOCK} (each half "
                         f"a Triton matmul's inner size >= {MIN_KEY_BLOCK}), got {head_dim}")


def _inside(shape: tuple[int, ...], sizes: tuple[int, ...]) -> Array | None:
    """A block's mask of entries inside the array: leading axes i < sizes[i] (None: all inside)."""
    if all(n >= b for n, b in zip(sizes, shape)):
        return None
    mask = jnp.ones(shape, bool)
    for axis, n in enumerate(sizes):
        if n < shape[axis]:
            mask = mask & (jax.lax.broadcasted_iota(jnp.int32, shape, axis) < n)
    return mask


def _load(ref, sizes: tuple[int, ...]) -> Array:
    """Load a block, entries past the array's end (leading axes `sizes`) masked to zero: Triton
    reads nothing there (a block may overhang the array: blocks are powers of two)."""
    mask = _inside(ref.shape, sizes)
    return ref[...] if mask is None else pl_triton.load(ref, mask=mask, other=0)


def _kernel(limits_ref, cos_ref, sin_ref, w_ref, qkv_ref, kv_ref, o_ref, *, t: int, g: int, block_k: int,
            blocks: int, eps: float | None) -> None:
    # one (row, kv head): the projection's q heads [tp, gp, hd] (pre-norm, unrotated; t x g of them
    # real), RoPE tables [tp, hd/2], keys and values [2, kv_len, hd], limits [tp] (the last key each
    # query position sees)
    tp, gp, hd = qkv_ref.shape
    r, half = tp * gp, hd // 2
    q1 = _load(qkv_ref.at[:, :, pl.ds(0, half)], (t, g)).astype(jnp.float32).reshape(r, half)
    q2 = _load(qkv_ref.at[:, :, pl.ds(half, half)], (t, g)).astype(jnp.float32).reshape(r, half)
    if eps is not None:  # the per-head RMSNorm of q (Qwen3), weight in halves as q
        factor = jax.lax.rsqrt((jnp.sum(q1 * q1, axis=1) + jnp.sum(q2 * q2, axis=1)) / hd + eps)[:, None]
        q1 = q1 * factor * w_ref[pl.ds(0, half)].astype(jnp.float32)[None, :]
        q2 = q2 * factor * w_ref[pl.ds(half, half)].astype(jnp.float32)[None, :]

    def per_row(table_ref) -> Array:  # [tp, half] -> [r, half]: a query position's table for its gp heads
        return jnp.broadcast_to(_load(table_ref, (t,))[:, None, :], (tp, gp, half)).reshape(r, half)
    cos, sin = per_row(cos_ref), per_row(sin_ref)
    # rotate-half RoPE, with the softmax scale; the scores are the two halves' products summed
    scale = hd ** -0.5
    dtype = kv_ref.dtype
    a1 = ((q1 * cos - q2 * sin) * scale).astype(dtype)
    a2 = ((q2 * cos + q1 * sin) * scale).astype(dtype)
    limits = jnp.broadcast_to(_load(limits_ref, (t,))[:, None], (tp, gp)).reshape(r)
    low = jnp.finfo(jnp.float32).min
    dims = (((1,), (1,)), ((), ()))

    def block(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        m, total, acc = carry
        start = pl.multiple_of(i * block_k, block_k)
        s = (jax.lax.dot_general(a1, kv_ref[0, pl.ds(start, block_k), pl.ds(0, half)], dims,
                                 preferred_element_type=jnp.float32)
             + jax.lax.dot_general(a2, kv_ref[0, pl.ds(start, block_k), pl.ds(half, half)], dims,
                                   preferred_element_type=jnp.float32))
        key = start + jax.lax.broadcasted_iota(jnp.int32, (r, block_k), 1)
        s = jnp.where(key <= limits[:, None], s, low)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        v = kv_ref[1, pl.ds(start, block_k), :]
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return m_new, total * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv
    init = (jnp.full((r,), low, jnp.float32), jnp.zeros((r,), jnp.float32), jnp.zeros((r, hd), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, blocks, block, init)
    out = (acc / total[:, None]).reshape(tp, gp, hd).astype(o_ref.dtype)
    mask = _inside(o_ref.shape, (t, g))  # rows past the real queries are never stored
    if mask is None:
        o_ref[...] = out
    else:
        pl_triton.store(o_ref, out, mask=mask)


def cached_attention(qkv_btkjd: Array, kv_2skmd: Array, limits_bt: Array, cos_bth: Array, sin_bth: Array, *,
                     q_norm: Array | None = None, eps: float = 1e-6, kv_len: int | None = None,
                     block_k: int = DEFAULT_BLOCK_K) -> Array:
    """Attention of the queries of a fused q/k/v projection [B, T, nkv, g + 2, hd] (rows = cache
    slots [0:B]; j < g are q heads, as `layers.fuse_qkv` lays them out) over keys/values [0:kv_len)
    of the key/value buffer [2, slots, nkv, max_len, hd]; query t of row b sees keys j <= limits[b, t].
    The queries are normed (RMSNorm with weight `q_norm` [hd] and `eps`, when given) and rotated
    (rotate-half RoPE, tables cos/sin [B, T, hd/2]) in the kernel. Returns [B, T, nkv, g, hd] in the
    projection's dtype: `Attention` with `layers.attend` and `cache.cached_mask`, to rounding.
    On a GPU (Triton) hd/2 must be >= 16 (a matmul's inner size)."""
    b, t, nkv, j, hd = qkv_btkjd.shape
    g = j - 2
    max_len = kv_2skmd.shape[3]
    kv_len = max_len if kv_len is None else kv_len
    if not 0 < kv_len <= max_len:
        raise ValueError(f"kv_len {kv_len} outside [1, cache max_len {max_len}]")
    block_k = min(block_k, kv_len & -kv_len)  # the largest power of two dividing kv_len, capped
    if block_k < MIN_KEY_BLOCK:
        raise ValueError(f"attention 'pallas' needs an attention length (kv_len or the cache's max_len) that is "
                         f"a multiple of {MIN_KEY_BLOCK}, got {kv_len}")
    if hd % 2 or cos_bth.shape != (b, t, hd // 2) or sin_bth.shape != cos_bth.shape:
        raise ValueError(f"RoPE tables must be [B, T, hd/2] = {(b, t, hd // 2)}, got {cos_bth.shape}, {sin_bth.shape}")
    # a kv head's block of queries: [tp, gp] positions x heads, powers of two (Triton's blocks) with
    # >= 16 rows (Triton's matmul); entries past the t x g queries are masked: zeros in, never stored
    tp = pl.next_power_of_2(t)
    gp = max(pl.next_power_of_2(g), MIN_QUERY_ROWS // tp)
    norm = q_norm if q_norm is not None else jnp.ones((hd,), qkv_btkjd.dtype)
    kernel = functools.partial(_kernel, t=t, g=g, block_k=block_k, blocks=kv_len // block_k,
                               eps=None if q_norm is None else float(eps))

    def call(interpret: bool) -> Array:
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((b, t, nkv, g, hd), qkv_btkjd.dtype),
            grid=(b, nkv),
            in_specs=[pl.BlockSpec((None, tp), lambda i, h: (i, 0)),
                      pl.BlockSpec((None, tp, hd // 2), lambda i, h: (i, 0, 0)),
                      pl.BlockSpec((None, tp, hd // 2), lambda i, h: (i, 0, 0)),
                      pl.BlockSpec((hd,), lambda i, h: (0,)),
                      pl.BlockSpec((None, tp, None, gp, hd), lambda i, h: (i, 0, h, 0, 0)),
                      pl.BlockSpec((2, None, None, kv_len, hd), lambda i, h: (0, i, h, 0, 0))],
            out_specs=pl.BlockSpec((None, tp, None, gp, hd), lambda i, h: (i, 0, h, 0, 0)),
            interpret=interpret, name="specjax_cached_attention",
            compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        )(limits_bt.astype(jnp.int32), cos_bth.astype(jnp.float32), sin_bth.astype(jnp.float32), norm,
          qkv_btkjd, kv_2skmd)
    # the platform the program is lowered for picks: Triton on CUDA, the interpreter elsewhere
    return jax.lax.platform_dependent(cuda=lambda: call(False), default=lambda: call(True))
