"""The Pallas decode-attention kernel (issue #36: one attention kernel per layer), run in Pallas'
interpreter on CPU: equal to `layers.attend` over the cache, in a forward and in the engine."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

try:
    from tests.engine_fixtures import BigramDrafter, block_drafter_blocks, compiled_text, greedy_outputs, tiny_target
except ImportError:  # tests/ itself on sys.path
    from engine_fixtures import BigramDrafter, block_drafter_blocks, compiled_text, greedy_outputs, tiny_target

from specjax.decoding.engine import EngineConfig
from specjax.models import cache as kvc
from specjax.models.decoder import CausalLM
from specjax.models.layers import attend, rope_tables, rotate
from specjax.models.pallas_attention import cached_attention, check_head_dim


def _case(t: int, dtype, seed: int = 0):
    """A fused projection [slots, t, nkv, g + 2, hd], a key/value buffer, row lengths and RoPE tables."""
    rng = np.random.default_rng(seed)
    slots, nkv, g, hd, max_len = 3, 2, 3, 16, 64
    kv = jnp.asarray(rng.normal(size=(2, slots, nkv, max_len, hd)), dtype)
    qkv = jnp.asarray(rng.normal(size=(slots, t, nkv, g + 2, hd)), dtype)
    lengths = jnp.asarray([5, 0, 64 - t], jnp.int32)  # a short row, an empty one, one filling the cache
    cos, sin = rope_tables(lengths[:, None] + jnp.arange(t), hd, theta=10000.0)
    return qkv, kv, lengths, cos, sin


def _reference(qkv, kv, lengths, cos, sin, kv_len, q_norm=None, k_norm=None):
    """What `decoder.Attention` computes without the kernel: queries and keys as `project` makes them,
    keys and values written by `cache.write_kv`, the written cache attended by `layers.attend`.
    Returns the output and the written buffer."""
    g, t = qkv.shape[3] - 2, qkv.shape[1]

    def norm_rotate(x, w, cos, sin):
        x = x.astype(jnp.float32)
        if w is not None:
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w
        return rotate(x.astype(qkv.dtype), cos, sin)
    q = norm_rotate(qkv[:, :, :, :g], q_norm, cos[:, :, None, None], sin[:, :, None, None])
    k = norm_rotate(qkv[:, :, :, g], k_norm, cos[:, :, None], sin[:, :, None])
    written = kvc.write_kv(kv, k, qkv[:, :, :, g + 1], lengths)
    k_all, v_all = kvc.read_kv(written, qkv.shape[0], kv_len=kv_len)
    out = attend(q, k_all, v_all, kvc.cached_mask(lengths, t, kv_len))  # [B, T, nkv * g, hd]
    return out.reshape(q.shape), written


def _weights(norm: bool, seed: int):
    return jnp.asarray(np.random.default_rng(seed).uniform(0.5, 1.5, 16), jnp.float32) if norm else None


@pytest.mark.parametrize("t,kv_len,block_k,norm", [(1, 64, 16, False), (4, 64, 64, True), (4, 32, 16, False),
                                                   (3, 64, 32, True)])
def test_kernel_equals_attend_over_the_cache(t, kv_len, block_k, norm):
    """Several key blocks (a running softmax) or one; one query per row (decoding), three or four
    (verify); queries and keys normed (Qwen3's q_norm and k_norm, random weights) and rotated in the
    kernel or only rotated; the keys and values written into the buffer as `cache.write_kv` does."""
    qkv, kv, lengths, cos, sin = _case(t, jnp.float32)
    if kv_len < 64:
        lengths = jnp.minimum(lengths, kv_len - t)
    wq, wk = _weights(norm, 9), _weights(norm, 10)
    ref, ref_kv = _reference(qkv, kv, lengths, cos, sin, kv_len, wq, wk)

    def kernel(lengths, cos, sin, wq, wk):
        return jax.jit(lambda *a: cached_attention(qkv, kv, *a[:3], q_norm=a[3], k_norm=a[4], kv_len=kv_len,
                                                   block_k=block_k))(lengths, cos, sin, wq, wk)
    got, got_kv = kernel(lengths, cos, sin, wq, wk)
    assert got.shape == ref.shape == (3, t, 2, 3, 16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got_kv), np.asarray(ref_kv), atol=1e-5, rtol=0)
    # negative controls: the rows one further on (one more old key seen, the writes shifted), a
    # position off in the RoPE tables, or (with the norms) a weight left out, each change the output
    cos1, sin1 = rope_tables(lengths[:, None] + jnp.arange(t) + 1, 16, theta=10000.0)
    off = {"lengths": kernel(jnp.minimum(lengths + 1, kv_len - t), cos, sin, wq, wk),
           "rope": kernel(lengths, cos1, sin1, wq, wk)}
    if norm:
        off["q norm weight"] = kernel(lengths, cos, sin, jnp.ones_like(wq), wk)
        off["k norm weight"] = kernel(lengths, cos, sin, wq, jnp.ones_like(wk))
    for name, (wrong, wrong_kv) in off.items():
        assert np.abs(np.asarray(wrong) - np.asarray(ref)).max() > 1e-3, name
    assert np.abs(np.asarray(off["rope"][1]) - np.asarray(ref_kv)).max() > 1e-3  # rotated keys written


def test_kernel_drops_writes_past_the_cache_and_reads_only_live_rows():
    """A row whose new tokens run past max_len writes those that fit and drops the rest (as
    `cache.write_kv`); a row reads only the key blocks holding its live rows (NaN in the blocks past
    them leaves its output finite and equal: a loop over every block would spread it)."""
    qkv, kv, lengths, cos, sin = _case(4, jnp.float32, seed=3)
    lengths = jnp.asarray([5, 0, 62], jnp.int32)  # row 2 writes rows 62, 63 and drops two
    _, ref_kv = _reference(qkv, kv, lengths, cos, sin, 64)
    got, got_kv = cached_attention(qkv, kv, lengths, cos, sin, block_k=16)
    np.testing.assert_allclose(np.asarray(got_kv), np.asarray(ref_kv), atol=1e-5, rtol=0)
    stale = kv.at[:, 0, :, 16:].set(jnp.nan).at[:, 1].set(jnp.nan)  # blocks past rows 0 and 1's lengths (5, 0)
    ref, _ = _reference(qkv, kv, lengths, cos, sin, 64)
    got_stale, _ = cached_attention(qkv, stale, lengths, cos, sin, block_k=16)
    np.testing.assert_allclose(np.asarray(got_stale[:2]), np.asarray(ref[:2]), atol=1e-5, rtol=0)
    # control: a NaN in a row's live keys does reach its output
    live = cached_attention(qkv, kv.at[:, 0, :, 4].set(jnp.nan), lengths, cos, sin, block_k=16)[0]
    assert np.isnan(np.asarray(live[0])).any()


def test_kernel_in_bfloat16_is_close_to_attend():
    qkv, kv, lengths, cos, sin = _case(1, jnp.bfloat16, seed=1)
    ref, ref_kv = _reference(qkv, kv, lengths, cos, sin, 64)
    got, got_kv = cached_attention(qkv, kv, lengths, cos, sin)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)),
                               atol=3e-2, rtol=0)
    np.testing.assert_allclose(np.asarray(got_kv.astype(jnp.float32)), np.asarray(ref_kv.astype(jnp.float32)),
                               atol=3e-2, rtol=0)


def test_kernel_refuses_shapes_it_cannot_block():
    qkv, kv, lengths, cos, sin = _case(1, jnp.float32)
    with pytest.raises(ValueError, match="multiple of 16, got 40"):
        cached_attention(qkv, kv, lengths, cos, sin, kv_len=40)
    with pytest.raises(ValueError, match="kv_len 128 outside"):
        cached_attention(qkv, kv, lengths, cos, sin, kv_len=128)
    with pytest.raises(ValueError, match=r"RoPE tables must be \[B, T, hd/2\] = \(3, 1, 8\)"):
        cached_attention(qkv, kv, lengths, cos[..., :4], sin[..., :4])


def _kernel_accesses(t: int, g: int) -> tuple[list[str], list[str]]:
    """The q loads and the output store of the kernel's jaxpr for T = t queries and g q heads per
    kv head (the fused projection has g + 2 entries per kv head)."""
    qkv = jnp.zeros((3, t, 2, g + 2, 16))
    kv = jnp.zeros((2, 3, 2, 64, 16))
    cos, sin = rope_tables(jnp.zeros((3, t), jnp.int32), 16, theta=1e4)
    text = str(jax.make_jaxpr(lambda *a: cached_attention(*a))(qkv, kv, jnp.zeros((3,), jnp.int32), cos, sin))
    lines = [ln.strip() for ln in text.splitlines()]
    loads = [ln for ln in lines if re.search(r"<- \w+\[:,:,(:8|8:)\]", ln)]
    stores = [ln for ln in lines if re.search(r", \w+\[\.\.\.\] <- \w+\[\.\.\.\], ", ln)]
    return loads, stores


def test_kernel_masks_blocks_that_overhang_the_arrays():
    """Triton's loads and stores are not bounds-checked and Pallas' interpreter pads, so the tests
    above cannot see an access past an array's end: the kernel's jaxpr must mask the q loads and the
    output store where its power-of-two block overhangs (one query of 3 heads: a 16-row block) and
    need no mask where it fits (4 queries of 4 heads)."""
    loads, stores = _kernel_accesses(1, 3)  # (the kernel appears once per platform branch)
    assert loads and stores and all("mask=" in ln for ln in loads + stores), (loads, stores)
    loads, stores = _kernel_accesses(4, 4)
    assert loads and stores and not any("mask=" in ln for ln in loads + stores), (loads, stores)


def test_head_sizes_the_kernel_cannot_lower_are_refused():
    """On a GPU each half of a head is a Triton matmul's inner size (>= 16); the interpreter takes any
    even size; the runner checks its devices' platform (CPU here: the tests' 16-wide heads pass)."""
    check_head_dim(16, "cpu")
    check_head_dim(64, "gpu")
    with pytest.raises(ValueError, match="on gpu needs head_dim >= 32.*got 16"):
        check_head_dim(16, "gpu")
    with pytest.raises(ValueError, match="even head_dim"):
        check_head_dim(15, "cpu")


def test_kernel_scales_rows_of_the_projection():
    """`row_sum_square_bt` with `row_norm` = (n, eps) multiplies each position's q, k and v by the
    input norm's factor rsqrt(ss / n + eps) before the q/k norms and the cache write, as a projection
    scaled by it would be (`FusedLinear(row_scale=)`); without it (control) both the output and the
    written keys differ."""
    qkv, kv, lengths, cos, sin = _case(3, jnp.float32, seed=4)
    ss = jnp.asarray(np.random.default_rng(4).uniform(1.0, 40.0, (3, 3)), jnp.float32)
    n, eps = 10, 1e-5
    scale = jax.lax.rsqrt(ss / n + eps)
    wq, wk = _weights(True, 1), _weights(True, 2)
    ref, ref_kv = _reference(qkv * scale[:, :, None, None, None], kv, lengths, cos, sin, 64, wq, wk)
    got, got_kv = cached_attention(qkv, kv, lengths, cos, sin, q_norm=wq, k_norm=wk, row_sum_square_bt=ss,
                                   row_norm=(n, eps), block_k=16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got_kv), np.asarray(ref_kv), atol=1e-5, rtol=0)
    plain, plain_kv = cached_attention(qkv, kv, lengths, cos, sin, q_norm=wq, k_norm=wk, block_k=16)
    assert np.abs(np.asarray(plain) - np.asarray(ref)).max() > 1e-3
    assert np.abs(np.asarray(plain_kv) - np.asarray(ref_kv)).max() > 1e-3
    with pytest.raises(ValueError, match=r"row_sum_square_bt must be \[B, T\]"):
        cached_attention(qkv, kv, lengths, cos, sin, row_sum_square_bt=ss[:, :2], row_norm=(n, eps))


@pytest.mark.parametrize("family", ["qwen3 folded", "qwen3", "qwen2"])
def test_forward_with_the_kernel_equals_xla_attention(family):
    """A prefill then two cached steps (one through kv_len): logits and cache of attention='pallas'
    equal attention='xla' for a Qwen3 target with its norm weights folded into the kernels (the input
    norm's row factor applied in the kernel) or not, and a Qwen2 one (q/k/v biases: the factor applied
    before them, outside the kernel); the kernel is in the program (pallas_call), and unknown names
    are refused."""
    from specjax.models.norm_folding import fold_norm_weights
    model = tiny_target(37, seed=3)
    if family == "qwen2":
        cfg = dataclasses.replace(model.config, architecture="Qwen2ForCausalLM", model_type="qwen2", qk_norm=False,
                                  attention_bias=True)
        model = CausalLM(cfg, rngs=nnx.Rngs(3))
    graph, state = nnx.split(model)
    rng = np.random.default_rng(3)  # random norm weights and biases: their placement matters
    state = jax.tree.map_with_path(lambda path, x: jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype)
                                   if x.ndim == 1 or "bias" in jax.tree_util.keystr(path) else x, state)
    model = nnx.merge(graph, state)
    if family.endswith("folded"):
        fold_norm_weights(model)
    graph, state = nnx.split(model)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 37, (2, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))

    def run(attention: str, st, cache, tok, pos, kv_len):
        return nnx.merge(graph, st).forward(tok, pos, cache, kv_len=kv_len, attention=attention)
    prefill = run("xla", state, model.init_cache(2, 32), tokens[:, :8], positions[:, :8], None)
    for sl, kv_len in ((slice(8, 10), None), (slice(8, 11), 16)):
        outs = {a: jax.jit(lambda st, c, t, p, a=a: run(a, st, c, t, p, kv_len))(state, prefill.cache, tokens[:, sl],
                                                                                positions[:, sl])
                for a in ("xla", "pallas")}
        np.testing.assert_allclose(np.asarray(outs["pallas"].logits), np.asarray(outs["xla"].logits), atol=1e-5, rtol=0)
        for a, b in zip(jax.tree.leaves(outs["pallas"].cache), jax.tree.leaves(outs["xla"].cache)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    jaxpr = str(jax.make_jaxpr(lambda st, c: run("pallas", st, c, tokens[:, 8:9], positions[:, 8:9], None))(
        state, prefill.cache))
    assert "pallas_call" in jaxpr and "pallas_call" not in str(jax.make_jaxpr(
        lambda st, c: run("xla", st, c, tokens[:, 8:9], positions[:, 8:9], None))(state, prefill.cache))
    with pytest.raises(ValueError, match="attention must be one of"):
        model.forward(tokens[:, :2], positions[:, :2], prefill.cache, attention="flash")


def test_engine_with_the_kernel_decodes_as_with_xla_attention():
    """Greedy outputs of plain decoding and of a drafter whose drafts were verified are the same with
    EngineConfig(attention='pallas'); a bad name is refused at construction."""
    model = tiny_target(16, seed=5, init_scale=2.0)
    plain, _, _ = greedy_outputs(model)
    assert greedy_outputs(model, attention="pallas")[0] == plain
    spec, drafted, _ = greedy_outputs(model, BigramDrafter(16, 3), attention="pallas")
    assert spec == plain and drafted > 0
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention="flash")
    with pytest.raises(ValueError, match=r"blocks of 16 rows: attention buckets \[100\] \(max_len 100\)"):
        EngineConfig(max_len=100, attention="pallas")  # the default bucket, 100, is not a multiple of 16
    EngineConfig(max_len=100, attention="pallas", attention_buckets=(64, 96))  # chosen buckets that block


@pytest.mark.parametrize("kv_len,block_k", [(64, 16), (32, 32)])
def test_context_block_kernel_equals_the_drafters_attention(kv_len, block_k):
    """A block drafter's attention (queries over the row's context rows and the whole block) in the
    kernel equals `attend_context_and_block` with a whole-block mask, over several key blocks or one;
    it reads only the blocks holding live rows (NaN past them changes nothing). Controls: a length
    one further on, or NaN in a live row, change the output."""
    from specjax.drafters.common import attend_context_and_block
    from specjax.models.pallas_attention import context_block_attention
    rng = np.random.default_rng(11)
    b, t, nkv, g, hd, max_len = 3, 5, 2, 3, 16, 64
    q = jnp.asarray(rng.normal(size=(b, t, nkv * g, hd)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(2, b, nkv, max_len, hd)), jnp.float32)
    k_blk, v_blk = (jnp.asarray(rng.normal(size=(b, t, nkv, hd)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([5, 0, kv_len], jnp.int32)  # a short row, an empty one, one filling its bucket

    def reference(kv, lengths):
        mask = jnp.broadcast_to(jnp.arange(kv_len)[None, None, :] < lengths[:, None, None], (b, t, kv_len))
        return attend_context_and_block(q, kv[0, :, :, :kv_len], kv[1, :, :, :kv_len], mask, k_blk, v_blk,
                                        jnp.ones((b, t, t), bool))

    def kernel(kv, lengths):
        return jax.jit(lambda kv, n: context_block_attention(q, kv, n, k_blk, v_blk, kv_len=kv_len,
                                                             block_k=block_k))(kv, lengths)
    want = reference(kv, lengths)
    got = kernel(kv, lengths)
    assert got.shape == want.shape == (b, t, nkv * g, hd)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    stale = kv.at[:, 0, :, block_k:].set(jnp.nan).at[:, 1].set(jnp.nan)  # blocks past rows 0 and 1's lengths
    np.testing.assert_allclose(np.asarray(kernel(stale, lengths)[:2]), np.asarray(want[:2]), atol=1e-5, rtol=0)
    assert np.abs(np.asarray(kernel(kv, jnp.minimum(lengths + 1, kv_len))[:2]) - np.asarray(want[:2])).max() > 1e-3
    assert np.isnan(np.asarray(kernel(kv.at[:, 0, :, 4].set(jnp.nan), lengths)[0])).any()
    with pytest.raises(ValueError, match=r"block keys and values must be \[B, T, nkv, hd\]"):
        context_block_attention(q, kv, lengths, k_blk[:, :2], v_blk[:, :2])


def test_block_drafter_with_the_kernel_proposes_and_decodes_as_with_xla():
    """A DSpark drafter's block with attention='pallas' (its context attention in the kernel) equals
    XLA's within rounding (same tokens, q within 1e-5); through the engine (fixed verification) its
    greedy output equals plain decoding's with drafts verified, and its programs hold the kernel (the
    engine passed the drafter its attention), where the drafter's default block does not (control)."""
    model, drafter, blocks, propose = block_drafter_blocks(attention=None, kv_len=16)
    np.testing.assert_array_equal(blocks["pallas"].tokens, blocks["xla"].tokens)
    np.testing.assert_allclose(blocks["pallas"].q, blocks["xla"].q, atol=1e-5, rtol=0)
    plain, _, _ = greedy_outputs(model)
    spec, drafted, eng = greedy_outputs(model, drafter, attention="pallas")
    assert spec == plain and drafted > 0
    assert "specjax_context_block_attention" in compiled_text(eng)
    xla_block = jax.make_jaxpr(lambda: propose(kv_len=16))()
    assert "specjax_context_block_attention" not in str(xla_block)  # control: XLA's ops by default
