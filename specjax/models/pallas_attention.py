"""Decode attention over the KV cache in one Pallas kernel (GPU; interpreted elsewhere, for tests).

`cached_attention(q, kv, limits, kv_len)` is what `layers.attend` computes for a cached forward whose
rows are cache slots [0:B] and whose query t of row b sees keys j <= limits[b, t]: scores, mask,
softmax and the value product in one kernel per (row, kv head), reading keys and values from the
layer's key/value buffer [2, slots, kv_heads, max_len, hd] where they are stored (no slice, copy or
transpose of the cache), over rows [0:kv_len) in blocks with a running (online) softmax. Softmax in
float32 as in `layers.attend`; every query sees at least key 0 (`cache.cached_mask`), so the first
block's maximum is finite and masked keys weigh exp(finfo.min - max) = 0.

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
MIN_QUERY_ROWS = 16  # Triton's dot needs >= 16 rows: a kv head's block of queries has at least 16 (rows past
# the real ones are masked loads and stores, no padded copies)
MIN_KEY_BLOCK = 16  # and >= 16 keys per block
DEFAULT_BLOCK_K = 128


def _kernel(limits_ref, q_ref, k_ref, v_ref, o_ref, *, block_k: int, blocks: int, scale: float) -> None:
    # one (row, kv head): q [R, hd], keys/values [kv_len, hd], limits [R] (last key each query sees)
    q = q_ref[...].astype(jnp.float32) * scale
    limits = limits_ref[...]
    r, hd = q.shape
    low = jnp.finfo(jnp.float32).min

    def block(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        m, total, acc = carry
        start = pl.multiple_of(i * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :].astype(jnp.float32)
        v = v_ref[pl.ds(start, block_k), :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        key = start + jax.lax.broadcasted_iota(jnp.int32, (r, block_k), 1)
        s = jnp.where(key <= limits[:, None], s, low)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return m_new, total * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv
    init = (jnp.full((r,), low, jnp.float32), jnp.zeros((r,), jnp.float32), jnp.zeros((r, hd), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, blocks, block, init)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)


def cached_attention(q_btkgd: Array, kv_2skmd: Array, limits_bt: Array, kv_len: int | None = None,
                     block_k: int = DEFAULT_BLOCK_K) -> Array:
    """Attention of q [B, T, nkv, g, hd] (rows = cache slots [0:B]) over keys/values [0:kv_len) of
    the key/value buffer [2, slots, nkv, max_len, hd]; query t of row b sees keys j <= limits[b, t].
    Returns [B, T, nkv * g, hd] in q's dtype (equal to `layers.attend` with `cache.cached_mask`)."""
    b, t, nkv, g, hd = q_btkgd.shape
    max_len = kv_2skmd.shape[3]
    kv_len = max_len if kv_len is None else kv_len
    if not 0 < kv_len <= max_len:
        raise ValueError(f"kv_len {kv_len} outside [1, cache max_len {max_len}]")
    block_k = min(block_k, kv_len & -kv_len)  # the largest power of two dividing kv_len, capped
    if block_k < MIN_KEY_BLOCK:
        raise ValueError(f"attention 'pallas' needs an attention length (kv_len or the cache's max_len) that is "
                         f"a multiple of {MIN_KEY_BLOCK}, got {kv_len}")
    rows = g * t
    r = max(MIN_QUERY_ROWS, pl.next_power_of_2(rows))
    # [B, nkv, g*T, hd]: a kv head's queries, g-major then t (a block of r >= g*T rows reads them)
    q = q_btkgd.transpose(0, 2, 3, 1, 4).reshape(b, nkv, rows, hd)
    lim = jnp.broadcast_to(limits_bt.astype(jnp.int32)[:, None, :], (b, g, t)).reshape(b, rows)
    kernel = functools.partial(_kernel, block_k=block_k, blocks=kv_len // block_k, scale=hd ** -0.5)

    def call(interpret: bool) -> Array:
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((b, nkv, rows, hd), q_btkgd.dtype),
            grid=(b, nkv),
            in_specs=[pl.BlockSpec((None, r), lambda i, h: (i, 0)),
                      pl.BlockSpec((None, None, r, hd), lambda i, h: (i, h, 0, 0)),
                      pl.BlockSpec((None, None, None, kv_len, hd), lambda i, h: (0, i, h, 0, 0)),
                      pl.BlockSpec((None, None, None, kv_len, hd), lambda i, h: (1, i, h, 0, 0))],
            out_specs=pl.BlockSpec((None, None, r, hd), lambda i, h: (i, h, 0, 0)),
            interpret=interpret, name="specjax_cached_attention",
            compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        )(lim, q, kv_2skmd, kv_2skmd)
    # the platform the program is lowered for picks: Triton on CUDA, the interpreter elsewhere
    out = jax.lax.platform_dependent(cuda=lambda: call(False), default=lambda: call(True))
    out = out.reshape(b, nkv, g, t, hd)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nkv * g, hd)
