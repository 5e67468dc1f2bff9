"""DSpark trained with its final norm started at the target's, against the shipped DSpark (norm at one).

    python -m bench.norm_init [--drafter runs/embedded/exports/dspark-norm] [--cap 8] [--max-tokens 64]
                              [--temperatures 0 1] [--eval-dir runs/norm_init] [--out-dir bench/results]

SmolLM2's final norm weight averages 1.80, and the frozen lm_head every drafter shares was trained on
inputs scaled by it; DeepSpec starts a drafter's own final norm at one, and after the shipped 480
Adam steps at lr 1e-3 it was still 0.98 on average. `--drafter` is the same DSpark config trained
with `model.init_norm_from_target: true` (configs/embedded/dspark-norm.yaml) on the shipped build's
data and budget, built by the command in BUILD; its directory name must differ from "dspark". Both
drafters are evaluated at each temperature in one `run_evaluation` on the same prompts (Table 1's
protocol, `bench.embedded.table1`), and a paired bootstrap over prompts gives 95% intervals of each
τ and of their ratio.

Evaluations are kept in `--eval-dir` and reused when rerun with the same settings. Not part of
`make bench` (the drafter is not shipped); `python -m bench.run_all --docs-only` adds its section.
Writes norm_init.json, .md and .png to `--out-dir`.
"""
from __future__ import annotations

import argparse
import functools
import os
from typing import Any

from bench.common import command_line, load_average, log, machine_info, md_table, write_results
from bench.embedded import EVAL_SETS
from bench.gamma_gain import add_comparison_arguments, evaluate_kept, fmt_ci, plot_intervals, tau_parts

BUILD = ("python -m train.build_embedded --stages prepare regenerate cache vocab train --drafters dspark-norm "
         "--out-dir runs/embedded/out")  # configs/embedded/dspark-norm.yaml, the shipped build's work dir
SHIPPED = "dspark"


def final_norm_weight(drafter_dir: str) -> dict[str, float]:
    """Mean, min and max of a block drafter's trained final norm weight (`norm.weight`)."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(os.path.join(drafter_dir, "model.safetensors"), "flax") as f:
        w = np.asarray(f.get_tensor("norm.weight"), np.float32)
    return {"mean": float(w.mean()), "min": float(w.min()), "max": float(w.max())}


def comparison(results: dict[str, Any], new: str, *, replicates: int = 4000) -> dict[str, Any]:
    """Paired-bootstrap intervals over prompts of the shipped DSpark's τ, `new`'s τ and their
    ratio (new / shipped) from one evaluation holding both, plus each first-token acceptance and
    Table 1's macro τ."""
    from specjax.eval.metrics import paired_tau_bootstrap

    names = (SHIPPED, new)
    parts = {n: tau_parts(results, n) for n in names}

    def boot(stat):
        return paired_tau_bootstrap(parts, stat, replicates=replicates)

    return {"tau": {n: boot(lambda t, n=n: t[n]) for n in names},
            "ratio": boot(lambda t: t[new] / t[SHIPPED]),
            "first_token_accept": {n: results["drafters"][n]["overall"]["accept_rate"][0] for n in names},
            "macro": {n: results["drafters"][n]["macro"] for n in names}}


def shipped_comparison_section(stats: dict[str, dict[str, Any]], new: str, args: argparse.Namespace, *,
                               title: str, command: str, drafter_text: str, shipped_label: str,
                               new_label: str, extra: list[str] | None = None) -> str:
    """The Markdown section of an experiment against the shipped DSpark: per temperature both τ,
    the ratio with its interval, and whether the interval shows the variant better (its lower end above 1), not
    (it holds 1) or worse (its upper end below 1)."""
    rows = [[t, fmt_ci(s["tau"][SHIPPED]), fmt_ci(s["tau"][new]), fmt_ci(s["ratio"]),
             f"{s['first_token_accept'][SHIPPED]:.3f} / {s['first_token_accept'][new]:.3f}",
             f"{s['macro'][SHIPPED]:.3f} / {s['macro'][new]:.3f}",
             "yes" if s["ratio"]["lo"] > 1 else "no" if s["ratio"]["hi"] >= 1 else "worse"]
            for t, s in stats.items()]
    n = next(iter(stats.values()))["ratio"]["requests"]
    return "\n".join([
        f"# {title}",
        "",
        f"Command: `{command}`",
        "",
        f"{drafter_text} Table 1's protocol ({args.cap} prompts from each of {', '.join(EVAL_SETS)}: {n} "
        f"prompts, {args.max_tokens} new tokens, fixed verification at gamma 7, per-prompt seeds), both "
        "drafters in one evaluation per temperature. τ pooled over the prompts, value [95% interval] from a "
        f"paired bootstrap over prompts ({args.replicates} replicates); macro: Table 1's mean of per-set τ.",
        "",
        md_table(["T", f"τ shipped ({shipped_label})", f"τ {new} ({new_label})", "ratio",
                  "P(first token accepted)", "macro τ", "better shown"], rows, "r" * 6 + "l"),
        *(extra or []),
        f"Evaluations kept in `{args.eval_dir}/eval_T*` (git-ignored). Machine: {machine_info()['cpu_count']} CPUs; "
        f"load {load_average()[0]:.1f} when written.",
    ])


