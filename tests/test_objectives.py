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
from specjax.drafters.common import shift_left
from specjax.training.objectives import make_objective

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


_TAPPED = dict(target_layer_ids=(0, 1, 2), num_draft_layers=1, block_size=3)
_SECTIONS = {"dspark": _TAPPED, "dflash": _TAPPED, "eagle3": _TAPPED, "mtp": {},
             "standalone": dict(num_draft_layers=1, block_size=3, draft_hidden_size=16,
                                draft_num_attention_heads=2, draft_num_key_value_heads=1,
                                draft_head_dim=8)}


def _mc(kind: str, **kw) -> ModelConfig:
    """A `model:` section of `kind` (its own fields, flat, as in YAML)."""
    return ModelConfig.from_mapping({"kind": kind, "target": "unused", "compute_dtype": "float32",
                                     "draft_intermediate_size": 32, **_SECTIONS.get(kind, {}),
                                     **kw})


def _jit_loss(obj, batch, target_params):
    """obj.loss_fn of obj's drafter, compiled once (eager dispatch of the op graph takes minutes)."""
    graph, state = nnx.split(obj.drafter)
    f = jax.jit(lambda st, b, t: obj.loss_fn(nnx.merge(graph, st), b, jax.random.PRNGKey(0), t))
    return f(state, batch, target_params)


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

    (loss, metrics), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    assert np.isfinite(float(loss)) and float(loss) > 0
    norms = [float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)]
    assert sum(norms) > 0
    if kind == "eagle3":
        assert "accuracy@3" in metrics and obj.drafter.gamma == 3
    else:
        assert 0.0 <= float(metrics["accept_rate"]) <= 1.0


def test_model_config_kinds():
    assert not hasattr(_mc("mtp").section, "mask_token_id")  # only block drafters have a mask token
    with pytest.raises(ConfigError, match="mask_token_id"):
        _mc("dspark")
    with pytest.raises(ConfigError, match="kind"):
        _mc("medusa")
    with pytest.raises(ConfigError, match="ttt_decay"):
        _mc("eagle3", ttt_decay=0.0)
    with pytest.raises(ConfigError, match="num_draft_layers"):
        _mc("eagle3", num_draft_layers=2)
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['markov_rank'\].*kind 'mtp'"):
        _mc("mtp", markov_rank=4)


# ---- label / target alignment against a hand computation, and where gradients go --------------

S_SMALL = 8


def _small_batch():
    """Two rows of 8 tokens: row 1 has one padding token; the loss masks differ per row."""
    ids = np.random.default_rng(3).integers(0, 63, (2, S_SMALL)).astype(np.int32)
    lm = np.zeros((2, S_SMALL), np.uint8)
    lm[0, 3:8] = 1
    lm[1, 2:6] = 1
    return {"input_ids": jnp.asarray(ids), "loss_mask": jnp.asarray(lm), "valid": jnp.asarray([8, 7], jnp.int32)}


def _np_softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _one_ahead_by_hand(z_btv, t_logits_btv, ids, lm, ahead: int, mc: ModelConfig) -> dict[str, float]:
    """mtp / standalone by loops: row t predicts ids[t+ahead] and matches the target's logits at row
    t+ahead-1, weighted by lm[t+ahead]; loss = alpha_ce * CE mean + alpha_tv * L1 mean."""
    ce = tv = w = 0.0
    for b in range(ids.shape[0]):
        for t in range(S_SMALL - ahead):
            if lm[b, t + ahead]:
                p_d = _np_softmax(z_btv[b, t])
                ce += -np.log(p_d[ids[b, t + ahead]])
                tv += np.abs(p_d - _np_softmax(t_logits_btv[b, t + ahead - 1])).sum()
                w += 1
    ce, tv = ce / w, tv / w
    return {"ce": ce, "tv": tv, "loss": mc.section.alpha_ce * ce + mc.section.alpha_tv * tv}


