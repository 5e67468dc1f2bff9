"""Drafter losses: hand-computed values, masking, chunking, gradients, memory bound."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import losses as L

# jit once per shape: op-by-op dispatch is slow on small CPUs
_dspark = jax.jit(L.dspark_loss, static_argnames=("chunk_anchors",))


def _log(p):
    return np.log(np.asarray(p, np.float64)).astype(np.float32)


def test_position_weights_match_reference():
    w = np.asarray(L.position_weights(7, 4.0))
    np.testing.assert_allclose(w, [1, 0.7788, 0.6065, 0.4724, 0.3679, 0.2865, 0.2231], atol=1e-4)
    with pytest.raises(ValueError):
        L.position_weights(0)


def _tiny_case():
    # one block, two slots, V = 3
    draft = np.stack([_log([0.5, 0.25, 0.25]), _log([1 / 3, 1 / 3, 1 / 3])])[None, None]
    target = np.stack([_log([0.25, 0.5, 0.25]), _log([1 / 3, 1 / 3, 1 / 3])])[None, None]
    labels = np.array([[[0, 2]]], np.int32)
    mask = np.ones((1, 1, 2), np.float32)
    conf = np.array([[[0.0, 2.0]]], np.float32)
    return draft, target, labels, mask, conf


def test_dspark_loss_hand_computed():
    draft, target, labels, mask, conf = _tiny_case()
    loss, m = _dspark(draft, target, labels, mask, conf)
    w1 = math.exp(-0.25)
    big_w = 1 + w1
    ce = (math.log(2) + w1 * math.log(3)) / big_w
    tv = (0.5 + 0.0) / big_w
    # BCE(0, 0.75) = log 2; BCE(2, 1) = log(1 + e^-2)
    conf_l = (math.log(2) + w1 * math.log1p(math.exp(-2))) / big_w
    np.testing.assert_allclose(float(m["ce"]), ce, rtol=1e-5)
    np.testing.assert_allclose(float(m["tv"]), tv, rtol=1e-5)
    np.testing.assert_allclose(float(m["conf"]), conf_l, rtol=1e-5)
    np.testing.assert_allclose(float(loss), 0.1 * ce + 0.9 * tv + 1.0 * conf_l, rtol=1e-5)
    np.testing.assert_allclose(float(m["accept_rate@1"]), 0.75, rtol=1e-5)
    np.testing.assert_allclose(float(m["accept_rate@2"]), 1.0, rtol=1e-5)
    np.testing.assert_allclose(float(m["tau_probabilistic"]), 1 + 0.75 + 0.75, rtol=1e-5)
    np.testing.assert_allclose(float(m["weight_sum"]), big_w, rtol=1e-5)
    # sigmoid(0) = .5 vs c* .75 ; sigmoid(2) vs 1
    s2 = 1 / (1 + math.exp(-2))
    np.testing.assert_allclose(float(m["conf_bias"]), ((0.5 - 0.75) + (s2 - 1)) / 2, rtol=1e-5)


def test_soft_label_bce_nonzero_conf_logit():
    draft, target, labels, mask, _ = _tiny_case()
    conf = np.array([[[1.5, -0.5]]], np.float32)
    _, m = _dspark(draft, target, labels, mask, conf)
    def bce(x, y):
        return -(y * math.log(1 / (1 + math.exp(-x))) + (1 - y) * math.log(1 - 1 / (1 + math.exp(-x))))
    w1 = math.exp(-0.25)
    want = (bce(1.5, 0.75) + w1 * bce(-0.5, 1.0)) / (1 + w1)
    np.testing.assert_allclose(float(m["conf"]), want, rtol=1e-5)


def test_masked_slots_and_blocks_are_excluded():
    draft, target, labels, mask, conf = _tiny_case()
    rng = np.random.default_rng(0)
    # add a second block full of garbage that is masked out
    g = rng.normal(size=draft.shape).astype(np.float32) * 5
    draft2 = np.concatenate([draft, g], axis=1)
    target2 = np.concatenate([target, -g], axis=1)
    labels2 = np.concatenate([labels, labels[:, :, ::-1]], axis=1)
    mask2 = np.concatenate([mask, np.zeros_like(mask)], axis=1)
    conf2 = np.concatenate([conf, conf + 3], axis=1)
    l1, m1 = _dspark(draft, target, labels, mask, conf)
    l2, m2 = _dspark(draft2, target2, labels2, mask2, conf2)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    np.testing.assert_allclose(float(m1["tau_probabilistic"]), float(m2["tau_probabilistic"]), rtol=1e-6)
    # a hole at slot 1 leaves slot 0 only: CE = -log .5, TV = .5
    _, m3 = _dspark(draft, target, labels, np.array([[[1.0, 0.0]]]), conf)
    np.testing.assert_allclose(float(m3["ce"]), math.log(2), rtol=1e-5)
    np.testing.assert_allclose(float(m3["tv"]), 0.5, rtol=1e-5)
    np.testing.assert_allclose(float(m3["tau_probabilistic"]), 1.75, rtol=1e-5)


def test_dflash_is_ce_only():
    draft, target, labels, mask, _ = _tiny_case()
    loss, m = jax.jit(L.dflash_loss)(draft, target, labels, mask)
    np.testing.assert_allclose(float(loss), float(m["ce"]), rtol=1e-6)
    assert "conf" not in m
    loss2, _ = _dspark(draft, target, labels, mask, None, alpha_ce=1.0, alpha_tv=0.0)
    np.testing.assert_allclose(float(loss), float(loss2), rtol=1e-6)


def _random_inputs(seed=0, b=2, a=10, k=3, v=11):
    rng = np.random.default_rng(seed)
    draft = rng.normal(size=(b, a, k, v)).astype(np.float32) * 2
    target = rng.normal(size=(b, a, k, v)).astype(np.float32) * 2
    labels = rng.integers(0, v, size=(b, a, k)).astype(np.int32)
    mask = np.cumprod(rng.random((b, a, k)) < 0.8, axis=-1).astype(np.float32)
    conf = rng.normal(size=(b, a, k)).astype(np.float32)
    return draft, target, labels, mask, conf


@pytest.mark.parametrize("chunk", [3, 5])
def test_chunked_equals_unchunked(chunk):
    draft, target, labels, mask, conf = _random_inputs()

    def f(d, c, ch):
        return L.dspark_loss(d, target, labels, mask, c, chunk_anchors=ch)

    vg = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True), static_argnums=2)
    (l0, m0), g0 = vg(draft, conf, None)
    (l1, m1), g1 = vg(draft, conf, chunk)
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-5)
    for key in m0:
        np.testing.assert_allclose(float(m0[key]), float(m1[key]), rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(g0, g1):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


def test_gradients_only_reach_draft_side():
    draft, target, labels, mask, conf = _random_inputs(1)
    def f(d, t, alpha_ce, alpha_tv):
        return L.dspark_loss(d, t, labels, mask, conf, alpha_ce=alpha_ce, alpha_tv=alpha_tv)[0]

    grad = jax.jit(jax.grad(f, argnums=(0, 1)))
    gd, gt = grad(draft, target, 0.1, 0.9)
    assert float(jnp.abs(gt).max()) == 0.0
    assert float(jnp.abs(gd).max()) > 0.0
    # the soft label is a constant: the confidence term alone sends nothing into the draft logits
    gd_conf, _ = grad(draft, target, 0.0, 0.0)
    assert float(jnp.abs(gd_conf).max()) == 0.0


def test_chunking_bounds_memory():
    b, a, k, v = 1, 32, 7, 2048
    shapes = (jax.ShapeDtypeStruct((b, a, k, v), jnp.float32),) * 2 + (
        jax.ShapeDtypeStruct((b, a, k), jnp.int32), jax.ShapeDtypeStruct((b, a, k), jnp.float32),
        jax.ShapeDtypeStruct((b, a, k), jnp.float32))

    def temp_bytes(chunk):
        def f(d, t, l, m, c):
            return L.dspark_loss(d, t, l, m, c, chunk_anchors=chunk)[0]
        compiled = jax.jit(jax.grad(f, argnums=(0, 4))).lower(*shapes).compile()
        ma = compiled.memory_analysis()
        if ma is None:
            pytest.skip("backend gives no memory analysis")
        return ma.temp_size_in_bytes

    full = temp_bytes(None)
    chunked = temp_bytes(4)
    logits_bytes = b * a * k * v * 4
    assert full >= logits_bytes  # the unchunked softmaxes are materialised
    assert chunked < full / 4


def test_shape_errors_name_the_argument():
    draft, target, labels, mask, conf = _tiny_case()
    with pytest.raises(ValueError, match="labels_bak"):
        L.dspark_loss(draft, target, labels[..., :1], mask, conf)
    with pytest.raises(ValueError, match="conf_logits_bak"):
        L.dspark_loss(draft, target, labels, mask, conf[..., :1])


# ------------------------------------------------------------------------------------------------
# Eagle3


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _eagle3_reference(step_logits, target_logits, mask, decay):
    n_steps, b, s, _ = step_logits.shape
    total = 0.0
    per = []
    for k in range(n_steps):
        acc = 0.0
        for bi in range(b):
            for t in range(s - k):
                w = mask[bi, t + k]
                if w == 0:
                    continue
                p_t = _np_softmax(target_logits[bi, t + k].astype(np.float64))
                logq = np.log(_np_softmax(step_logits[k, bi, t].astype(np.float64)))
                acc += w * -(p_t * logq).sum()
        per.append(acc / (b * s))
        total += decay ** k * per[-1]
    return total, per


@pytest.mark.parametrize("chunk", [None, 2])
def test_eagle3_loss_matches_reference(chunk):
    rng = np.random.default_rng(3)
    n_steps, b, s, v = 3, 2, 5, 6
    step = rng.normal(size=(n_steps, b, s, v)).astype(np.float32)
    tgt = rng.normal(size=(b, s, v)).astype(np.float32)
    mask = np.array([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]], np.float32)
    loss, m = jax.jit(lambda a, b_, c: L.eagle3_loss(a, b_, c, decay=0.8, chunk_tokens=chunk))(
        step, tgt, mask)
    want, per = _eagle3_reference(step, tgt, mask, 0.8)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    for k in range(n_steps):
        np.testing.assert_allclose(float(m[f"ploss_{k}"]), per[k], rtol=1e-5)
    assert 0.0 <= float(m["accept_rate@1"]) <= 1.0
    assert 1.0 <= float(m["tau_probabilistic"]) <= 1.0 + n_steps


def test_eagle3_perfect_draft_has_full_acceptance():
    rng = np.random.default_rng(4)
    b, s, v, n_steps = 1, 6, 5, 3
    tgt = rng.normal(size=(b, s, v)).astype(np.float32)
    # step k at position t must match target row t + k
    step = np.stack([np.concatenate([tgt[:, k:], tgt[:, :k]], axis=1) for k in range(n_steps)])
    mask = np.array([[1, 1, 1, 1, 1, 0]], np.float32)
    _, m = jax.jit(L.eagle3_loss)(step, tgt, mask)
    for k in range(1, n_steps + 1):
        np.testing.assert_allclose(float(m[f"accept_rate@{k}"]), 1.0, rtol=1e-5)
        np.testing.assert_allclose(float(m[f"accuracy@{k}"]), 1.0)
    # position t's chain has min(3, #supervised rows from t) links: t=0,1,2 -> 3, t=3 -> 2, t=4 -> 1
    np.testing.assert_allclose(float(m["tau_greedy"]), 1 + (3 + 3 + 3 + 2 + 1) / 5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# MTP


def test_mtp_loss_masked_mean():
    rng = np.random.default_rng(5)
    b, t, v = 2, 4, 7
    d = rng.normal(size=(b, t, v)).astype(np.float32)
    tg = rng.normal(size=(b, t, v)).astype(np.float32)
    lab = rng.integers(0, v, size=(b, t))
    mask = np.array([[1, 1, 0, 0], [1, 0, 1, 0]], np.float32)
    loss, m = jax.jit(lambda *a: L.mtp_loss(*a, chunk_tokens=3))(d, tg, lab, mask)
    pd, pt = _np_softmax(d.astype(np.float64)), _np_softmax(tg.astype(np.float64))
    ce = -np.log(np.take_along_axis(pd, lab[..., None], -1)[..., 0])
    l1 = np.abs(pd - pt).sum(-1)
    ce_m = (ce * mask).sum() / mask.sum()
    tv_m = (l1 * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(m["ce"]), ce_m, rtol=1e-5)
    np.testing.assert_allclose(float(m["tv"]), tv_m, rtol=1e-5)
    np.testing.assert_allclose(float(loss), 0.1 * ce_m + 0.9 * tv_m, rtol=1e-5)
    np.testing.assert_allclose(float(m["accept_rate"]),
                               (np.clip(1 - l1 / 2, 0, 1) * mask).sum() / mask.sum(), rtol=1e-5)
