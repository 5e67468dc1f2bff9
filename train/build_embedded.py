"""Build the shipped drafters of the embedded default target: `make embedded`.

Usage: `python -m train.build_embedded [--stages prepare regenerate ...] [--drafters dspark ...]
[--scale full|smoke] [--rows N --max-new-tokens N --steps N ...] [--target T --out-dir D
--work-dir W --config-dir C]`.

Stages (`specjax.training.build`, their programs launched by `train.build_stages`): prepare (ShareGPT prompts) -> regenerate (the target's own
answers) -> cache (offline target features) -> vocab (draft vocabularies) -> train (each drafter)
-> calibrate (STS of confidence heads) -> export (to <out-dir>/drafters/<name>, bfloat16, <= 40 MiB
in all). Each stage is skipped when complete and resumes where it stopped, so after an interruption
rerun the same command. Defaults: the SmolLM2 target, specjax/assets/smollm2, runs/embedded and
configs/embedded; wall times, sizes and settings go to <out-dir>/BUILD.json. A from-scratch build:
remove the work directory first. Stages run as child processes (`--in-process` runs them in this
one, as the tests do).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Sequence

from specjax.training import build as B
from train.build_stages import program_build, run_child, run_in_process

DEFAULT_WORK = os.path.join("runs", "embedded")
DEFAULT_CONFIGS = os.path.join("configs", "embedded")
DEFAULT_EVAL = os.path.join("..", "shared", "data", "eval")


def _log(msg: str) -> None:
    print(f"[build_embedded {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    from specjax import default_target as dt

    p = argparse.ArgumentParser(prog="python -m train.build_embedded",
                                description=__doc__.split("\n")[0])
    p.add_argument("--stages", nargs="+", choices=B.STAGES, default=list(B.STAGES))
    p.add_argument("--drafters", nargs="+", default=list(dt.DRAFTER_NAMES),
                   help="drafters to train (each needs <config-dir>/<name>.yaml)")
    p.add_argument("--scale", choices=sorted(B.SCALES), default="full",
                   help="preset sizes; the flags below override single fields")
    for name, what in (("rows", "answers regenerated (training conversations)"),
                       ("max-new-tokens", "tokens per regenerated answer"),
                       ("prompt-max-tokens", "longest ShareGPT prompt kept (target tokens)"),
                       ("prepare-limit", "ShareGPT conversations read"),
                       ("steps", "optimizer steps of every drafter (default: each config's)"),
                       ("calibrate-prompts", "held-out prompts for STS"),
                       ("calibrate-tokens", "new tokens per calibration prompt"),
                       ("reference-rows", "original ShareGPT replies added as training text "
                                          "(cached, not regenerated; default 0)"),
                       ("text-rows", "original ShareGPT replies a drafter trained on text alone "
                                     "(the standalone LM) reads besides the answers")):
        p.add_argument(f"--{name}", type=int, default=None, help=what)
    p.add_argument("--target", default=None, help="target checkpoint (default: SmolLM2's GGUF)")
    p.add_argument("--out-dir", default=None, help="default: specjax/assets/smollm2")
    p.add_argument("--work-dir", default=DEFAULT_WORK)
    p.add_argument("--config-dir", default=DEFAULT_CONFIGS)
    p.add_argument("--eval-dir", default=DEFAULT_EVAL, help="evaluation prompts kept out of training")
    p.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the installed package's)")
    p.add_argument("--heldout-fraction", type=float, default=0.01)
    p.add_argument("--regen-slots", type=int, default=32, help="answers decoded together")
    p.add_argument("--budget-mb", type=float, default=40.0, help="shipped drafters in all (MiB)")
    p.add_argument("--in-process", action="store_true", help="run the stages in this process")
    args = p.parse_args(argv)

    try:
        scale = B.SCALES[args.scale]
        over = {k.replace("-", "_"): getattr(args, k.replace("-", "_")) for k in (
            "rows", "max-new-tokens", "prompt-max-tokens", "prepare-limit", "steps",
            "calibrate-prompts", "calibrate-tokens", "reference-rows", "text-rows")}
        scale = dataclasses.replace(scale, **{k: v for k, v in over.items() if v is not None})
        label = None
        if args.target is None:
            args.target, label = dt.gguf_path(), f"{dt.NAME} ({dt.PACKAGE}=={dt.VERSION})"
        settings = B.BuildSettings(
            target=args.target, out_dir=args.out_dir or os.path.relpath(dt.asset_dir()),
            work_dir=args.work_dir, config_dir=args.config_dir, drafters=tuple(args.drafters),
            eval_dir=args.eval_dir, scale=scale, sharegpt=args.sharegpt, target_label=label,
            heldout_fraction=args.heldout_fraction, regen_slots=args.regen_slots,
            budget_mb=args.budget_mb)
        build = program_build(settings, run_in_process if args.in_process else run_child, log=_log)
        build.run(args.stages)
    except (B.BuildError, ValueError, dt.EmbeddedTargetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _log(f"recorded total {build.record.get('total_wall_s', 0):.0f} s -> {settings.record_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
