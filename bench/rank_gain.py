"""DSpark with the reference's Markov rank (256) against the shipped DSpark (rank 32).

    python -m bench.rank_gain [--drafter runs/embedded/exports/dspark-r256] [--cap 8] [--max-tokens 64]
                              [--temperatures 0 1] [--eval-dir runs/rank_gain] [--out-dir bench/results]

From the second draft slot on, DSpark's Markov head is the only path by which a slot sees the token
drafted before it, and its rank bounds what it carries: `bench.count_reference` finds a rank-32
factorisation of ShareGPT's bigram statistics naming the target's next greedy token about half as
often as a rank-256 one. `--drafter` is the shipped DSpark config with markov_rank 256, the
reference's value, instead of 32 (configs/embedded/dspark-r256.yaml: same data, seed, batch 8 and 480
steps), trained on the shipped build's data by `VARIANT.build`. Both drafters are evaluated at each
temperature in one `run_evaluation` on the same prompts (Table 1's protocol), and a paired bootstrap
over prompts gives 95% intervals of each τ and of their ratio (`bench.vs_shipped`); the section adds
the acceptance by draft position, where a sequential head shows from the second slot on.

Evaluations are kept in `--eval-dir` and reused when rerun with the same settings. Not part of
`make bench` (the drafter is not shipped); `python -m bench.run_all --section rank_gain` adds its
section. Writes rank_gain.json, .md and .png to `--out-dir`.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Sequence

from bench.common import md_table
from bench.vs_shipped import SHIPPED, Variant

VARIANT = Variant(
    name="rank_gain", drafter="dspark-r256", change="Markov rank 256",
    title="DSpark with the reference's Markov rank, 256 (an experiment, not shipped)",
    drafter_text="Markov head of rank 256 (the reference's) instead of the shipped 32; everything else (the "
                 "data, 384 regenerated answers, the seed, batch 8, lr 1e-3, 480 steps) is the shipped DSpark's.",
    shipped_label="rank 32", new_label="rank 256",
    plot_title="DSpark: Markov rank 32 (shipped) vs 256")
report = VARIANT.report
POSITIONS = 3


def by_position(args: argparse.Namespace, new: str) -> tuple[dict[str, Any], list[str]]:
    """P(n >= k), k = 1..POSITIONS, of both drafters per temperature, from the kept evaluations."""
    acc: dict[str, dict[str, list[float]]] = {}
    for temp in args.temperatures:
        with open(os.path.join(args.eval_dir, f"eval_T{temp:g}", "results.json"), encoding="utf-8") as f:
            res = json.load(f)
        acc[f"{temp:g}"] = {n: res["drafters"][n]["overall"]["accept_rate"][:POSITIONS] for n in (SHIPPED, new)}
    rows = [[f"{name} ({label})"] + [" / ".join(f"{x:.3f}" for x in acc[t][name]) for t in acc]
            for name, label in ((SHIPPED, VARIANT.shipped_label), (new, VARIANT.new_label))]
    lines = ["", f"Acceptance by draft position, P(n >= k) for k = 1..{POSITIONS}, all sets pooled:", "",
             md_table(["drafter"] + [f"T={t}" for t in acc], rows), ""]
    return {"accept_by_position": acc}, lines


def main(argv: Sequence[str] | None = None) -> None:
    VARIANT.main(argv, doc=__doc__, measure=by_position)


if __name__ == "__main__":
    main()
