"""The drafter build for a target: its plan (settings, scales, the drafters' configs, the stages
and when each is complete) and the bookkeeping between stages. `train/build_embedded.py` runs it
(`make embedded`); the stages that are programs are launched by `train/build_stages.py`, given to
`Build` as a `Launcher`: the library names and runs no program.

Stages, in order; each is skipped when its output is complete and resumes where it stopped:

    prepare      ShareGPT prompts -> <work>/sharegpt/{prompts,heldout}.jsonl + manifest.json
                 (deduplicated, length-filtered, evaluation prompts out; a training row holds
                 every user turn up to an excluded one)
    regenerate   the first `rows` training prompts (their first `max_turns` user turns) answered
                 by the target through our engine under its chat template, each turn on its own
                 earlier answers, `regen_slots` requests at a time (resumes by record)
                 -> <work>/regen.jsonl; with `seed_answers` (an answers artifact, gzip JSONL) the
                 prompts it answered are copied once to <work>/regen_seed.jsonl and not
                 regenerated (every later stage reads both files)
    cache        the target's hidden taps + final hidden per token of regen.jsonl, offline
                 (tensorstore; resumes after the last complete batch); with `reference_rows`
                 N > 0 also `cache/references`: the original ShareGPT replies of the N training
                 prompts after the regenerated ones (<work>/references_<N>.jsonl) cached in
                 <work>/cache_references_<N>, which every drafter then trains on besides
                 regen.jsonl (EAGLE-1 trained on such replies)
    vocab        token counts of the supervised tokens -> the N most frequent ids (+ EOS) for every
                 draft_vocab_size N of the configs -> <work>/vocab/draft_vocab_<N>.json
    train        each drafter from <config_dir>/<name>.yaml (resumes from its last orbax
                 checkpoint) -> <work>/exports/<name> (bfloat16); a drafter trained on text alone
                 (the standalone LM with alpha_tv 0) also reads the original replies of the
                 `text_rows` training prompts after the regenerated ones (<work>/text_<N>.jsonl;
                 prepare then writes references.jsonl)
    calibrate    STS of every confidence head on held-out prompts
    export       the exports copied to <out>/drafters/<name> (refused above `budget_mb` in all),
                 with training.json, plus the split manifest and held-out prompts

After each stage `<out>/BUILD.json` records it (`specjax.training.build_record`).

With `budget_s` the build runs within that many seconds of wall time: a plan splitting them
between the units (stages; a stage of several drafters per drafter) is printed first
(`specjax.training.build_budget`), each unit gets its share of the time left when it starts, and
a unit that reaches its share stops and keeps its work instead of failing the build: regeneration
keeps the rows written, training saves a checkpoint and exports the drafter it has (calibration
and export then use that export), and the next run continues both. A unit that fails (a program's
error, e.g. one drafter out of accelerator memory) is recorded with its error and the other units
go on, so that one run on a lent machine keeps all it can; the build then fails naming it.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Protocol, Sequence

from specjax.io import read_jsonl, write_jsonl_atomic
from specjax.training.answers import answer_stats, answered, read_answers
from specjax.training.build_budget import ALWAYS, Budget, UnitRef, format_plan
from specjax.training.build_outputs import (PROGRESS_NAME, BuildError, build_vocab_files, check_budget,
                                            export_drafters, planned_bytes, with_shipped, write_split)
from specjax.training.build_plan import (CURVE_EVAL_SETS, STAGES, BuildSettings, DrafterPlan, cache_layers,
                                         drafter_plan, online_plan)
from specjax.training.build_record import (count_rows, drafter_build, load_record,
                                           note_stage, provenance)

class Launcher(Protocol):
    """Runs the stages that are programs (`train/build_stages.py`); raises BuildError when one
    fails. Each reads what it needs from `build` (settings, plans, cache layers)."""

    def prepare(self, build: "Build") -> None: ...

    def regenerate(self, build: "Build") -> None: ...

    def cache(self, build: "Build", data: Sequence[str], out: str) -> None: ...

    def train(self, build: "Build", plan: DrafterPlan) -> None: ...

    def calibrate(self, build: "Build", plan: DrafterPlan) -> None: ...

    def machine(self) -> dict[str, Any]:
        """The machine the stages run on (`build_record.machine()` as they see it)."""
        ...


Unit = tuple[str, Callable[[], bool], Callable[[], None]]  # (record key, done, work)


class Build:
    """Plans and runs the stages of one build (module docstring); `launch` runs the programs."""

    def __init__(self, settings: BuildSettings, launch: Launcher,
                 log: Callable[[str], None] = print):
        self.s = settings
        self.launch = launch
        self.log = log
        self.plans = [drafter_plan(settings, n) for n in settings.drafters]
        if settings.scale.online:
            self.plans = [online_plan(p) for p in self.plans]
        self.layers = cache_layers(self.plans)
        self.record = load_record(settings.record_path)
        self._exported = False
        self.budget = (Budget(settings.budget_s, settings.scale.min_unit_s)
                       if settings.budget_s is not None else None)
        # the running unit's share (with a budget; None for the stages that run whole)
        self.unit_budget_s: float | None = None

    def check_sizes(self) -> None:
        """BuildError before any stage runs when the drafters to build, exported, would not fit
        `budget_mb` beside the other drafters shipped in <out> (sizes from the configs)."""
        planned = {p.name: planned_bytes(p.config, self.s.target) for p in self.plans}
        total = check_budget(self.s, with_shipped(self.s, planned), "would take")
        self.log("planned sizes: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in planned.items())
                 + f" (with the others shipped: {total / 2**20:.1f} of {self.s.budget_mb:g} MiB)")

    def check_curve_sets(self) -> None:
        """BuildError before any stage runs when a drafter records a learning curve but the
        evaluation directory holds none of Table 1's sets (the curve would go without them, e.g.
        on a machine the evaluation files were not carried to)."""
        if not self.s.scale.curve_every or not any(p.name in self.s.curve_drafters for p in self.plans):
            return
        if not self.curve_eval_files():
            names = ", ".join(f"{n}.jsonl" for n in CURVE_EVAL_SETS)
            raise BuildError(f"the learning curve reads Table 1's sets ({names}) from --eval-dir "
                             f"{self.s.eval_dir}, which holds none of them; pass --eval-dir, or "
                             f"--curve-every 0 for no curve")

    def curve_eval_files(self) -> list[str]:
        """The files of Table 1's sets (CURVE_EVAL_SETS) found in the evaluation directory."""
        paths = (os.path.join(self.s.eval_dir, f"{n}.jsonl") for n in CURVE_EVAL_SETS)
        return [f for f in paths if os.path.isfile(f)]

    # running -------------------------------------------------------------------------------
    def run(self, stages: Sequence[str] = STAGES) -> None:
        """Run the chosen stages in the fixed order, recording each."""
        unknown = [x for x in stages if x not in STAGES]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; stages: {', '.join(STAGES)}")
        chosen = [x for x in STAGES if x in stages]
        if "train" in chosen:
            self.check_sizes()
            self.check_curve_sets()
        units = [(i, name, u) for i, name in enumerate(chosen, 1) for u in self._units(name)]
        todo: list[UnitRef] = []
        if self.budget is not None:
            todo = [(u[0], name) for _, name, u in units if name == "export" or not u[1]()]
            self.budget.check(todo)
            self.log(format_plan(self.budget, todo))
        failed: list[str] = []
        for i, name, (key, done, work) in units:
            tag = f"[{i}/{len(chosen)}] {key}"
            self.unit_budget_s = None
            if self.budget is not None and (key, name) in todo:
                todo = todo[todo.index((key, name)):]
                share = self.budget.share(todo)
                if self.budget.skips(name, share):
                    self.log(f"{tag}: {share:.0f} s left for it, below "
                             f"{self.budget.min_unit_s:g} s: skipped (rerun with more budget)")
                    continue
                if name not in ALWAYS:  # the short stages run whole
                    self.unit_budget_s = share
                    tag += f" (share {share:.0f} s)"
            try:
                self._run_unit(tag, key, done, work)
            except BuildError as e:
                if self.budget is None:
                    raise
                failed.append(key)
                self.log(f"{tag}: failed ({e}); the other units go on")
        if failed:
            raise BuildError(f"unit(s) {', '.join(failed)} failed (BUILD.json: each stage's "
                             f"last_error); the other units' work is kept and a rerun retries them")

    def _run_unit(self, tag: str, key: str, done: Callable[[], bool],
                  work: Callable[[], None]) -> None:
        if done():
            self.log(f"{tag}: complete, skipped")
            st = self.record["stages"].get(key)
            if st is not None and not st.get("complete"):
                self._note(key, 0.0, True, ran=False)
            return
        self.log(f"{tag}: running")
        t0, before, error = time.perf_counter(), self._counts(key), None
        try:
            work()
            if not done() and self.budget is None:
                raise BuildError(f"stage {key} ended without completing its output "
                                 "(interrupted?); rerun the build to resume it")
        except BuildError as e:
            error = str(e)
            raise
        finally:
            seconds = time.perf_counter() - t0
            self._note(key, seconds, done(), facts=self._facts(key, before, seconds), error=error)
        cut = "" if done() else " (not complete: a rerun resumes it)"
        self.log(f"{tag}: done in {self.record['stages'][key]['last_run_s']:.0f} s{cut}")

    def _units(self, name: str) -> list[Unit]:
        if name == "train":
            return [(f"train/{p.name}", lambda p=p: self.done_train(p),
                     lambda p=p: self.train(p)) for p in self.plans]
        if name == "calibrate":
            return [(f"calibrate/{p.name}", lambda p=p: self.done_calibrate(p),
                     lambda p=p: self.calibrate(p)) for p in self.plans if p.confidence_head]
        if name == "cache" and self.s.scale.reference_rows:
            return [("cache", self.done_cache, self.cache),
                    ("cache/references", self.done_cache_references, self.cache_references)]
        return [(name, getattr(self, f"done_{name}"), getattr(self, name))]

    def _note(self, key: str, seconds: float, complete: bool, *, ran: bool = True,
              facts: dict[str, Any] | None = None, error: str | None = None) -> None:
        note_stage(self.record, self.s, key, seconds, complete, ran=ran, layers=self.layers,
                   wants_text=self.wants_text, machine_info=self.launch.machine(), facts=facts,
                   error=error)

    def _counts(self, key: str) -> int:
        """Rows regenerated so far (the regenerate unit's starting point)."""
        return count_rows(self.s.regen_out) if key == "regenerate" else 0

    def _facts(self, key: str, before: int, seconds: float) -> dict[str, Any] | None:
        """What a unit's run did, for BUILD.json: regenerate: samples, answer turns and tokens of
        all answers and of this run (tokens/s); train: steps, samples and steps/s."""
        if key == "regenerate" and os.path.isfile(self.s.regen_out):
            from specjax import checkpoints

            tok = checkpoints.load_tokenizer(self.s.target)
            rows = [read_jsonl(f, objects=True, repair_torn_tail=True)
                    for f in self.s.answers_files]
            self.record.setdefault("data", {})["answers"] = answer_stats(
                (r for part in rows for r in part), tok)
            new = answer_stats(rows[-1][before:], tok)
            return {**{f"new_{k}": v for k, v in new.items()},
                    "answer_tokens_per_s": round(new["answer_tokens"] / max(seconds, 1e-9), 1)}
        if key.startswith("train/"):
            plan = next(p for p in self.plans if f"train/{p.name}" == key)
            return self.train_progress(plan)
        return None

    # prepare -------------------------------------------------------------------------------
    @property
    def wants_text(self) -> bool:
        """Whether a drafter of this build reads original replies as text (`text_rows`)."""
        return bool(self.s.scale.text_rows) and any(p.text_only for p in self.plans)

    @property
    def wants_references(self) -> bool:
        """Whether prepare must write the original replies (references.jsonl)."""
        return bool(self.s.scale.reference_rows) or self.wants_text

    def done_prepare(self) -> bool:
        need = ["manifest.json"] + (["references.jsonl"] if self.wants_references else [])
        return all(os.path.isfile(os.path.join(self.s.sharegpt_dir, f)) for f in need)

    def prepare(self) -> None:
        self.launch.prepare(self)

    # regenerate ----------------------------------------------------------------------------
    def wanted_prompts(self) -> list[dict[str, Any]]:
        """The first `rows` training prompts of the prepare stage, each with its first
        `max_turns` user turns."""
        src = os.path.join(self.s.sharegpt_dir, "prompts.jsonl")
        if not os.path.isfile(src):
            raise BuildError(f"regenerate needs {src}: run the prepare stage first")
        rows = read_jsonl(src, objects=True)[: self.s.scale.rows]
        if not rows:
            raise BuildError(f"{src} has no training prompt")
        k = self.s.scale.max_turns
        return [{**r, "turns": r["turns"][:k]} if k is not None else r for r in rows]

    def seeded_ids(self) -> set[str]:
        """Ids (JSON) of the prompts the seed artifact answered (regen_seed.jsonl)."""
        return {json.dumps(r["id"]) for r in read_jsonl(self.s.regen_seed, objects=True,
                                                        missing_ok=True)}

    def pending_prompts(self) -> list[dict[str, Any]]:
        """The wanted prompts that the seed artifact did not answer (they are regenerated)."""
        seeded = self.seeded_ids()
        return [r for r in self.wanted_prompts() if json.dumps(r["id"]) not in seeded]

    def done_regenerate(self) -> bool:
        if not os.path.isfile(os.path.join(self.s.sharegpt_dir, "prompts.jsonl")):
            return False
        if self.s.seed_answers and not os.path.isfile(self.s.regen_seed):
            return False
        n = count_rows(self.s.regen_prompts)
        return (n == len(self.pending_prompts())
                and count_rows(self.s.regen_out) + count_rows(self.s.regen_errors) >= n)

    def seed(self) -> None:
        """regen_seed.jsonl = the artifact's answers to wanted prompts, written once (the first
        stage that reads answers) so that later runs regenerate the same prompts; without
        prepared prompts (no prepare stage on this machine) the artifact's first `rows` answers. A
        corrupt artifact is an error naming it, before any file of the work directory is
        touched."""
        if not self.s.seed_answers or os.path.isfile(self.s.regen_seed):
            return
        rows = read_answers(self.s.seed_answers)
        if os.path.isfile(os.path.join(self.s.sharegpt_dir, "prompts.jsonl")):
            rows = answered(rows, self.wanted_prompts())
        else:
            rows = rows[:self.s.scale.rows]
            self.log(f"no prepared prompts in {self.s.sharegpt_dir}: the artifact's first {len(rows)} "
                     f"answers are used (rows {self.s.scale.rows})")
        write_jsonl_atomic(self.s.regen_seed, rows)
        self.log(f"{len(rows)} prompts already answered by {self.s.seed_answers}")

    @property
    def heldout_prompts(self) -> str:
        """The prepare stage's held-out prompts, else the shipped ones (<out>/prompts)."""
        held = os.path.join(self.s.sharegpt_dir, "heldout.jsonl")
        shipped = os.path.join(self.s.out_dir, "prompts", "heldout.jsonl")
        return held if os.path.isfile(held) or not os.path.isfile(shipped) else shipped

    def select_prompts(self) -> int:
        """regen_prompts.jsonl = the first `rows` training prompts not answered by the seed
        artifact. An existing file may only grow (a larger --rows): the rows already answered stay
        first, so regeneration resumes."""
        if len(self.wanted_prompts()) < self.s.scale.rows:
            self.log(f"regenerate: only {len(self.wanted_prompts())} training prompts (asked for "
                     f"{self.s.scale.rows})")
        self.seed()
        rows = self.pending_prompts()
        have = read_jsonl(self.s.regen_prompts, objects=True, missing_ok=True)
        if have != rows[: len(have)]:
            raise BuildError(
                f"{self.s.regen_prompts} ({len(have)} rows) is not the start of the {len(rows)} "
                f"prompts asked for now (fewer rows or other prompts); remove it and "
                f"{self.s.regen_out} to regenerate from scratch")
        if len(have) < len(rows) or not os.path.isfile(self.s.regen_prompts):
            write_jsonl_atomic(self.s.regen_prompts, rows)
        return len(rows)

    def regenerate(self) -> None:
        s = self.s
        n = self.select_prompts()
        if n == 0:
            return
        self.log(f"regenerate: {n} prompts x <= {s.scale.max_new_tokens} new tokens per turn, "
                 f"{s.regen_slots} at a time")
        self.launch.regenerate(self)

    # cache ---------------------------------------------------------------------------------
    def done_cache(self) -> bool:
        from specjax.training.features import MANIFEST

        return self.layers is None or os.path.isfile(os.path.join(self.s.cache_dir, MANIFEST))

    def cache(self) -> None:
        self.seed()
        self.launch.cache(self, self.s.answers_files, self.s.cache_dir)

    def reference_conversations(self, n: int) -> list[dict[str, Any]]:
        """The original first replies of the first `n` training prompts that follow the
        regenerated ones (prepare order; prompts without a reply are passed over)."""
        src = os.path.join(self.s.sharegpt_dir, "references.jsonl")
        if not os.path.isfile(src):
            raise BuildError(f"original replies need {src}: run the prepare stage")
        regen_ids = {r["id"] for r in read_jsonl(self.s.regen_prompts, objects=True)}
        regen_ids |= {r["id"] for r in read_jsonl(self.s.regen_seed, objects=True, missing_ok=True)}
        rows = [r for r in read_jsonl(src, objects=True) if r["id"] not in regen_ids]
        if len(rows) < n:
            self.log(f"original replies: only {len(rows)} (asked for {n})")
        return rows[:n]

    def done_cache_references(self) -> bool:
        from specjax.training.features import MANIFEST

        if not os.path.isfile(self.s.references_out):  # online drafters read the file itself
            return False
        return self.layers is None or os.path.isfile(
            os.path.join(self.s.references_cache_dir, MANIFEST))

    def cache_references(self) -> None:
        rows = self.reference_conversations(self.s.scale.reference_rows)
        if not rows:
            raise BuildError("cache/references: no original reply to add")
        write_jsonl_atomic(self.s.references_out, rows)
        if self.layers is not None:
            self.launch.cache(self, [self.s.references_out], self.s.references_cache_dir)

    # vocab ---------------------------------------------------------------------------------
    def vocab_sizes(self) -> list[int]:
        return sorted({p.draft_vocab_size for p in self.plans if p.draft_vocab_size})

    def done_vocab(self) -> bool:
        return all(os.path.isfile(self.s.vocab_file(n)) for n in self.vocab_sizes())

    def vocab(self) -> None:
        self.seed()
        cov = build_vocab_files(self.s, self.vocab_sizes())
        self.record.setdefault("data", {})["draft_vocab_coverage"] = {str(k): v
                                                                      for k, v in cov.items()}
        self.log("vocab: coverage " + ", ".join(f"N={k}: {v:.4f}" for k, v in cov.items()))

    # train ---------------------------------------------------------------------------------
    def trained(self, p: DrafterPlan) -> bool:
        """An export of the drafter exists (maybe of a run its budget stopped)."""
        return os.path.isfile(os.path.join(self.s.export_dir(p.name), "config.json"))

    def train_progress(self, p: DrafterPlan) -> dict[str, Any] | None:
        """The export's progress file (steps done of the total, samples, steps/s), if any."""
        path = os.path.join(self.s.export_dir(p.name), PROGRESS_NAME)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def done_train(self, p: DrafterPlan) -> bool:
        prog = self.train_progress(p)
        return self.trained(p) and (prog is None or prog["step"] >= prog["total_steps"])

    def training_files(self, p: DrafterPlan) -> list[str]:
        """The JSONL files an online drafter trains on: the answers, the original replies
        (`reference_rows`) and, for a drafter trained on text alone, `text_rows` more replies
        (written here the first time)."""
        s = self.s
        self.seed()
        files = s.answers_files + ([s.references_out] if s.scale.reference_rows else [])
        if p.text_only and s.scale.text_rows:
            if not os.path.isfile(s.text_out):
                write_jsonl_atomic(s.text_out, self.reference_conversations(s.scale.text_rows))
            files.append(s.text_out)
        return files

    def train(self, p: DrafterPlan) -> None:
        stale = os.path.join(self.s.export_dir(p.name), "calibration.json")
        if os.path.isfile(stale):  # calibrated on an earlier, shorter run: calibrate again
            os.remove(stale)
        self.launch.train(self, p)

    # calibrate -----------------------------------------------------------------------------
    def done_calibrate(self, p: DrafterPlan) -> bool:
        return os.path.isfile(os.path.join(self.s.export_dir(p.name), "calibration.json"))

    def calibrate(self, p: DrafterPlan) -> None:
        if not self.trained(p):
            if self.budget is None:
                raise BuildError(f"calibrate/{p.name} needs the trained drafter (stage train)")
            self.log(f"calibrate/{p.name}: no trained drafter yet, skipped")
            return
        held = self.heldout_prompts
        if count_rows(held) == 0:
            raise BuildError(f"calibrate needs held-out prompts; {held} has none (raise "
                             "heldout_fraction or read more conversations)")
        self.launch.calibrate(self, p)

    # export --------------------------------------------------------------------------------
    def done_export(self) -> bool:
        return self._exported  # cheap and idempotent: refreshed by every build that names it

    def export(self) -> None:
        plans = self.plans
        if self.budget is not None:  # what the budget trained so far (a rerun continues it)
            plans = [p for p in self.plans if self.trained(p)]
            if not plans:
                self.log("export: no drafter trained yet, nothing exported")
                return
        missing = [p.name for p in plans if not self.done_train(p)]
        if missing and self.budget is None:
            raise BuildError(f"export needs the trained drafters {missing} (stage train)")
        sizes = export_drafters(self.s, plans, lambda p: provenance(self.s, p), self.log)
        if os.path.isfile(os.path.join(self.s.sharegpt_dir, "manifest.json")):
            write_split(self.s)
        else:
            self.log(f"export: no prepare stage here; {self.s.out_dir}/split.json stays as it is")
        builds = self.record.setdefault("drafter_builds", {})
        for p in plans:
            builds[p.name] = drafter_build(self.s, self.train_progress(p), self.launch.machine())
        self.record["drafter_bytes"] = sizes
        self.record["drafter_bytes_total"] = sum(sizes.values())
        self._exported = True
        self.log(f"export: {self.record['drafter_bytes_total'] / 2**20:.1f} MiB in all -> "
                 f"{os.path.join(self.s.out_dir, 'drafters')}")


__all__ = ["Build", "Launcher"]
