"""Tests for specjax.scheduling: cost table, prefix-scheduling policies, losslessness, no jax."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.scheduling import (
    POLICIES,
    CostTable,
    CostTableMeta,
    async_capacity,
    async_plan,
    expected_tokens_per_second,
    prefix_schedule,
    prefix_survival,
)
from specjax.scheduling import policies as pol

REPO_ROOT = Path(__file__).resolve().parents[1]
LOSSY = "anticipating_global_search_LOSSY"


# ---- helpers and plain-loop references ----------------------------------------------------------


def _meta(**overrides) -> CostTableMeta:
    fields = dict(
        target="tiny-qwen3@abc123",
        dtype="float32",
        hardware="cpu x1",
        context_length=512,
        slots_buckets=(1, 4, 16),
        tokens_buckets=(1, 2, 4, 8),
    )
    fields.update(overrides)
    return CostTableMeta(**fields)


def _grid_table(meta: CostTableMeta | None = None) -> CostTable:
    """seconds(s, t) = 1 + s * t / 100 on slots (1, 4, 16) x tokens (1, 2, 4, 8)."""
    return CostTable.from_seconds(
        {(s, t): 1.0 + s * t / 100 for s in (1, 4, 16) for t in (1, 2, 4, 8)}, meta=meta
    )


def _appendix_table() -> CostTable:
    """Paper Appendix A: one request, SPS(1)=1.0, SPS(2)=0.5, SPS(3)=0.45 (seconds = 1/SPS)."""
    return CostTable.from_seconds({(1, 1): 1.0, (1, 2): 1 / 0.5, (1, 3): 1 / 0.45})


def _ref_candidates(c: np.ndarray) -> list[tuple[float, int, int]]:
    """(a, j, r) for every position, j 1-based, sorted by a desc, then j asc, then r asc."""
    R, G = c.shape
    out = []
    for r in range(R):
        p = 1.0
        for j in range(G):
            p = p * float(c[r, j]) if j else float(c[r, 0])
            out.append((p, j + 1, r))
    return sorted(out, key=lambda t: (-t[0], t[1], t[2]))


def _ref_confidence(c: np.ndarray, table: CostTable) -> np.ndarray:
    """Algorithm 1 as a literal greedy loop."""
    R, _ = c.shape
    ell = [0] * R
    tau, max_ell = float(R), 0
    best = tau / table.seconds(R, 1)
    for a, j, r in _ref_candidates(c):
        if j + 1 > table.max_tokens_per_slot or ell[r] != j - 1:
            continue  # cannot execute, or its prefix is not admitted
        new_max = max(max_ell, j)
        theta = (tau + a) / table.seconds(R, 1 + new_max)
        if not theta > best:
            break  # first non-improvement: stop
        ell[r], tau, max_ell, best = j, tau + a, new_max, theta
    return np.array(ell)


def _ref_global(c: np.ndarray, table: CostTable) -> tuple[np.ndarray, int]:
    """Global argmax over every prefix of the sorted (executable) candidates; (lengths, max ell)."""
    R, _ = c.shape
    cands = [t for t in _ref_candidates(c) if t[1] + 1 <= table.max_tokens_per_slot]
    tau, max_ell = float(R), 0
    best, best_n, best_max = tau / table.seconds(R, 1), 0, 0
    for n, (a, j, _) in enumerate(cands, start=1):
        tau += a
        max_ell = max(max_ell, j)
        theta = tau / table.seconds(R, 1 + max_ell)
        if theta > best:
            best, best_n, best_max = theta, n, max_ell
    ell = np.zeros(R, dtype=int)
    for _, _, r in cands[:best_n]:
        ell[r] += 1
    return ell, best_max


def _ref_async(c: np.ndarray, old: np.ndarray, table: CostTable) -> np.ndarray:
    R, G = c.shape
    old_ell, max_ell = _ref_global(old, table)
    k = int(old_ell.sum())
    cap = min(G, table.bucket_for(R, 1 + max_ell)[1] - 1)
    ell = np.zeros(R, dtype=int)
    for _, _, r in [t for t in _ref_candidates(c) if t[1] <= cap][:k]:
        ell[r] += 1
    return ell


def _admitted_is_sorted_prefix(c: np.ndarray, ell: np.ndarray, max_pos: int) -> bool:
    """The admitted set {(r, j): j <= ell_r} equals the first sum(ell) sorted candidates with
    j <= max_pos."""
    cands = [(r, j) for _, j, r in _ref_candidates(c) if j <= max_pos]
    n = int(ell.sum())
    return set(cands[:n]) == {(r, j) for r in range(c.shape[0]) for j in range(1, ell[r] + 1)}


# ---- hypothesis strategies ----------------------------------------------------------------------

_conf = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 0.8, 1.0]), st.floats(0.0, 1.0))
_sec = st.one_of(st.sampled_from([0.5, 1.0, 2.0]), st.floats(0.05, 10.0))


@st.composite
def _scenario(draw, n_conf: int = 1):
    """(table, R, gamma, [confidences [R, gamma]] * n_conf) with R within the table."""
    R = draw(st.integers(1, 6))
    gamma = draw(st.integers(0, 5))
    slots = sorted(draw(st.sets(st.integers(1, 8), min_size=1, max_size=3)))
    if slots[-1] < R:
        slots.append(R)
    tokens = sorted(draw(st.sets(st.integers(1, 7), min_size=1, max_size=4)))
    table = CostTable.from_seconds({(s, t): draw(_sec) for s in slots for t in tokens})
    confs = [
        np.array([[draw(_conf) for _ in range(gamma)] for _ in range(R)], dtype=np.float64).reshape(
            R, gamma
        )
        for _ in range(n_conf)
    ]
    return table, R, gamma, confs


# ---- cost table ---------------------------------------------------------------------------------


def test_bucket_for_is_smallest_bucket_at_least_request():
    t = _grid_table()
    assert t.bucket_for(1, 1) == (1, 1)
    assert t.bucket_for(3, 3) == (4, 4)
    assert t.bucket_for(5, 2) == (16, 2)
    assert t.bucket_for(16, 8) == (16, 8)
    assert t.seconds(3, 3) == pytest.approx(1 + 4 * 4 / 100)  # staircase: the executed bucket
    assert t.steps_per_second(3, 3) == pytest.approx(1 / (1 + 4 * 4 / 100))
    np.testing.assert_allclose(
        t.staircase(2), [1.04, 1.04, 1.08, 1.16, 1.16, 1.32, 1.32, 1.32, 1.32]
    )


@pytest.mark.parametrize(
    "slots,tokens,match",
    [(17, 1, "slots=17 exceeds the largest slots bucket 16"),
     (1, 9, "tokens_per_slot=9 exceeds the largest tokens-per-slot bucket 8"),
     (0, 1, "slots must be a positive integer"),
     (1, 0, "tokens_per_slot must be a positive integer")],
)
def test_bucket_for_beyond_grid_names_the_limit(slots, tokens, match):
    with pytest.raises(ValueError, match=match):
        _grid_table().bucket_for(slots, tokens)


@pytest.mark.parametrize(
    "seconds,match",
    [({(1, 1): 1.0, (1, 2): 1.0, (2, 1): 1.0}, r"missing bucket\(s\) \[\(2, 2\)\]"),
     ({(1, 1): 0.0}, "positive and finite"),
     ({(1, 1): -1.0}, "positive and finite"),
     ({(1, 1): float("nan")}, "positive and finite"),
     ({(1, 1): float("inf")}, "positive and finite"),
     ({(1, 1): "fast"}, "must be a number"),
     ({(True, 1): 1.0}, "slots bucket"),
     ({(1,): 1.0}, "pair"),
     ({}, "non-empty")],
)
def test_from_seconds_validation(seconds, match):
    with pytest.raises(ValueError, match=match):
        CostTable.from_seconds(seconds)


def test_meta_must_agree_with_grid_and_be_valid():
    with pytest.raises(ValueError, match="tokens_buckets"):
        _grid_table(_meta(tokens_buckets=(1, 2, 4)))
    with pytest.raises(ValueError, match="context_length"):
        _meta(context_length=0)
    with pytest.raises(ValueError, match="slots_buckets must be strictly increasing"):
        _meta(slots_buckets=(4, 1, 16))
    with pytest.raises(ValueError, match="target"):
        _meta(target="")


def test_json_round_trip(tmp_path):
    table = _grid_table(_meta())
    path = tmp_path / "cost.json"
    table.to_json(path)
    loaded = CostTable.from_json(path)
    assert loaded == table
    assert loaded.meta == _meta()
    assert loaded.as_dict() == table.as_dict()
    assert json.loads(path.read_text())["meta"]["dtype"] == "float32"
    loaded.check_matches(_meta())  # same everything: accepted


@pytest.mark.parametrize(
    "field,value",
    [("target", "other-model"), ("dtype", "bfloat16"), ("hardware", "TPU v5e x8"),
     ("context_length", 4096), ("slots_buckets", (1, 4, 32)), ("tokens_buckets", (1, 2, 4))],
)
def test_check_matches_refuses_and_names_field(field, value):
    table = _grid_table(_meta())
    with pytest.raises(ValueError, match=f"{field}: table has"):
        table.check_matches(_meta(**{field: value}))


def test_check_matches_without_meta_and_save_without_meta(tmp_path):
    with pytest.raises(ValueError, match="no metadata"):
        _grid_table().check_matches(_meta())
    with pytest.raises(ValueError, match="needs metadata"):
        _grid_table().to_json(tmp_path / "x.json")


def test_from_json_bad_files_name_the_file(tmp_path):
    good = _grid_table(_meta()).to_dict()
    cases = {
        "notjson.json": "{not json",
        "drop.json": json.dumps({**good, "entries": good["entries"][1:]}),
        "format.json": json.dumps({**good, "format": "something-else"}),
        "metafield.json": json.dumps({**good, "meta": {**good["meta"], "flavour": "x"}}),
        "nometa.json": json.dumps({k: v for k, v in good.items() if k != "meta"}),
    }
    matches = {
        "notjson.json": "not valid JSON",
        "drop.json": "missing bucket",
        "format.json": "field 'format'",
        "metafield.json": "unknown field",
        "nometa.json": "missing field 'meta'",
    }
    for name, text in cases.items():
        p = tmp_path / name
        p.write_text(text)
        with pytest.raises(ValueError, match=matches[name]) as info:
            CostTable.from_json(p)
        assert name in str(info.value)


# ---- Algorithm 1 unit cases ---------------------------------------------------------------------


def test_appendix_a_counterexample_numbers():
    table = _appendix_table()
    c = np.array([[0.8]])
    assert expected_tokens_per_second(c, [0], table) == pytest.approx(1.0)  # Theta0
    assert expected_tokens_per_second(c, [1], table) == pytest.approx(0.9)  # Theta1
    assert prefix_schedule(c, table, "confidence").tolist() == [0]
    assert prefix_schedule(c, table, LOSSY).tolist() == [0]


def test_admitting_helps_when_the_step_is_cheap_enough():
    table = CostTable.from_seconds({(1, 1): 1.0, (1, 2): 1 / 0.8, (1, 3): 1 / 0.45})
    # Theta1 = 1.95 * 0.8 = 1.56 > 1; Theta2 = (1.95 + 0.9025) * 0.45 = 1.28 < 1.56: stop at 1.
    assert prefix_schedule([[0.95, 0.95]], table, "confidence").tolist() == [1]
    # With a flat cost every admission helps.
    flat = CostTable.from_seconds({(2, t): 1.0 for t in (1, 2, 3)})
    assert prefix_schedule([[0.9, 0.5], [0.3, 0.9]], flat, "confidence").tolist() == [2, 2]


def test_two_requests_greedy_order_and_stop():
    # slots 2; tokens 1..3 cost 1.0, 1.5, 1.6. Sorted a: 0.9(r0,j1) 0.81(r0,j2) 0.2(r1,j1) ...
    table = CostTable.from_seconds({(2, 1): 1.0, (2, 2): 1.5, (2, 3): 1.6})
    c = np.array([[0.9, 0.9], [0.2, 0.5]])
    # Theta: 2/1=2 -> 2.9/1.5=1.93: the very first admission does not improve -> nothing.
    assert prefix_schedule(c, table, "confidence").tolist() == [0, 0]
    # The global search sees past the bucket step: 3.71/1.6, 3.91/1.6, 4.01/1.6 = 2.51 (max).
    assert prefix_schedule(c, table, LOSSY).tolist() == [2, 2]
    cheaper = CostTable.from_seconds({(2, 1): 1.0, (2, 2): 1.2, (2, 3): 1.6})
    # 2.9/1.2=2.42 > 2 -> admit; 3.71/1.6=2.32 < 2.42 -> stop.
    assert prefix_schedule(c, cheaper, "confidence").tolist() == [1, 0]


def test_objective_uses_the_executed_bucket():
    c = [[0.9, 0.9, 0.9]]
    # Only buckets 1 and 4: one draft token already pays for bucket 4, so three are free.
    coarse = CostTable.from_seconds({(1, 1): 1.0, (1, 4): 1.1})
    assert prefix_schedule(c, coarse, "confidence").tolist() == [3]
    # Fine buckets with a steep third step: stop after two.
    fine = CostTable.from_seconds({(1, 1): 1.0, (1, 2): 1.1, (1, 3): 1.2, (1, 4): 5.0})
    assert prefix_schedule(c, fine, "confidence").tolist() == [2]


def test_cost_aware_policies_stay_within_the_largest_tokens_bucket():
    small = CostTable.from_seconds({(4, 1): 1.0, (4, 2): 1.0})
    c = np.ones((3, 5))
    for policy in ("confidence", LOSSY):
        assert prefix_schedule(c, small, policy).tolist() == [1, 1, 1]
    assert prefix_schedule(c, small, "confidence_async", old_confidences=c).tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="policy 'fixed'.*tokens_per_slot=6 exceeds"):
        prefix_schedule(c, small, "fixed")


def test_rule_based_policies():
    c = np.array([[0.9, 0.5, 0.9], [0.4, 0.9, 0.9], [0.9, 0.9, 0.9]])
    t = _grid_table()
    assert prefix_schedule(c, t, "plain").tolist() == [0, 0, 0]
    assert prefix_schedule(c, t, "fixed").tolist() == [3, 3, 3]
    assert prefix_schedule(c, None, "fixed", gamma=2).tolist() == [2, 2, 2]
    assert prefix_schedule(c, t, "mtp1").tolist() == [1, 1, 1]
    assert prefix_schedule(c[:, :0], t, "mtp1").tolist() == [0, 0, 0]
    assert prefix_schedule(c, t, "threshold", threshold=0.6).tolist() == [1, 0, 3]
    assert prefix_schedule(c, t, "threshold", threshold=0.6, gamma=2).tolist() == [1, 0, 2]
    assert prefix_schedule(c, t, "threshold", threshold=0.0).tolist() == [3, 3, 3]
    assert pol.threshold(c, 0.95).tolist() == [0, 0, 0]
    assert pol.fixed(c, gamma=1).tolist() == [1, 1, 1]
    out = prefix_schedule(c, t, "confidence")
    assert out.dtype == np.int32 and out.shape == (3,)
    assert prefix_schedule(np.zeros((0, 4)), t, "confidence").shape == (0,)


def test_confidence_async_capacity_from_old_fill_from_current():
    table = CostTable.from_seconds({(2, 1): 1.0, (2, 2): 1.1, (2, 3): 1.2, (2, 4): 5.0})
    old = np.array([[0.9, 0.9, 0.9], [0.1, 0.1, 0.1]])
    # Old Theta by prefix size: 2/1, 2.9/1.1, 3.71/1.2 (best), 4.439/5, ... -> K=2, bucket 3, cap 2.
    assert async_capacity(old, table) == (2, 2)
    cur = np.array([[0.1, 0.1, 0.1], [0.9, 0.9, 0.9]])
    assert prefix_schedule(cur, table, "confidence_async", old_confidences=old).tolist() == [0, 2]
    assert pol.confidence_async(cur, old, table).tolist() == [0, 2]
    # Same current confidences through the synchronous greedy would use them directly.
    assert prefix_schedule(cur, table, "confidence").tolist() == [0, 2]


def test_public_policy_functions_agree_with_entry_point():
    rng = np.random.default_rng(0)
    c = rng.uniform(size=(5, 4))
    t = _grid_table()
    assert np.array_equal(pol.confidence(c, t), prefix_schedule(c, t, "confidence"))
    assert np.array_equal(pol.anticipating_global_search_LOSSY(c, t), prefix_schedule(c, t, LOSSY))
    assert np.array_equal(pol.plain(c), np.zeros(5))
    assert np.array_equal(pol.mtp1(c), np.ones(5))
    np.testing.assert_array_equal(prefix_survival(c), np.cumprod(c, axis=1))


# ---- losslessness: the Appendix A bias ---------------------------------------------------------


def _first_token_distribution(schedule, p_t: np.ndarray, p_d: np.ndarray, c2_given_x1) -> np.ndarray:
    """Exact distribution of the first emitted token of one round, one request, gamma = 2.

    The draft samples x1 ~ p_d; the confidence of position 2 depends on x1 (it is computed after the
    block is sampled). With ell = 0 the target samples from p_t; otherwise x1 is accepted with
    probability min(1, p_t/p_d), else the residual norm(max(p_t - p_d, 0)) is sampled.
    """
    out = np.zeros_like(p_t)
    residual = np.maximum(p_t - p_d, 0.0)
    residual /= residual.sum()
    for x1 in range(p_t.size):
        ell = int(schedule(np.array([[0.8, c2_given_x1[x1]]]))[0])
        if ell == 0:
            out += p_d[x1] * p_t
        else:
            acc = min(1.0, p_t[x1] / p_d[x1])
            out[x1] += p_d[x1] * acc
            out += p_d[x1] * (1.0 - acc) * residual
    return out


def test_early_stop_is_lossless_and_global_search_is_biased():
    table = _appendix_table()
    p_t, p_d = np.array([0.7, 0.3]), np.array([0.5, 0.5])
    c2 = (1.0, 0.0)  # high confidence after token 0, none after token 1
    sync = _first_token_distribution(lambda c: prefix_schedule(c, table, "confidence"), p_t, p_d, c2)
    np.testing.assert_allclose(sync, p_t, atol=1e-12)
    lossy = _first_token_distribution(lambda c: prefix_schedule(c, table, LOSSY), p_t, p_d, c2)
    np.testing.assert_allclose(lossy, [0.85, 0.15], atol=1e-12)
    old = np.array([[0.8, 1.0]])  # two rounds old: cannot depend on this round's x1
    asyn = _first_token_distribution(
        lambda c: prefix_schedule(c, table, "confidence_async", old_confidences=old), p_t, p_d, c2
    )
    np.testing.assert_allclose(asyn, p_t, atol=1e-12)


# ---- input validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(confidences=[[0.5, float("nan")]]), "finite"),
     (dict(confidences=[[0.5, float("inf")]]), "finite"),
     (dict(confidences=[[0.5, 1.5]]), r"in \[0, 1\]"),
     (dict(confidences=[[-0.1, 0.5]]), r"in \[0, 1\]"),
     (dict(confidences=[0.5, 0.5]), "2-D"),
     (dict(confidences=[["a", "b"]]), "numeric"),
     (dict(policy="greedy"), "unknown scheduling policy 'greedy'; valid policies: plain, fixed"),
     (dict(confidences=np.full((17, 2), 0.5)), "slots=17 exceeds the largest slots bucket 16"),
     (dict(gamma=3), "gamma=3 must be within 0..2"),
     (dict(policy="threshold"), "needs threshold="),
     (dict(policy="threshold", threshold=1.5), "threshold must be a number in"),
     (dict(threshold=0.5), "only used by policy 'threshold'"),
     (dict(policy="confidence_async"), "needs old_confidences"),
     (dict(policy="confidence_async", old_confidences=[[0.5, 0.5], [0.5, 0.5]]), "must equal"),
     (dict(policy="confidence_async", old_confidences=[[0.5, 2.0]]), "old_confidences must lie"),
     (dict(old_confidences=[[0.5, 0.5]]), "only used by policy 'confidence_async'"),
     (dict(cost_table=None), "needs a cost_table"),
     (dict(cost_table={"a": 1}), "must be a CostTable")],
)
def test_prefix_schedule_rejects_bad_input(kwargs, match):
    args = dict(confidences=[[0.5, 0.5]], cost_table=_grid_table(), policy="confidence")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        prefix_schedule(args.pop("confidences"), args.pop("cost_table"), args.pop("policy"), **args)


def test_expected_tokens_per_second_validation():
    t = _grid_table()
    with pytest.raises(ValueError, match="lengths must lie in 0..2"):
        expected_tokens_per_second([[0.5, 0.5]], [3], t)
    with pytest.raises(ValueError, match="integer array of shape"):
        expected_tokens_per_second([[0.5, 0.5]], [0.5], t)


# ---- property tests -----------------------------------------------------------------------------


def _run_all(table, gamma, c, old):
    out = {}
    for policy in POLICIES:
        kw = {}
        if policy == "threshold":
            kw["threshold"] = 0.5
        if policy == "confidence_async":
            kw["old_confidences"] = old
        # Rule-based policies ignore cost (and raise if their bucket is missing): no table.
        cost = table if policy in ("confidence", "confidence_async", LOSSY) else None
        out[policy] = prefix_schedule(c, cost, policy, **kw)
    return out


@settings(max_examples=150, deadline=None)
@given(_scenario(n_conf=2))
def test_lengths_in_range_and_match_loop_references(scn):
    table, R, gamma, (c, old) = scn
    out = _run_all(table, gamma, c, old)
    for policy, ell in out.items():
        assert ell.shape == (R,) and ell.dtype == np.int32, policy
        assert (ell >= 0).all() and (ell <= gamma).all(), policy
    max_pos = min(gamma, table.max_tokens_per_slot - 1)
    np.testing.assert_array_equal(out["confidence"], _ref_confidence(c, table))
    np.testing.assert_array_equal(out[LOSSY], _ref_global(c, table)[0])
    np.testing.assert_array_equal(out["confidence_async"], _ref_async(c, old, table))
    assert _admitted_is_sorted_prefix(c, out["confidence"], max_pos)
    assert _admitted_is_sorted_prefix(c, out[LOSSY], max_pos)
    cap = async_capacity(old, table)[1]
    assert _admitted_is_sorted_prefix(c, out["confidence_async"], cap)
    # The greedy only admits on strict improvement; the global search is at least as good.
    theta = {p: expected_tokens_per_second(c, out[p], table) for p in ("plain", "confidence", LOSSY)}
    assert theta["confidence"] >= theta["plain"] * (1 - 1e-12)
    assert theta[LOSSY] >= theta["confidence"] * (1 - 1e-12)


@settings(max_examples=150, deadline=None)
@given(_scenario(), st.data())
def test_steeper_cost_table_never_admits_more(scn, data):
    """Multiply seconds by 2**k_t with k_t non-decreasing in the tokens bucket (powers of two keep
    the arithmetic exact, so the property holds bit for bit, not just in real numbers)."""
    table, R, gamma, (c,) = scn
    steps = data.draw(st.lists(st.integers(0, 2), min_size=len(table.tokens_buckets),
                               max_size=len(table.tokens_buckets)))
    k_t = np.cumsum(steps)
    k_s = data.draw(st.lists(st.integers(0, 2), min_size=len(table.slots_buckets),
                             max_size=len(table.slots_buckets)))
    steep = CostTable(table.slots_buckets, table.tokens_buckets,
                      table.seconds_st * 2.0 ** (np.asarray(k_s)[:, None] + k_t[None, :]))
    base = prefix_schedule(c, table, "confidence")
    steeper = prefix_schedule(c, steep, "confidence")
    assert steeper.sum() <= base.sum()
    assert (steeper <= base).all()


@settings(max_examples=150, deadline=None)
@given(_scenario(n_conf=3), st.data())
def test_admission_of_position_k_ignores_later_confidences(scn, data):
    """Non-anticipation: whether (r, k) is verified never depends on c[r, k:] (0-based), i.e. on
    anything computed after the token at position k was sampled."""
    table, R, gamma, (c, old, noise) = scn
    if gamma == 0:
        return
    r = data.draw(st.integers(0, R - 1))
    k = data.draw(st.integers(1, gamma))
    c2 = c.copy()
    c2[r, k:] = noise[r, k:]
    for policy, kw in (("confidence", {}), ("confidence_async", {"old_confidences": old})):
        e1 = prefix_schedule(c, table, policy, **kw)[r]
        e2 = prefix_schedule(c2, table, policy, **kw)[r]
        assert min(e1, k) == min(e2, k), policy


# ---- the fast kernels against the loop references at serving sizes -------------------------------


def _serving_case(seed: int, R: int, gamma: int, kind: str) -> tuple[CostTable, np.ndarray, np.ndarray]:
    """A roofline-shaped table (launch + max(floor, per-token work)) and two confidence blocks.
    kind 'ties' draws from {0, 0.5, 1} so equal survivals are everywhere (within and across rows)."""
    rng = np.random.default_rng(seed)
    slots = (1, 8, 64, 512)
    tokens = tuple(sorted(rng.choice(np.arange(1, 11), size=rng.integers(1, 6), replace=False).tolist()))
    floor, per_token = rng.uniform(0.1, 5.0), 10.0 ** rng.uniform(-4, -1)
    table = CostTable.from_seconds(
        {(s, t): 0.3 + max(floor, per_token * s * t) for s in slots for t in tokens}
    )

    def block() -> np.ndarray:
        if kind == "beta":
            return rng.beta(6.0, 1.5, size=(R, gamma))
        if kind == "ties":
            return rng.choice([0.0, 0.5, 1.0], size=(R, gamma))
        x = rng.beta(2.0, 1.0, size=(R, gamma))
        x[rng.random((R, gamma)) < 0.3] = 1.0
        x[rng.random((R, gamma)) < 0.1] = 0.0
        return x

    return table, block(), block()


def _assert_matches_references(confidence_fn, table: CostTable, c: np.ndarray, old: np.ndarray) -> None:
    np.testing.assert_array_equal(confidence_fn(c, table), _ref_confidence(c, table))
    np.testing.assert_array_equal(prefix_schedule(c, table, LOSSY), _ref_global(c, table)[0])
    np.testing.assert_array_equal(
        prefix_schedule(c, table, "confidence_async", old_confidences=old), _ref_async(c, old, table)
    )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    R=st.one_of(st.integers(1, 40), st.sampled_from([64, 256, 300])),
    gamma=st.integers(0, 9),
    kind=st.sampled_from(["beta", "ties", "mixed"]),
)
def test_fast_kernels_equal_loop_references_at_serving_sizes(seed, R, gamma, kind):
    """Up to 300 requests x gamma 9: the vectorised policies give exactly the literal loops' lengths,
    and `async_plan` gives exactly what its three separate calls give."""
    table, c, old = _serving_case(seed, R, gamma, kind)
    _assert_matches_references(lambda x, t: prefix_schedule(x, t, "confidence"), table, c, old)
    k, cap = async_capacity(old, table)
    ell = prefix_schedule(old, table, "confidence_async", old_confidences=old)
    assert async_plan(old, table) == (k, cap, expected_tokens_per_second(old, ell, table))
    assert k == int(_ref_global(old, table)[0].sum())


def _row_major_ties_confidence(c: np.ndarray, table: CostTable) -> np.ndarray:
    """Mutant of Algorithm 1 that ranks tied survivals row-major (lower r first) instead of toward
    earlier positions: the kind of slip a fast path could make."""
    R, G = c.shape
    g = min(G, table.max_tokens_per_slot - 1)
    a = np.cumprod(c[:, :g], axis=1)
    ell, tau, max_ell = np.zeros(R, dtype=int), float(R), 0
    best = tau / table.seconds(R, 1)
    for idx in np.argsort(-a.ravel(), kind="stable"):
        r, j = divmod(int(idx), g)
        if ell[r] != j:
            continue
        theta = (tau + a[r, j]) / table.seconds(R, 1 + max(max_ell, j + 1))
        if not theta > best:
            break
        ell[r], tau, max_ell, best = j + 1, tau + a[r, j], max(max_ell, j + 1), theta
    return ell


def test_reference_comparison_catches_a_tie_order_mutant():
    """Negative control for the test above: on tie-heavy inputs of the same generator the comparison
    fails for a mutant that breaks ties the wrong way, while the real fast path passes."""
    failures = 0
    for seed in range(40):
        table, c, old = _serving_case(seed, 16, 4, "ties")
        _assert_matches_references(lambda x, t: prefix_schedule(x, t, "confidence"), table, c, old)
        try:
            _assert_matches_references(_row_major_ties_confidence, table, c, old)
        except AssertionError:
            failures += 1
    assert failures > 0


def test_async_plan_validation():
    t = _grid_table()
    with pytest.raises(ValueError, match="at least one request"):
        async_plan(np.zeros((0, 3)), t)
    with pytest.raises(ValueError, match="needs a CostTable"):
        async_plan(np.ones((2, 3)), None)
    with pytest.raises(ValueError, match="old_confidences must lie in"):
        async_plan(np.full((2, 3), 1.5), t)
    with pytest.raises(ValueError, match="slots=17 exceeds"):
        async_plan(np.ones((17, 3)), t)
    # gamma = 0: nothing to draft; Theta is one token per request over the smallest bucket
    assert async_plan(np.ones((2, 3)), t, gamma=0) == (0, 0, 2 / t.seconds(2, 1))


# ---- no jax ------------------------------------------------------------------------------------


def test_importing_scheduling_does_not_import_jax():
    code = (
        "import importlib, pkgutil, sys\n"
        "import specjax.scheduling as s\n"
        "for m in pkgutil.walk_packages(s.__path__, 'specjax.scheduling.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = [m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules]\n"
        "assert not bad, f'specjax.scheduling imported {bad}'\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_meta_is_frozen():
    m = _meta()
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.dtype = "bfloat16"  # type: ignore[misc]


def test_measured_cost_tables_are_made_monotone():
    from specjax.decoding.profiling import monotone
    noisy = {(1, 1): 3.0, (1, 2): 2.4, (1, 4): 3.3, (2, 1): 2.9, (2, 2): 4.8, (2, 4): 4.7}
    fixed = monotone(noisy)
    # a bigger bucket never reads cheaper: (1, 2) lifts to (1, 1), (2, 1) to (1, 1), (2, 4) to (2, 2)
    assert fixed == {(1, 1): 3.0, (1, 2): 3.0, (1, 4): 3.3, (2, 1): 3.0, (2, 2): 4.8, (2, 4): 4.8}
    assert monotone(fixed) == fixed
