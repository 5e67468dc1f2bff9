"""Train a drafter: DSpark / DFlash, Eagle3, MTP-1 or a standalone draft LM.

Usage: `specjax-train --config configs/train/dspark.yaml [--set section.field=value]` (or
`python -m train.train_draft ...`).

Reads a `specjax.training.config.TrainConfig` YAML (`--set section.field=value` overrides), loads
the target checkpoint, builds the drafter of `model.kind` with frozen copies of the target's
embedding and lm_head, and trains it on an offline target cache (`data.mode: cache`: DSpark /
DFlash / Eagle3 / MTP-1, made by `python -m train.build_cache`) or online from chat or
{"prompt", "completion"} JSONL (`data.mode: online`: the frozen target runs inside the jitted
step); see `specjax.training.run`. With `curve.every` > 0 it records a learning curve (tau at T=0
on greedy texts of named prompt sets, `specjax.eval.curve`) every that many steps and at the end.
Resumes from the latest checkpoint in `checkpoint.directory`;
SIGTERM / SIGINT save a checkpoint and exit with status 0.

Multi-host (one process per host, `specjax.distributed`): run the same command on every host with
`--coordinator-address HOST:PORT --num-processes N --process-id I` (or on a TPU pod slice / SLURM
with their own settings); the mesh spans every process's devices and each process reads and feeds
only its slice of every global batch. Process 0 writes the logs, the config copy and the export.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from specjax import distributed as dist


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specjax-train", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="training YAML (configs/train/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.FIELD=VALUE", help="override a config field (repeatable)")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many optimizer steps in total (default: the schedule's)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds for this run (from its start, loading and compiling "
                        "included): past it, save a checkpoint and export the drafter trained so "
                        "far; a rerun continues")
    p.add_argument("--draft-vocab", default=None, metavar="JSON",
                   help="draft vocabulary file ({\"draft_ids\": [...]}, written by the "
                        "embedded build's vocab stage); needed when model.draft_vocab_size > 0")
    p.add_argument("--export-dtype", default=None, choices=("float32", "bfloat16"),
                   help="tensor dtype of the export (default: the parameters' own)")
    dist.add_distributed_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    from specjax.config import ConfigError
    from specjax.training.build_outputs import read_draft_vocab
    from specjax.training.config import load_train_config
    from specjax.training.run import build, curve_hook, train

    try:
        if args.budget_s is not None and args.budget_s <= 0:
            raise ValueError(f"--budget-s must be > 0, got {args.budget_s:g}")
        dist.initialize_from_args(args)
        cfg = load_train_config(args.config, args.overrides)
        draft_ids = None
        if args.draft_vocab:
            draft_ids = read_draft_vocab(args.draft_vocab, size=cfg.model.draft_vocab_size)
        run = build(cfg, draft_ids=draft_ids)
        curve = curve_hook(cfg, run) if cfg.curve.every else None
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    train(cfg, run, steps=args.steps, export_dtype=args.export_dtype, deadline=deadline, curve=curve)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
