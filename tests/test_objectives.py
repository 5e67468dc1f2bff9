"""specjax.training.objectives: every drafter kind's online loss on a tiny random target."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.models.decoder import CausalLM
from specjax.training.config import ModelConfig
from specjax.training.objectives import make_objective, shift_left

TCFG = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    tie_word_embeddings=True, max_position_embeddings=64, rope_theta=1e4)


def _batch(b: int = 2, s: int = 16):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 63, (b, s)).astype(np.int32)
    lm = np.zeros((b, s), np.uint8)
    lm[:, 4:13] = 1
    return {"input_ids": jnp.asarray(ids), "loss_mask": jnp.asarray(lm),
            "valid": jnp.full((b,), 13, jnp.int32)}


def _mc(kind: str, **kw) -> ModelConfig:
    return ModelConfig(kind=kind, target="unused", target_layer_ids=(0, 1, 2), num_draft_layers=1,
                       block_size=3, compute_dtype="float32", draft_hidden_size=16,
                       draft_intermediate_size=32, draft_num_attention_heads=2,
                       draft_num_key_value_heads=1, draft_head_dim=8, **kw)


def test_shift_left():
    x = jnp.arange(10).reshape(2, 5)
    np.testing.assert_array_equal(shift_left(x, 2), [[2, 3, 4, 0, 0], [7, 8, 9, 0, 0]])
    np.testing.assert_array_equal(shift_left(x, 0), x)
    y = jnp.ones((1, 3, 2))
    assert shift_left(y, 1).shape == (1, 3, 2) and float(shift_left(y, 1)[0, 2].sum()) == 0.0


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "standalone"])
def test_loss_finite_and_trains_only_drafter(kind):
    target = CausalLM(TCFG, rngs=nnx.Rngs(1))
    gd, aux = nnx.split(target)
    obj = make_objective(_mc(kind), target, TCFG, target_graphdef=gd, feature_dtype=jnp.float32)
    graph, params, rest = nnx.split(obj.drafter, nnx.Param, ...)

    def f(p):
        loss, metrics = obj.loss_fn(nnx.merge(graph, p, rest), _batch(), jax.random.PRNGKey(0), aux)
        return loss, metrics

    (loss, metrics), grads = jax.value_and_grad(f, has_aux=True)(params)
    assert np.isfinite(float(loss)) and float(loss) > 0
    norms = [float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)]
    assert sum(norms) > 0
    if kind == "eagle3":
        assert "accuracy@3" in metrics and obj.drafter.gamma == 3
    else:
        assert 0.0 <= float(metrics["accept_rate"]) <= 1.0


def test_mtp_targets_are_the_next_next_token():
    """A perfect MTP drafter (its logits = the target's own logits one row ahead) has TV 0."""
    from specjax.training.losses import mtp_loss

    target = CausalLM(TCFG, rngs=nnx.Rngs(2))
    b = _batch()
    out = target.forward(b["input_ids"], jnp.broadcast_to(jnp.arange(16), (2, 16)),
                         valid_b=b["valid"], logits="all")
    t = shift_left(out.logits, 1)
    _, m = mtp_loss(t, t, shift_left(b["input_ids"], 2), shift_left(b["loss_mask"], 2))
    assert float(m["tv"]) == pytest.approx(0.0, abs=1e-6)
    assert float(m["accept_rate"]) == pytest.approx(1.0, abs=1e-6)


def test_model_config_kinds():
    assert _mc("mtp").mask_token_id is None  # only block drafters need a mask token
    with pytest.raises(ConfigError, match="mask_token_id"):
        _mc("dspark")
    with pytest.raises(ConfigError, match="kind"):
        _mc("medusa")
    with pytest.raises(ConfigError, match="ttt_decay"):
        _mc("eagle3", ttt_decay=0.0)
    with pytest.raises(ConfigError, match="num_draft_layers"):
        target = CausalLM(TCFG, rngs=nnx.Rngs(1))
        make_objective(dataclasses_replace(_mc("eagle3"), num_draft_layers=2), target, TCFG,
                       target_graphdef=nnx.split(target)[0])


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)
