"""The throughput-interactivity frontier (the paper's Figures 7 and 8) on the embedded default.

A closed-loop concurrency sweep: for each concurrency C, C requests are kept in flight (a finished one
is replaced at once) until N requests are done. Every policy's sweep runs three times (policies
taking turns) and each point reports its median run. For each verification policy it reports aggregate
tokens/s against per-user tokens/s, and the mean verification length per request per round.

    python -m bench.frontier                      # full sweep (1..64)
    python -m bench.frontier --concurrency 1,4 --requests 8 --max-tokens 24   # quick
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

import numpy as np

from bench.common import command_line, load_bench_target, log, machine_info, md_table, pyplot, write_results
from specjax.scheduling import ROUND_KINDS

POLICIES = ("plain", "mtp1", "fixed-dflash", "fixed-dspark", "threshold", "confidence", "confidence_async")
PREFILL = 128  # prompt bucket (the longest prompt kept)


def _drafters(target) -> tuple[dict[str, Any], str]:
    """Shipped DFlash / DSpark / MTP drafters when present, else untrained ones built on the spot."""
    from specjax import default_target
    from specjax.drafters import registry
    out, notes = {}, []
    built = default_target.available_drafters() if target.source == "embedded" else []
    for name in ("dflash", "dspark", "mtp1"):
        if name in built:
            out[name] = registry.load_drafter(default_target.drafter_dir(name), target=target.model)
        else:
            notes.append(name)
    if notes:
        from flax import nnx
        from specjax.drafters.dspark import BlockDrafterConfig
        from specjax.drafters.dspark import make_block_drafter
        ids = (1, max(1, target.config.num_hidden_layers // 2))
        for name in [n for n in notes if n in ("dflash", "dspark")]:
            cfg = BlockDrafterConfig.from_target(
                target.config, target_layer_ids=ids, mask_token_id=target.config.vocab_size - 1, num_draft_layers=1,
                block_size=7, markov_rank=0 if name == "dflash" else 64, confidence_head=name == "dspark")
            out[name] = make_block_drafter(target.model, target.config, cfg, nnx.Rngs(1))
    note = ("shipped drafters" if not notes else f"untrained stand-ins for {', '.join(notes)} (not shipped yet)")
    return out, note


def _engine(target, drafter, policy: str, max_slots: int, max_len: int, gamma: int, cost_table=None):
    from specjax.decoding.buckets import pow2_buckets
    from specjax.decoding.engine import Engine, EngineConfig
    eos = list(target.config.eos_token_ids)
    cfg = EngineConfig(max_slots=max_slots, max_len=max_len, gamma=None if drafter is None else gamma, policy=policy,
                       threshold=0.6 if policy == "threshold" else None, slots_buckets=pow2_buckets(1, max_slots),
                       tokens_buckets=(1, 2, 4, gamma + 1) if drafter is not None and gamma > 1 else (1, 2),
                       prefill_buckets=(PREFILL,), max_prefill=PREFILL, prefill_batch_buckets=(1, 8),
                       prefix_caching=False)  # runs repeat the prompts: decoding is timed, not the cache
    eng = Engine(target.model, drafter, cfg, eos_token_ids=eos, cost_table=cost_table, progress=True)
    eng.warmup()
    return eng


def closed_loop(engine, prompts: list[list[int]], concurrency: int, n_requests: int, max_tokens: int,
                temperature: float = 1.0, keep_outputs: bool = False) -> dict:
    """Keep `concurrency` requests in flight until `n_requests` are done (`keep_outputs`: also
    each request's output ids, under "outputs" by request id)."""
    from specjax.decoding.engine import EngineRequest
    ells: list[int] = []
    kinds: dict[str, int] = {}

    def hook(info):
        ells.extend(info["ell"])
        kinds[info["kind"]] = kinds.get(info["kind"], 0) + 1
    engine.on_round = hook
    done, submitted, in_flight = [], 0, 0
    t0 = time.perf_counter()
    while len(done) < n_requests:
        while in_flight < concurrency and submitted < n_requests:
            p = prompts[submitted % len(prompts)]
            engine.add_request(EngineRequest(str(submitted), list(p), max_tokens=max_tokens, temperature=temperature,
                                             seed=submitted))
            submitted += 1
            in_flight += 1
        fin = engine.step()
        in_flight -= len(fin)
        done += fin
    wall = time.perf_counter() - t0
    engine.on_round = None
    tokens = sum(len(r.output_ids) for r in done)
    per_user_e2e = [len(r.output_ids) / (r.metrics.finish_time - r.metrics.start_time) for r in done]
    tau = [r.metrics.mean_acceptance_length for r in done if r.metrics.num_drafts]
    return {"concurrency": concurrency, "requests": n_requests, "tokens": tokens, "seconds": wall,
            "aggregate_tokens_per_s": tokens / wall, "per_user_tokens_per_s": per_user_decode_rate(done),
            "per_user_e2e_tokens_per_s": float(np.mean(per_user_e2e)),
            "mean_verification_length": float(np.mean(ells)) if ells else 0.0,
            "tau": float(np.mean(tau)) if tau else 1.0, "rounds_by_kind": kinds,
            **({"outputs": {r.request_id: list(r.output_ids) for r in done}} if keep_outputs else {})}


def per_user_decode_rate(done) -> float:
    """Per-user tokens/s as serving reports it: 1 / TPOT (`RequestMetrics.time_per_output_token`: the
    tokens after the first over the time from the first token to the finish) averaged over requests.
    Queueing and prefill (the time to the first token) are left out; the end-to-end rate is reported
    beside it. Requests with a single token have no decode time and are skipped."""
    tpots = [r.metrics.time_per_output_token(len(r.output_ids)) for r in done]
    rates = [1.0 / t for t in tpots if t]
    if not rates:
        raise ValueError("per-user decode rate: no finished request produced two or more tokens")
    return float(np.mean(rates))


def median_run(runs: list[dict]) -> dict:
    """The run with the median aggregate throughput, with every run's throughput listed."""
    runs = sorted(runs, key=lambda r: r["aggregate_tokens_per_s"])
    mid = dict(runs[len(runs) // 2])
    mid["aggregate_runs"] = [r["aggregate_tokens_per_s"] for r in runs]
    return mid


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--requests", type=int, default=0, help="requests per point (default: max(4C, 48))")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--temperatures", default="1,0", help="sampling temperatures, one sweep each")
    ap.add_argument("--repeats", type=int, default=3, help="runs per point; the median run is reported")
    ap.add_argument("--paired", type=int, default=6,
                    help="back-to-back confidence_async/plain run pairs per level for the never-below-plain "
                         "goal, the order alternating (0: judge it from the sweeps; an even count balances it)")
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    import jax
    cache_dir = os.path.join("runs", "jit-cache")
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    levels = [int(x) for x in args.concurrency.split(",")]
    target = load_bench_target()
    drafters, drafter_note = _drafters(target)
    prompts = _prompts(target)
    max_slots = max(levels)
    max_len = max(len(p) for p in prompts) + args.max_tokens + args.gamma + 2
    log(f"target: {target.description}; drafters: {drafter_note}; {len(prompts)} prompts")
    policies = args.policies.split(",")
    # every policy's sweep runs `repeats` times, the policies taking turns, so a drift of the machine's
    # speed (+-15% over minutes on 2 shared cores) hits them alike; each point reports its median run.
    # One engine lives at a time (all of them at once exhaust the process's memory maps); rebuilding
    # one loads its executables from the persistent compilation cache.
    def build(policy: str):
        drafter = {"plain": None, "mtp1": drafters.get("mtp1", drafters["dspark"]),
                   "fixed-dflash": drafters["dflash"]}.get(policy, drafters["dspark"])
        eng_policy = {"fixed-dflash": "fixed", "fixed-dspark": "fixed"}.get(policy, policy)
        gamma = 1 if policy == "mtp1" and "mtp1" in drafters else args.gamma
        return _engine(target, drafter, eng_policy, max_slots, max_len, gamma)

    def n_requests(c: int) -> int:
        return args.requests or max(4 * c, 48)

    temps = [float(t) for t in args.temperatures.split(",")]
    by_temp: dict[float, tuple[dict, dict]] = {}
    for temp in temps:
        runs: dict[str, dict[int, list[dict]]] = {p: {c: [] for c in levels} for p in policies}
        for rep in range(args.repeats):
            for policy in policies:
                log(f"T={temp:g} {policy}: building (run {rep + 1}/{args.repeats})")
                eng = build(policy)
                for c in levels:
                    r = closed_loop(eng, prompts, c, n_requests(c), args.max_tokens, temp)
                    runs[policy][c].append(r)
                    log(f"{policy:18s} C={c:3d}: {r['aggregate_tokens_per_s']:8.1f} tok/s aggregate, "
                        f"{r['per_user_tokens_per_s']:7.1f} tok/s per user (1/TPOT), mean ell "
                        f"{r['mean_verification_length']:.2f}")
                del eng
                jax.clear_caches()
                gc.collect()
        results = {p: [median_run(runs[p][c]) for c in levels] for p in policies}
        paired = {}
        if "plain" in policies and "confidence_async" in policies and args.paired:
            engines = {p: build(p) for p in ("plain", "confidence_async")}
            paired = paired_ratios(engines, prompts, levels, args.max_tokens, args.paired, n_requests,
                                   temp)
            del engines
            jax.clear_caches()
            gc.collect()
        by_temp[temp] = (results, paired)
    _report(by_temp, levels, target, drafter_note, args, argv)


def paired_ratios(engines: dict, prompts, levels: list[int], max_tokens: int, repeats: int,
                  n_requests, temperature: float = 1.0) -> dict[int, list[float]]:
    """confidence_async / plain aggregate throughput from back-to-back run pairs (both engines alive,
    alternating), `repeats` pairs per level: the machine's drift cancels within a pair, which the
    sweeps above (one policy after another) cannot promise."""
    out: dict[int, list[float]] = {}
    for c in levels:
        out[c] = []
        for i in range(repeats):
            tps = {}
            for name in pair_order(i):  # which engine runs first alternates: the order's effect cancels
                tps[name] = closed_loop(engines[name], prompts, c, n_requests(c), max_tokens,
                                        temperature)["aggregate_tokens_per_s"]
            out[c].append(tps["confidence_async"] / tps["plain"])
        lo, hi = ratio_interval(out[c])
        log(f"paired C={c:3d}: confidence_async / plain median {np.median(out[c]):.3f} "
            f"({min(out[c]):.3f}..{max(out[c]):.3f}; geometric mean 95% interval {lo:.3f}..{hi:.3f})")
    return out


def pair_order(i: int) -> tuple[str, str]:
    """The engines' order in the i-th pair: plain first in even pairs, confidence_async first in odd
    ones, so that an order effect (on shared CPUs the second run of a pair tends to be faster)
    cancels instead of biasing every ratio the same way."""
    return ("plain", "confidence_async") if i % 2 == 0 else ("confidence_async", "plain")


def ratio_interval(ratios: list[float], level: float = 0.95, replicates: int = 4000,
                   seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the geometric mean of paired throughput ratios (resampling the pairs).
    It tells a shortfall that the pairs show from one within their noise."""
    r = np.asarray(ratios, np.float64)
    if r.size == 0 or not (np.isfinite(r).all() and (r > 0).all()):
        raise ValueError(f"paired ratios must be positive and finite, got {ratios!r}")
    logs = np.log(r)
    rng = np.random.default_rng(seed)
    means = logs[rng.integers(0, logs.size, size=(replicates, logs.size))].mean(axis=1)
    a = (1.0 - level) / 2.0
    return float(np.exp(np.quantile(means, a))), float(np.exp(np.quantile(means, 1.0 - a)))


def _prompts(target, longest: int = PREFILL) -> list[list[int]]:
    """Chat prompts for the real target: the first user turns of the Table-1 sets (mt-bench, gsm8k,
    humaneval, math500, mbpp) under the chat template, those of at most `longest` tokens; random
    token ids for a random stand-in."""
    if target.tokenizer is not None and getattr(target.tokenizer, "chat_template", None):
        from bench.embedded import _eval_paths
        from specjax.eval.datasets import load_dataset
        out = [p for path in _eval_paths() for p in load_dataset(path, target.tokenizer, cap=32).prompts
               if len(p) <= longest]
        return out[:64]
    rng = np.random.default_rng(0)
    return [list(rng.integers(0, target.config.vocab_size, size=32)) for _ in range(16)]


def per_user_at(points: list[dict], aggregate: float) -> float | None:
    """Per-user tokens/s of a policy's frontier at `aggregate` tokens/s: linear interpolation between
    its measured (aggregate, per-user) points, the best segment where several cover it; None when
    `aggregate` lies outside the measured range."""
    pts = sorted(points, key=lambda r: r["concurrency"])
    best = None
    for a, b in zip(pts, pts[1:]):
        xa, xb = a["aggregate_tokens_per_s"], b["aggregate_tokens_per_s"]
        lo, hi = min(xa, xb), max(xa, xb)
        if lo <= aggregate <= hi:
            w = 0.0 if hi == lo else (aggregate - xa) / (xb - xa)
            v = a["per_user_tokens_per_s"] + w * (b["per_user_tokens_per_s"] - a["per_user_tokens_per_s"])
            best = v if best is None else max(best, v)
    for r in pts:
        if r["aggregate_tokens_per_s"] == aggregate:
            best = max(best or 0.0, r["per_user_tokens_per_s"])
    return best


def _matched(results: dict[str, list[dict]], base: str = "mtp1"):
    """(policy, base point, policy per-user tokens/s or None) at each of `base`'s aggregate throughputs."""
    for r in results.get(base, []):
        for p in ("confidence", "confidence_async"):
            if p in results:
                yield p, r, per_user_at(results[p], r["aggregate_tokens_per_s"])


def matched_throughput_rows(results: dict[str, list[dict]], base: str = "mtp1") -> list[list[str]]:
    """At each of `base`'s measured aggregate throughputs: its per-user tokens/s and that of each
    confidence policy's frontier at the same aggregate throughput (interpolated), with the ratio."""
    return [[p, str(r["concurrency"]), f"{r['aggregate_tokens_per_s']:.0f}", f"{r['per_user_tokens_per_s']:.1f}",
             "-" if v is None else f"{v:.1f}", "-" if v is None else f"{v / r['per_user_tokens_per_s']:.2f}"]
            for p, r, v in _matched(results, base)]


def _best_by_level(results: dict[str, list[dict]], policies) -> dict[int, float]:
    """Per concurrency level, the highest aggregate tokens/s among `policies` measured there."""
    best: dict[int, float] = {}
    for p in policies:
        for r in results.get(p, []):
            best[r["concurrency"]] = max(best.get(r["concurrency"], 0.0), r["aggregate_tokens_per_s"])
    return best


def goal_rows(results: dict[str, list[dict]], gamma: int = 7,
              paired: dict[int, list[float]] | None = None) -> list[list[str]]:
    """The issue's frontier goals, each as [goal, measured, "yes"/"no"], from the sweep's results.

    Best confidence policy vs best fixed policy (>= 0.97x at every concurrency), vs plain (never below;
    from the paired runs when given: "yes" when every level's median ratio is >= 1, "no" when some
    level's 95% interval of the geometric mean lies below 1, else "no (within noise)"), vs fixed gamma at the highest
    concurrency (>= 1.1x), and per-user tokens/s at mtp1's aggregate throughputs (>= 1.5x at every
    point where the frontiers overlap)."""
    conf = [p for p in ("confidence", "confidence_async") if p in results]
    fixed = [p for p in ("fixed-dflash", "fixed-dspark") if p in results]
    if not conf or not fixed:
        return []

    best_conf, best_fixed, plain = (_best_by_level(results, conf), _best_by_level(results, fixed),
                                    _best_by_level(results, ["plain"]))
    levels = sorted(best_conf)
    vs_fixed = [best_conf[c] / best_fixed[c] for c in levels if c in best_fixed]
    vs_plain = [best_conf[c] / plain[c] for c in levels if c in plain]
    top = levels[-1]
    rows = [[f"best confidence >= 0.97x best fixed (gamma {gamma}) at every concurrency",
             f"min {min(vs_fixed):.2f}", "yes" if min(vs_fixed) >= 0.97 else "no"]]
    if paired:
        med = {c: float(np.median(v)) for c, v in paired.items()}
        ci = {c: ratio_interval(v) for c, v in paired.items()}
        worst = min(med, key=med.get)
        shown = [c for c in paired if ci[c][1] < 1.0]  # levels whose pairs show the policy slower
        judged = min(shown, key=med.get) if shown else worst
        verdict = "no" if shown else "yes" if med[worst] >= 1.0 else "no (within noise)"
        rows.append(["best confidence never below plain (confidence_async vs plain, paired runs)",
                     f"min median {med[worst]:.3f} (C={worst}); C={judged}: pairs {min(paired[judged]):.2f}–"
                     f"{max(paired[judged]):.2f}, geometric mean 95% interval {ci[judged][0]:.3f}–{ci[judged][1]:.3f}",
                     verdict])
    elif vs_plain:
        worst = min((c for c in levels if c in plain), key=lambda c: best_conf[c] / plain[c])
        spread = "; ".join(f"{p} runs {min(r['aggregate_runs']):.0f}–{max(r['aggregate_runs']):.0f}"
                           for p in ["plain"] + conf for r in results[p]
                           if r["concurrency"] == worst and r.get("aggregate_runs"))
        rows.append(["best confidence never below plain",
                     f"min {min(vs_plain):.2f} (C={worst}{'; ' + spread if spread else ''})",
                     "yes" if min(vs_plain) >= 1.0 else "no"])
    if top in best_fixed:
        r = best_conf[top] / best_fixed[top]
        rows.append([f"best confidence >= 1.1x fixed gamma {gamma} at C={top}", f"{r:.2f}", "yes" if r >= 1.1 else "no"])
    ratios: dict[str, list[float]] = {}
    for p, r, v in _matched(results):
        if v is not None:
            ratios.setdefault(p, []).append(v / r["per_user_tokens_per_s"])
    if ratios:
        best = max(ratios, key=lambda p: min(ratios[p]))
        vals = ratios[best]
        rows.append([f"per-user tok/s at mtp1's aggregate throughput >= 1.5x mtp1 ({best})",
                     f"min {min(vals):.2f} over {len(vals)} points", "yes" if min(vals) >= 1.5 else "no"])
    return rows


def drafting_ceiling(results: dict[str, list[dict]]) -> str:
    """One sentence on what drafting itself buys on this machine: each drafting policy's per-user
    tokens/s at the lowest concurrency, relative to plain decoding's there (no scheduler can buy a
    user more speed than drafting offers when the engine is otherwise idle)."""
    plain = {r["concurrency"]: r for r in results.get("plain", [])}
    if not plain:
        return ""
    c = min(plain)
    parts = []
    for p in ("mtp1", "fixed-dflash", "fixed-dspark"):
        r = next((r for r in results.get(p, []) if r["concurrency"] == c), None)
        if r is not None:
            parts.append(f"{p} {r['per_user_tokens_per_s'] / plain[c]['per_user_tokens_per_s']:.2f}x")
    if not parts:
        return ""
    return (f"Drafting's own ceiling here: at C={c} (an otherwise idle engine) per-user tokens/s relative to "
            f"plain decoding are {', '.join(parts)}. A scheduler chooses how much of that to buy; it cannot "
            "exceed it.")


def _report(by_temp, levels, target, drafter_note, args, argv) -> None:
    md = (f"# Throughput-interactivity frontier\n\nCommand: `{command_line('bench.frontier', argv)}`\n\n"
          f"Target: {target.description}. Drafters: {drafter_note}. Prompts: chat-templated first turns "
          f"of the Table-1 sets. {args.max_tokens} new tokens, gamma {args.gamma}; closed loop per "
          f"concurrency level, policies taking turns, {args.repeats} runs per point, the median run "
          "reported (the range of all runs under runs). Rounds: the scheduler's decisions in the median "
          "run (draft / upkeep = no drafting, drafter kept up to date / lite = no drafting, no drafter "
          "upkeep). Per-user tokens/s: each request's decode speed, 1 / TPOT (tokens after the first over "
          "the time from the first token to the finish), vLLM's and the paper's per-user speed; 'end to end' "
          "counts from the request's arrival (queueing and prefill included).\n")
    for temp, (results, paired) in by_temp.items():
        md += f"\n## Temperature {temp:g}\n\n" + _section(results, levels, args, paired)

    def plot(path):
        plt = pyplot()
        fig, axes = plt.subplots(len(by_temp), 2, figsize=(11, 4 * len(by_temp)), squeeze=False)
        for (temp, (results, _)), (a, b) in zip(by_temp.items(), axes):
            for policy, pts in results.items():
                a.plot([r["per_user_tokens_per_s"] for r in pts], [r["aggregate_tokens_per_s"] for r in pts],
                       "o-", label=policy)
                b.plot([r["concurrency"] for r in pts], [r["mean_verification_length"] for r in pts], "o-",
                       label=policy)
            a.set_xlabel("per-user tokens/s (1 / TPOT)")
            a.set_ylabel("aggregate tokens/s")
            a.set_title(f"throughput vs interactivity (T={temp:g})")
            b.set_xscale("log", base=2)
            b.set_xlabel("concurrency")
            b.set_ylabel("mean verification length")
            b.set_title(f"verification length vs load (T={temp:g})")
            a.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    write_results("frontier", {"machine": machine_info(), "target": target.description, "drafters": drafter_note,
                               "by_temperature": {str(t): {"results": r, "paired_vs_plain": {str(c): v for c, v in p.items()}}
                                                  for t, (r, p) in by_temp.items()}},
                  md, out_dir=args.out_dir, plot=plot)
    log(f"wrote {args.out_dir}/frontier.{{json,md,png}}")


def _section(results, levels, args, paired) -> str:
    rows = []
    for policy, pts in results.items():
        for r in pts:
            runs = r.get("aggregate_runs") or [r["aggregate_tokens_per_s"]]
            k = r.get("rounds_by_kind", {})
            rows.append([policy, r["concurrency"], f"{r['aggregate_tokens_per_s']:.1f}",
                         f"{min(runs):.0f}–{max(runs):.0f}", f"{r['per_user_tokens_per_s']:.1f}",
                         f"{r['per_user_e2e_tokens_per_s']:.1f}",
                         f"{r['mean_verification_length']:.2f}", f"{r['tau']:.2f}",
                         "/".join(str(k.get(x, 0)) for x in ROUND_KINDS)])
    md = md_table(["policy", "concurrency", "aggregate tok/s", "runs", "per-user tok/s", "per-user end to end",
                   "mean ell", "τ", "rounds " + "/".join(ROUND_KINDS)], rows, "lrrrrrrrr")
    best_fixed = _best_by_level(results, ("fixed-dflash", "fixed-dspark"))
    best_conf = _best_by_level(results, ("confidence", "confidence_async"))
    plain = _best_by_level(results, ["plain"])
    if best_fixed and best_conf:
        md += "\n| concurrency | best confidence / best fixed | best confidence / plain |\n|---:|---:|---:|\n"
        for c in levels:
            bc = best_conf[c]
            md += (f"| {c} | {bc / best_fixed[c]:.2f} | {bc / plain[c]:.2f} |\n" if c in plain
                   else f"| {c} | {bc / best_fixed[c]:.2f} | - |\n")
    matched = matched_throughput_rows(results)
    if matched:
        md += ("\n### Per-user speed at matched aggregate throughput (against mtp1)\n\n"
               "At each aggregate throughput mtp1 reached, the confidence policy's per-user tokens/s on its own "
               "frontier at that same aggregate throughput (linear interpolation between its measured points; "
               "'-' where its frontier does not reach that throughput). Goal: >= 1.5x.\n\n"
               + md_table(["policy", "mtp1 concurrency", "aggregate tok/s", "mtp1 per-user", "policy per-user",
                           "ratio"], matched, "lrrrrr"))
    if paired:
        md += ("\n### Paired runs: confidence_async against plain\n\n"
               "Back-to-back closed-loop runs of the two engines (both alive), so the machine's speed drift "
               "cancels within each pair; which engine runs first alternates from pair to pair, so the order's "
               "effect cancels too. Ratio of aggregate tokens/s; the interval is a bootstrap over the pairs "
               "of their geometric mean (an interval containing 1 means the pairs cannot tell the two apart).\n\n"
               + md_table(["concurrency", "median ratio", "pairs (min–max)", "geometric mean [95%]"],
                          [[str(c), f"{np.median(v):.3f}", f"{min(v):.3f}–{max(v):.3f}",
                            "{:.3f} [{:.3f}, {:.3f}]".format(float(np.exp(np.mean(np.log(v)))), *ratio_interval(v))]
                           for c, v in paired.items()], "rrrr"))
    goals = goal_rows(results, args.gamma, paired)
    if goals:
        md += "\n### Goals\n\n" + md_table(["goal", "measured", "met"], goals, "lll")
    ceiling = drafting_ceiling(results)
    if ceiling:
        md += "\n" + ceiling + "\n"

    return md


if __name__ == "__main__":
    main()
