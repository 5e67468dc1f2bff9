"""The target's fused kernels, RoPE tables once per forward and attention over cache rows [0:kv_len]
(issue #36): equal to the unfused, per-layer-RoPE computation of the same checkpoint."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

try:
    from tests.hf_fixtures import make_tiny_lm, single_and_sharded
except ImportError:  # tests/ itself on sys.path
    from hf_fixtures import make_tiny_lm, single_and_sharded

from specjax import checkpoints
from specjax.checkpoints import layouts
from specjax.models import cache as kvc
from specjax.models import decoder
from specjax.models.layers import Embed, Linear, RMSNorm, apply_rope, gqa_attention, rope_tables, rotate
from specjax.models.unfused import DecoderLayer

VOCAB = 97
FAMILIES = {  # Qwen3 q/k norms; Llama with llama3 RoPE scaling and GQA 3; Qwen2 q/k/v biases
    "qwen3": dict(heads=4, kv_heads=2, head_dim=16, hidden=32, seed=31),
    "llama": dict(heads=6, kv_heads=2, head_dim=8, hidden=48, seed=32, tie=True,
                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
    "qwen2": dict(heads=4, kv_heads=2, head_dim=16, hidden=32, seed=33, rope_theta=1e6),
}


class UnfusedLM(nnx.Module):
    """Today's computation in the Hugging Face layout: separate q/k/v and gate/up matmuls, RoPE
    from positions inside every layer, `gqa_attention` over [B, S, nkv, hd] keys."""

    def __init__(self, cfg):
        rngs = nnx.Rngs(0)
        self.cfg = cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, logical_axes=("embed", "vocab"), rngs=rngs)

    def __call__(self, tokens_bt, positions_bt):
        x = self.embed_tokens(tokens_bt)
        mask = kvc.causal_mask(tokens_bt.shape[1])
        for layer in self.layers:
            xn = layer.input_layernorm(x)
            q = layer.self_attn.queries(xn, positions_bt)
            k, v = layer.self_attn.keys_values(xn, positions_bt)
            x = x + layer.self_attn.output(gqa_attention(q, k, v, mask))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.norm(x)
        return self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)


UNFUSED_KEYS = checkpoints.KeyMap(prefix_map={"embed_tokens.": "model.embed_tokens.",
                                              "layers.": "model.layers.", "norm.": "model.norm."})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {fam: make_tiny_lm(root, fam, vocab=VOCAB, layers=3, **kw) for fam, kw in FAMILIES.items()}


def _unfused(path, cfg):
    ref = UnfusedLM(cfg)
    checkpoints.load_params_into(ref, path, key_map=UNFUSED_KEYS)
    return ref


def _batch(seed=0, b=2, t=11):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(3, VOCAB, (b, t)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_logits_equal_the_unfused_layers(ckpts, family):
    """Prefill, then two cached steps (one through kv_len): logits of the fused target equal the
    unfused layers' within 1e-5; the target holds one q/k/v and one gate/up kernel per layer."""
    model, cfg = checkpoints.load_target(ckpts[family])
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    assert attn.qkv_proj.kernel[...].shape == (cfg.hidden_size, cfg.num_key_value_heads, g + 2, cfg.head_dim)
    assert mlp.gate_up_proj.kernel[...].shape == (cfg.hidden_size, 2, cfg.intermediate_size)
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")
    tokens, positions = _batch()
    want = np.asarray(_unfused(ckpts[family], cfg)(tokens, positions))
    np.testing.assert_allclose(np.asarray(model(tokens, positions)), want, atol=1e-5, rtol=0)
    out = model.forward(tokens[:, :8], positions[:, :8], model.init_cache(2, 32))
    step = model.forward(tokens[:, 8:10], positions[:, 8:10], out.cache)
    last = model.forward(tokens[:, 10:], positions[:, 10:], step.cache, kv_len=16)
    got = np.concatenate([np.asarray(o.logits) for o in (out, step, last)], axis=1)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_a_loader_that_swaps_k_and_v_fails_the_parity(ckpts, monkeypatch):
    """Negative control: the same comparison catches a fusion that puts v where k belongs."""
    path = ckpts["qwen3"]
    cfg = checkpoints.read_target_config(path)
    join = layouts.Fusion.join

    def swapped(self, parts, shape):
        return join(self, [parts[0], parts[2], parts[1]] if self.kind == "qkv" else parts, shape)

    monkeypatch.setattr(layouts.Fusion, "join", swapped)
    bad, _ = checkpoints.load_target(path)
    tokens, positions = _batch()
    want = np.asarray(_unfused(path, cfg)(tokens, positions))
    assert np.abs(np.asarray(bad(tokens, positions)) - want).max() > 1e-2


