"""Host-side scheduling: cost table and prefix-scheduling policies (numpy only; never imports jax)."""
from specjax.scheduling.cost_table import CostTable, CostTableMeta
from specjax.scheduling.policies import (
    COST_AWARE_POLICIES,
    LOSSLESS_POLICIES,
    LOSSY_POLICY,
    POLICIES,
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
    "async_capacity",
    "async_plan",
    "expected_tokens_per_second",
    "prefix_schedule",
    "prefix_survival",
]
