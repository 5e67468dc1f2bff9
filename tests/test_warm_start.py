"""specjax.drafters.warm_start: a block drafter's layer started from a target layer."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.drafters.warm_start import head_rms, mlp_channels
from specjax.models.decoder import CausalLM
from specjax.models.layers import rope_tables, split_gate_up, split_qkv
from specjax.training.config import ModelConfig
from specjax.training.features import target_features
from specjax.training.objectives import make_objective

TCFG = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    tie_word_embeddings=True, max_position_embeddings=64, rope_theta=1e4)
LLAMA = dataclasses.replace(TCFG, model_type="llama", architecture="LlamaForCausalLM",
                            qk_norm=False)


def _mc(**kw) -> ModelConfig:
    base = dict(kind="dspark", target="unused", target_layer_ids=(0, 1, 2), num_draft_layers=1,
                block_size=3, compute_dtype="float32", mask_token_id=63, markov_rank=4,
                draft_intermediate_size=64)
    base.update(kw)
    return ModelConfig.from_mapping(base)


def _drafter(tcfg, **kw):
    target = CausalLM(tcfg, rngs=nnx.Rngs(1))
    gd, aux = nnx.split(target)
    obj = make_objective(_mc(**kw), target, tcfg, target_graphdef=gd, feature_dtype=jnp.float32)
    return target, gd, aux, obj.drafter


def test_context_keys_values_start_as_the_target_layers():
    """With init_layer_from_target: 3 and tap 2 (the input of layer 3), the drafter's context
    keys/values over the taps are target layer 3's keys/values at the start; a random start
    (the control) gives others."""
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 63, (2, 10)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (2, 10))
    for init, same in ((3, True), (None, False)):
        target, gd, aux, drafter = _drafter(TCFG, init_layer_from_target=init)
        taps, _ = target_features(aux, gd, ids, None, tap_layers=(0, 1, 2), dtype=jnp.float32)
        t_layer = target.model.layers[3]
        h_in = taps[..., 2 * TCFG.hidden_size:]
        cos, sin = rope_tables(pos, TCFG.head_dim, **TCFG.rope_kwargs)
        _, want_k, want_v = t_layer.self_attn.project(t_layer.input_layernorm(h_in), cos[:, :, None, None],
                                                      sin[:, :, None, None])
        got_k, got_v = drafter.layers[0].context_kv(drafter.context_features(taps), pos)
        assert np.allclose(got_k, want_k, atol=1e-5) == same
        assert np.allclose(got_v, want_v, atol=1e-5) == same
        if same:
            np.testing.assert_array_equal(np.asarray(drafter.layers[0].mlp.down_proj.kernel[...]),
                                          np.asarray(t_layer.mlp.down_proj.kernel[...]))


def test_narrow_mlp_keeps_the_largest_channels_and_llama_gets_qk_norm_scales():
    target, _, _, drafter = _drafter(LLAMA, init_layer_from_target=3, draft_intermediate_size=16)
    src = target.model.layers[3]
    gate, up = split_gate_up(np.asarray(src.mlp.gate_up_proj.kernel[...]))
    down = np.asarray(src.mlp.down_proj.kernel[...])
    keep = mlp_channels(gate, up, down, 16)
    score = np.linalg.norm(gate, axis=0) * np.linalg.norm(up, axis=0) * np.linalg.norm(down, axis=1)
    assert len(keep) == 16 and score[keep].min() >= np.delete(score, keep).max()
    np.testing.assert_array_equal(np.asarray(drafter.layers[0].mlp.up_proj.kernel[...]), up[:, keep])
    q_w = np.asarray(drafter.layers[0].self_attn.q_norm.weight[...])
    want = head_rms(np.asarray(src.input_layernorm.weight[...]),
                    split_qkv(np.asarray(src.self_attn.qkv_proj.kernel[...]))[0], LLAMA.head_dim)
    np.testing.assert_allclose(q_w, want, rtol=1e-6)
    assert not np.allclose(q_w, 1.0)
    # head_rms against a Monte-Carlo estimate over isotropic inputs
    rng = np.random.default_rng(0)
    w_ln, kern = rng.uniform(0.5, 2, 8), rng.normal(size=(8, 6))
    q = (rng.normal(size=(200_000, 8)) * w_ln) @ kern
    np.testing.assert_allclose(head_rms(w_ln, kern, 3),
                               np.sqrt((q.reshape(-1, 2, 3) ** 2).mean(axis=(0, 1))), rtol=0.02)


def test_bad_warm_start_fields_are_refused_by_name():
    with pytest.raises(ConfigError, match="init_layer_from_target.*tap layer 1"):
        _drafter(TCFG, init_layer_from_target=2, target_layer_ids=(0, 2))
    with pytest.raises(ConfigError, match=r"init_layer_from_target' must be in \[1, 3\]"):
        _drafter(TCFG, init_layer_from_target=4, target_layer_ids=(0, 3))
    with pytest.raises(ConfigError, match="draft_intermediate_size"):
        _drafter(TCFG, init_layer_from_target=3, draft_intermediate_size=128)
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['init_layer_from_target'\].*eagle3"):
        ModelConfig.from_mapping(dict(kind="eagle3", target="unused", init_layer_from_target=3))
    with pytest.raises(ConfigError, match="init_layer_from_target"):
        _mc(init_layer_from_target=True)
