"""DSpark's gain over DFlash at gamma 7 and at gamma 15, with intervals from a paired bootstrap.

    python -m bench.gamma_gain [--g15-dir runs/embedded_g15/drafters] [--cap 8] [--max-tokens 64]
                               [--temperatures 0 1] [--eval-dir runs/gamma_gain] [--out-dir bench/results]

Table 1's goal "the DSpark-over-DFlash gain larger at gamma 15 than at gamma 7" compares two
ratios of mean acceptance lengths measured on a few dozen prompts, so it needs an interval. At each
temperature this evaluates, in one `specjax.eval.evaluate.run_evaluation` on the same prompts
(Table 1's protocol: the five sets of ../shared/data/eval, `--cap` prompts each, fixed verification,
per-prompt seeds), the shipped DSpark and DFlash (block 7, verified at gamma 7) and the block-15
pair that `python -m train.build_embedded --stages train calibrate export --drafters dspark-g15
dflash-g15 --out-dir runs/embedded_g15` builds on the shipped data (verified at gamma 15). Then it
resamples the prompts (the same draw for all four drafters: `metrics.paired_tau_bootstrap`) for 95%
intervals of tau(DSpark)/tau(DFlash) at each gamma and of the difference of the two ratios.

Each temperature's evaluation is kept in `--eval-dir` and reused when rerun with the same settings.
Not part of `make bench` (its block-15 drafters are not shipped); `python -m bench.run_all
--docs-only` adds its section. Writes gamma_gain.json, .md and .png to `--out-dir`.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from bench.common import DEFAULT_OUT_DIR, command_line, load_average, log, machine_info, md_table, pyplot, write_results
from bench.embedded import EVAL_SETS, table1
G15_BUILD = ("python -m train.build_embedded --stages train calibrate export --drafters dspark-g15 dflash-g15 "
             "--out-dir runs/embedded_g15")
PAIRS = {7: ("dspark", "dflash"), 15: ("dspark-g15", "dflash-g15")}


def gain_statistics(parts: dict[str, dict[str, tuple[int, int]]], *, replicates: int = 4000,
                    seed: int = 0) -> dict[str, Any]:
    """Paired-bootstrap intervals over prompts from the four drafters' per-prompt parts
    (`metrics.per_request_tau_parts`): each tau, each gamma's DSpark/DFlash ratio, and the ratio at
    15 minus the ratio at 7."""
    from specjax.eval.metrics import paired_tau_bootstrap

    def boot(stat):
        return paired_tau_bootstrap(parts, stat, replicates=replicates, seed=seed)

    out: dict[str, Any] = {"tau": {n: boot(lambda t, n=n: t[n]) for n in parts}}
    out["ratio"] = {str(g): boot(lambda t, a=a, b=b: t[a] / t[b]) for g, (a, b) in PAIRS.items()}
    (a7, b7), (a15, b15) = PAIRS[7], PAIRS[15]
    out["gain_difference"] = boot(lambda t: t[a15] / t[b15] - t[a7] / t[b7])
    return out


def tau_parts(results: dict[str, Any], drafter: str) -> dict[str, tuple[int, int]]:
    """One drafter's per-prompt (rounds, committed tokens) over every set of an evaluation."""
    merged: dict[str, tuple[int, int]] = {}
    for entry in results["drafters"][drafter]["datasets"].values():
        merged.update({k: (int(v[0]), int(v[1])) for k, v in entry["requests"].items()})
    return merged


