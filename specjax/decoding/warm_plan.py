"""The executables an engine compiles ahead (`Engine.warmup`): every (family, bucket key) its policy,
sampling variants, log-probabilities, prefix caching and buckets may run."""
from __future__ import annotations

from typing import Any

from specjax.decoding import buckets as bk
from specjax.decoding.runner import bucket_key


def warm_keys(engine: Any) -> list[tuple[str, tuple[Any, ...]]]:
    """Every (family, bucket) `engine` (a `decoding.engine.Engine`) may execute under its policy: round
    buckets once per configured sampling variant without log-probabilities, and (max_logprobs > 0) once
    more in the widest variant with them: a round with a row asking for log-probabilities runs that
    variant, which covers every row (see `Engine._launch`); each at every attention bucket."""
    attention, plens = engine.buckets.attention, engine.buckets.prefill
    # a prefill chunk of bucket p is longer than the bucket below (prev): it needs > prev rows
    keys: list[tuple[str, tuple[Any, ...]]] = [("prefill", (pb, p, a)) for pb in engine.prefill_batches
                                                for prev, p in zip((0,) + plens, plens)
                                                for a in attention if a > prev]
    keys.append(("release", (engine.cfg.max_slots,)))
    if engine.prefixes is not None and engine.cfg.max_slots > 1:  # a busy slot's rows copied into a free one
        keys.append(("copy", (engine.cfg.max_slots,)))
    if engine.cfg.max_logprobs > 0:  # echo's prompt log-likelihoods, one prompt per call
        keys += [("score", (1, p)) for p in engine.buckets.prefill]
    tokens = engine.buckets.tokens
    combos = [(v, False) for v in engine.cfg.sampling_variants]
    if engine.cfg.max_logprobs > 0:
        combos.append((engine.cfg.sampling_variants[-1], True))
    for variant, lp in combos:
        for sb in engine.buckets.slots:
            for family, max_ell in engine.planner.families.items():
                if max_ell is None:
                    tbs = [1]  # no tokens field
                elif family in ("verify", "fused_fill"):  # every tokens bucket: the cost table measures them all
                    tbs = list(tokens)
                else:
                    tbs = sorted({1, bk.pick(tokens, max_ell + 1)} | {t for t in tokens if t <= max_ell + 1})
                keys += [(family, bucket_key(family, rows=sb, tokens=tb, logprobs=lp, attn=a, variant=variant))
                         for tb in tbs for a in attention]
    return list(dict.fromkeys(keys))  # draft has no logprobs field: each key once
