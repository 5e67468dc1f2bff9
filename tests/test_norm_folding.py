"""specjax.models.norm_folding: the target's norm weights folded into the QKV and gate/up kernels.

A folded target computes the same logits (float32, 1e-5) on every family, with non-trivial norm
weights; folding without marking the norms (the weight applied twice) is the negative control.
Exports divide the weights back out, a zero weight keeps its norm unfolded (exact), a folded norm
refuses a plain call, and a drafter warm-started from a folded target equals one from the plain
target. `checkpoints.load_target` folds by default."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import checkpoints
from specjax.config import TargetConfig
from specjax.models.decoder import CausalLM
from specjax.models.norm_folding import fold_norm_weights, is_folded, unfolded
from specjax.training.config import ModelConfig
from specjax.training.objectives import make_objective

QWEN3 = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                     max_position_embeddings=64, rope_theta=1e4)
FAMILIES = {
    "qwen3": QWEN3,
    "llama": dataclasses.replace(QWEN3, model_type="llama", architecture="LlamaForCausalLM", qk_norm=False),
    "qwen2": dataclasses.replace(QWEN3, model_type="qwen2", architecture="Qwen2ForCausalLM", qk_norm=False,
                                 attention_bias=True, tie_word_embeddings=False),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)


def _model(cfg: TargetConfig, seed: int = 0) -> CausalLM:
    """A random target whose norm weights are far from one (signs and scales vary)."""
    model = CausalLM(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            w = rng.uniform(0.3, 2.0, cfg.hidden_size) * rng.choice([-1.0, 1.0], cfg.hidden_size)
            norm.weight.set_value(jnp.asarray(w, jnp.float32))
    return model


def _kernels(model: CausalLM) -> list[np.ndarray]:
    return [np.asarray(k[...]) for layer in model.model.layers
            for k in (layer.self_attn.qkv_proj.kernel, layer.mlp.gate_up_proj.kernel)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_folded_target_computes_the_same_logits(family):
    cfg = FAMILIES[family]
    plain, folded = _model(cfg), _model(cfg)
    assert fold_norm_weights(folded) == 2 * cfg.num_hidden_layers and is_folded(folded)
    assert not is_folded(plain)
    want = np.asarray(plain(TOKENS))
    np.testing.assert_allclose(np.asarray(folded(TOKENS)), want, atol=1e-5, rtol=1e-5)
    assert not any(np.allclose(a, b) for a, b in zip(_kernels(plain), _kernels(folded)))
    # negative control: folded kernels with the norms unmarked apply every weight twice
    for layer in folded.model.layers:
        layer.input_layernorm.folded = layer.post_attention_layernorm.folded = False
    assert np.abs(np.asarray(folded(TOKENS)) - want).max() > 1e-2


def test_export_divides_the_weights_back_out_and_a_zero_weight_stays_unfolded(tmp_path):
    cfg = FAMILIES["qwen2"]
    plain, folded = _model(cfg), _model(cfg)
    w = folded.model.layers[1].input_layernorm.weight
    w.set_value(w[...].at[5].set(0.0))
    plain.model.layers[1].input_layernorm.weight.set_value(w[...])
    assert fold_norm_weights(folded) == 2 * cfg.num_hidden_layers - 1
    assert not folded.model.layers[1].input_layernorm.folded
    np.testing.assert_array_equal(np.asarray(folded.model.layers[1].self_attn.qkv_proj.kernel[...]),
                                  np.asarray(plain.model.layers[1].self_attn.qkv_proj.kernel[...]))
    copy = unfolded(folded)
    assert is_folded(folded) and not is_folded(copy) and unfolded(plain) is plain
    for a, b in zip(_kernels(plain), _kernels(copy)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    back, _ = checkpoints.load_target(checkpoints.export_target(folded, cfg, tmp_path / "out"), fold_norms=False)
    for a, b in zip(_kernels(plain), _kernels(back)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(back.model.layers[2].post_attention_layernorm.weight[...]),
                                  np.asarray(plain.model.layers[2].post_attention_layernorm.weight[...]))


def test_load_target_folds_by_default_and_a_folded_norm_refuses_a_plain_call(tmp_path):
    cfg = FAMILIES["llama"]
    plain = _model(cfg)
    path = checkpoints.export_target(plain, cfg, tmp_path / "plain")
    model, _ = checkpoints.load_target(path)
    assert model.model.layers[0].input_layernorm.folded
    assert not checkpoints.load_target(path, fold_norms=False)[0].model.layers[0].input_layernorm.folded
    np.testing.assert_allclose(np.asarray(model(TOKENS)), np.asarray(plain(TOKENS)), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="folded"):
        model.model.layers[0].input_layernorm(jnp.ones((1, cfg.hidden_size)))


def test_warm_start_from_a_folded_target_equals_the_plain_one():
    mc = ModelConfig.from_mapping(dict(kind="dspark", target="unused", target_layer_ids=(0, 1), num_draft_layers=1,
                                       block_size=3, compute_dtype="float32", mask_token_id=63, markov_rank=4,
                                       draft_intermediate_size=48, init_layer_from_target=2))
    drafters = []
    for fold in (False, True):
        target = _model(QWEN3)
        if fold:
            fold_norm_weights(target)
        gd, _ = nnx.split(target)
        drafters.append(make_objective(mc, target, QWEN3, target_graphdef=gd, feature_dtype=jnp.float32).drafter)
    plain, folded = (jax.tree.leaves(nnx.state(d, nnx.Param)) for d in drafters)
    for a, b in zip(plain, folded):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
