"""The Pallas decode-attention kernel (issue #36: one attention kernel per layer), run in Pallas'
interpreter on CPU: equal to `layers.attend` over the cache, in a forward and in the engine."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

try:
    from tests.engine_fixtures import BigramDrafter, tiny_target
except ImportError:  # tests/ itself on sys.path
    from engine_fixtures import BigramDrafter, tiny_target

from specjax.decoding.engine import Engine, EngineConfig
from specjax.decoding.requests import EngineRequest
from specjax.models import cache as kvc
from specjax.models.layers import attend
from specjax.models.pallas_attention import cached_attention


def _case(t: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    slots, nkv, g, hd, max_len = 3, 2, 3, 16, 64
    kv = jnp.asarray(rng.normal(size=(2, slots, nkv, max_len, hd)), dtype)
    q = jnp.asarray(rng.normal(size=(slots, t, nkv, g, hd)), dtype)
    lengths = jnp.asarray([5, 0, 64 - t], jnp.int32)  # a short row, an empty one, one filling the cache
    return q, kv, lengths


@pytest.mark.parametrize("t,kv_len,block_k", [(1, 64, 16), (4, 64, 64), (4, 32, 16)])
def test_kernel_equals_attend_over_the_cache(t, kv_len, block_k):
    """Several key blocks (a running softmax) or one; one query per row (decoding) or four (verify)."""
    q, kv, lengths = _case(t, jnp.float32)
    if kv_len < 64:
        lengths = jnp.minimum(lengths, kv_len - t)
    limits = kvc.write_indices(lengths, t)
    k, v = kvc.read_kv(kv, 3, kv_len=kv_len)
    ref = attend(q, k, v, kvc.cached_mask(lengths, t, kv_len))
    got = jax.jit(lambda q, kv, lim: cached_attention(q, kv, lim, kv_len, block_k=block_k))(q, kv, limits)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=0)
    # negative control: one more key visible to every query changes the output
    wider = jax.jit(lambda q, kv, lim: cached_attention(q, kv, lim, kv_len, block_k=block_k))(q, kv, limits + 1)
    assert np.abs(np.asarray(wider) - np.asarray(ref)).max() > 1e-3


def test_kernel_in_bfloat16_is_close_to_attend():
    q, kv, lengths = _case(1, jnp.bfloat16, seed=1)
    k, v = kvc.read_kv(kv, 3)
    ref = attend(q, k, v, kvc.cached_mask(lengths, 1, 64)).astype(jnp.float32)
    got = cached_attention(q, kv, kvc.write_indices(lengths, 1)).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-2, rtol=0)


def test_kernel_refuses_attention_lengths_it_cannot_block():
    q, kv, lengths = _case(1, jnp.float32)
    limits = kvc.write_indices(lengths, 1)
    with pytest.raises(ValueError, match="multiple of 16, got 40"):
        cached_attention(q, kv, limits, 40)
    with pytest.raises(ValueError, match="kv_len 128 outside"):
        cached_attention(q, kv, limits, 128)


def test_forward_with_the_kernel_equals_xla_attention():
    """A prefill then two cached steps (one through kv_len): logits and cache of attention='pallas'
    equal attention='xla'; the kernel is in the program (pallas_call), and unknown names are refused."""
    model = tiny_target(37, seed=3)
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
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
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
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [7, 8, 9, 7, 8, 9, 7]]

    def outputs(attention: str, drafter=None):
        cfg = EngineConfig(max_slots=2, max_len=32, policy="fixed" if drafter else "plain", slots_buckets=(2,),
                           prefill_buckets=(8,), max_prefill=8, prefill_batch_buckets=(2,),
                           sampling_variants=("greedy",), attention=attention)
        eng = Engine(model, drafter, cfg, progress=False)
        eng.warmup()
        reqs = [EngineRequest(str(i), p, max_tokens=8, temperature=0.0) for i, p in enumerate(prompts)]
        eng.run(reqs, progress=False)
        return [r.output_ids for r in reqs], sum(r.metrics.num_draft_tokens for r in reqs)
    plain, _ = outputs("xla")
    assert outputs("pallas")[0] == plain
    spec, drafted = outputs("pallas", BigramDrafter(16, 3))
    assert spec == plain and drafted > 0
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention="flash")
    with pytest.raises(ValueError, match=r"blocks of 16 rows: attention buckets \[100\] \(max_len 100\)"):
        EngineConfig(max_len=100, attention="pallas")  # the default bucket, 100, is not a multiple of 16
    EngineConfig(max_len=100, attention="pallas", attention_buckets=(64, 96))  # chosen buckets that block