def evaluate_kept(drafters: list[str], temperature: float, cap: int, max_tokens: int, out: str) -> dict[str, Any]:
    """One Table-1 evaluation of `drafters` at `temperature`, or the one already in `out` with the
    same drafters and settings."""
    path = os.path.join(out, "results.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            done = json.load(f)
        p = done["protocol"]
        if (sorted(done["drafters"]) == sorted(os.path.basename(d) for d in drafters)
                and p["temperature"] == temperature and p["max_new_tokens"] == max_tokens
                and all(d["evaluated"] == min(cap, d["rows"]) for d in done["datasets"].values())
                and all("requests" in e for r in done["drafters"].values() for e in r["datasets"].values())):
            log(f"T={temperature}: reusing {path}")
            return done
    log(f"T={temperature}: evaluating {', '.join(drafters)} (load {load_average()[0]:.1f})")
    table1(drafters, cap, max_tokens, temperature, out)  # bench.embedded's Table 1 protocol
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def fmt_ci(s: dict[str, float], digits: int = 3) -> str:
    """`value [lo, hi]` of a bootstrap result."""
    return f"{s['value']:.{digits}f} [{s['lo']:.{digits}f}, {s['hi']:.{digits}f}]"


def add_comparison_arguments(ap: argparse.ArgumentParser, eval_dir: str) -> None:
    """The flags of a paired Table-1 comparison: prompts, tokens, temperatures, bootstrap
    replicates, where evaluations are kept (`eval_dir` by default) and where results go."""
    ap.add_argument("--cap", type=int, default=8, help="prompts per evaluation set (Table 1: 8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--replicates", type=int, default=4000)
    ap.add_argument("--eval-dir", default=eval_dir)
    ap.add_argument("--out-dir", default=DEFAULT_OUT_DIR)


def plot_intervals(path: str, groups: dict[str, dict[str, dict[str, float]]], *, ylabel: str,
                   title: str, hline: float | None = None) -> None:
    """A PNG of bootstrap results ({value, lo, hi}) with their intervals: one cluster per group
    (x label), one colour per series within it."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, series in enumerate(groups.values()):
        for j, (name, r) in enumerate(series.items()):
            ax.errorbar([i * 3 + j], [r["value"]], yerr=[[r["value"] - r["lo"]], [r["hi"] - r["value"]]],
                        fmt="o", capsize=4, color=f"C{j}", label=name if i == 0 else None)
    if hline is not None:
        ax.axhline(hline, color="grey", lw=0.8)
    ax.set_xticks([i * 3 + 0.5 for i in range(len(groups))], list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(stats: dict[str, dict[str, Any]], args: argparse.Namespace, argv: list[str] | None) -> str:
    """The Markdown section: per temperature, each tau and ratio with its 95% interval, and the
    difference of ratios with its one-sided bootstrap p-value."""
    rows = []
    for t, s in stats.items():
        r7, r15, d = s["ratio"]["7"], s["ratio"]["15"], s["gain_difference"]
        shown = "yes" if d["lo"] > 0 else "no (interval contains 0)" if d["hi"] > 0 else "no (smaller at 15)"
        rows.append([t, fmt_ci(s["tau"]["dspark"]), fmt_ci(s["tau"]["dflash"]), fmt_ci(r7),
                     fmt_ci(s["tau"]["dspark-g15"]), fmt_ci(s["tau"]["dflash-g15"]), fmt_ci(r15),
                     f"{d['value']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]", f"{d['p_le_0']:.2f}", shown])
    n = next(iter(stats.values()))["gain_difference"]["requests"]
    return "\n".join([
        "# DSpark's gain over DFlash at gamma 7 and 15, with intervals over prompts (an experiment, not shipped)",
        "",
        f"Command: `{command_line('bench.gamma_gain', argv)}`",
        "",
        f"Table 1's protocol ({args.cap} prompts from each of {', '.join(EVAL_SETS)}: {n} prompts, "
        f"{args.max_tokens} new tokens, fixed verification, per-prompt seeds), all four drafters in one "
        "evaluation per temperature on the same prompts. Gamma 7: the shipped DSpark and DFlash (block 7). "
        f"Gamma 15: the block-15 pair `{G15_BUILD}` builds on the shipped data and budget (not shipped). "
        "τ here is pooled over all the prompts (committed tokens over drafting rounds), which differs "
        "from Table 1's macro mean of per-set τ in the third decimal. "
        "Each cell: value [95% interval], from a paired bootstrap over prompts "
        f"({next(iter(stats.values()))['gain_difference']['replicates']} replicates; the same resampled "
        "prompts for all four drafters, `specjax.eval.metrics.paired_tau_bootstrap`). "
        "P(≤0): the fraction of replicates in which the gain at 15 did not exceed the gain at 7.",
        "",
        md_table(["T", "τ DSpark γ7", "τ DFlash γ7", "ratio γ7", "τ DSpark γ15", "τ DFlash γ15", "ratio γ15",
                  "ratio γ15 − ratio γ7", "P(≤0)", "gain larger at γ15 shown"], rows, "r" * 9 + "l"),
        f"Evaluations kept in `{args.eval_dir}/eval_T*` (git-ignored). Machine: {machine_info()['cpu_count']} CPUs; "
        f"load {load_average()[0]:.1f} when written.",
    ])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--g15-dir", default=os.path.join("runs", "embedded_g15", "drafters"),
                    help="directory holding the block-15 drafters dspark-g15/ and dflash-g15/")
    add_comparison_arguments(ap, os.path.join("runs", "gamma_gain"))
    args = ap.parse_args(argv)
    from specjax import default_target

    missing = [n for n in PAIRS[7] if n not in default_target.available_drafters()]
    if missing:
        raise SystemExit(f"shipped drafters missing: {missing} (run `{default_target.BUILD_COMMAND}`)")
    g15 = [os.path.join(args.g15_dir, n) for n in PAIRS[15]]
    absent = [p for p in g15 if not os.path.isfile(os.path.join(p, "config.json"))]
    if absent:
        raise SystemExit(f"--g15-dir: no drafter at {absent}; build them with `{G15_BUILD}`")
    drafters = list(PAIRS[7]) + g15
    stats: dict[str, dict[str, Any]] = {}
    for temp in args.temperatures:
        res = evaluate_kept(drafters, temp, args.cap, args.max_tokens, os.path.join(args.eval_dir, f"eval_T{temp:g}"))
        parts = {n: tau_parts(res, n) for n in (*PAIRS[7], *PAIRS[15])}
        stats[f"{temp:g}"] = gain_statistics(parts, replicates=args.replicates)
        log(f"T={temp:g}: ratio γ7 {fmt_ci(stats[f'{temp:g}']['ratio']['7'])}, "
            f"γ15 {fmt_ci(stats[f'{temp:g}']['ratio']['15'])}")

    def plot(path: str) -> None:
        groups = {f"T = {t}": {f"gamma {g}": s["ratio"][g] for g in ("7", "15")} for t, s in stats.items()}
        plot_intervals(path, groups, ylabel="τ DSpark / τ DFlash (95% interval)",
                       title="DSpark over DFlash on the same prompts, paired bootstrap", hline=1.0)

    result = {"command": command_line("bench.gamma_gain", argv), "cap": args.cap, "max_tokens": args.max_tokens,
              "drafters": {"7": list(PAIRS[7]), "15": g15}, "statistics": stats, "machine": machine_info()}
    for p in write_results("gamma_gain", result, report(stats, args, argv), out_dir=args.out_dir, plot=plot):
        log(f"wrote {p}")


if __name__ == "__main__":
    main()
