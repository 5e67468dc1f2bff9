"""DSpark trained with three times the peak learning rate, against the shipped DSpark.

    python -m bench.lr_gain [--drafter runs/embedded/exports/dspark-lr3] [--cap 8] [--max-tokens 64]
                            [--temperatures 0 1] [--eval-dir runs/lr_gain] [--out-dir bench/results]

`bench.steps_gain` finds the shipped DSpark better after 1440 steps than after its 480 on the same
data, and `bench.fit_gap` finds it underfit even on the answers it trained on. `--drafter` is the
shipped DSpark config with a peak learning rate of 3e-3 instead of 1e-3 (configs/embedded/dspark-lr3.yaml:
same warmup ratio, cosine decay to zero, data, seed, batch 8 and 480 steps), trained on the shipped
build's data by `VARIANT.build`: does a faster schedule buy the longer run's gain at the shipped
budget? Both drafters are evaluated at each temperature in one `run_evaluation` on the same prompts
(Table 1's protocol), and a paired bootstrap over prompts gives 95% intervals of each τ and of their
ratio (`bench.vs_shipped`).

Evaluations are kept in `--eval-dir` and reused when rerun with the same settings. Not part of
`make bench` (the drafter is not shipped); `python -m bench.run_all --section lr_gain` adds its
section. Writes lr_gain.json, .md and .png to `--out-dir`.
"""
from __future__ import annotations

from typing import Sequence

from bench.vs_shipped import Variant

VARIANT = Variant(
    name="lr_gain", drafter="dspark-lr3", change="learning rate 3e-3",
    title="DSpark trained at three times the learning rate (an experiment, not shipped)",
    drafter_text="Peak learning rate 3e-3 instead of the shipped 1e-3 (the same 4% warmup and cosine decay "
                 "to zero); everything else (the data, 384 regenerated answers, the seed, batch 8, 480 steps) "
                 "is the shipped DSpark's.",
    shipped_label="lr 1e-3", new_label="lr 3e-3",
    plot_title="DSpark: peak learning rate 1e-3 (shipped) vs 3e-3")
report = VARIANT.report


def main(argv: Sequence[str] | None = None) -> None:
    VARIANT.main(argv, doc=__doc__)


if __name__ == "__main__":
    main()
