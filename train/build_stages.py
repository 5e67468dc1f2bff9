"""The programs behind the drafter build's stages (`specjax.training.build.Launcher`).

Each stage that is a program becomes a `Step` (a `train.*` module and its arguments) that a runner
executes: `run_child` as a child process (`python -m <module> <args...>`), `run_in_process` in
this one (the tests). The arguments come from the build's settings and drafter plans.

With a budget (`Build.unit_budget_s`, the running unit's share) regeneration and training get
`--budget-s` (`SOFT_SHARE` of the share: they stop by themselves, keep what they did and leave
time to save and export), and a child process is killed at its whole share plus `KILL_GRACE_S`
(status `TIMED_OUT`: the stage is cut, not failed; calibration, which has no budget flag, is cut
that way and leaves nothing behind).
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
from typing import Any, Callable, NamedTuple, Sequence

from specjax.training.build import Build
from specjax.training.build_outputs import BuildError
from specjax.training.build_plan import CURVE_EVAL_SETS, BuildSettings, DrafterPlan
from specjax.training import build_record
from specjax.training.build_record import count_rows


SOFT_SHARE = 0.85
KILL_GRACE_S = 10.0
TIMED_OUT = 124  # the exit status of a child killed at its share


class Step(NamedTuple):
    """One program run: `python -m <module> <args...>`, killed after `timeout_s` when given."""

    module: str
    args: list[str]
    timeout_s: float | None = None


class StepResult(NamedTuple):
    """A step's exit status and, when it failed, the last lines its child wrote to stderr."""

    status: int
    error_tail: str = ""


Runner = Callable[[Step], "StepResult | int"]  # runs a step; an int is an exit status alone
TAIL_BYTES = 4096  # of a child's stderr, kept for the error of a failed step
TAIL_LINES = 3


