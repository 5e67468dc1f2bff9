"""Llama and Qwen2 targets against transformers on tiny random checkpoints (torch only in tests):
logits parity (Llama with llama3 RoPE scaling past its original context), export -> transformers
-> load round trips, greedy speculative decoding with a DSpark drafter equal to plain decoding,
drafter checkpoints on these families, and named errors for what is not supported."""
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
    from tests.hf_fixtures import hf_forward, load_hf_model, padded_batch, make_tiny_lm
except ImportError:  # tests/ itself on sys.path
    from hf_fixtures import hf_forward, load_hf_model, padded_batch, make_tiny_lm

from specjax import checkpoints
from specjax.config import ConfigError, TargetConfig
from specjax.decoding.engine import EngineRequest
from specjax.drafters import registry
from specjax.drafters.dspark import BlockDrafterConfig
from specjax.drafters.dspark import make_block_drafter
from specjax.drafters.eagle3 import Eagle3Config, make_eagle3_drafter
from specjax.drafters.mtp import MTPConfig, make_mtp_drafter
from specjax.drafters.standalone import StandaloneDrafter

from engine_fixtures import small_engine

VOCAB = 97
ORIGINAL_CONTEXT = 16  # llama3 scaling's original_max_position_embeddings; prompts run past it
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL_CONTEXT}
FAMILIES = {
    # SmolLM2-like: tied embeddings, GQA 3, llama3 RoPE scaling
    "llama": dict(tie=True, heads=6, kv_heads=2, head_dim=8, hidden=48, rope_scaling=LLAMA3,
                  seed=21),
    # untied, q/k/v biases, head_dim (16) != hidden / heads (8)
    "qwen2": dict(tie=False, heads=4, kv_heads=2, head_dim=16, hidden=32, rope_theta=1e6,
                  seed=22),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {fam: make_tiny_lm(root, fam, vocab=VOCAB, **kw) for fam, kw in FAMILIES.items()}


@pytest.fixture(scope="module")
def targets(ckpts):
    return {fam: checkpoints.load_target(path) for fam, path in ckpts.items()}


def _jit_forward(model):
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames=("tap_layers",))
    def fwd(state, tokens, positions, valid=None, tap_layers=()):
        return nnx.merge(graphdef, state).forward(tokens, positions, None, valid,
                                                  tap_layers=tap_layers)

    return functools.partial(fwd, state)


def _batch(seed: int, lengths=(40, 9, 27)):
    return padded_batch(seed, lengths, VOCAB)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_taps_match_transformers(ckpts, targets, family):
    model, cfg = targets[family]
    assert (cfg.model_type, cfg.architecture) == (family, ARCHITECTURES[family])
    assert cfg.qk_norm is False and cfg.attention_bias == (family == "qwen2")
    attn = model.model.layers[0].self_attn
    assert attn.q_norm is None and (attn.qkv_proj.bias is not None) == (family == "qwen2")
    tokens, positions, valid = _batch(seed=3)
    taps = (-1, 0)
    out = _jit_forward(model)(jnp.asarray(tokens), jnp.asarray(positions),
                              valid=jnp.asarray(valid), tap_layers=taps)
    ref_logits, ref_hidden = hf_forward(ckpts[family], tokens, valid)
    ok = np.arange(tokens.shape[1])[None, :] < valid[:, None]
    assert np.abs(ref_logits[ok]).max() > 0.5
    np.testing.assert_allclose(np.asarray(out.logits)[ok], ref_logits[ok], atol=1e-4, rtol=0)
    for lid, tap in zip(taps, out.taps):
        np.testing.assert_allclose(np.asarray(tap)[ok], ref_hidden[lid + 1][ok], atol=1e-4,
                                   rtol=0, err_msg=f"tap {lid}")


