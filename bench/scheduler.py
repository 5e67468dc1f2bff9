"""Benchmark the host-side prefix scheduler: microseconds per `prefix_schedule` call per policy.

    python -m bench.scheduler [--calls 300] [--repeats 7] [--out-dir bench/results]

Confidences are random (Beta-distributed per-step values) and the cost table is a synthetic
roofline-shaped staircase (a weight-read floor plus a per-token cost, over power-of-two slots
buckets); both only exercise the scheduler — no model is run. Writes scheduler.json, scheduler.md
and scheduler.png to the output directory and prints the Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from specjax.scheduling import (
    POLICIES,
    CostTable,
    CostTableMeta,
    expected_tokens_per_second,
    prefix_schedule,
)

SIZES: tuple[tuple[int, int], ...] = ((1, 8), (32, 8), (256, 4), (256, 8))
SLOTS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKENS_BUCKETS = (1, 2, 4, 6, 9)
TARGET_US = 100.0  # goal for policy 'confidence' at R=256, gamma=8


def synthetic_table() -> CostTable:
    """Roofline-shaped staircase: 0.3 ms launch + max(5 ms weight read, 5 us per padded token)."""
    meta = CostTableMeta(
        target="synthetic-roofline",
        dtype="bfloat16",
        hardware="synthetic",
        context_length=4096,
        slots_buckets=SLOTS_BUCKETS,
        tokens_buckets=TOKENS_BUCKETS,
    )
    return CostTable.from_seconds(
        {(s, t): 3e-4 + max(5e-3, 5e-6 * s * t) for s in SLOTS_BUCKETS for t in TOKENS_BUCKETS},
        meta=meta,
    )


def _kwargs(policy: str, old: np.ndarray) -> dict:
    if policy == "threshold":
        return {"threshold": 0.6}
    if policy == "confidence_async":
        return {"old_confidences": old}
    return {}


def time_call(fn, calls: int, repeats: int) -> tuple[float, float, float]:
    """(median wall, min wall, median process CPU) microseconds per call over `repeats` batches of
    `calls` calls. CPU time is the steadier number on a shared machine."""
    fn()  # warm
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        wall.append((time.perf_counter() - t0) / calls * 1e6)
        cpu.append((time.process_time() - c0) / calls * 1e6)
    return statistics.median(wall), min(wall), statistics.median(cpu)


def run(calls: int, repeats: int, seed: int = 0) -> list[dict]:
    """Time every policy at every size; also report mean ell and Theta relative to plain."""
    table = synthetic_table()
    rng = np.random.default_rng(seed)
    rows = []
    for R, gamma in SIZES:
        conf = rng.beta(6.0, 1.5, size=(R, gamma))
        old = rng.beta(6.0, 1.5, size=(R, gamma))
        theta_plain = expected_tokens_per_second(conf, np.zeros(R, dtype=np.int32), table)
        for policy in POLICIES:
            kw = _kwargs(policy, old)

            def fn(policy=policy, kw=kw):
                return prefix_schedule(conf, table, policy, **kw)

            med, best, cpu = time_call(fn, calls, repeats)
            ell = fn()
            rows.append(
                {
                    "R": R,
                    "gamma": gamma,
                    "policy": policy,
                    "median_us": round(med, 2),
                    "min_us": round(best, 2),
                    "cpu_median_us": round(cpu, 2),
                    "mean_ell": round(float(ell.mean()), 3),
                    "theta_vs_plain": round(
                        expected_tokens_per_second(conf, ell, table) / theta_plain, 4
                    ),
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    """Markdown table of the results."""
    head = "| R | gamma | policy | median us | min us | CPU us | mean ell | Theta / plain |\n"
    head += "|---:|---:|---|---:|---:|---:|---:|---:|\n"
    body = "".join(
        f"| {r['R']} | {r['gamma']} | {r['policy']} | {r['median_us']:.1f} | {r['min_us']:.1f} "
        f"| {r['cpu_median_us']:.1f} | {r['mean_ell']:.2f} | {r['theta_vs_plain']:.3f} |\n"
        for r in rows
    )
    return head + body


def plot(rows: list[dict], path: str) -> None:
    """Grouped bars per size and policy: median wall-clock and process-CPU microseconds per call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [f"R={R}, g={g}" for R, g in SIZES]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), sharey=True)
    width = 0.8 / len(POLICIES)
    for ax, key, title in ((axes[0], "median_us", "wall clock"), (axes[1], "cpu_median_us", "process CPU")):
        for k, policy in enumerate(POLICIES):
            vals = [
                next(r[key] for r in rows if (r["R"], r["gamma"]) == s and r["policy"] == policy)
                for s in SIZES
            ]
            ax.bar(np.arange(len(SIZES)) + k * width, vals, width, label=policy)
        ax.axhline(TARGET_US, color="k", ls="--", lw=1, label=f"target {TARGET_US:.0f} us")
        ax.set_xticks(np.arange(len(SIZES)) + width * (len(POLICIES) - 1) / 2, sizes)
        ax.set_title(f"prefix_schedule latency ({title}, median)")
    axes[0].set_ylabel("microseconds per call")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per timed batch")
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per (size, policy)")
    parser.add_argument("--out-dir", default=os.path.join("bench", "results"))
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        parser.error("--calls and --repeats must be >= 1")

    rows = run(args.calls, args.repeats)
    table_md = markdown(rows)
    print(table_md)
    headline = next(r for r in rows if (r["R"], r["gamma"], r["policy"]) == (256, 8, "confidence"))
    ok = headline["median_us"] <= TARGET_US
    print(f"confidence @ R=256, gamma=8: {headline['median_us']:.1f} us wall, "
          f"{headline['cpu_median_us']:.1f} us CPU "
          f"({'meets' if ok else 'MISSES'} the {TARGET_US:.0f} us wall-clock target; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")

    os.makedirs(args.out_dir, exist_ok=True)
    result = {
        "benchmark": "scheduler",
        "unit": "microseconds per prefix_schedule call",
        "target_us": TARGET_US,
        "meets_target": ok,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "cost_table": "synthetic roofline staircase (not measured)",
        "slots_buckets": list(SLOTS_BUCKETS),
        "tokens_buckets": list(TOKENS_BUCKETS),
        "calls": args.calls,
        "repeats": args.repeats,
        "env": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "rows": rows,
    }
    with open(os.path.join(args.out_dir, "scheduler.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    with open(os.path.join(args.out_dir, "scheduler.md"), "w", encoding="utf-8") as f:
        f.write("# Scheduler latency\n\n" + table_md)
    if not args.no_plot:
        plot(rows, os.path.join(args.out_dir, "scheduler.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
