"""Measure a cost table on the running engine: seconds per round for every executed bucket; the
target identity a cost table is keyed by (`target_identity`).

A drafting round of the host-scheduled policies is one draft call plus one verify call of the bucket
(slots bucket, tokens-per-slot bucket), timed together; the async policy's is one fused_fill call.
Both run on the engine's real state with every row idle (idle rows commit nothing, so the
measurement leaves the engine's state as it was).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from specjax.decoding.runner import bucket_key
from specjax.scheduling import CostTable, CostTableMeta


def target_identity(target: Any) -> str:
    """A stable identity of a target: its config and a checksum of its weights."""
    import hashlib
    import json
    h = hashlib.sha256(json.dumps(dataclasses.asdict(target.config), sort_keys=True).encode())
    for leaf in jax.tree.leaves(nnx.state(target, nnx.Param))[:4]:
        h.update(np.asarray(leaf, np.float32).tobytes()[:4096])
    return f"qwen3-{target.config.num_hidden_layers}x{target.config.hidden_size}-{h.hexdigest()[:12]}"


def cost_table_meta(engine: Any) -> CostTableMeta:
    """The metadata a cost table for `engine` must carry (target, dtype, hardware, buckets, the round
    its policy times)."""
    dev = jax.devices()[0]
    n = 1 if engine.mesh is None else engine.mesh.size
    dtype = str(jax.tree.leaves(engine.runner.t_params)[0].dtype)
    return CostTableMeta(target=engine.target_id, dtype=dtype, hardware=f"{dev.platform}:{dev.device_kind} x{n}",
                         context_length=engine.cfg.max_len, slots_buckets=tuple(engine.buckets.slots),
                         tokens_buckets=tuple(engine.buckets.tokens),
                         timed_round="fused_fill" if engine.planner.mode == "device" else "draft+verify")


def monotone(seconds: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """The smallest table >= the measured one that never gets cheaper with more slots or more tokens
    per slot (a running max along both axes). A bigger bucket does strictly more work, so a cheaper
    reading is timing noise, and a scheduler would buy tokens with it."""
    sb = sorted({s for s, _ in seconds})
    tb = sorted({t for _, t in seconds})
    grid = np.array([[seconds[(s, t)] for t in tb] for s in sb])
    grid = np.maximum.accumulate(np.maximum.accumulate(grid, axis=0), axis=1)
    return {(s, t): float(grid[i, k]) for i, s in enumerate(sb) for k, t in enumerate(tb)}


def measure_cost_table(engine, *, repeats: int = 7, warmup: int = 2, progress: bool = True) -> CostTable:
    """Median seconds of a drafting round (draft + verify, or fused_fill under the async policy) for
    each (slots, tokens) bucket of `engine`, made monotone."""
    from tqdm.auto import tqdm
    if engine.drafter is None:
        raise ValueError("a cost table needs a drafter: plain decoding has no verification lengths to choose")
    if any(engine.slot_req):
        raise RuntimeError("profile the engine before it serves requests")
    if engine.prefixes is not None:  # the timed rounds write the cache rows freed slots keep
        engine.prefixes.forget_all()
    seconds: dict[tuple[int, int], float] = {}
    keys = [(sb, tb) for sb in engine.buckets.slots for tb in engine.buckets.tokens]
    run = engine.runner.run
    variant = engine.cfg.sampling_variants[-1]  # the widest compiled: bounds every variant's cost
    attn = engine.buckets.attention[-1]  # the whole cache: bounds every live length's cost
    meta = engine.cost_table_meta()  # its timed_round says which round this policy runs
    k_total = engine.runner.put(np.zeros((1,), np.int32))
    for sb, tb in tqdm(keys, desc="profiling buckets", disable=not progress, leave=False):
        # every row idle (the resident row state before serving); copied in once, outside the timed calls
        ell = engine.runner.put(np.full((sb,), tb - 1, np.int32))
        fields = dict(rows=sb, tokens=tb, logprobs=False, attn=attn, variant=variant)
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            if meta.timed_round == "fused_fill":
                outs = run("fused_fill", bucket_key("fused_fill", **fields), ell_b=ell, k_total_1=k_total)
            else:
                draft, q, _ = run("draft", bucket_key("draft", **fields), ell_b=ell)
                outs = run("verify", bucket_key("verify", **fields), draft_bg=draft, q_bgn=q, ell_b=ell)
            jax.block_until_ready(outs)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        seconds[(sb, tb)] = float(np.median(times))
    return CostTable.from_seconds(monotone(seconds), meta=meta)


def measure_plain_seconds(engine, *, repeats: int = 7, warmup: int = 2) -> dict[int, float]:
    """Median seconds of a lite round (no drafting, no drafter upkeep: plain decoding's cost) per slots
    bucket."""
    if engine.prefixes is not None:  # the timed rounds write the cache rows freed slots keep
        engine.prefixes.forget_all()
    out: dict[int, float] = {}
    for sb in engine.buckets.slots:
        ell = engine.runner.put(np.zeros((sb,), np.int32))  # all rows idle; copied in once
        key = bucket_key("lite", rows=sb, logprobs=False, attn=engine.buckets.attention[-1],  # as the cost table
                         variant=engine.cfg.sampling_variants[-1])
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            outs = engine.runner.run("lite", key, ell_b=ell)
            jax.block_until_ready(outs)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out[sb] = float(np.median(times))
    return {sb: s for (sb, _), s in monotone({(sb, 1): s for sb, s in out.items()}).items()}
