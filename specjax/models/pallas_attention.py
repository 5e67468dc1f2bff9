"""Cached attention in one Pallas kernel per layer (GPU; interpreted elsewhere, for tests).

`cached_attention(qkv, kv, lengths, cos, sin)` is what `decoder.Attention` computes from its fused
q/k/v projection in a cached forward whose rows are cache slots [0:B]: in one kernel per (row, kv
head), the input norm's per-row factor (from the rows' sums of squares; the norm's weight is folded
into the projection's kernel), the queries' and new keys' RMSNorm (Qwen3's q_norm and k_norm) and
RoPE, the new keys and values written into the layer's key/value buffer [2, slots, kv_heads,
max_len, hd] in place (the kernel's output aliases it: no scatter), and attention of each query over
the row's cache rows [0:length) and the new keys up to its own. It reads the projection where it was
written and the buffer where it is stored (no slice, copy or transpose), only the key blocks that
hold the row's live rows, with a running (online) softmax that starts from the new keys (every query
sees the first, so the maximum is finite and masked keys weigh exp(finfo.min - max) = 0), and writes
its output in the layout the output projection reads. Softmax in float32 as in `layers.attend`.
Triton's blocks are powers of two and its loads and stores are not bounds-checked: where a block
overhangs its array, the kernel masks it (`_load`, and the output store); the new keys and values
are stored a row at a time, those past max_len dropped.

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

from specjax.models.pallas_triton import TRITON_MIN_DOT, on_platform, power_of_two_block

Array = jax.Array

ATTENTION_IMPLEMENTATIONS = ("xla", "pallas")  # CausalLM.forward(attention=...), EngineConfig.attention
MIN_QUERY_ROWS = TRITON_MIN_DOT  # a kv head's block of queries has at least 16 rows (Triton's dot)
MIN_KEY_BLOCK = TRITON_MIN_DOT  # and >= 16 keys per block
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


def _halves(ref, sizes: tuple[int, ...], n: int, half: int) -> tuple[Array, Array]:
    """A block's two head halves in float32, [n, hd/2] each (entries past the array masked to 0)."""
    return tuple(_load(ref.at[..., pl.ds(i * half, half)], sizes).astype(jnp.float32).reshape(n, half)
                 for i in (0, 1))


def _norm_rotate(x1: Array, x2: Array, w_ref, eps: float | None, cos: Array, sin: Array) -> tuple[Array, Array]:
    """Per-head RMSNorm (weight in halves as x; none when eps is None) then rotate-half RoPE of a
    head given as halves [n, hd/2], in float32."""
    half = x1.shape[1]
    if eps is not None:
        factor = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / (2 * half) + eps)[:, None]
        x1 = x1 * factor * w_ref[pl.ds(0, half)].astype(jnp.float32)[None, :]
        x2 = x2 * factor * w_ref[pl.ds(half, half)].astype(jnp.float32)[None, :]
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def _new_rows(cos_ref, sin_ref, cosk_ref, sink_ref, sq_ref, sk_ref, wq_ref, wk_ref, q_ref, k_ref, v_ref, *,
              t: int, g: int, dtype: jnp.dtype, eps_q: float | None, eps_k: float | None,
              row_norm: tuple[int, float] | None) -> tuple[Array, ...]:
    """A (row, kv head)'s queries (halves [tp * gp, hd/2] with the softmax scale) and new keys
    (halves [tk, hd/2]) and values [tk, hd], in `dtype`: each position scaled by its input norm's
    factor (`row_norm`), then queries and keys normed and rotated (keys rounded as the cache stores
    them)."""
    tp, gp, hd = q_ref.shape
    r, half = tp * gp, hd // 2

    def row_factor(ss_ref) -> Array:  # the input norm's factor rsqrt(ss / n + eps) of each position (1 without)
        return jnp.ones(ss_ref.shape, jnp.float32) if row_norm is None else jax.lax.rsqrt(
            _load(ss_ref, (t,)).astype(jnp.float32) / row_norm[0] + row_norm[1])

    def per_query(table_ref) -> Array:  # [tp, half] -> [r, half]: a query position's table for its gp heads
        return jnp.broadcast_to(_load(table_ref, (t,))[:, None, :], (tp, gp, half)).reshape(r, half)
    sq = jnp.broadcast_to(row_factor(sq_ref)[:, None], (tp, gp)).reshape(r, 1)
    a1, a2 = (x * hd ** -0.5 for x in _norm_rotate(*(x * sq for x in _halves(q_ref, (t, g), r, half)), wq_ref,
                                                   eps_q, per_query(cos_ref), per_query(sin_ref)))
    sk = row_factor(sk_ref)[:, None]
    k1, k2 = _norm_rotate(*(x * sk for x in _halves(k_ref, (t,), k_ref.shape[0], half)), wk_ref, eps_k,
                          _load(cosk_ref, (t,)), _load(sink_ref, (t,)))
    v = _load(v_ref, (t,)).astype(jnp.float32) * sk
    return tuple(x.astype(dtype) for x in (a1, a2, k1, k2, v))


