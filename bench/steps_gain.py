"""DSpark trained three times as long on the same data, against the shipped DSpark.

    python -m bench.steps_gain [--drafter runs/embedded/exports/dspark-long] [--cap 8] [--max-tokens 64]
                               [--temperatures 0 1] [--eval-dir runs/steps_gain] [--out-dir bench/results]

`bench.fit_gap` finds the shipped drafters no better on the prompts they trained on than on new
ones: not overfit, not fit yet. `--drafter` is the shipped DSpark config given 1440 optimizer steps
(30 epochs of the 384 regenerated answers) instead of 480 (configs/embedded/dspark-long.yaml),
trained on the shipped build's data by the command in BUILD. Both drafters are evaluated at each
temperature in one `run_evaluation` on the same prompts (Table 1's protocol), and a paired
bootstrap over prompts gives 95% intervals of each τ and of their ratio (`bench.norm_init`).

Evaluations are kept in `--eval-dir` and reused when rerun with the same settings. Not part of
`make bench` (the drafter is not shipped); `python -m bench.run_all --section steps_gain` adds its
section. Writes steps_gain.json, .md and .png to `--out-dir`.
"""
from __future__ import annotations

import argparse
import functools
import os
from typing import Any

from bench.common import command_line, log, machine_info, write_results
from bench.gamma_gain import add_comparison_arguments
from bench.norm_init import compare_with_shipped, plot_with_shipped, shipped_comparison_section

BUILD = ("python -m train.build_embedded --stages prepare regenerate cache vocab train --drafters dspark-long "
         "--out-dir runs/embedded/out")  # configs/embedded/dspark-long.yaml, the shipped build's work dir


def report(stats: dict[str, dict[str, Any]], new: str, args: argparse.Namespace,
           argv: list[str] | None) -> str:
    """This experiment's section (`bench.norm_init.shipped_comparison_section`)."""
    return shipped_comparison_section(
        stats, new, args, title="DSpark trained three times as long on the same data (an experiment, not shipped)",
        command=command_line("bench.steps_gain", argv),
        drafter_text=f"Drafter: `{BUILD}`. 1440 optimizer steps (30 epochs of the 384 regenerated answers, "
                     "the learning-rate schedule stretched with them) instead of the shipped 480; everything "
                     "else (the data, the seed, batch 8, lr 1e-3) is the shipped DSpark's.",
        shipped_label="480 steps", new_label="1440 steps", extra=[""])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default=os.path.join("runs", "embedded", "exports", "dspark-long"),
                    help="the DSpark trained for 1440 steps (a directory or a link to one)")
    add_comparison_arguments(ap, os.path.join("runs", "steps_gain"))
    args = ap.parse_args(argv)
    new, stats = compare_with_shipped(args, f"configs/embedded/dspark-long.yaml) with `{BUILD}`")
    md = report(stats, new, args, argv)
    result = {"command": command_line("bench.steps_gain", argv), "drafter": args.drafter, "cap": args.cap,
              "max_tokens": args.max_tokens, "statistics": stats, "machine": machine_info()}
    plot = functools.partial(plot_with_shipped, stats=stats, new=new, title="DSpark: 480 steps (shipped) vs 1440 on the same data")
    for p in write_results("steps_gain", result, md, out_dir=args.out_dir, plot=plot):
        log(f"wrote {p}")


if __name__ == "__main__":
    main()