def _eagle3_by_hand(z_kbsv, t_logits_btv, lm, mc: ModelConfig) -> dict[str, float]:
    """Step k at row t predicts ids[t+k+2]: soft CE against the target's logits at row t+k+1, weighted
    by lm[t+k+2]; each step's sum is divided by B*S and the steps decay by ttt_decay**k."""
    n_steps, b_n = z_kbsv.shape[0], lm.shape[0]
    out = {"loss": 0.0}
    for k in range(n_steps):
        acc = 0.0
        for b in range(b_n):
            for t in range(S_SMALL - k - 2):
                if lm[b, t + k + 2]:
                    p_t = _np_softmax(t_logits_btv[b, t + k + 1])
                    acc += -(p_t * np.log(_np_softmax(z_kbsv[k, b, t]))).sum()
        out[f"ploss_{k}"] = acc / (b_n * S_SMALL)
        out["loss"] += mc.section.ttt_decay ** k * out[f"ploss_{k}"]
    return out


def _objective_and_hand(kind: str):
    """(objective, target params, hand-computed metrics) for a tiny random target and drafter."""
    target = CausalLM(TCFG, rngs=nnx.Rngs(5))
    gd, aux = nnx.split(target)
    mc = _mc(kind)
    obj = make_objective(mc, target, TCFG, target_graphdef=gd, feature_dtype=jnp.float32)
    b = _small_batch()
    ids, lm = np.asarray(b["input_ids"]), np.asarray(b["loss_mask"])
    pos = jnp.broadcast_to(jnp.arange(S_SMALL), ids.shape)
    out = target.forward(b["input_ids"], pos, valid_b=b["valid"], tap_layers=obj.tap_layers, logits="all")
    t_logits = np.asarray(out.logits)  # the target's own next-token logits: row r predicts ids[r+1]
    d = obj.drafter
    if kind == "eagle3":
        z = d.ttt_forward(jnp.concatenate(out.taps, axis=-1), b["input_ids"], mc.section.block_size)
        hand = _eagle3_by_hand(np.asarray(z), t_logits, lm, mc)
    elif kind == "mtp":
        z = d.train_forward(out.hidden, b["input_ids"])
        hand = _one_ahead_by_hand(np.asarray(z), t_logits, ids, lm, 2, mc)
    else:
        z = d.model.forward(b["input_ids"], pos, valid_b=b["valid"], logits="all").logits
        hand = _one_ahead_by_hand(np.asarray(z), t_logits, ids, lm, 1, mc)
    # the draft's distributions differ from the target's, so a misaligned target or label shows
    assert np.abs(np.asarray(z)[..., :S_SMALL, :] - t_logits).max() > 0.1
    return obj, aux, b, hand


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "standalone"])
def test_objective_alignment_matches_hand_computation(kind):
    obj, aux, b, hand = _objective_and_hand(kind)
    _, metrics = _jit_loss(obj, b, aux)
    for name, want in hand.items():
        assert float(metrics[name]) == pytest.approx(want, rel=1e-4, abs=1e-6), (kind, name)


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "standalone"])
def test_only_the_drafter_receives_gradients(kind):
    obj, aux, b, _ = _objective_and_hand(kind)
    graph, params, rest = nnx.split(obj.drafter, nnx.Param, ...)

    def f(p, target_params):
        return obj.loss_fn(nnx.merge(graph, p, rest), b, jax.random.PRNGKey(0), target_params)[0]

    g_draft, g_target = jax.jit(jax.grad(f, argnums=(0, 1)))(params, aux)
    target_norm = sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(g_target))
    assert target_norm == 0.0, f"{kind}: the frozen target received gradient (L1 {target_norm})"
    draft_leaves = jax.tree.leaves(g_draft)
    assert draft_leaves and all(float(jnp.abs(g).sum()) > 0 for g in draft_leaves), \
        f"{kind}: some drafter parameter got no gradient"