def _kernel(len_ref, cos_ref, sin_ref, cosk_ref, sink_ref, sq_ref, sk_ref, wq_ref, wk_ref, q_ref, k_ref, v_ref,
            kv_ref, o_ref, kv_out_ref, *, t: int, g: int, block_k: int, blocks: int, eps_q: float | None,
            eps_k: float | None, row_norm: tuple[int, float] | None) -> None:
    # one (row, kv head): the row's cache length (a scalar), RoPE tables [tp | tk, hd/2] and sums of
    # squares [tp | tk] of the projection's input rows (`row_norm`) for the queries and the new keys,
    # the projection's q heads [tp, gp, hd] (t x g real), its new keys and values [tk, hd] (t real;
    # pre-norm, unrotated), the cache's keys and values [2, kv_len, hd] to read, and the same buffer
    # [2, max_len, hd] (aliased) to write the new ones into
    length = len_ref[...]
    a1, a2, k1, k2, v = _new_rows(cos_ref, sin_ref, cosk_ref, sink_ref, sq_ref, sk_ref, wq_ref, wk_ref, q_ref, k_ref,
                                  v_ref, t=t, g=g, dtype=kv_ref.dtype, eps_q=eps_q, eps_k=eps_k, row_norm=row_norm)
    _attend_and_store(a1, a2, k1, k2, v, kv_ref, o_ref, length, t=t, g=g, causal=True, block_k=block_k,
                      blocks=blocks)
    _write_new_rows(kv_out_ref, length, t, k1, k2, v)


