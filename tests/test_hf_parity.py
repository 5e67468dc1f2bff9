"""specjax's Qwen3 target against transformers on tiny random checkpoints (torch only in tests)."""
from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

try:
    from tests.hf_fixtures import (hf_forward, load_hf_model, make_tiny_qwen3, make_tiny_tokenizer,
                                   padded_batch, single_and_sharded)
except ImportError:  # tests/ itself on sys.path
    from hf_fixtures import (hf_forward, load_hf_model, make_tiny_qwen3, make_tiny_tokenizer,
                             padded_batch, single_and_sharded)

from specjax import checkpoints
from specjax.checkpoints import common
from specjax.config import TargetConfig
from specjax.models.layers import Embed, Linear, RMSNorm, split_qkv

VOCAB = 97
CONFIGS = {
    # untied, GQA ratio 1, head_dim == hidden / heads
    "untied_gqa1": dict(tie=False, heads=4, kv_heads=4, head_dim=8, hidden=32, seed=1),
    # tied, GQA ratio 2, head_dim (16) != hidden / heads (8)
    "tied_gqa2_hd16": dict(tie=True, heads=4, kv_heads=2, head_dim=16, hidden=32, seed=2),
    # untied, GQA ratio 4, hidden 48 / 8 heads = 6 != head_dim 8, three layers, theta 1e6
    "untied_gqa4_3layers": dict(tie=False, heads=8, kv_heads=2, head_dim=8, hidden=48, layers=3,
                                rope_theta=1e6, seed=3),
    # tied, GQA ratio 4, linear RoPE scaling
    "tied_linear_rope": dict(tie=True, heads=4, kv_heads=1, head_dim=8, hidden=32,
                             rope_scaling={"rope_type": "linear", "factor": 2.0}, seed=4),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_parity")
    return {name: make_tiny_qwen3(root, vocab=VOCAB, subdir=name, **kw)
            for name, kw in CONFIGS.items()}


def _jit_forward(model):
    """model.forward as one jitted function of (tokens, positions, cache, valid) (eager is slow)."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames=("tap_layers",))
    def fwd(state, tokens, positions, cache=None, valid=None, tap_layers=()):
        return nnx.merge(graphdef, state).forward(tokens, positions, cache, valid,
                                                  tap_layers=tap_layers)

    return functools.partial(fwd, state)


def _batch(seed: int, lengths=(11, 4, 8)):
    return padded_batch(seed, lengths, VOCAB)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_taps_match_transformers(ckpts, name):
    path = ckpts[name]
    model, cfg = checkpoints.load_target(path)
    assert cfg.tie_word_embeddings == CONFIGS[name]["tie"]
    assert (model.lm_head is None) == cfg.tie_word_embeddings
    tokens, positions, valid = _batch(seed=len(name))
    n_layers = cfg.num_hidden_layers
    taps = (-1,) + tuple(range(n_layers - 1))
    out = _jit_forward(model)(jnp.asarray(tokens), jnp.asarray(positions),
                              valid=jnp.asarray(valid), tap_layers=taps)
    ref_logits, ref_hidden = hf_forward(path, tokens, valid)
    assert len(ref_hidden) == n_layers + 1
    ok = np.arange(tokens.shape[1])[None, :] < valid[:, None]  # valid positions only
    logits = np.asarray(out.logits)
    assert np.abs(ref_logits[ok]).max() > 0.5  # logits are not trivially tiny
    np.testing.assert_allclose(logits[ok], ref_logits[ok], atol=1e-4, rtol=0)
    for lid, tap in zip(taps, out.taps):
        np.testing.assert_allclose(np.asarray(tap)[ok], ref_hidden[lid + 1][ok], atol=1e-4, rtol=0,
                                   err_msg=f"tap {lid}")
    np.testing.assert_allclose(np.asarray(out.hidden)[ok], ref_hidden[n_layers][ok], atol=1e-4,
                               rtol=0)


@pytest.mark.parametrize("name", ["untied_gqa4_3layers", "tied_linear_rope"])
def test_incremental_equals_full(ckpts, name):
    """Prefill (per-row prompt lengths) then (a) one 5-token step, (b) single-token steps."""
    model, cfg = checkpoints.load_target(ckpts[name])
    fwd = _jit_forward(model)
    b, t, k = 3, 13, 5
    tokens = np.random.RandomState(7).randint(3, VOCAB, size=(b, t)).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    full = np.asarray(fwd(jnp.asarray(tokens), jnp.asarray(positions)).logits)
    prompt = np.array([5, 3, 8], np.int32)  # different cache lengths per row
    p_max = int(prompt.max())
    cache = model.init_cache(slots=b + 1, max_len=16)  # one extra slot that must stay untouched
    out = fwd(jnp.asarray(tokens[:, :p_max]), jnp.asarray(positions[:, :p_max]), cache,
              jnp.asarray(prompt))
    for r in range(b):
        np.testing.assert_allclose(np.asarray(out.logits)[r, :prompt[r]], full[r, :prompt[r]],
                                   atol=1e-5, rtol=0)
    prefilled = out.cache
    np.testing.assert_array_equal(np.asarray(prefilled.lengths), list(prompt) + [0])

    # (a) one 5-token step, each row continuing from its own length
    rows = np.arange(b)[:, None]
    cols = prompt[:, None] + np.arange(k)[None, :]
    out = fwd(jnp.asarray(tokens[rows, cols]), jnp.asarray(cols.astype(np.int32)), prefilled)
    np.testing.assert_allclose(np.asarray(out.logits), full[rows, cols], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), list(prompt + k) + [0])

    # (b) single-token steps until every row reaches t (finished rows pass valid = 0)
    cache, cur, steps = prefilled, prompt.copy(), 0
    while cur.min() < t:
        live = cur < t
        step_tok = tokens[np.arange(b), np.minimum(cur, t - 1)][:, None]
        out = fwd(jnp.asarray(step_tok), jnp.asarray(cur[:, None]), cache,
                  jnp.asarray(live.astype(np.int32)))
        logits = np.asarray(out.logits)
        for r in np.flatnonzero(live):
            np.testing.assert_allclose(logits[r, 0], full[r, cur[r]], atol=1e-5, rtol=0,
                                       err_msg=f"row {r} position {cur[r]}")
        cache, cur, steps = out.cache, cur + live, steps + 1
        np.testing.assert_array_equal(np.asarray(cache.lengths), list(cur) + [0])
    assert steps == t - prompt.min()
    assert float(jnp.abs(cache.kv[0][:, b]).max()) == 0.0  # the extra slot was never written (keys, values)
    assert float(jnp.abs(cache.kv[-1][:, b]).max()) == 0.0


@pytest.mark.parametrize("name", ["untied_gqa1", "tied_linear_rope"])
def test_export_round_trip_loads_in_transformers(ckpts, name, tmp_path):
    src = ckpts[name]
    model, cfg = checkpoints.load_target(src, fold_norms=False)  # a bit-exact export
    tok_dir = make_tiny_tokenizer(tmp_path / "tok", vocab=VOCAB)
    out_dir = tmp_path / "export"
    checkpoints.export_target(model, cfg, out_dir, tokenizer_dir=tok_dir)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (out_dir / f).exists(), f
    # same tensor names as transformers' own save (no lm_head when tied)
    src_names = {n for n, _ in checkpoints.read_safetensors_dir(src)}
    assert {n for n, _ in checkpoints.read_safetensors_dir(out_dir)} == src_names
    assert ("lm_head.weight" in src_names) == (not cfg.tie_word_embeddings)
    tokens, _, valid = _batch(seed=5)
    ok = np.arange(tokens.shape[1])[None, :] < valid[:, None]
    ref, _ = hf_forward(src, tokens, valid)
    exported = load_hf_model(out_dir)
    assert exported.config.tie_word_embeddings == cfg.tie_word_embeddings
    got, _ = hf_forward(exported, tokens, valid)
    np.testing.assert_allclose(got[ok], ref[ok], atol=1e-6, rtol=0)
    model2, cfg2 = checkpoints.load_target(out_dir)
    assert cfg2 == cfg
    tok = checkpoints.load_tokenizer(out_dir)
    assert tok is not None and tok("w5 w7 w90")["input_ids"][-3:] == [5, 7, 90]
    assert checkpoints.load_tokenizer(src) is None  # no tokenizer files there


def test_bf16_checkpoint_loads(tmp_path):
    path = make_tiny_qwen3(tmp_path, dtype="bfloat16", vocab=VOCAB, seed=9)
    with checkpoints.SafetensorsDir(path) as reader:
        name = "model.layers.0.self_attn.q_proj.weight"
        arr = reader[name]
        assert arr.dtype == jnp.dtype("bfloat16")
        raw = common._read_raw(reader.file_of(name), name)  # header-parsing fallback agrees
        np.testing.assert_array_equal(raw.astype(np.float32), arr.astype(np.float32))
    model, cfg = checkpoints.load_target(path, fold_norms=False)  # kernels as stored
    qkv = model.model.layers[0].self_attn.qkv_proj.kernel[...]
    assert qkv.dtype == jnp.float32
    np.testing.assert_array_equal(split_qkv(np.asarray(qkv))[0], arr.astype(np.float32).T)
    tokens, positions, valid = _batch(seed=3)
    ok = np.arange(tokens.shape[1])[None, :] < valid[:, None]
    ref, _ = hf_forward(path, tokens, valid)  # transformers upcasts the bf16 weights to float32
    got = _jit_forward(model)(jnp.asarray(tokens), jnp.asarray(positions), valid=jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(got.logits)[ok], ref[ok], atol=1e-4, rtol=0)
    model_bf16, _ = checkpoints.load_target(path, dtype="bfloat16")
    assert model_bf16.model.embed_tokens.embedding[...].dtype == jnp.bfloat16


def test_sharded_checkpoint_and_bf16_sharded_export(tmp_path):
    path = make_tiny_qwen3(tmp_path, vocab=VOCAB, max_shard_size="20KB", seed=12)
    assert (path / checkpoints.SAFE_INDEX).exists() and not (path / checkpoints.SAFE_WEIGHTS).exists()
    model, cfg = checkpoints.load_target(path)
    out_dir = tmp_path / "export_bf16"
    checkpoints.export_target(model, cfg, out_dir, dtype="bfloat16", max_shard_bytes=8_000)
    index = json.loads((out_dir / checkpoints.SAFE_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out_dir / s).exists() for s in shards)
    assert json.loads((out_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model2, _ = checkpoints.load_target(out_dir)  # bf16 on disk, float32 params
    k1 = np.asarray(model.model.layers[1].mlp.down_proj.kernel[...])
    k2 = np.asarray(model2.model.layers[1].mlp.down_proj.kernel[...])
    np.testing.assert_array_equal(k2, k1.astype(jnp.bfloat16).astype(np.float32))
    tokens, positions, valid = _batch(seed=8)
    ok = np.arange(tokens.shape[1])[None, :] < valid[:, None]
    ref, _ = hf_forward(out_dir, tokens, valid)
    got = _jit_forward(model2)(jnp.asarray(tokens), jnp.asarray(positions),
                               valid=jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(got.logits)[ok], ref[ok], atol=1e-4, rtol=0)


def test_write_safetensors_shards_and_reads_back(tmp_path):
    rng = np.random.RandomState(0)
    tensors = {f"t{i}": rng.randn(10, 20).astype(np.float32) for i in range(5)}  # 800 B each
    files = checkpoints.write_safetensors(tmp_path, iter(tensors.items()), max_shard_bytes=1700)
    assert files[-1] == checkpoints.SAFE_INDEX and len(files) == 4  # shards of 2, 2, 1 tensors
    back = dict(checkpoints.read_safetensors_dir(tmp_path))
    assert back.keys() == tensors.keys()
    for k in tensors:
        np.testing.assert_array_equal(back[k], tensors[k])
    files = checkpoints.write_safetensors(tmp_path, tensors)  # rewrite as one file: stale shards removed
    assert files == [checkpoints.SAFE_WEIGHTS]
    assert sorted(os.listdir(tmp_path)) == [checkpoints.SAFE_WEIGHTS]


def _config_dicts():
    base = TargetConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)).to_hf_dict()
    old = dict(base, rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    new = {k: v for k, v in base.items() if k not in ("rope_theta", "rope_scaling")}
    new.update(rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
               rope_theta=None, layer_types=["full_attention"] * 2, transformers_version="5.24.0")
    return old, new


def test_config_dialects_load_the_same(ckpts, tmp_path):
    old, new = _config_dicts()
    src = ckpts["tied_gqa2_hd16"]  # weights of the same shapes (hidden 32, heads 4/2, head_dim 16)
    loaded = []
    for tag, d in (("old", old), ("new", new)):
        dst = tmp_path / tag
        dst.mkdir()
        shutil.copyfile(src / "model.safetensors", dst / "model.safetensors")
        (dst / "config.json").write_text(json.dumps(d))
        loaded.append(checkpoints.load_target(dst))
    (m_old, c_old), (m_new, c_new) = loaded
    assert c_old == c_new
    assert (c_old.rope_type, c_old.rope_factor, c_old.rope_theta) == ("linear", 2.0, 1e6)
    tokens, positions, _ = _batch(seed=2)
    l_old = np.asarray(_jit_forward(m_old)(jnp.asarray(tokens), jnp.asarray(positions)).logits)
    l_new = np.asarray(_jit_forward(m_new)(jnp.asarray(tokens), jnp.asarray(positions)).logits)
    np.testing.assert_array_equal(l_old, l_new)
    # transformers agrees on both files
    ref, _ = hf_forward(tmp_path / "new", tokens)
    np.testing.assert_allclose(l_new, ref, atol=1e-4, rtol=0)


class _ToyDrafter(nnx.Module):
    """DeepSpec-like naming: no `model.` prefix, fc, markov head with an embedding-like table."""

    def __init__(self, rngs: nnx.Rngs):
        self.fc = Linear(6, 4, logical_axes=("embed", "embed"), rngs=rngs)
        self.norm = RMSNorm(4)
        self.markov_head = nnx.Module()
        self.markov_head.markov_w1 = Embed(11, 3, rngs=rngs)
        self.markov_head.markov_w2 = Linear(3, 11, logical_axes=(None, "vocab"), rngs=rngs)
        self.proj = Linear(4, 1, logical_axes=("embed", None), rngs=rngs, use_bias=True)


def test_generic_key_map_round_trip_for_drafter_style_names():
    a = _ToyDrafter(nnx.Rngs(0))
    key_map = checkpoints.KeyMap(prefix_map={"proj.": "confidence_head.proj."})
    tensors = checkpoints.module_to_hf_tensors(a, key_map=key_map)
    assert set(tensors) == {"fc.weight", "norm.weight", "markov_head.markov_w1.weight",
                            "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                            "confidence_head.proj.bias"}
    assert tensors["fc.weight"].shape == (4, 6)  # torch Linear layout [out, in]
    assert tensors["markov_head.markov_w1.weight"].shape == (11, 3)  # embedding: no transpose
    assert tensors["markov_head.markov_w2.weight"].shape == (11, 3)
    b = nnx.eval_shape(lambda: _ToyDrafter(nnx.Rngs(1)))
    report = checkpoints.load_params_into(b, dict(tensors, **{"rotary_emb.inv_freq": np.ones(2)}),
                                 key_map=key_map)
    assert report.ignored == ("rotary_emb.inv_freq",)
    flat_a, flat_b = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
    assert len(flat_a) == len(flat_b) == 6
    for (pa, va), (pb, vb) in zip(flat_a, flat_b):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()))
    # rename returning None leaves a param out of the checkpoint
    skip_map = checkpoints.KeyMap(rename=lambda n: None if n.startswith("markov_head.") else n)
    assert "markov_head.markov_w1.weight" not in checkpoints.module_to_hf_tensors(a, key_map=skip_map)
    c = _ToyDrafter(nnx.Rngs(2))
    rep = checkpoints.load_params_into(c, {k: v for k, v in tensors.items() if k.startswith(("fc", "norm"))},
                              key_map=checkpoints.KeyMap(rename=lambda n: n if n.startswith(("fc", "norm"))
                                                else None))
    assert set(rep.skipped) == {"markov_head.markov_w1.embedding", "markov_head.markov_w2.kernel",
                                "proj.kernel", "proj.bias"}
    np.testing.assert_array_equal(np.asarray(c.fc.kernel[...]), np.asarray(a.fc.kernel[...]))
    # part of a larger checkpoint: unexpected tensors are an error unless ignore_unexpected
    only_fc = checkpoints.KeyMap(rename=lambda n: n if n.startswith("fc.") else None)
    with pytest.raises(ValueError, match="unexpected"):
        checkpoints.load_params_into(_ToyDrafter(nnx.Rngs(3)), tensors, key_map=only_fc)
    d = _ToyDrafter(nnx.Rngs(3))
    rep = checkpoints.load_params_into(d, tensors, key_map=only_fc, ignore_unexpected=True)
    assert rep.loaded == ("fc.weight",) and len(rep.ignored) == 5
    np.testing.assert_array_equal(np.asarray(d.fc.kernel[...]), np.asarray(a.fc.kernel[...]))


def test_mesh_placement_uses_logical_axes(ckpts):
    sharding = pytest.importorskip("specjax.sharding")
    mesh = sharding.serve_mesh(data=1, tensor=1)
    model, _ = checkpoints.load_target(ckpts["untied_gqa1"], mesh=mesh, rules="serve")
    var = model.model.layers[0].mlp.gate_up_proj.kernel
    kernel = var[...]
    assert isinstance(kernel.sharding, jax.sharding.NamedSharding)
    assert kernel.sharding.mesh.shape == mesh.shape
    assert kernel.sharding.spec == sharding.partition_spec(
        var.get_metadata()["logical_axes"], kernel.shape, mesh, "serve")
    assert kernel.sharding.spec != jax.sharding.PartitionSpec()  # mlp -> tensor
    ref, _ = checkpoints.load_target(ckpts["untied_gqa1"])
    tokens, positions, _ = _batch(seed=4)
    got = _jit_forward(model)(jnp.asarray(tokens), jnp.asarray(positions)).logits
    want = _jit_forward(ref)(jnp.asarray(tokens), jnp.asarray(positions)).logits
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


def test_sharded_target_on_2x4_mesh_equals_single_device(ckpts):
    """8 emulated CPU devices, a (data 2, tensor 4) mesh: same logits within 1e-5."""
    import jax
    import jax.numpy as jnp
    from specjax import sharding
    single, sharded, mesh = single_and_sharded(ckpts["untied_gqa1"], data=2, tensor=4)
    gate_up = sharded.model.layers[0].mlp.gate_up_proj.kernel[...]
    assert len(gate_up.sharding.device_set) == 8 and gate_up.sharding.spec[2] == "tensor"
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, size=(4, 9)), jnp.int32)
    tokens = jax.device_put(tokens, sharding.named_sharding(mesh, ("batch", "seq"), tokens.shape, "serve"))
    np.testing.assert_allclose(np.asarray(sharded(tokens)), np.asarray(single(tokens)), atol=1e-5, rtol=1e-5)
