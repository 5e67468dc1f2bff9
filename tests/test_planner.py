"""The round planner (numpy only): its plan/observe sequence makes the async policy's decisions that
the engine's state machine made before it moved to scheduling/, and every mode plans as before."""
import numpy as np
import pytest

from specjax.decoding.buckets import pick
from specjax.scheduling import CostTable, RoundPlanner, async_plan

GAMMA, SLOTS, SLOTS_BUCKETS = 3, 8, (2, 4, 8)
TABLE = CostTable.from_seconds({(s, t): 1.0 + 0.1 * s + 0.3 * (t - 1) for s in SLOTS_BUCKETS for t in (1, 2, 4)})
PLAIN_SECONDS = {2: 1.2, 4: 1.4, 8: 1.8}


class ReferenceAsync:
    """The async policy's state machine as `Engine` held it (specjax/decoding/engine.py before the
    planner): `_async_plan`, the bookkeeping `step` did around it, and `_caps`' stale-row rule.
    `lag` = 2 reads confidences two rounds old, as the policy must; other values are controls."""

    PROBE_EVERY, PROBE_MAX = 32, 512

    def __init__(self, lag: int = 2, lite_after: int = 8):
        self.lag, self.LITE_AFTER = lag, lite_after
        self._conf_known = np.full((SLOTS, GAMMA), np.nan)
        self._conf_lagged = np.full((SLOTS, GAMMA), np.nan)
        self._conf_prior = None
        self._fresh = np.zeros((SLOTS,), bool)
        self._rounds_since_draft = self._plain_streak = 0
        self._probe_interval = self.PROBE_EVERY

    def admit(self, slot):
        self._fresh[slot] = True
        self._conf_known[slot] = self._conf_lagged[slot] = np.nan

    def _async_plan(self, sb, active):
        rows = np.flatnonzero(active)
        fresh = self._fresh[rows]
        if not fresh.any():
            return 0, 0, "lite"
        prior = np.full((GAMMA,), 0.5) if self._conf_prior is None else self._conf_prior
        c = (self._conf_lagged if self.lag == 2 else self._conf_known)[rows]
        c = np.where(np.isnan(c), prior[None, :], c)
        c[~fresh] = 0.0
        k_total, cap, theta = async_plan(c, TABLE, gamma=GAMMA)
        plain_s = PLAIN_SECONDS.get(sb)
        if self._conf_prior is None:
            return k_total, cap, "draft"
        if k_total > 0 and theta > len(rows) / plain_s:
            self._plain_streak, self._probe_interval = 0, self.PROBE_EVERY
            return k_total, cap, "draft"
        self._plain_streak += 1
        if self._rounds_since_draft >= self._probe_interval:
            self._probe_interval = min(2 * self._probe_interval, self.PROBE_MAX)
            return k_total, cap, "draft"
        return k_total, cap, "lite" if self._plain_streak > self.LITE_AFTER else "plain"

    def round(self, caps, active, conf):
        """One round: (kind, ell, K), then the round's confidences recorded."""
        sb = active.shape[0]
        caps = np.where(self._fresh[:sb], caps, 0)
        k_total, cap, kind = self._async_plan(sb, active)
        self._rounds_since_draft = 0 if kind == "draft" else self._rounds_since_draft + 1
        if kind == "lite":
            self._fresh[:sb] &= ~active
            ell = np.zeros((sb,), np.int64)
        elif kind == "plain":
            ell = np.minimum(np.zeros((sb,), np.int64), caps) * active
        else:
            ell = np.minimum(caps, cap) * active
        self._conf_lagged = self._conf_known.copy()
        seen = active & self._fresh[:sb]
        if kind == "draft" and seen.any():
            self._conf_known[np.flatnonzero(seen)] = conf[seen]
            self._conf_prior = conf[seen].mean(axis=0)
        return {"plain": "upkeep"}.get(kind, kind), ell, k_total