def test_llama3_scaling_matters_past_the_original_context(ckpts, targets, tmp_path):
    """Negative control: the same weights without the llama3 scaling give other logits, mostly
    at positions past `original_max_position_embeddings`."""
    model, cfg = targets["llama"]
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position_embeddings) == \
        ("llama3", 4.0, ORIGINAL_CONTEXT)
    plain_dir = tmp_path / "unscaled"
    shutil.copytree(ckpts["llama"], plain_dir)
    d = json.loads((plain_dir / "config.json").read_text())
    d.pop("rope_scaling", None)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    (plain_dir / "config.json").write_text(json.dumps(d))
    unscaled, ucfg = checkpoints.load_target(plain_dir)
    assert ucfg.rope_type == "default"
    tokens, positions, _ = _batch(seed=5, lengths=(40,))
    a = np.asarray(_jit_forward(model)(jnp.asarray(tokens), jnp.asarray(positions)).logits)[0]
    b = np.asarray(_jit_forward(unscaled)(jnp.asarray(tokens), jnp.asarray(positions)).logits)[0]
    late = np.abs(a - b)[ORIGINAL_CONTEXT:].max()
    assert late > 1e-2, late


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_round_trip_loads_in_transformers(ckpts, targets, family, tmp_path):
    model, cfg = checkpoints.load_target(ckpts[family], fold_norms=False)  # a bit-exact export
    out_dir = checkpoints.export_target(model, cfg, tmp_path / "export")
    src_names = {n for n, _ in checkpoints.read_safetensors_dir(ckpts[family])}
    assert {n for n, _ in checkpoints.read_safetensors_dir(out_dir)} == src_names
    assert any(n.endswith("q_proj.bias") for n in src_names) == (family == "qwen2")
    exported = load_hf_model(out_dir)
    assert type(exported).__name__ == ARCHITECTURES[family]
    tokens, _, valid = _batch(seed=7)
    ok = np.arange(tokens.shape[1])[None, :] < valid[:, None]
    ref, _ = hf_forward(ckpts[family], tokens, valid)
    got, _ = hf_forward(exported, tokens, valid)
    np.testing.assert_allclose(got[ok], ref[ok], atol=1e-6, rtol=0)
    _, cfg2 = checkpoints.load_target(out_dir)
    assert cfg2 == cfg


def _prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(3, VOCAB, size=n))) for n in (5, 12, 21)]


