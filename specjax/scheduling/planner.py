"""The engine's round planner: what each round runs, decided on the host (numpy only; never imports jax).

Round kinds (`RoundPlan.kind`, the engine's `on_round` "kind"):
  draft   the drafter proposes a block and the target verifies each row's first ell_r drafts;
  upkeep  no drafting (ell = 0 everywhere), but the target's taps still extend the drafter's context;
  lite    the target alone, one token per row, nothing committed to the drafter: a plain decoding
          step. Those rows' drafter context falls behind, so they never draft again.
Programs (`RoundPlan.program`, named as the runner's executable families): "lite"; "fused" (draft
and verify in one call, lengths known before drafting); "verify" (after a "draft" call, with lengths
filled from this round's confidences on the host); "fused_fill" (draft, a device fill of the lengths
from this round's confidences and verify, in one call).

The async policy (`confidence_async`) plans from confidences two rounds old, which `observe` keeps:
a round drafts when it admits a draft and its expected tokens/s beat a plain decoding step's (rows
whose drafter context is behind count one token each); otherwise it is an upkeep round, turning lite
after `LITE_AFTER` such decisions in a row. A drafting probe refreshes the confidences after
`probe_interval` rounds without drafting; the interval doubles (up to `PROBE_MAX`) each time a probe
changes nothing. Nothing here looks at this round's tokens, so the schedule stays lossless. With
`one_behind` (the engine dispatches a round before reading the previous one, so a plan comes before
the last round's `observe`) the confidences two rounds old are the last observed ones.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from specjax.scheduling.cost_table import CostTable
from specjax.scheduling.names import DEVICE_POLICIES, FIXED_POLICIES, LOSSLESS_POLICIES
from specjax.scheduling.policies import async_plan, fixed_length, prefix_schedule

ROUND_KINDS: tuple[str, ...] = ("draft", "upkeep", "lite")


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """One round over rows [0:sb]: what runs, and each row's verification length (an upper bound
    when `fill` chooses the lengths: "host" from this round's confidences, after drafting; "device"
    by the fused_fill program's top-`k_total` fill of the current prefix survivals)."""

    kind: str  # ROUND_KINDS
    program: str  # "lite" | "fused" | "verify" | "fused_fill"
    ell_b: np.ndarray  # int64 [sb]; 0 for idle rows
    active_b: np.ndarray  # bool [sb]
    fill: str = "none"  # "none" | "host" | "device"
    k_total: int = 0  # device fill: draft positions admitted over the batch


