"""Build the shipped drafters of the embedded default target: `make embedded`.

Usage: `python -m train.build_embedded [--stages prepare regenerate ...] [--drafters dspark ...]
[--scale full|smoke|gpu] [--rows N --max-new-tokens N --steps N ...] [--target T --out-dir D
--work-dir W --config-dir C] [--budget-s N] [--seed-answers FILE|none] [--pack DIR | --unpack DIR]`.

The GPU profile, one budgeted command on one accelerator:
`python -m train.build_embedded --scale gpu --budget-s 540 --work-dir /tmp/gpu --out-dir
/tmp/gpu/out --stages regenerate vocab train calibrate export --pack $OUT` answers every user
turn (seeded from the committed answers, `specjax/assets/smollm2/regen/`), trains every drafter
of configs/gpu (sized for it: the target's MLP width) on online target features at batch 64 in
bfloat16, records DSpark's learning curve, calibrates and exports within 540 s of wall
time, splitting them by a plan it prints first (`specjax.training.build_budget`); a stage that
reaches its share stops and keeps its work, and the same command with more budget continues.
`--pack DIR` writes what must leave the machine (`specjax.training.build_pack`: at most 8 files
of 15 MiB), also when a stage failed (with a budget a failed unit, e.g. one drafter out of
accelerator memory, is recorded in BUILD.json and the others go on; the exit status is 1);
`--unpack DIR` (on the machine that keeps the repository) restores it into --out-dir and
--work-dir. A GPU profile on a machine without an accelerator is refused unless --allow-cpu.

Stages (`specjax.training.build`, their programs launched by `train.build_stages`): prepare (ShareGPT prompts) -> regenerate (the target's own
answers) -> cache (offline target features) -> vocab (draft vocabularies) -> train (each drafter)
-> calibrate (STS of confidence heads) -> export (to <out-dir>/drafters/<name>, bfloat16, <= 64 MiB
in all, checked from the configs before training too). Each stage is skipped when complete and resumes where it stopped, so after an interruption
rerun the same command. Defaults: the SmolLM2 target, specjax/assets/smollm2, runs/embedded and
configs/embedded; wall times, sizes and settings go to <out-dir>/BUILD.json. A from-scratch build:
remove the work directory first. Stages run as child processes (`--in-process` runs them in this
one, as the tests do).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shlex
import sys
import time
from typing import Any, Callable, Sequence

from specjax.training import build_plan as B
from specjax.training import build_record
from specjax.training.build_outputs import BuildError
from specjax.training.answers import ANSWERS_NAME
from specjax.training.build_pack import pack, unpack
from train.build_stages import Runner, probe_machine, program_build, run_child, run_in_process

DEFAULT_WORK = os.path.join("runs", "embedded")
DEFAULT_CONFIGS = os.path.join("configs", "embedded")
GPU_CONFIGS = os.path.join("configs", "gpu")  # the drafters' shapes of --scale gpu
DEFAULT_EVAL = os.path.join("..", "shared", "data", "eval")
PACK_RESERVE_S = 5.0  # of --budget-s, kept for --pack


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
                                     "(the standalone LM) reads besides the answers"),
                       ("max-turns", "user turns answered per conversation (default: the "
                                     "scale's; gpu: every turn)"),
                       ("context-tokens", "tokens per conversation, regeneration and training "
                                          "(default: the scale's)"),
                       ("curve-every", "DSpark's learning curve: tau on greedy texts every N "
                                       "training steps (0: none; default: the scale's)"),
                       ("curve-prompts", "learning curve: prompts per file of each set"),
                       ("curve-tokens", "learning curve: tokens per greedy answer")):
        p.add_argument(f"--{name}", type=int, default=None, help=what)
    p.add_argument("--min-unit-s", type=float, default=None,
                   help="with --budget-s: the fewest seconds a stage (or drafter) runs in; one "
                        "whose share is smaller is skipped (default: the scale's)")
    p.add_argument("--target", default=None, help="target checkpoint (default: SmolLM2's GGUF)")
    p.add_argument("--out-dir", default=None, help="default: specjax/assets/smollm2")
    p.add_argument("--work-dir", default=DEFAULT_WORK)
    p.add_argument("--config-dir", default=None,
                   help=f"<name>.yaml training configs (default: {DEFAULT_CONFIGS}; --scale gpu: {GPU_CONFIGS})")
    p.add_argument("--eval-dir", default=DEFAULT_EVAL, help="evaluation prompts kept out of training")
    p.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the installed package's)")
    p.add_argument("--heldout-fraction", type=float, default=0.01)
    p.add_argument("--regen-slots", type=int, default=None,
                   help="answers decoded together (default 256 with --scale gpu, else 32)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds for the whole build, split between the stages by a "
                        "printed plan; each stops at its share keeping its work")
    p.add_argument("--seed-answers", default=None,
                   help="answers artifact (gzip JSONL) whose prompts are not regenerated "
                        "(default with --scale gpu: <out-dir>/regen/answers.jsonl.gz; 'none': no seed)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run --scale gpu on a machine without an accelerator (tests)")
    act = p.add_mutually_exclusive_group()
    act.add_argument("--pack", metavar="DIR", default=None,
                     help="after the stages, pack what must leave this machine into DIR")
    act.add_argument("--unpack", metavar="DIR", default=None,
                     help="restore a pack into --out-dir / --work-dir (runs no stage)")
    p.add_argument("--budget-mb", type=float, default=64.0,
                   help="shipped drafters in all (MiB), checked from the configs before training and at export")
    p.add_argument("--in-process", action="store_true", help="run the stages in this process")
    argv_list = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv_list)

    t0 = time.monotonic()
    runner, machine = (run_in_process, build_record.machine) if args.in_process else children_setup()
    try:
        scale = B.SCALES[args.scale]
        over = {k.replace("-", "_"): getattr(args, k.replace("-", "_")) for k in (
            "rows", "max-new-tokens", "prompt-max-tokens", "prepare-limit", "steps",
            "calibrate-prompts", "calibrate-tokens", "reference-rows", "text-rows",
            "max-turns", "context-tokens", "min-unit-s", "curve-every", "curve-prompts", "curve-tokens")}
        scale = dataclasses.replace(scale, **{k: v for k, v in over.items() if v is not None})
        gpu = args.scale == "gpu"
        if gpu and not args.unpack and not args.allow_cpu:
            require_accelerator(machine())
        out_dir = args.out_dir or os.path.relpath(dt.asset_dir())
        seed = args.seed_answers
        if seed is None and gpu and os.path.isfile(os.path.join(out_dir, "regen", ANSWERS_NAME)):
            seed = os.path.join(out_dir, "regen", ANSWERS_NAME)
        budget = args.budget_s
        if budget is not None and args.pack:  # packing comes after the stages
            budget -= max(PACK_RESERVE_S, 0.02 * budget)
            if budget <= 0:
                raise ValueError(f"--budget-s {args.budget_s:g} is too small to run any stage "
                                 f"and pack ({PACK_RESERVE_S:g} s are kept for packing)")
        label = None
        if args.target is None:
            args.target, label = dt.gguf_path(), f"{dt.NAME} ({dt.PACKAGE}=={dt.VERSION})"
        settings = B.BuildSettings(
            target=args.target, out_dir=out_dir,
            work_dir=args.work_dir, config_dir=args.config_dir or (GPU_CONFIGS if gpu else DEFAULT_CONFIGS),
            drafters=tuple(args.drafters),
            eval_dir=args.eval_dir, scale=scale, sharegpt=args.sharegpt, target_label=label,
            heldout_fraction=args.heldout_fraction,
            regen_slots=args.regen_slots or (256 if gpu else 32), budget_mb=args.budget_mb,
            seed_answers=None if seed in (None, "none") else seed, budget_s=budget,
            command=" ".join(["python -m train.build_embedded", *map(shlex.quote, argv_list)]))
        if args.unpack:
            got = unpack(settings, args.unpack)
            _log(f"unpacked {args.unpack}: drafters {got['drafters']}, "
                 f"{got.get('answers_rows', 0)} answers -> {settings.out_dir}")
            return 0
        build = program_build(settings, runner, log=_log, machine=machine)
        try:
            build.run(args.stages)
        finally:  # what the stages did leaves the machine, also when one of them failed
            if args.pack:
                man = pack(settings, args.pack)
                _log(f"packed {len(man['files']) + 1} files "
                     f"({sum(f['bytes'] for f in man['files'].values()) / 2**20:.1f} MiB) -> {args.pack}")
    except (BuildError, ValueError, dt.EmbeddedTargetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _log(f"recorded total {build.record.get('total_wall_s', 0):.0f} s -> {settings.record_path}"
         f" ({time.monotonic() - t0:.0f} s wall)")
    return 0


def children_setup() -> tuple[Runner, Callable[[], dict[str, Any]]]:
    """(runner, machine) for stages run as child processes. This process, which plans, records
    and exports, starts no accelerator (JAX on the CPU): a GPU's memory (JAX takes 75% of it when
    it starts) and a TPU (one process at a time) stay for the children; the machine recorded is
    the one a child sees, probed once. Call before JAX starts a backend."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    return run_child, functools.cache(probe_machine)


def require_accelerator(machine: dict[str, Any]) -> None:
    """ValueError unless the stages' machine (`build_record.machine()`) has a GPU or TPU."""
    if machine["jax_backend"] == "cpu":
        raise ValueError("--scale gpu needs an accelerator, but jax sees only the CPU "
                         f"({machine['device']}); pass --allow-cpu to run it on the CPU anyway")


if __name__ == "__main__":
    raise SystemExit(main())
