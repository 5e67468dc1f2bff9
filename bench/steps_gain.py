"""DSpark trained three times as long on the same data, against the shipped DSpark.

    python -m bench.steps_gain [--drafter runs/embedded/exports/dspark-long] [--cap 8] [--max-tokens 64]
                               [--temperatures 0 1] [--eval-dir runs/steps_gain] [--out-dir bench/results]

`bench.fit_gap` finds the shipped drafters no better on the prompts they trained on than on new
ones: not overfit, not fit yet. `--drafter` is the shipped DSpark config given 1440 optimizer steps
(30 epochs of the 384 regenerated answers) instead of 480 (configs/embedded/dspark-long.yaml),
trained on the shipped build's data by `VARIANT.build`. Both drafters are evaluated at each
temperature in one `run_evaluation` on the same prompts (Table 1's protocol), and a paired
bootstrap over prompts gives 95% intervals of each τ and of their ratio (`bench.vs_shipped`).

Evaluations are kept in `--eval-dir` and reused when rerun with the same settings. Not part of
`make bench` (the drafter is not shipped); `python -m bench.run_all --section steps_gain` adds its
section. Writes steps_gain.json, .md and .png to `--out-dir`.
"""
from __future__ import annotations

from typing import Sequence

from bench.vs_shipped import Variant

VARIANT = Variant(
    name="steps_gain", drafter="dspark-long", change="1440 steps",
    title="DSpark trained three times as long on the same data (an experiment, not shipped)",
    drafter_text="1440 optimizer steps (30 epochs of the 384 regenerated answers, the learning-rate schedule "
                 "stretched with them) instead of the shipped 480; everything else (the data, the seed, "
                 "batch 8, lr 1e-3) is the shipped DSpark's.",
    shipped_label="480 steps", new_label="1440 steps",
    plot_title="DSpark: 480 steps (shipped) vs 1440 on the same data")
report = VARIANT.report


def main(argv: Sequence[str] | None = None) -> None:
    VARIANT.main(argv, doc=__doc__)


if __name__ == "__main__":
    main()