class RoundPlanner:
    """Plans each round of an engine's policy and keeps the host state that planning needs."""

    PROBE_EVERY, PROBE_MAX, LITE_AFTER = 32, 512, 8

    def __init__(self, policy: str, gamma: int, slots: int, *, threshold: float | None = None,
                 schedule_fn: Callable[[np.ndarray], np.ndarray] | None = None,
                 cost_table: CostTable | None = None):
        if policy not in LOSSLESS_POLICIES and schedule_fn is None:
            raise ValueError(f"unknown policy {policy!r}; choose one of {LOSSLESS_POLICIES}")
        if policy == "threshold" and threshold is None:
            raise ValueError("policy 'threshold' needs EngineConfig.threshold")
        self.policy, self.gamma, self.threshold = policy, gamma, threshold
        # schedule_fn(confidences [R, gamma]) -> lengths [R]: a custom host policy (tests use a
        # deliberately anticipating one to show the losslessness checks have teeth)
        self.schedule_fn = schedule_fn
        self.cost_table = cost_table
        self.plain_seconds: dict[int, float] | None = None  # per slots bucket: a lite round's seconds
        if policy == "plain":
            self.mode = "plain"
        elif schedule_fn is not None:
            self.mode = "host"
        else:
            self.mode = "fixed" if policy in FIXED_POLICIES else "device" if policy in DEVICE_POLICIES else "host"
        # per slot: drafter context complete (False once a lite round left it behind); confidences
        # [slots, gamma] as known after the last round and after the one before (the plan reads only
        # the latter); the mean confidences of the last drafting round, a prior for rows not yet seen
        g = max(gamma, 1)
        self.fresh = np.zeros((slots,), bool)
        self._conf_known = np.full((slots, g), np.nan)
        self._conf_lagged = np.full((slots, g), np.nan)
        self._conf_prior: np.ndarray | None = None
        self._rounds_since_draft = 0
        self._undrafted_streak = 0
        self.probe_interval = self.PROBE_EVERY
        self.one_behind = False  # set by the engine: plans come one `observe` early (see module docstring)
        self._probed = False  # a round drafted before any confidences were known

    @property
    def reads_confidence(self) -> bool:
        """Whether this planner's rounds choose lengths from draft confidences."""
        return self.mode in ("host", "device")

    @property
    def families(self) -> dict[str, int | None]:
        """The runner families this planner's rounds call, each with the largest ell it verifies
        (None: no tokens bucket; "verify" and "fused_fill" may take any of the engine's tokens buckets)."""
        return {"plain": {"lite": None}, "fixed": {"fused": self.fused_ell},
                "host": {"draft": None, "verify": self.gamma},
                "device": {"fused_fill": self.gamma, "fused": 0, "lite": None}}[self.mode]

    @property
    def fused_ell(self) -> int:
        return fixed_length(self.policy, self.gamma) if self.mode == "fixed" else 0

    def admit(self, slot: int) -> None:
        """A request took `slot`: its prefill commits the whole prompt to the drafter."""
        self.fresh[slot] = True
        self._conf_known[slot] = self._conf_lagged[slot] = np.nan

    def plan(self, caps_b: np.ndarray, active_b: np.ndarray) -> RoundPlan:
        """The next round over rows [0:sb], from each row's largest admissible ell (`caps_b`, int64)."""
        caps = np.where(self.fresh[:active_b.shape[0]], caps_b, 0)  # a row left behind stays plain
        if self.mode == "plain":
            return self._lite(active_b)
        if self.mode == "fixed":
            return RoundPlan("draft", "fused", np.minimum(self.fused_ell, caps) * active_b, active_b)
        if self.mode == "host":
            return RoundPlan("draft", "verify", caps * active_b, active_b, fill="host")
        return self._async(caps, active_b)

    def host_lengths(self, plan: RoundPlan, conf_bg: np.ndarray) -> np.ndarray:
        """A "host" fill: each active row's length under the policy, from this round's confidences
        [sb, gamma], within the plan's bound. int64 [sb]."""
        ell = np.zeros(plan.active_b.shape, np.int64)
        active = plan.active_b
        ell[active] = np.minimum(self._host_lengths(conf_bg[active]), plan.ell_b[active])
        return ell

    def observe(self, plan: RoundPlan, conf_bg: np.ndarray | None) -> None:
        """Record a finished round's confidences [sb, gamma] (None after a lite round) for later plans."""
        if self.mode != "device":
            return
        self._conf_lagged = self._conf_known.copy()
        seen = plan.active_b & self.fresh[:plan.active_b.shape[0]]
        if plan.kind == "draft" and seen.any():  # rows with a complete drafter context drafted for real
            self._conf_known[np.flatnonzero(seen)] = conf_bg[seen]
            self._conf_prior = conf_bg[seen].mean(axis=0)

    def _host_lengths(self, conf_rg: np.ndarray) -> np.ndarray:
        if self.schedule_fn is not None:
            return np.asarray(self.schedule_fn(conf_rg), np.int64)
        if self.policy == "threshold":
            return prefix_schedule(conf_rg, None, "threshold", gamma=self.gamma, threshold=self.threshold)
        return prefix_schedule(conf_rg, self.cost_table, "confidence", gamma=self.gamma)

    def _lite(self, active_b: np.ndarray) -> RoundPlan:
        self.fresh[:active_b.shape[0]] &= ~active_b  # these rows' drafter context is now behind
        return RoundPlan("lite", "lite", np.zeros(active_b.shape, np.int64), active_b)

    def _async(self, caps_b: np.ndarray, active_b: np.ndarray) -> RoundPlan:
        k_total, cap, kind = self._async_decision(active_b)
        self._rounds_since_draft = 0 if kind == "draft" else self._rounds_since_draft + 1
        if kind == "lite":
            return self._lite(active_b)
        if kind == "upkeep":
            return RoundPlan("upkeep", "fused", np.zeros(active_b.shape, np.int64), active_b)
        return RoundPlan("draft", "fused_fill", np.minimum(caps_b, cap) * active_b, active_b, fill="device",
                         k_total=k_total)

    def _async_decision(self, active_b: np.ndarray) -> tuple[int, int, str]:
        """(K, cap, kind) from confidences two rounds old (see the module docstring)."""
        rows = np.flatnonzero(active_b)
        fresh = self.fresh[rows]
        if not fresh.any():
            return 0, 0, "lite"  # nobody can draft
        prior = np.full((self.gamma,), 0.5) if self._conf_prior is None else self._conf_prior
        c = (self._conf_known if self.one_behind else self._conf_lagged)[rows]
        c = np.where(np.isnan(c), prior[None, :], c)
        c[~fresh] = 0.0
        # theta: expected tokens/s of the schedule the async policy picks on these confidences
        k_total, cap, theta = async_plan(c, self.cost_table, gamma=self.gamma)
        plain_s = self.plain_seconds.get(active_b.shape[0]) if self.plain_seconds else None
        # nothing to judge by yet: draft (a probe); one round behind, the probe's confidences are not
        # back when the next round is planned, which judges on the 0.5 prior rather than probe again
        if plain_s is None or (self._conf_prior is None and not (self.one_behind and self._probed)):
            self._probed = True
            return k_total, cap, "draft"
        # a round that admits no draft is an upkeep round plus a proposal: never better than plain,
        # whatever the noise between the cost table's 1-token entry and the measured plain round
        if k_total > 0 and theta > len(rows) / plain_s:
            self._undrafted_streak, self.probe_interval = 0, self.PROBE_EVERY
            return k_total, cap, "draft"
        self._undrafted_streak += 1
        if self._rounds_since_draft >= self.probe_interval:
            self.probe_interval = min(2 * self.probe_interval, self.PROBE_MAX)
            return k_total, cap, "draft"
        return k_total, cap, "lite" if self._undrafted_streak > self.LITE_AFTER else "upkeep"