def report(stats: dict[str, dict[str, Any]], new: str, args: argparse.Namespace,
           argv: list[str] | None, norms: dict[str, dict[str, float]] | None = None) -> str:
    """This experiment's section (`shipped_comparison_section`), with the trained final norm weights."""
    return shipped_comparison_section(
        stats, new, args, title="DSpark with its final norm started at the target's (an experiment, not shipped)",
        command=command_line("bench.norm_init", argv),
        drafter_text=f"Drafter: `{BUILD}`. Everything but the start of the final norm (and so the data, 384 "
                     "regenerated answers, the seed and 480 steps) is the shipped DSpark's.",
        shipped_label="norm at 1", new_label="norm from target",
        extra=[""] + ([] if not norms else [
            "Trained final norm weight (mean, min to max): " + "; ".join(
                f"{n} {v['mean']:.2f} ({v['min']:.2f} to {v['max']:.2f})" for n, v in norms.items()) + ".", ""]))


def compare_with_shipped(args: argparse.Namespace, build_hint: str) -> tuple[str, dict[str, Any]]:
    """Check `args.drafter` (it must exist, `build_hint` says how to build it, and its name must
    differ from the shipped one) and compare it with the shipped DSpark at each temperature.
    Returns (its name, {temperature: `comparison`})."""
    new = os.path.basename(os.path.normpath(args.drafter))
    if not os.path.isfile(os.path.join(args.drafter, "config.json")):
        raise SystemExit(f"--drafter: no drafter at {args.drafter}; build it ({build_hint})")
    if new == SHIPPED:
        raise SystemExit(f"--drafter: its directory name must differ from {SHIPPED!r} (results are keyed by it)")
    stats: dict[str, Any] = {}
    for temp in args.temperatures:
        res = evaluate_kept([SHIPPED, args.drafter], temp, args.cap, args.max_tokens,
                            os.path.join(args.eval_dir, f"eval_T{temp:g}"))
        stats[f"{temp:g}"] = comparison(res, new, replicates=args.replicates)
        log(f"T={temp:g}: ratio {fmt_ci(stats[f'{temp:g}']['ratio'])}")
    return new, stats


def plot_with_shipped(path: str, stats: dict[str, Any], new: str, title: str) -> None:
    """Both drafters' τ intervals, one cluster per temperature."""
    groups = {f"T = {t}": {n: s["tau"][n] for n in (SHIPPED, new)} for t, s in stats.items()}
    plot_intervals(path, groups, ylabel="τ (95% interval over prompts)", title=title)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default=os.path.join("runs", "embedded", "exports", "dspark-norm"),
                    help="the DSpark trained with init_norm_from_target (a directory or a link to one)")
    add_comparison_arguments(ap, os.path.join("runs", "norm_init"))
    args = ap.parse_args(argv)
    new, stats = compare_with_shipped(args, f"configs/embedded/dspark-norm.yaml, init_norm_from_target: true) "
                                      f"with `{BUILD}`")
    from specjax import default_target

    norms = {SHIPPED: final_norm_weight(default_target.drafter_dir(SHIPPED)),
             new: final_norm_weight(args.drafter)}
    md = report(stats, new, args, argv, norms)
    result = {"command": command_line("bench.norm_init", argv), "drafter": args.drafter, "cap": args.cap,
              "max_tokens": args.max_tokens, "statistics": stats, "final_norm_weight": norms, "machine": machine_info()}
    plot = functools.partial(plot_with_shipped, stats=stats, new=new, title="DSpark: final norm at one (shipped) vs from the target")
    for p in write_results("norm_init", result, md, out_dir=args.out_dir, plot=plot):
        log(f"wrote {p}")


if __name__ == "__main__":
    main()
