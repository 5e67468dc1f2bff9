"""Host-side scheduling: cost table, prefix-scheduling policies and the engine's round planner
(numpy only; never imports jax)."""
from specjax.scheduling.cost_table import CostTable, CostTableMeta
from specjax.scheduling.names import COST_AWARE_POLICIES, LOSSLESS_POLICIES, LOSSY_POLICY, POLICIES
from specjax.scheduling.planner import ROUND_KINDS, RoundPlan, RoundPlanner
from specjax.scheduling.policies import (
    async_capacity,
    async_plan,
    expected_tokens_per_second,
    prefix_schedule,
    prefix_survival,
)

__all__ = [
    "COST_AWARE_POLICIES",
    "CostTable",
    "CostTableMeta",
    "LOSSLESS_POLICIES",
    "LOSSY_POLICY",
    "POLICIES",
    "ROUND_KINDS",
    "RoundPlan",
    "RoundPlanner",
    "async_capacity",
    "async_plan",
    "expected_tokens_per_second",
    "prefix_schedule",
    "prefix_survival",
]