@pytest.mark.parametrize("kind", ["dspark", "eagle3", "mtp", "standalone"])
def test_draft_intermediate_size_narrows_the_mlp_and_round_trips(kind, tmp_path):
    """`draft_intermediate_size` sets the MLP width of every kind's own layers (0 = the target's);
    the checkpoint records it and loads back into the same drafter."""
    from specjax.drafters.registry import load_drafter, save_drafter

    target = CausalLM(TCFG, rngs=nnx.Rngs(1))
    gd, _ = nnx.split(target)
    extra = {"mask_token_id": 63, "markov_rank": 4} if kind == "dspark" else {}

    def build(width):
        return make_objective(_mc(kind, draft_intermediate_size=width, **extra), target,
                              TCFG, target_graphdef=gd, feature_dtype=jnp.float32).drafter

    def mlp_widths(d):  # Linear kernels are [in, out]
        return sorted({int(v.shape[-1]) for p, v in jax.tree_util.tree_leaves_with_path(
            nnx.state(d, nnx.Param)) if "up_proj" in jax.tree_util.keystr(p)})

    assert mlp_widths(build(0)) == [TCFG.intermediate_size]
    narrow = build(24)
    assert mlp_widths(narrow) == [24]
    back = load_drafter(save_drafter(narrow, tmp_path / kind, target_config=TCFG), target=target)
    assert mlp_widths(back) == [24]
    a, b = nnx.state(narrow, nnx.Param), nnx.state(back, nnx.Param)
    for (pa, va), (pb, vb) in zip(jax.tree_util.tree_leaves_with_path(a),
                                  jax.tree_util.tree_leaves_with_path(b)):
        assert jax.tree_util.keystr(pa) == jax.tree_util.keystr(pb)
        np.testing.assert_array_equal(va, vb, err_msg=jax.tree_util.keystr(pa))


def test_draft_intermediate_size_zero_is_the_target_width_and_negative_is_refused():
    assert ModelConfig.from_mapping(
        dict(kind="dflash", target="t", mask_token_id=1, markov_rank=0,
             confidence_head=False)).section.draft_intermediate_size == 0
    with pytest.raises(ConfigError, match="draft_intermediate_size"):
        ModelConfig.from_mapping(dict(kind="mtp", target="t", draft_intermediate_size=-1))


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_cached_features_give_the_online_loss(kind):
    """Eagle3 / MTP-1 trained from an offline target cache (batch with taps + hidden, no target)
    see the same loss as online; a cache of another layer's taps (eagle3) or of a shifted hidden
    state (mtp) does not."""
    from specjax.training.features import target_features

    target = CausalLM(TCFG, rngs=nnx.Rngs(1))
    gd, aux = nnx.split(target)
    obj = make_objective(_mc(kind), target, TCFG, target_graphdef=gd, feature_dtype=jnp.float32)
    batch = _batch()
    online, _ = _jit_loss(obj, batch, aux)
    taps, hid = target_features(aux, gd, batch["input_ids"], batch["valid"], tap_layers=(0, 1, 2),
                                dtype=jnp.float32)
    cached, _ = _jit_loss(obj, dict(batch, taps=taps, hidden=hid), None)
    np.testing.assert_allclose(float(cached), float(online), rtol=1e-5)
    if kind == "eagle3":
        wrong_taps, _ = target_features(aux, gd, batch["input_ids"], batch["valid"],
                                        tap_layers=(1, 2, 3), dtype=jnp.float32)
        wrong = dict(batch, taps=wrong_taps, hidden=hid)
    else:
        wrong = dict(batch, taps=taps, hidden=shift_left(hid, 1))
    bad, _ = _jit_loss(obj, wrong, None)
    assert abs(float(bad) - float(online)) > 1e-3


@pytest.mark.parametrize("kind,path", [("dspark", ("norm",)), ("eagle3", ("norm",)),
                                       ("mtp", ("shared_head", "norm"))])