def _attend_and_store(a1: Array, a2: Array, k1: Array, k2: Array, v: Array, kv_ref, o_ref, length: Array, *, t: int,
                      g: int, causal: bool, block_k: int, blocks: int) -> None:
    """Store in o_ref [tp, gp, hd] the attention of queries (halves [tp * gp, hd/2], scaled) over the
    new keys (halves [tk, hd/2]) and values [tk, hd] (query position i sees new keys j <= i when
    `causal`, else the t real ones) and over cache rows j < length of kv_ref [2, kv_len, hd], read a
    key block at a time with a running softmax (only the blocks that hold live rows)."""
    tp, gp, hd = o_ref.shape
    r, half, tk = tp * gp, hd // 2, k1.shape[0]
    low = jnp.finfo(jnp.float32).min
    dims = (((1,), (1,)), ((), ()))

    def scores(c1: Array, c2: Array) -> Array:  # [r, n] of keys given as halves [n, half]
        return (jax.lax.dot_general(a1, c1, dims, preferred_element_type=jnp.float32)
                + jax.lax.dot_general(a2, c2, dims, preferred_element_type=jnp.float32))

    def values(p: Array, v_nd: Array) -> Array:
        return jax.lax.dot_general(p.astype(v.dtype), v_nd, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    # the new keys first: every query sees new key 0 at least (a finite maximum)
    key = jax.lax.broadcasted_iota(jnp.int32, (r, tk), 1)
    q_pos = jax.lax.broadcasted_iota(jnp.int32, (tp, gp), 0).reshape(r)
    s = jnp.where(key <= q_pos[:, None] if causal else key < t, scores(k1, k2), low)
    m = jnp.max(s, axis=1)
    p = jnp.exp(s - m[:, None])
    init = (m, jnp.sum(p, axis=1), values(p, v))

    def block(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        # cache keys j < length, in blocks with a running softmax; keys past it weigh exp(low - m) = 0
        m, total, acc = carry
        start = pl.multiple_of(i * block_k, block_k)
        rows = pl.ds(start, block_k)
        s = scores(kv_ref[0, rows, pl.ds(0, half)], kv_ref[0, rows, pl.ds(half, half)])
        s = jnp.where(start + jax.lax.broadcasted_iota(jnp.int32, (r, block_k), 1) < length, s, low)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        return m_new, total * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + values(p, kv_ref[1, rows, :])
    _, total, acc = jax.lax.fori_loop(0, jnp.minimum((length + block_k - 1) // block_k, blocks), block, init)
    out = (acc / total[:, None]).reshape(tp, gp, hd).astype(o_ref.dtype)
    mask = _inside(o_ref.shape, (t, g))  # rows past the real queries are never stored
    if mask is None:
        o_ref[...] = out
    else:
        pl_triton.store(o_ref, out, mask=mask)


def _write_new_rows(kv_out_ref, length: Array, t: int, k1: Array, k2: Array, v: Array) -> None:
    """The new keys (halves [tk, hd/2]) and values [tk, hd] of rows i < t into cache rows length + i
    of a (row, kv head)'s buffer [2, max_len, hd], a row at a time; rows past max_len dropped (as
    `cache.write`)."""
    half, max_len, dtype = k1.shape[1], kv_out_ref.shape[1], kv_out_ref.dtype
    row = jax.lax.broadcasted_iota(jnp.int32, (k1.shape[0], 1), 0)
    for i in range(t):
        def write(i: int = i) -> None:
            def pick(x: Array) -> Array:  # row i of x [tk, n] as [1, n]
                return jnp.sum(jnp.where(row == i, x.astype(jnp.float32), 0.0), axis=0, keepdims=True).astype(dtype)
            at = pl.ds(length + i, 1)
            kv_out_ref[0, at, pl.ds(0, half)] = pick(k1)
            kv_out_ref[0, at, pl.ds(half, half)] = pick(k2)
            kv_out_ref[1, at, :] = pick(v)
        pl.when(length + i < max_len)(write)


def _key_blocks(max_len: int, kv_len: int | None, block_k: int) -> tuple[int, int]:
    """(kv_len, block_k): the cache rows read (max_len by default) and the key block, the largest
    power of two dividing kv_len up to `block_k` (>= MIN_KEY_BLOCK, else refused)."""
    kv_len = max_len if kv_len is None else kv_len
    if not 0 < kv_len <= max_len:
        raise ValueError(f"kv_len {kv_len} outside [1, cache max_len {max_len}]")
    block_k = power_of_two_block(kv_len, block_k)
    if block_k < MIN_KEY_BLOCK:
        raise ValueError(f"attention 'pallas' needs an attention length (kv_len or the cache's max_len) that is "
                         f"a multiple of {MIN_KEY_BLOCK}, got {kv_len}")
    return kv_len, block_k


def _blocks(t: int, g: int) -> tuple[int, int, int]:
    """(tp, gp, tk): a kv head's block of queries, [tp, gp] positions x heads, powers of two
    (Triton's blocks) with >= 16 rows (Triton's matmul), and of new keys and values, tk >= 16
    positions. Entries past the t x g queries or t keys are masked: zeros in, never stored."""
    tp = pl.next_power_of_2(t)
    return tp, max(pl.next_power_of_2(g), MIN_QUERY_ROWS // tp), max(tp, MIN_KEY_BLOCK)


def _checked(qkv_btkjd: Array, kv_2skmd: Array, cos_bth: Array, sin_bth: Array, ss_bt: Array | None,
             kv_len: int | None, block_k: int) -> tuple[int, int]:
    """(kv_len, block_k) of a `cached_attention` call, its shapes checked."""
    b, t, _, _, hd = qkv_btkjd.shape
    kv_len, block_k = _key_blocks(kv_2skmd.shape[3], kv_len, block_k)
    if hd % 2 or cos_bth.shape != (b, t, hd // 2) or sin_bth.shape != cos_bth.shape:
        raise ValueError(f"RoPE tables must be [B, T, hd/2] = {(b, t, hd // 2)}, got {cos_bth.shape}, {sin_bth.shape}")
    if ss_bt is not None and ss_bt.shape != (b, t):
        raise ValueError(f"row_sum_square_bt must be [B, T] = {(b, t)}, got {ss_bt.shape}")
    return kv_len, block_k


def cached_attention(qkv_btkjd: Array, kv_2skmd: Array, lengths_b: Array, cos_bth: Array, sin_bth: Array, *,
                     q_norm: Array | None = None, k_norm: Array | None = None, eps: float = 1e-6,
                     row_sum_square_bt: Array | None = None, row_norm: tuple[int, float] = (1, 0.0),
                     kv_len: int | None = None, block_k: int = DEFAULT_BLOCK_K) -> tuple[Array, Array]:
    """One cached attention call of a fused q/k/v projection [B, T, nkv, g + 2, hd] (rows = cache
    slots [0:B]; j < g are q heads, then the key and the value, as `layers.fuse_qkv` lays them out)
    whose row b writes its T keys and values at cache rows lengths[b] + t of the key/value buffer
    [2, slots, nkv, max_len, hd] (writes past max_len dropped), query t seeing the row's cache rows
    [0:lengths[b]) (read within [0:kv_len)) and new keys 0..t. In the kernel, each position's q, k
    and v are first multiplied by its input norm's factor rsqrt(ss / n + eps) when given its input
    row's sum of squares ss (`row_sum_square_bt` [B, T], `row_norm` = (n, eps): `RMSNorm.factored`),
    then queries and keys normed (RMSNorm with weights `q_norm`, `k_norm` [hd] and `eps`, when given)
    and rotated (rotate-half RoPE, tables cos/sin [B, T, hd/2]). Returns the output [B, T, nkv, g, hd]
    in the projection's dtype and the buffer with the new keys and values (in place: the kernel's
    output aliases it): `Attention` with `cache.write_kv`, `layers.attend` and `cache.cached_mask`,
    to rounding. On a GPU (Triton) hd/2 must be >= 16 (a matmul's inner size)."""
    b, t, nkv, j, hd = qkv_btkjd.shape
    g = j - 2
    kv_len, block_k = _checked(qkv_btkjd, kv_2skmd, cos_bth, sin_bth, row_sum_square_bt, kv_len, block_k)
    max_len = kv_2skmd.shape[3]
    tp, gp, tk = _blocks(t, g)
    ones = jnp.ones((hd,), qkv_btkjd.dtype)
    kernel = functools.partial(_kernel, t=t, g=g, block_k=block_k, blocks=kv_len // block_k,
                               eps_q=None if q_norm is None else float(eps),
                               eps_k=None if k_norm is None else float(eps),
                               row_norm=None if row_sum_square_bt is None else (int(row_norm[0]), float(row_norm[1])))
    tables = [pl.BlockSpec((None, n, hd // 2), lambda i, h: (i, 0, 0)) for n in (tp, tp, tk, tk)]
    factors = [pl.BlockSpec((None, n), lambda i, h: (i, 0)) for n in (tp, tk)]
    ss_bt = jnp.ones((b, t), jnp.float32) if row_sum_square_bt is None else row_sum_square_bt
    heads = pl.BlockSpec((None, tp, None, gp, hd), lambda i, h: (i, 0, h, 0, 0))
    cache = [pl.BlockSpec((2, None, None, n, hd), lambda i, h: (0, i, h, 0, 0)) for n in (kv_len, max_len)]

    def new(entry: int) -> pl.BlockSpec:  # the key (entry g) or the value (g + 1) of a kv head, tk positions
        return pl.BlockSpec((None, tk, None, None, hd), lambda i, h: (i, 0, h, entry, 0))

    def call(interpret: bool) -> tuple[Array, Array]:
        return pl.pallas_call(
            kernel,
            out_shape=(jax.ShapeDtypeStruct((b, t, nkv, g, hd), qkv_btkjd.dtype),
                       jax.ShapeDtypeStruct(kv_2skmd.shape, kv_2skmd.dtype)),
            grid=(b, nkv),
            in_specs=[pl.BlockSpec((None,), lambda i, h: (i,)), *tables, *factors,
                      pl.BlockSpec((hd,), lambda i, h: (0,)), pl.BlockSpec((hd,), lambda i, h: (0,)), heads, new(g),
                      new(g + 1), cache[0]],
            out_specs=(heads, cache[1]),
            input_output_aliases={12: 1},  # the key/value buffer is written in place
            interpret=interpret, name="specjax_cached_attention",
            compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        )(lengths_b.astype(jnp.int32), *(x.astype(jnp.float32) for x in (cos_bth, sin_bth, cos_bth, sin_bth)),
          ss_bt, ss_bt, ones if q_norm is None else q_norm, ones if k_norm is None else k_norm, qkv_btkjd, qkv_btkjd,
          qkv_btkjd, kv_2skmd)
    return on_platform(call)


def _block_kernel(len_ref, q_ref, k_ref, v_ref, kv_ref, o_ref, *, t: int, g: int, block_k: int, blocks: int) -> None:
    # one (row, kv head): the row's context length (a scalar), the block's q heads [tp, gp, hd] (t x g
    # real; normed and rotated), its keys and values [tk, hd] (t real) and the context cache's keys
    # and values [2, kv_len, hd]
    tp, gp, hd = q_ref.shape
    dtype = kv_ref.dtype
    a1, a2 = ((x * hd ** -0.5).astype(dtype) for x in _halves(q_ref, (t, g), tp * gp, hd // 2))
    k1, k2 = (x.astype(dtype) for x in _halves(k_ref, (t,), k_ref.shape[0], hd // 2))
    _attend_and_store(a1, a2, k1, k2, _load(v_ref, (t,)).astype(dtype), kv_ref, o_ref, len_ref[...], t=t, g=g,
                      causal=False, block_k=block_k, blocks=blocks)


def context_block_attention(q_bthd: Array, kv_2skmd: Array, lengths_b: Array, k_blk_bthd: Array,
                            v_blk_bthd: Array, *, kv_len: int | None = None,
                            block_k: int = DEFAULT_BLOCK_K) -> Array:
    """A block drafter's attention in one kernel per (row, kv head): row b's T queries q [B, T, nh,
    hd] (normed and rotated) over its context, cache rows [0:lengths[b]) of the key/value buffer
    [2, slots, nkv, max_len, hd] (read within [0:kv_len)), and over all T of the block's own keys
    and values [B, T, nkv, hd]; softmax in float32. `drafters.common.attend_context_and_block` with
    a whole-block mask, to rounding, without the scores in memory. Returns [B, T, nh, hd] in q's
    dtype."""
    b, t, nh, hd = q_bthd.shape
    nkv = kv_2skmd.shape[2]
    g = nh // nkv
    kv_len, block_k = _key_blocks(kv_2skmd.shape[3], kv_len, block_k)
    if k_blk_bthd.shape != (b, t, nkv, hd) or v_blk_bthd.shape != k_blk_bthd.shape or nh % nkv:
        raise ValueError(f"block keys and values must be [B, T, nkv, hd] = {(b, t, nkv, hd)} and heads a multiple "
                         f"of {nkv}, got {k_blk_bthd.shape}, {v_blk_bthd.shape} and {nh} heads")
    tp, gp, tk = _blocks(t, g)
    kernel = functools.partial(_block_kernel, t=t, g=g, block_k=block_k, blocks=kv_len // block_k)
    heads = pl.BlockSpec((None, tp, None, gp, hd), lambda i, h: (i, 0, h, 0, 0))
    own = pl.BlockSpec((None, tk, None, hd), lambda i, h: (i, 0, h, 0))

    def call(interpret: bool) -> Array:
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((b, t, nkv, g, hd), q_bthd.dtype), grid=(b, nkv),
            in_specs=[pl.BlockSpec((None,), lambda i, h: (i,)), heads, own, own,
                      pl.BlockSpec((2, None, None, kv_len, hd), lambda i, h: (0, i, h, 0, 0))],
            out_specs=heads, interpret=interpret, name="specjax_context_block_attention",
            compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        )(lengths_b.astype(jnp.int32), q_bthd.reshape(b, t, nkv, g, hd), k_blk_bthd.astype(kv_2skmd.dtype),
          v_blk_bthd.astype(kv_2skmd.dtype), kv_2skmd)
    return on_platform(call).reshape(b, t, nh, hd)