def workload(seed: int, rounds: int = 2500):
    """(admitted slots, caps [sb], active [sb], confidences [sb, gamma]) per round: requests arrive and
    finish at random, and the drafter's confidences switch between long good and bad spells, so the
    policy drafts, keeps the drafter up, goes lite and probes."""
    rng = np.random.default_rng(seed)
    occupied = np.zeros((SLOTS,), bool)
    good = True
    for _ in range(rounds):
        free = np.flatnonzero(~occupied)
        admitted = free[rng.random(free.size) < 0.3]
        occupied[admitted] = True
        if not occupied.any():
            continue
        sb = pick(SLOTS_BUCKETS, int(np.flatnonzero(occupied).max()) + 1)
        active = occupied[:sb].copy()
        caps = np.where(active, rng.integers(0, GAMMA + 1, sb), 0).astype(np.int64)
        good = good != (rng.random() < 0.02)
        lo, hi = (0.6, 1.0) if good else (0.0, 0.4)
        yield admitted, caps, active, rng.uniform(lo, hi, (sb, GAMMA)).astype(np.float32)
        occupied[np.flatnonzero(occupied)[rng.random(occupied.sum()) < 0.1]] = False


def decisions(planner_or_reference, seed: int):
    out = []
    for admitted, caps, active, conf in workload(seed):
        for s in admitted:
            planner_or_reference.admit(int(s))
        if isinstance(planner_or_reference, RoundPlanner):
            plan = planner_or_reference.plan(caps, active)
            planner_or_reference.observe(plan, None if plan.kind == "lite" else conf)
            out.append((plan.kind, plan.ell_b.tolist(), plan.k_total if plan.kind == "draft" else 0,
                        planner_or_reference.fresh.tolist()))
        else:
            kind, ell, k_total = planner_or_reference.round(caps, active, conf)
            out.append((kind, ell.tolist(), k_total if kind == "draft" else 0, planner_or_reference._fresh.tolist()))
    return out


def async_planner() -> RoundPlanner:
    planner = RoundPlanner("confidence_async", GAMMA, SLOTS, cost_table=TABLE)
    planner.plain_seconds = PLAIN_SECONDS
    return planner


@pytest.mark.parametrize("seed", [0, 1])
def test_async_plans_reproduce_the_engine_state_machine(seed):
    got, want = decisions(async_planner(), seed), decisions(ReferenceAsync(), seed)
    assert got == want
    kinds = [k for k, *_ in got]
    # the workload reaches every branch: drafting, upkeep, lite, and probes after long undrafted spells
    assert {"draft", "upkeep", "lite"} <= set(kinds) and kinds.count("draft") > 100
    assert np.diff([i for i, k in enumerate(kinds) if k == "draft"]).max() > RoundPlanner.PROBE_EVERY


@pytest.mark.parametrize("control", [dict(lag=1), dict(lite_after=7)])
def test_comparison_catches_a_changed_state_machine(control):
    """Negative controls: a machine that plans on one-round-old confidences (the lag the policy must
    not have), or turns lite one decision early, disagrees with the planner on the same workload."""
    assert decisions(async_planner(), 0) != decisions(ReferenceAsync(**control), 0)


def test_fixed_host_and_plain_modes():
    caps, active = np.array([3, 0, 2, 1], np.int64), np.array([True, True, True, False])
    for policy, want in (("fixed", [3, 0, 2, 0]), ("mtp1", [1, 0, 1, 0])):
        planner = RoundPlanner(policy, GAMMA, 4)
        for s in range(4):
            planner.admit(s)
        plan = planner.plan(caps, active)
        assert (plan.kind, plan.program, plan.ell_b.tolist()) == ("draft", "fused", want)
        assert planner.families == {"fused": min(GAMMA, 1 if policy == "mtp1" else GAMMA)}
    planner = RoundPlanner("threshold", GAMMA, 4, threshold=0.5)
    for s in range(4):
        planner.admit(s)
    plan = planner.plan(caps, active)
    assert (plan.program, plan.fill) == ("verify", "host")
    conf = np.array([[0.9, 0.9, 0.9], [0.9, 0.2, 0.9], [0.9, 0.9, 0.1], [0.9, 0.9, 0.9]])
    assert planner.host_lengths(plan, conf).tolist() == [3, 0, 2, 0]  # leading run >= 0.5, within caps
    planner = RoundPlanner("plain", 0, 4)
    for s in range(4):
        planner.admit(s)
    plan = planner.plan(caps, active)
    assert (plan.kind, plan.program, plan.ell_b.tolist()) == ("lite", "lite", [0, 0, 0, 0])
    assert planner.fresh.tolist() == [False, False, False, True]  # left behind: plain to the end
    with pytest.raises(ValueError, match="unknown policy"):
        RoundPlanner("sometimes", GAMMA, 4)
    with pytest.raises(ValueError, match="threshold"):
        RoundPlanner("threshold", GAMMA, 4)