def run_child(step: Step) -> StepResult:
    """Run `step` as a child process (its stderr passed through as it comes, the end kept); kill
    it after `step.timeout_s` (status TIMED_OUT)."""
    proc = subprocess.Popen([sys.executable, "-m", step.module, *step.args], stderr=subprocess.PIPE)
    tail = bytearray()

    def pump() -> None:  # drains the pipe to the end whatever this process's stderr accepts
        for chunk in iter(lambda: proc.stderr.read1(65536), b""):
            tail.extend(chunk)
            del tail[:-TAIL_BYTES]
            try:
                if hasattr(sys.stderr, "buffer"):
                    sys.stderr.buffer.write(chunk)
                else:  # a text-only stream (a notebook's)
                    sys.stderr.write(chunk.decode("utf-8", "replace"))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        status = proc.wait(timeout=step.timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = TIMED_OUT
    except BaseException:  # an interrupt of this process: the child does not outlive it
        proc.kill()
        proc.wait()
        raise
    reader.join(timeout=KILL_GRACE_S)  # a grandchild may hold the pipe open
    if status in (0, TIMED_OUT):
        return StepResult(status)
    lines = [x.strip() for x in tail.decode("utf-8", "replace").replace("\r", "\n").split("\n")]
    return StepResult(status, " | ".join([x for x in lines if x][-TAIL_LINES:]))


def run_in_process(step: Step) -> StepResult:
    return StepResult(int(importlib.import_module(step.module).main(step.args) or 0))


def probe_machine() -> dict[str, Any]:
    """`build_record.machine()` as a child process sees it: the accelerator the stages run on,
    for a parent that starts none itself."""
    code = "import json; from specjax.training.build_record import machine; print(json.dumps(machine()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"probing the machine in a child process failed ({out.returncode}): {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class ProgramStages:
    """Launches the build's program stages as `Step`s through `runner`."""

    def __init__(self, runner: Runner, machine: Callable[[], dict[str, Any]] = build_record.machine):
        self.runner = runner
        self._probe = machine
        self._machine: dict[str, Any] | None = None

    def machine(self) -> dict[str, Any]:
        if self._machine is None:
            self._machine = self._probe()
        return self._machine

    def _run(self, build: Build, step: Step) -> None:
        share = build.unit_budget_s if build.budget is not None else None
        if share is not None:
            step = step._replace(timeout_s=share + KILL_GRACE_S)
        build.log("$ python -m " + " ".join([step.module, *step.args]))
        res = self.runner(step)
        rc, tail = (res, "") if isinstance(res, int) else res
        if rc == TIMED_OUT and share is not None:
            build.log(f"python -m {step.module} ran past its share ({share:.0f} s) and was "
                      "stopped; a rerun resumes the stage")
        elif rc != 0:
            raise BuildError(f"python -m {step.module} failed with exit status {rc}"
                             + (f": {tail}" if tail else ""))

    @staticmethod
    def _budget_args(build: Build) -> list[str]:
        """`--budget-s` of a program that stops by itself (with a budget)."""
        if build.budget is None or build.unit_budget_s is None:
            return []
        return ["--budget-s", f"{SOFT_SHARE * build.unit_budget_s:.1f}"]

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
            "--max-prefill", str(min(512, s.max_length)), *self._budget_args(build)]))

    def cache(self, build: Build, data: Sequence[str], out: str) -> None:
        cached = [p for p in build.plans if p.mode == "cache"]
        self._run(build, Step("train.build_cache", [
            "--target", build.s.target, *(a for f in data for a in ("--data", f)), "--out", out,
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
            sets += ["data.mode=online", f"data.train_jsonl={json.dumps(build.training_files(p))}",
                     f"data.max_length={min(p.max_length, s.max_length)}"]
        if s.scale.steps is not None:
            sets.append(f"schedule.total_steps={s.scale.steps}")
        if s.scale.batch_size is not None:
            sets.append(f"data.batch_size={s.scale.batch_size}")
        if s.scale.compute_dtype is not None:
            sets.append(f"model.compute_dtype={s.scale.compute_dtype}")
        sets += self._curve_sets(build, p)
        args = ["--config", p.config, "--export-dtype", "bfloat16", *self._budget_args(build)]
        for x in sets:
            args += ["--set", x]
        if p.draft_vocab_size:
            args += ["--draft-vocab", s.vocab_file(p.draft_vocab_size)]
        self._run(build, Step("train.train_draft", args))

    @staticmethod
    def _curve_sets(build: Build, p: DrafterPlan) -> list[str]:
        """The `curve.*` config overrides of a drafter that records a learning curve: sets
        `train` (the answered prompts), `heldout` and `table1` (the evaluation sets found)."""
        s, sc = build.s, build.s.scale
        if not sc.curve_every or p.name not in s.curve_drafters:
            return []
        table1 = build.curve_eval_files()
        answered = [f for f in s.answers_files if count_rows(f)]
        sets = ([{"name": "train", "files": answered}] if answered else []) + [
            {"name": "heldout", "files": [build.heldout_prompts]}]
        if table1:
            sets.append({"name": "table1", "files": table1})
        else:
            build.log(f"curve/{p.name}: no evaluation set of {list(CURVE_EVAL_SETS)} in {s.eval_dir}")
        return [f"curve.every={sc.curve_every}", f"curve.sets={json.dumps(sets)}",
                f"curve.prompts={sc.curve_prompts}", f"curve.max_tokens={sc.curve_tokens}",
                f"curve.max_prompt_tokens={sc.prompt_max_tokens}",
                f"curve.texts={os.path.join(s.run_dir(p.name), 'curve_texts.jsonl')}"]

    def calibrate(self, build: Build, p: DrafterPlan) -> None:
        s, sc = build.s, build.s.scale
        held = build.heldout_prompts
        self._run(build, Step("train.calibrate", [
            "--target", s.target, "--drafter", s.export_dir(p.name), "--prompts", held,
            "--cap", str(sc.calibrate_prompts), "--max-new-tokens", str(sc.calibrate_tokens),
            "--max-num-seqs", str(min(8, s.regen_slots, sc.calibrate_prompts)),
            "--max-model-len", str(sc.prompt_max_tokens + 64 + sc.calibrate_tokens),
            "--max-prefill", str(min(256, sc.prompt_max_tokens + 64)), "--quiet"]))


def program_build(settings: BuildSettings, runner: Runner, log: Callable[[str], None] = print,
                  machine: Callable[[], dict[str, Any]] = build_record.machine) -> Build:
    """A `Build` whose program stages run through `runner` on the machine `machine()` describes."""
    return Build(settings, ProgramStages(runner, machine), log=log)