def test_export_writes_the_separate_tensors_back(ckpts, tmp_path):
    """Checkpoints are unchanged on disk: export splits the fused kernels into the very tensors
    that were loaded (names, shapes, values), and the copy loads to the same params (unfolded
    norms: a bit-exact copy; a folded target's export is checked in tests/test_norm_folding.py)."""
    src = ckpts["qwen2"]
    model, cfg = checkpoints.load_target(src, fold_norms=False)
    out = checkpoints.export_target(model, cfg, tmp_path / "copy")
    with checkpoints.SafetensorsDir(src) as a, checkpoints.SafetensorsDir(out) as b:
        assert set(b) == set(a)
        for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.bias",
                     "model.layers.2.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
            np.testing.assert_array_equal(b[name], a[name])
    back, _ = checkpoints.load_target(out, fold_norms=False)
    np.testing.assert_array_equal(np.asarray(back.model.layers[1].self_attn.qkv_proj.kernel[...]),
                                  np.asarray(model.model.layers[1].self_attn.qkv_proj.kernel[...]))


def _rope_per_call(x_bthd, positions_bt, **kw):
    """RoPE as computed before the tables: angles, cos/sin and a concatenation at every call."""
    from specjax.models.layers import rope_inv_freq_scaled
    hd = x_bthd.shape[-1]
    angles = positions_bt.astype(jnp.float32)[..., None] * rope_inv_freq_scaled(hd, **kw)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x_bthd[..., : hd // 2], x_bthd[..., hd // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_rope_tables_once_per_forward_equal_per_layer_rope(ckpts, family, monkeypatch):
    """The tables give the per-call rotation exactly; the forward builds them once for all layers,
    and each layer's q/k equal the unfused layer's per-layer RoPE."""
    model, cfg = checkpoints.load_target(ckpts[family], fold_norms=False)  # layers as stored
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 7, 3, cfg.head_dim)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 200, (2, 7)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(apply_rope(x, pos, **cfg.rope_kwargs)),
                                  np.asarray(_rope_per_call(x, pos, **cfg.rope_kwargs)))
    cos, sin = rope_tables(pos, cfg.head_dim, **cfg.rope_kwargs)
    np.testing.assert_array_equal(np.asarray(rotate(x, cos[:, :, None], sin[:, :, None])),
                                  np.asarray(_rope_per_call(x, pos, **cfg.rope_kwargs)))
    calls = []
    monkeypatch.setattr(decoder, "rope_tables", lambda *a, **k: calls.append(1) or rope_tables(*a, **k))
    tokens, _ = _batch(t=7)
    model.forward(tokens, pos)
    assert len(calls) == 1 and cfg.num_hidden_layers == 3
    ref = _unfused(ckpts[family], cfg)
    xn = jnp.asarray(rng.standard_normal((2, 7, cfg.hidden_size)), jnp.float32)
    q, k, v = model.model.layers[1].self_attn.project(xn, cos[:, :, None, None], sin[:, :, None, None])
    want_k, want_v = ref.layers[1].self_attn.keys_values(xn, pos)
    want_q = ref.layers[1].self_attn.queries(xn, pos)
    np.testing.assert_allclose(np.asarray(q).reshape(want_q.shape), np.asarray(want_q), atol=1e-5)
    np.testing.assert_allclose(np.asarray(k), np.asarray(want_k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(v), np.asarray(want_v), atol=1e-5)


def test_kv_len_forward_equals_the_full_forward(ckpts):
    """Reading cache rows [0:kv_len] gives the full forward's logits and cache (rows of
    different lengths, T > 1, slot ids); kv_len past max_len or without a cache is refused."""
    model, _ = checkpoints.load_target(ckpts["llama"])
    fwd = jax.jit(model.forward, static_argnames=("kv_len",))
    tokens, positions = _batch(seed=2, b=3, t=12)
    cache = model.init_cache(4, 64)
    cache = fwd(tokens[:, :6], positions[:, :6], cache, jnp.asarray([6, 3, 5], jnp.int32)).cache
    lengths = cache.lengths[:3]
    pos = lengths[:, None] + jnp.arange(4, dtype=jnp.int32)[None]
    rows = jnp.asarray([2, 0, 1], jnp.int32)
    full = fwd(tokens[:, 6:10], pos, cache, rows_b=jnp.asarray([0, 1, 2], jnp.int32))
    short = fwd(tokens[:, 6:10], pos, cache, rows_b=jnp.asarray([0, 1, 2], jnp.int32), kv_len=10)
    np.testing.assert_allclose(np.asarray(short.logits), np.asarray(full.logits), atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(short.cache), jax.tree.leaves(full.cache)):  # writes: whole cache
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    moved = fwd(tokens[:, 6:10], pos, cache, rows_b=rows, kv_len=16)  # other slots: other contexts
    assert not np.allclose(np.asarray(moved.logits), np.asarray(full.logits))
    with pytest.raises(ValueError, match="kv_len"):
        model.forward(tokens[:, :2], positions[:, :2], cache, kv_len=65)
    with pytest.raises(ValueError, match="kv_len"):
        model.forward(tokens[:, :2], positions[:, :2], kv_len=8)


def test_fused_kernels_shard_over_kv_heads_and_mlp(ckpts):
    """On a tensor mesh of 2 the q/k/v kernel splits by kv group (each device keeps its groups'
    q, k and v) and gate/up by mlp channel; logits equal one device's."""
    single, sharded, _ = single_and_sharded(ckpts["qwen3"], data=1, tensor=2)
    qkv = sharded.model.layers[0].self_attn.qkv_proj.kernel[...]
    gate_up = sharded.model.layers[0].mlp.gate_up_proj.kernel[...]
    assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None, None)
    assert gate_up.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    shard0 = np.asarray(qkv.addressable_shards[0].data)
    whole = np.asarray(single.model.layers[0].self_attn.qkv_proj.kernel[...])
    np.testing.assert_array_equal(shard0, whole[:, :1])  # kv group 0: its q heads, key and value
    tokens, positions = _batch(seed=4)
    np.testing.assert_allclose(np.asarray(sharded(tokens, positions)), np.asarray(single(tokens, positions)),
                               atol=1e-5, rtol=0)


def test_random_init_draws_as_the_unfused_layers():
    """A randomly initialised target holds the fused form of what separate q/k/v and gate/up
    Linears would have drawn (tests and benchmarks keep their random models)."""
    from specjax.config import TargetConfig
    from specjax.models.layers import split_gate_up, split_qkv
    cfg = TargetConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    fused = decoder.CausalLM(cfg, rngs=nnx.Rngs(3))
    rngs = nnx.Rngs(3)
    Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
    ref = DecoderLayer(dataclasses.replace(cfg), rngs=rngs)
    layer = fused.model.layers[0]
    for got, lin in zip(split_qkv(np.asarray(layer.self_attn.qkv_proj.kernel[...])),
                        (ref.self_attn.q_proj, ref.self_attn.k_proj, ref.self_attn.v_proj)):
        np.testing.assert_array_equal(got, np.asarray(lin.kernel[...]))
    for got, lin in zip(split_gate_up(np.asarray(layer.mlp.gate_up_proj.kernel[...])),
                        (ref.mlp.gate_proj, ref.mlp.up_proj)):
        np.testing.assert_array_equal(got, np.asarray(lin.kernel[...]))
