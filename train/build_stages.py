"""The programs behind the drafter build's stages (`specjax.training.build.Launcher`).

Each stage that is a program becomes a `Step` (a `train.*` module and its arguments) that a runner
executes: `run_child` as a child process (`python -m <module> <args...>`), `run_in_process` in
this one (the tests). The arguments come from the build's settings and drafter plans.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Callable, NamedTuple

from specjax.training.build import Build, BuildError, BuildSettings, DrafterPlan


class Step(NamedTuple):
    """One program run: `python -m <module> <args...>`."""

    module: str
    args: list[str]


Runner = Callable[[Step], int]  # runs a step, returns its exit status


def run_child(step: Step) -> int:
    return subprocess.call([sys.executable, "-m", step.module, *step.args])


def run_in_process(step: Step) -> int:
    return int(importlib.import_module(step.module).main(step.args) or 0)


class ProgramStages:
    """Launches the build's program stages as `Step`s through `runner`."""

    def __init__(self, runner: Runner):
        self.runner = runner

    def _run(self, build: Build, step: Step) -> None:
        build.log("$ python -m " + " ".join([step.module, *step.args]))
        rc = self.runner(step)
        if rc != 0:
            raise BuildError(f"python -m {step.module} failed with exit status {rc}")

    def prepare(self, build: Build) -> None:
        s = build.s
        args = ["--tokenizer", s.target, "--out-dir", s.sharegpt_dir, "--eval-dir", s.eval_dir,
                "--min-tokens", str(s.prompt_min_tokens),
                "--max-tokens", str(s.scale.prompt_max_tokens),
                "--heldout-fraction", str(s.heldout_fraction)]
        if s.sharegpt:
            args += ["--sharegpt", s.sharegpt]
        if s.scale.prepare_limit is not None:
            args += ["--limit", str(s.scale.prepare_limit)]
        if build.wants_references:
            args.append("--references")
        self._run(build, Step("train.prepare_sharegpt", args))

    def regenerate(self, build: Build) -> None:
        s = build.s
        self._run(build, Step("train.regenerate", [
            "--target", s.target, "--prompts", s.regen_prompts, "--out", s.regen_out,
            "--errors", s.regen_errors, "--temperature", str(s.temperature),
            "--top-p", str(s.top_p), "--top-k", str(s.top_k),
            "--max-tokens", str(s.scale.max_new_tokens), "--seed", str(s.seed),
            "--max-num-seqs", str(s.regen_slots), "--max-model-len", str(s.max_length),
            "--max-prefill", str(min(512, s.max_length))]))

    def cache(self, build: Build, data: str, out: str) -> None:
        cached = [p for p in build.plans if p.mode == "cache"]
        self._run(build, Step("train.build_cache", [
            "--target", build.s.target, "--data", data, "--out", out,
            "--layers=" + ",".join(str(x) for x in build.layers),
            "--max-length", str(max(p.max_length for p in cached)),
            "--min-loss-tokens", str(min(p.min_loss_tokens for p in cached)),
            "--batch-size", str(build.s.cache_batch)]))

    def train(self, build: Build, p: DrafterPlan) -> None:
        s, run = build.s, build.s.run_dir(p.name)
        sets = [f"model.target={s.target}", f"export_dir={s.export_dir(p.name)}",
                f"checkpoint.directory={os.path.join(run, 'checkpoints')}",
                f"logging.directory={os.path.join(run, 'logs')}"]
        if p.mode == "cache":
            sets.append(f"data.cache_dir={s.cache_dir}")
            if s.scale.reference_rows:
                sets.append(f"data.extra_cache_dirs=[{json.dumps(s.references_cache_dir)}]")
        else:
            sets += [f"data.train_jsonl={json.dumps(build.training_files(p))}",
                     f"data.max_length={min(p.max_length, s.max_length)}"]
        if s.scale.steps is not None:
            sets.append(f"schedule.total_steps={s.scale.steps}")
        args = ["--config", p.config, "--export-dtype", "bfloat16"]
        for x in sets:
            args += ["--set", x]
        if p.draft_vocab_size:
            args += ["--draft-vocab", s.vocab_file(p.draft_vocab_size)]
        self._run(build, Step("train.train_draft", args))

    def calibrate(self, build: Build, p: DrafterPlan) -> None:
        s, sc = build.s, build.s.scale
        held = os.path.join(s.sharegpt_dir, "heldout.jsonl")
        self._run(build, Step("train.calibrate", [
            "--target", s.target, "--drafter", s.export_dir(p.name), "--prompts", held,
            "--cap", str(sc.calibrate_prompts), "--max-new-tokens", str(sc.calibrate_tokens),
            "--max-num-seqs", str(min(8, s.regen_slots, sc.calibrate_prompts)),
            "--max-model-len", str(sc.prompt_max_tokens + 64 + sc.calibrate_tokens),
            "--max-prefill", str(min(256, sc.prompt_max_tokens + 64)), "--quiet"]))


def program_build(settings: BuildSettings, runner: Runner,
                  log: Callable[[str], None] = print) -> Build:
    """A `Build` whose program stages run through `runner`."""
    return Build(settings, ProgramStages(runner), log=log)