def _greedy_reference(model, prompts, n):
    """Greedy continuations by full forwards (one fixed shape: causal attention ignores the zero
    padding after the current position)."""
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))
    width = max(map(len, prompts)) + n
    out = []
    for p in prompts:
        seq = list(p) + [0] * (width - len(p))
        for i in range(len(p), len(p) + n):
            seq[i] = int(jnp.argmax(fwd(state, jnp.array([seq]))[0, i - 1]))
        out.append(seq[len(p):len(p) + n])
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_dspark_equals_plain(targets, family, tmp_path):
    """A random DSpark drafter (built from the target's config, saved and reloaded through the
    registry) verified block by block in the engine gives exactly the plain greedy tokens
    (computed by full forwards); positions run past the llama3 original context."""
    model, cfg = targets[family]
    bcfg = BlockDrafterConfig.from_target(cfg, target_layer_ids=(0, 1), mask_token_id=VOCAB - 1,
                                          num_draft_layers=1, block_size=3, markov_rank=4,
                                          confidence_head=True)
    made = make_block_drafter(model, cfg, bcfg, nnx.Rngs(3))
    path = registry.save_drafter(made, tmp_path / "dspark", target_config=cfg)
    drafter = registry.load_drafter(path, target=model)
    assert drafter.config == bcfg
    n, prompts = 24, _prompts()
    spec = small_engine(model, drafter, slots=2, max_len=64, prefill=16, gamma=3,
                        tokens_buckets=(1, 4), variants=("greedy",))
    reqs = [EngineRequest(str(i), p, max_tokens=n, temperature=0.0)
            for i, p in enumerate(prompts)]
    spec.run(reqs, progress=False)  # 3 prompts, 2 slots: a slot is reused; 21 > 16: chunked prefill
    assert [r.output_ids for r in reqs] == _greedy_reference(model, prompts, n)
    assert sum(r.metrics.num_draft_tokens for r in reqs) > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_standalone_drafter_of_the_family_round_trips(targets, family, tmp_path):
    """A standalone draft LM of the target's family saves as a plain CausalLM of that family
    (transformers-loadable) and loads back through the registry."""
    _, cfg = targets[family]
    small = TargetConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, architecture=cfg.architecture, model_type=cfg.model_type,
                         qk_norm=False, attention_bias=cfg.attention_bias)
    d = StandaloneDrafter.from_config(small, 3, rngs=nnx.Rngs(1))
    out = registry.save_drafter(d, tmp_path / "standalone", target_config=cfg)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == [cfg.architecture]
    assert registry.drafter_kind(out) == "standalone"
    back = registry.load_drafter(out, target=cfg)
    assert back.model.config == small and back.gamma == 3
    np.testing.assert_array_equal(np.asarray(back.model.model.layers[0].self_attn.qkv_proj.kernel[...]),
                                  np.asarray(d.model.model.layers[0].self_attn.qkv_proj.kernel[...]))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_eagle3_and_mtp_checkpoints_on_the_family(targets, family, kind, tmp_path):
    """Eagle3 and MTP-1 drafters of a Llama / Qwen2 target save (config.json from the target's)
    and load back equal, their frozen embedding / lm_head taken from the target."""
    model, cfg = targets[family]
    if kind == "eagle3":
        made = make_eagle3_drafter(model, Eagle3Config.from_target(cfg, target_layer_ids=(0, 1),
                                                                   gamma=3), nnx.Rngs(2))
    else:
        made = make_mtp_drafter(model, MTPConfig.from_target(cfg), nnx.Rngs(2))
    path = registry.save_drafter(made, tmp_path / kind, target_config=cfg)
    back = registry.load_drafter(path, target=model)
    assert back.config == made.config
    flat_a = nnx.to_flat_state(nnx.state(made, nnx.Param))
    flat_b = nnx.to_flat_state(nnx.state(back, nnx.Param))
    assert len(flat_a) == len(flat_b) > 0
    for (pa, va), (pb, vb) in zip(flat_a, flat_b):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()))


def _write_config(tmp_path, ckpt, name, **changes):
    dst = tmp_path / name
    shutil.copytree(ckpt, dst)
    d = json.loads((dst / "config.json").read_text())
    d.update(changes)
    (dst / "config.json").write_text(json.dumps(d))
    return dst


@pytest.mark.parametrize("changes, named", [
    (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "'MistralForCausalLM'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "'yarn'"),
    (dict(hidden_act="gelu"), "'gelu'"),
    (dict(mlp_bias=True), "mlp_bias"),
])
def test_unsupported_architecture_or_field_is_named(ckpts, tmp_path, changes, named):
    bad = _write_config(tmp_path, ckpts["llama"], "bad", **changes)
    with pytest.raises(ConfigError) as err:
        checkpoints.load_target(bad)
    msg = str(err.value)
    assert named in msg and "supported" in msg, msg
    if "architectures" in changes:  # the list of what is supported
        for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"):
            assert arch in msg, msg
    assert "config.json" in msg  # names the file


def test_generation_config_eos_ids_join_the_configs(ckpts, tmp_path):
    """generation_config.json's eos ids (what transformers' generate and vLLM stop on) are added to
    config.json's; a bad one is named with its file."""
    src = ckpts["llama"]
    base = checkpoints.read_target_config(src)
    dst = _write_config(tmp_path, src, "gen")
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [*base.eos_token_ids, 7]}))
    assert checkpoints.read_target_config(dst).eos_token_ids == (*base.eos_token_ids, 7)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert checkpoints.load_target(dst)[1].eos_token_ids == (*base.eos_token_ids, 7)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [VOCAB]}))
    with pytest.raises(ConfigError, match="generation_config.json: 'eos_token_id' must be"):
        checkpoints.read_target_config(dst)
