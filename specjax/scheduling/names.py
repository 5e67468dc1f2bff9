"""Scheduling policy names, defined once for the policies, the planner and the engine.

A policy chooses each request's verification length ell_r in 0..gamma. "plain" means plain
decoding and nothing else: no drafting, the target alone, one token per row.
"""
from __future__ import annotations

FIXED_POLICIES: tuple[str, ...] = ("plain", "fixed", "mtp1")  # lengths known before drafting
HOST_POLICIES: tuple[str, ...] = ("threshold", "confidence")  # from this round's confidences, on the host
DEVICE_POLICIES: tuple[str, ...] = ("confidence_async",)  # capacity from old confidences, filled on the device
LOSSLESS_POLICIES: tuple[str, ...] = FIXED_POLICIES + HOST_POLICIES + DEVICE_POLICIES  # the engine's policies
LOSSY_POLICY = "anticipating_global_search_LOSSY"  # biased on purpose: tests show the checks catch it
POLICIES: tuple[str, ...] = LOSSLESS_POLICIES + (LOSSY_POLICY,)
COST_AWARE_POLICIES: tuple[str, ...] = ("confidence", "confidence_async", LOSSY_POLICY)