def test_init_norm_from_target_starts_the_output_norm_at_the_targets(kind, path):
    """`init_norm_from_target` copies the target's final norm weight into the norm before the
    drafter's frozen head, so (same pre-norm input) the drafter's logits are the target's;
    without it the norm starts at one (DeepSpec) and the logits differ."""
    import functools

    target = CausalLM(TCFG, rngs=nnx.Rngs(1))
    tw = np.asarray(target.model.norm.weight[...])
    target.model.norm.weight[...] = jnp.asarray(1.0 + 2.0 * np.abs(tw - 1.0) + 0.5)  # far from one
    gd, _ = nnx.split(target)
    extra = {"mask_token_id": 63, "markov_rank": 0, "confidence_head": False} \
        if kind == "dspark" else {}

    def norm_of(init: bool):
        obj = make_objective(_mc(kind, init_norm_from_target=init, **extra), target, TCFG,
                             target_graphdef=gd, feature_dtype=jnp.float32)
        return obj.drafter, functools.reduce(getattr, path, obj.drafter)

    x = jax.random.normal(jax.random.PRNGKey(0), (3, TCFG.hidden_size))
    want = np.asarray(target.logits(target.model.norm(x)))
    drafter, norm = norm_of(True)
    np.testing.assert_array_equal(np.asarray(norm.weight[...]),
                                  np.asarray(target.model.norm.weight[...]))
    head = drafter.shared_head.head if kind == "mtp" else drafter.lm_head
    np.testing.assert_allclose(np.asarray(head(norm(x))), want, rtol=1e-5, atol=1e-5)
    drafter, norm = norm_of(False)  # control: the DeepSpec start
    np.testing.assert_array_equal(np.asarray(norm.weight[...]), np.ones(TCFG.hidden_size))
    head = drafter.shared_head.head if kind == "mtp" else drafter.lm_head
    assert not np.allclose(np.asarray(head(norm(x))), want, rtol=1e-3, atol=1e-3)


def test_init_norm_from_target_is_refused_for_standalone_and_non_bools():
    with pytest.raises(ConfigError, match="init_norm_from_target"):
        _mc("standalone", init_norm_from_target=True)
    with pytest.raises(ConfigError, match="init_norm_from_target"):
        _mc("mtp", init_norm_from_target="yes")


@pytest.mark.parametrize("chunk", [None, 3])
def test_standalone_text_only_is_the_cross_entropy_and_never_runs_the_target(chunk):
    """With alpha_tv 0 the standalone LM's loss is its next-token cross-entropy on the text (and
    top1 the share of supervised tokens it ranks first), by hand, chunked or not; the target is
    not needed at all (no graph, no parameters), while the default alpha_tv needs it (control)."""
    target = CausalLM(TCFG, rngs=nnx.Rngs(5))
    gd, aux = nnx.split(target)
    b = _small_batch()
    ids, lm = np.asarray(b["input_ids"]), np.asarray(b["loss_mask"])
    obj = make_objective(_mc("standalone", alpha_ce=1.0, alpha_tv=0.0, chunk_anchors=chunk), target, TCFG,
                         target_graphdef=None, feature_dtype=jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(S_SMALL), ids.shape)
    z = np.asarray(obj.drafter.model.forward(b["input_ids"], pos, valid_b=b["valid"], logits="all").logits)
    ce, top1, n = 0.0, 0.0, 0
    for r in range(ids.shape[0]):
        for t in range(S_SMALL - 1):
            if lm[r, t + 1]:
                ce -= np.log(_np_softmax(z[r, t])[ids[r, t + 1]])
                top1 += float(np.argmax(z[r, t]) == ids[r, t + 1])
                n += 1
    _, metrics = _jit_loss(obj, b, None)
    assert float(metrics["loss"]) == pytest.approx(ce / n, rel=1e-4)
    assert float(metrics["top1"]) == pytest.approx(top1 / n, abs=1e-6) and "tv" not in metrics
    with_tv = make_objective(_mc("standalone"), target, TCFG, target_graphdef=None, feature_dtype=jnp.float32)
    with pytest.raises(ValueError, match="no online target"):  # the target is needed to run it
        _jit_loss(with_tv, b, None)
