"""DSpark trained with its loss weighted toward the first draft slots, against the shipped DSpark.

    python -m bench.decay_gain [--drafter runs/embedded/exports/dspark-decay1] [--cap 8] [--max-tokens 64]
                               [--temperatures 0 1] [--eval-dir runs/decay_gain] [--out-dir bench/results]

The block drafters' loss weights draft slot j by exp(-j / decay), decay 4 (the reference's): the
first slot carries 27% of the weight. At the shipped budget the first draft token is accepted about
23% of the time and the second 5% (Table 1), so most of the loss goes to slots that buy almost no τ.
`--drafter` is the shipped DSpark config at decay 1 (configs/embedded/dspark-decay1.yaml: the first
slot carries 63%; same data, seed, lr and 480 steps), trained on the shipped build's data by
`VARIANT.build`: does a drafter that spends its small budget on the first slots accept more?
Both drafters are evaluated at each temperature in one `run_evaluation` on the same prompts
(Table 1's protocol), and a paired bootstrap over prompts gives 95% intervals of each τ and of
their ratio (`bench.vs_shipped`).

Evaluations are kept in `--eval-dir` and reused when rerun with the same settings. Not part of
`make bench` (the drafter is not shipped); `python -m bench.run_all --section decay_gain` adds its
section. Writes decay_gain.json, .md and .png to `--out-dir`.
"""
from __future__ import annotations

from typing import Sequence

from bench.vs_shipped import Variant

VARIANT = Variant(
    name="decay_gain", drafter="dspark-decay1", change="loss_decay 1.0",
    title="DSpark with its loss weighted toward the first draft slots (an experiment, not shipped)",
    drafter_text="Position weights exp(-j / 1) instead of the shipped exp(-j / 4) over the 7 draft slots "
                 "(the first slot's share of the weight 63% instead of 27%); everything else (the data, 384 "
                 "regenerated answers, the seed, batch 8, lr 1e-3, 480 steps) is the shipped DSpark's.",
    shipped_label="decay 4", new_label="decay 1",
    plot_title="DSpark: position decay 4 (shipped) vs 1")
report = VARIANT.report


def main(argv: Sequence[str] | None = None) -> None:
    VARIANT.main(argv, doc=__doc__)


if __name__ == "__main__":
    main()
