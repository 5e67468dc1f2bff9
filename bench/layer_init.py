"""DSpark whose draft layer starts as a target layer, against the shipped DSpark (random start).

    python -m bench.layer_init [--drafter runs/embedded/exports/dspark-layer] [--cap 8] [--max-tokens 64]
                               [--temperatures 0 1] [--eval-dir runs/layer_init] [--out-dir bench/results]

The shipped drafters start their draft layer at random (DeepSpec's start) and 480 steps at batch 8
leave them underfit. `--drafter` is the same DSpark config with `model.init_layer_from_target: 28`
and `init_norm_from_target: true` (configs/embedded/dspark-layer.yaml, `specjax.drafters.warm_start`)
trained on the shipped build's data and budget by `VARIANT.build`. Both drafters are evaluated
at each temperature in one `run_evaluation` on the same prompts (Table 1's protocol), and a paired
bootstrap over prompts gives 95% intervals of each τ and of their ratio (`bench.vs_shipped`).

Evaluations are kept in `--eval-dir` and reused when rerun with the same settings. Not part of
`make bench` (the drafter is not shipped); `python -m bench.run_all --section layer_init` adds its
section. Writes layer_init.json, .md and .png to `--out-dir`.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Sequence

from bench.common import md_table
from bench.vs_shipped import SHIPPED, Variant

BASELINE_BUILD = "python -m train.build_embedded --stages train --drafters dspark --out-dir runs/embedded/out"
VARIANT = Variant(
    name="layer_init", drafter="dspark-layer", change="init_layer_from_target: 28",
    title="DSpark with its draft layer started from a target layer (an experiment, not shipped)",
    drafter_text="Its draft layer starts as SmolLM2's layer 28 (attention and norms copied, the 512 of 1536 "
                 "MLP channels with the largest weights), `fc` reads tap 27 (layer 28's input) through an "
                 "identity block, so its first context keys/values are layer 28's, and its final norm starts "
                 "at the target's. Everything else (the data, 384 regenerated answers, the seed, 480 steps at "
                 "lr 1e-3) is the shipped DSpark's.",
    shipped_label="random start", new_label="from layer 28",
    plot_title="DSpark: draft layer at random (shipped) vs from target layer 28")


WINDOWS = ((1, 10), (11, 100), (101, 240), (241, 400), (401, 480))  # optimizer steps, inclusive
CURVE_KEYS = ("ce", "accept_rate@1", "tau_probabilistic")


def training_curves(log_dir: str, names: tuple[str, str]) -> dict[str, Any] | None:
    """Per window of steps, the mean of each CURVE_KEYS metric in both runs' metrics.jsonl
    (`<log_dir>/<name>/logs`); the two runs share data seed and batch order, so the windows pair.
    None when either log is missing."""
    import json

    import numpy as np

    rows: dict[str, dict[int, dict[str, float]]] = {}
    for n in names:
        path = os.path.join(log_dir, n, "logs", "metrics.jsonl")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            recs = [json.loads(line) for line in f if line.strip()]
        rows[n] = {int(r["step"]): r for r in recs if "step" in r and all(k in r for k in CURVE_KEYS)}
    out = []
    for lo, hi in WINDOWS:
        steps = [s for s in rows[names[0]] if lo <= s <= hi and s in rows[names[1]]]
        if steps:
            out.append({"steps": [lo, hi], "logged": len(steps), **{
                n: {k: float(np.mean([rows[n][s][k] for s in steps])) for k in CURVE_KEYS} for n in names}})
    return {"log_dir": log_dir, "windows": out}


def curves_lines(curves: dict[str, Any] | None, names: tuple[str, str]) -> list[str]:
    """The training-log table (each cell: the random start / the warm start)."""
    if not curves:
        return [""]
    rows = [[f"{w['steps'][0]}-{w['steps'][1]}", w["logged"],
             *(f"{w[names[0]][k]:.3f} / {w[names[1]][k]:.3f}" for k in CURVE_KEYS)] for w in curves["windows"]]
    return ["", f"Training logs (`{curves['log_dir']}/<name>/logs/metrics.jsonl`), the shipped config retrained by "
            f"`{BASELINE_BUILD}` against {names[1]}, same batches in the same order; mean of the logged steps "
            "in each window, each cell random start / warm start (CE over the 8192 draft tokens: uniform "
            "would be 9.01):", "",
            md_table(["steps", "logged", "CE", "first-token acceptance", "τ (probabilistic)"], rows, "rrrrr"), ""]


def report(stats: dict[str, dict[str, Any]], new: str, args: argparse.Namespace,
           argv: Sequence[str] | None, curves: dict[str, Any] | None = None) -> str:
    """This experiment's section, with the training-log table."""
    return VARIANT.report(stats, new, args, argv, curves_lines(curves, (SHIPPED, new)))


def main(argv: Sequence[str] | None = None) -> None:
    def add_arguments(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--train-logs", default=os.path.join("runs", "embedded", "train"),
                        help="where both runs' training logs are (<dir>/<name>/logs); their table is left "
                             "out when either is missing")

    def measure(args: argparse.Namespace, new: str) -> tuple[dict[str, Any], list[str]]:
        curves = training_curves(args.train_logs, (SHIPPED, new))
        return {"training_curves": curves}, curves_lines(curves, (SHIPPED, new))

    VARIANT.main(argv, doc=__doc__, add_arguments=add_arguments, measure=measure)


if __name__ == "__main__":
    main()
