"""Sequential temperature scaling and the acceptance / calibration metrics (numpy only)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from specjax.config import ConfigError
from specjax.eval import metrics as M
from specjax.scheduling import calibration_metrics as CM
from specjax.scheduling import calibration as C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _synthetic_rounds(seed=0, n=3000, gamma=5, scale=3.0, fixed=True):
    """True conditional acceptance sigmoid(u); the head reports logits scale*u (overconfident)."""
    rng = np.random.default_rng(seed)
    u = rng.normal(1.0, 1.5, size=(n, gamma))
    ok = rng.random((n, gamma)) < _sigmoid(u)
    accepted = np.argmin(np.concatenate([ok, np.zeros((n, 1), bool)], axis=1), axis=1)
    proposal = np.full(n, gamma) if fixed else rng.integers(1, gamma + 1, size=n)
    accepted = np.minimum(accepted, proposal)
    return scale * u, accepted, proposal


# ------------------------------------------------------------------------------------------------
# metrics


def test_ece_hand_case():
    assert CM.ece([0.1, 0.1, 0.9, 0.9], [0, 1, 1, 1]) == pytest.approx(0.25)
    assert CM.ece([0.0, 1.0], [0, 1]) == pytest.approx(1e-8)  # clamped to [1e-8, 1 - 1e-8]
    batched = CM.ece(np.array([[0.1, 0.1, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5]]), [0, 1, 1, 1])
    np.testing.assert_allclose(batched, [0.25, 0.25])
    assert CM.ece([0.3, 0.7], [0, 1], bins=1) == pytest.approx(0.0)


def test_auroc_ties_and_brute_force():
    assert CM.auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert CM.auroc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert CM.auroc([0.2, 0.5, 0.5, 0.9], [0, 1, 0, 1]) == pytest.approx(0.875)
    assert np.isnan(CM.auroc([0.1, 0.2], [1, 1]))
    rng = np.random.default_rng(1)
    p = rng.integers(0, 6, 60) / 5.0
    y = rng.random(60) < 0.4
    pos, neg = p[y], p[~y]
    brute = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (
        len(pos) * len(neg))
    assert CM.auroc(p, y) == pytest.approx(brute)


def test_brier():
    assert CM.brier([0.2, 0.9], [0, 1]) == pytest.approx((0.04 + 0.01) / 2)


def test_acceptance_metrics_hand_case():
    out = M.acceptance_metrics([3, 1, 0, 2], [3, 3, 3, 2], gamma=3)
    assert out["tau"] == pytest.approx(2.5)  # lengths 4, 2, 1, 3
    assert out["accept_rate@1"] == pytest.approx(3 / 4)
    assert out["accept_rate@2"] == pytest.approx(2 / 4)
    assert out["accept_rate@3"] == pytest.approx(1 / 3)
    assert out["cond_accept@1"] == pytest.approx(3 / 4)
    assert out["cond_accept@2"] == pytest.approx(2 / 3)
    assert out["cond_accept@3"] == pytest.approx(1.0)
    assert out["verify_rate"] == pytest.approx(10 / 15)
    assert out["num_drafts"] == 4 and out["num_draft_tokens"] == 11
    assert out["num_accepted_tokens"] == 6
    assert out["num_accepted_tokens_per_pos"].tolist() == [3, 2, 1]
    assert out["mean_acceptance_length"] == pytest.approx(2.5)
    assert out["draft_acceptance_rate"] == pytest.approx(6 / 11)
    np.testing.assert_allclose(out["acceptance_rate_per_pos"], [0.75, 0.5, 0.25])
    assert out["acceptance_histogram"].tolist() == [1, 1, 1, 1]


def test_acceptance_metrics_bonus_zero_rounds_and_fixed_length_conditional():
    out = M.acceptance_metrics([2, 1], [2, 2], gamma=2, bonus_per_round=[0, 1])
    assert out["tau"] == pytest.approx((2 + 2) / 2)
    n, m = np.array([4, 0, 2, 1, 4, 3]), np.full(6, 4)
    out = M.acceptance_metrics(n, m, gamma=4)
    ar = [1.0] + [out[f"accept_rate@{k}"] for k in range(1, 5)]
    for k in range(1, 5):
        assert out[f"cond_accept@{k}"] == pytest.approx(ar[k] / ar[k - 1])
    # rounds that verify nothing are rounds but not drafts
    out = M.acceptance_metrics([0, 2], [0, 2], gamma=2)
    assert out["num_drafts"] == 1 and out["tau"] == pytest.approx(2.0)
    assert out["mean_acceptance_length"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="accepted_per_round"):
        M.acceptance_metrics([3], [2], gamma=3)
    with pytest.raises(ValueError, match="proposed_per_round"):
        M.acceptance_metrics([1], [4], gamma=3)


def test_confidence_metrics_uses_prefix_survival():
    conf = np.array([[0.9, 0.5], [0.8, 0.5], [0.2, 0.9]])
    out = CM.confidence_metrics(conf, [2, 1, 0], [2, 2, 1])
    # position 1: a = .9, .8, .2 vs y = 1, 1, 0; position 2 only rounds 0, 1: a = .45, .4 vs 1, 0
    assert out["count"].tolist() == [3, 2]
    assert out["brier@1"] == pytest.approx((0.01 + 0.04 + 0.04) / 3)
    assert out["mean_pred@2"] == pytest.approx(0.425)
    assert out["mean_obs@2"] == pytest.approx(0.5)
    assert out["auroc@1"] == pytest.approx(1.0)
    assert out["auroc@2"] == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------------
# STS


def test_sts_lowers_ece_and_keeps_ranking():
    z, acc, prop = _synthetic_rounds()
    temps = C.fit_sts(z, acc, prop)
    assert temps.shape == (5,)
    assert np.all((temps > 2.0) & (temps < 4.5)), temps  # the logits were scaled by 3
    raw = CM.confidence_metrics(_sigmoid(z), acc, prop)
    cal_p = C.apply_sts(z, temps)
    cal = CM.confidence_metrics(cal_p, acc, prop)
    assert np.all(cal["ece"] < raw["ece"])
    assert cal["ece_weighted"] < 0.4 * raw["ece_weighted"]
    assert cal["auroc@1"] == pytest.approx(raw["auroc@1"], abs=1e-12)
    for k in range(5):  # per-step temperature scaling is order preserving
        np.testing.assert_array_equal(np.argsort(z[:, k], kind="stable"),
                                      np.argsort(cal_p[:, k], kind="stable"))


def test_sts_is_sequential_with_earlier_positions_frozen():
    z, acc, prop = _synthetic_rounds(seed=2, n=1500, gamma=3, scale=0.5, fixed=False)
    grid = np.geomspace(0.1, 10, 41)
    temps = C.fit_sts(z, acc, prop, grid=grid)
    y = acc[:, None] >= np.arange(1, 4)[None]
    for k in range(3):
        sel = prop >= k + 1
        prev = np.prod(_sigmoid(z[sel, :k] / temps[:k]), axis=1)
        errs = [CM.ece(prev * _sigmoid(z[sel, k] / t), y[sel, k]) for t in grid]
        assert CM.ece(prev * _sigmoid(z[sel, k] / temps[k]), y[sel, k]) == pytest.approx(min(errs))
    assert np.all(temps < 1.0)  # underconfident logits (scale .5) get sharpened


def test_sts_unobserved_position_keeps_unit_temperature():
    z, acc, prop = _synthetic_rounds(seed=3, n=500, gamma=4)
    prop = np.minimum(prop, 2)
    acc = np.minimum(acc, prop)
    temps = C.fit_sts(z, acc, prop)
    assert temps[2] == 1.0 and temps[3] == 1.0


def test_apply_sts_shapes_and_errors():
    temps = np.array([2.0, 0.5, 1.0])
    out = C.apply_sts(np.array([[2.0, 1.0]]), temps)
    np.testing.assert_allclose(out, [[_sigmoid(1.0), _sigmoid(2.0)]])
    with pytest.raises(ValueError, match="exceeds"):
        C.apply_sts(np.zeros((1, 4)), temps)
    with pytest.raises(ValueError, match="conf_logits"):
        C.fit_sts(np.zeros(5), np.zeros(5), np.ones(5))
    with pytest.raises(ValueError, match="accepted_prefix_len"):
        C.fit_sts(np.zeros((2, 2)), [3, 0], [2, 2])


def test_save_load_roundtrip_and_errors(tmp_path):
    path = tmp_path / "sts.json"
    C.save_sts(path, [1.5, 2.0, 0.7], {"drafter": "tiny", "ece_before": 0.08})
    temps, meta = C.load_sts(path)
    np.testing.assert_allclose(temps, [1.5, 2.0, 0.7])
    assert meta == {"drafter": "tiny", "ece_before": 0.08}
    with pytest.raises(ConfigError, match="not found"):
        C.load_sts(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "specjax-sts", "version": 1, "temperatures": [1.0, -2]}))
    with pytest.raises(ConfigError, match="temperatures"):
        C.load_sts(bad)
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ConfigError, match="format"):
        C.load_sts(bad)
    with pytest.raises(ValueError):
        C.save_sts(path, [0.0])


def test_calibration_does_not_import_jax():
    code = ("import sys; import specjax.scheduling.calibration, specjax.scheduling.calibration_metrics, specjax.eval.metrics; "
            "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib', 'flax'))]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
