"""DSpark trained with its final norm started at the target's, against the shipped DSpark (norm at one).

    python -m bench.norm_init [--drafter runs/embedded/exports/dspark-norm] [--cap 8] [--max-tokens 64]
                              [--temperatures 0 1] [--eval-dir runs/norm_init] [--out-dir bench/results]

SmolLM2's final norm weight averages 1.80, and the frozen lm_head every drafter shares was trained on
inputs scaled by it; DeepSpec starts a drafter's own final norm at one, and after the shipped 480
Adam steps at lr 1e-3 it was still 0.98 on average. `--drafter` is the same DSpark config trained
with `model.init_norm_from_target: true` (configs/embedded/dspark-norm.yaml) on the shipped build's
data and budget, built by `VARIANT.build`; its directory name must differ from "dspark". Both
drafters are evaluated at each temperature in one `run_evaluation` on the same prompts (Table 1's
protocol, `bench.vs_shipped`), and a paired bootstrap over prompts gives 95% intervals of each
τ and of their ratio.

Evaluations are kept in `--eval-dir` and reused when rerun with the same settings. Not part of
`make bench` (the drafter is not shipped); `python -m bench.run_all --docs-only` adds its section.
Writes norm_init.json, .md and .png to `--out-dir`.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Sequence

from bench.vs_shipped import SHIPPED, Variant

VARIANT = Variant(
    name="norm_init", drafter="dspark-norm", change="init_norm_from_target: true",
    title="DSpark with its final norm started at the target's (an experiment, not shipped)",
    drafter_text="Everything but the start of the final norm (and so the data, 384 regenerated answers, "
                 "the seed and 480 steps) is the shipped DSpark's.",
    shipped_label="norm at 1", new_label="norm from target",
    plot_title="DSpark: final norm at one (shipped) vs from the target")


def final_norm_weight(drafter_dir: str) -> dict[str, float]:
    """Mean, min and max of a block drafter's trained final norm weight (`norm.weight`)."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(os.path.join(drafter_dir, "model.safetensors"), "flax") as f:
        w = np.asarray(f.get_tensor("norm.weight"), np.float32)
    return {"mean": float(w.mean()), "min": float(w.min()), "max": float(w.max())}


def norm_lines(norms: dict[str, dict[str, float]] | None) -> list[str]:
    """The section's line on the trained final norm weights."""
    return [""] + ([] if not norms else [
        "Trained final norm weight (mean, min to max): " + "; ".join(
            f"{n} {v['mean']:.2f} ({v['min']:.2f} to {v['max']:.2f})" for n, v in norms.items()) + ".", ""])


def report(stats: dict[str, dict[str, Any]], new: str, args: argparse.Namespace,
           argv: Sequence[str] | None, norms: dict[str, dict[str, float]] | None = None) -> str:
    """This experiment's section, with the trained final norm weights."""
    return VARIANT.report(stats, new, args, argv, norm_lines(norms))


def measure(args: argparse.Namespace, new: str) -> tuple[dict[str, Any], list[str]]:
    from specjax import default_target

    norms = {SHIPPED: final_norm_weight(default_target.drafter_dir(SHIPPED)),
             new: final_norm_weight(args.drafter)}
    return {"final_norm_weight": norms}, norm_lines(norms)


def main(argv: Sequence[str] | None = None) -> None:
    VARIANT.main(argv, doc=__doc__, measure=measure)


if __name__ == "__main__":
    main()
