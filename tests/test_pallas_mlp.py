"""The Pallas gated-MLP kernel (issue #36: the gate/up products and the SiLU gate in one kernel, no
[M, 2F] product in memory), run in Pallas' interpreter on CPU: equal to XLA's ops, in a forward,
in a drafter's block and through the engine."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

try:
    from tests.engine_fixtures import block_drafter_blocks, compiled_text, greedy_outputs, tiny_target
except ImportError:  # tests/ itself on sys.path
    from engine_fixtures import block_drafter_blocks, compiled_text, greedy_outputs, tiny_target

from specjax.decoding.engine import EngineConfig
from specjax.decoding.runner import bucket_key
from specjax.models.layers import fuse_gate_up
from specjax.models.pallas_mlp import check_sizes, gated_projection

KERNEL = "specjax_gated_projection"


def _case(m: int, h: int, f: int, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (m, h))
    gate, up = (jax.random.normal(kk, (h, f)) / h ** 0.5 for kk in k[1:3])
    return x, gate, up, jax.random.uniform(k[3], (m,), minval=0.5, maxval=2.0)


def _reference(x, gate, up, s):
    return jax.nn.silu((x @ gate) * s[:, None]) * ((x @ up) * s[:, None])


@pytest.mark.parametrize("m,h,f,blocks", [(1, 32, 48, {}), (20, 96, 64, dict(block_m=16, block_n=32, block_k=32)),
                                          (70, 64, 256, dict(block_n=64, block_k=16))])
def test_kernel_equals_the_xla_ops(m, h, f, blocks):
    """Rows fewer than a block, a last row block overhanging x, several column and key blocks: the
    fused [H, 2, F] and the separate (gate, up) layouts equal silu(s * x @ gate) * (s * x @ up); without
    the row factor the result differs (control: the factor is applied)."""
    x, gate, up, s = _case(m, h, f)
    want = np.asarray(_reference(x, gate, up, s))
    fused = jax.jit(lambda x, w, s: gated_projection(x, w, s, **blocks))(x, fuse_gate_up(gate, up), s)
    pair = gated_projection(x, (gate, up), s, **blocks)
    np.testing.assert_allclose(np.asarray(fused), want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(pair), want, atol=2e-5, rtol=1e-5)
    unscaled = np.asarray(gated_projection(x, (gate, up), None, **blocks))
    np.testing.assert_allclose(unscaled, np.asarray(_reference(x, gate, up, jnp.ones_like(s))), atol=2e-5, rtol=1e-5)
    assert not np.allclose(unscaled, want, atol=1e-3)


def test_kernel_refuses_what_it_cannot_block():
    x, gate, up, s = _case(4, 32, 48)
    with pytest.raises(ValueError, match="the hidden size to be a multiple of 16, got 40"):
        check_sizes(40, 48)
    with pytest.raises(ValueError, match="the MLP size to be a multiple of 16, got 24"):
        gated_projection(x, (gate[:, :24], up[:, :24]))
    with pytest.raises(ValueError, match=r"gate_up must be \[H, 2, F\].*H = 32"):
        gated_projection(x, fuse_gate_up(gate, up)[:16])
    with pytest.raises(ValueError, match=r"row_scale_m must be \[M\] = \(4,\)"):
        gated_projection(x, (gate, up), s[:3])


def test_forward_with_the_kernel_equals_xla():
    """A prefill then a cached step: logits and cache with mlp='pallas' equal mlp='xla' (norm
    weights folded, so the post-attention norm's row factor goes into the kernel); the kernel is in
    the program only when asked for, and unknown names are refused."""
    from specjax.models.norm_folding import fold_norm_weights
    model = tiny_target(37, seed=3)
    graph, state = nnx.split(model)
    rng = np.random.default_rng(3)  # random norm weights: their folding matters
    model = nnx.merge(graph, jax.tree.map(lambda x: jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype)
                                          if x.ndim == 1 else x, state))
    fold_norm_weights(model)
    graph, state = nnx.split(model)
    tokens = jnp.asarray(rng.integers(0, 37, (2, 10)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (2, 10))

    def run(mlp: str, st, cache, sl):
        return nnx.merge(graph, st).forward(tokens[:, sl], positions[:, sl], cache, mlp=mlp)
    outs = {m: jax.jit(lambda st, c, m=m: run(m, st, c, slice(0, 8)))(state, model.init_cache(2, 32))
            for m in ("xla", "pallas")}
    np.testing.assert_allclose(np.asarray(outs["pallas"].logits), np.asarray(outs["xla"].logits), atol=1e-5, rtol=0)
    step = {m: run(m, state, outs["xla"].cache, slice(8, 10)) for m in ("xla", "pallas")}
    np.testing.assert_allclose(np.asarray(step["pallas"].logits), np.asarray(step["xla"].logits), atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(step["pallas"].cache), jax.tree.leaves(step["xla"].cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    text = {m: str(jax.make_jaxpr(lambda st, m=m: run(m, st, None, slice(0, 8)))(state))  # cache-free too
            for m in ("xla", "pallas")}
    assert KERNEL in text["pallas"] and KERNEL not in text["xla"]
    with pytest.raises(ValueError, match="mlp must be one of"):
        model.forward(tokens, positions, mlp="triton")


def test_engine_and_block_drafter_with_the_kernel_decode_as_with_xla():
    """A DSpark drafter's block with mlp='pallas' equals XLA's (same tokens, q within 1e-5); through
    the engine with EngineConfig(mlp='pallas') (fixed verification: the target's kernel in prefill
    and rounds, the drafter's in its block) the greedy outputs are plain decoding's with XLA's ops,
    drafts verified; the engine's programs hold the kernel (the drafter's own draft program too:
    the engine passed it its mlp), the default engine's none (control). A bad name is refused at
    construction."""
    model, drafter, blocks, _ = block_drafter_blocks(mlp=None)
    np.testing.assert_array_equal(blocks["pallas"].tokens, blocks["xla"].tokens)
    np.testing.assert_allclose(blocks["pallas"].q, blocks["xla"].q, atol=1e-5, rtol=0)
    plain, _, default = greedy_outputs(model)
    assert KERNEL not in compiled_text(default)
    spec, drafted, eng = greedy_outputs(model, drafter, mlp="pallas")
    assert spec == plain and drafted > 0
    assert KERNEL in compiled_text(eng)
    draft = eng.runner.lower("draft", bucket_key("draft", rows=2, attn=eng.buckets.attention[-1], variant="greedy"))
    assert KERNEL in draft.compile().as_text()  # the drafter's own program: the engine passed it its mlp
    with pytest.raises(ValueError, match="mlp must be one of"):
        EngineConfig(mlp="triton")
