"""What the drafter build writes besides its record: draft vocabulary files and the lean copies
of the trained drafters that ship (without the frozen copies of the target's tensors)."""
from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from specjax.io import read_jsonl, write_json_atomic

if TYPE_CHECKING:
    from specjax.training.build_plan import BuildSettings, DrafterPlan


class BuildError(RuntimeError):
    """A stage of the drafter build could not run or did not finish."""


# a trainer's export holds this file: {"step", "total_steps", "status", ...} of the run that wrote
# it (`specjax.training.run.train`); the build's train stage is complete when step >= total_steps
PROGRESS_NAME = "progress.json"


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


def build_vocab_files(s: "BuildSettings", sizes: Sequence[int]) -> dict[int, float]:
    """Count the supervised tokens of the answers (seeded and regenerated; tokenised as the
    trainer does) and write one draft vocabulary per size; returns the coverage of each."""
    from specjax import checkpoints
    from specjax.drafters import vocab as dv
    from specjax.training import features as feat

    tcfg = checkpoints.read_target_config(s.target)
    tok = checkpoints.load_tokenizer(s.target)
    samples = feat.read_jsonl_samples(s.answers_files, tok, max_length=s.max_length,
                                      min_loss_tokens=0)
    counts = dv.token_counts((ids for ids, _ in samples), tcfg.vocab_size,
                             masks=(m for _, m in samples))
    out: dict[int, float] = {}
    for n in sorted(set(sizes)):
        choice = dv.build_draft_vocab(counts, n, always=tcfg.eos_token_ids)
        write_draft_vocab(s.vocab_file(n), choice.draft_ids, coverage=choice.coverage,
                          counted_tokens=int(counts.sum()),
                          source=",".join(os.path.basename(f) for f in s.answers_files))
        out[n] = choice.coverage
    return out


# ------------------------------------------------------------------------------------------------
# shipped drafters


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
    from specjax.drafters.common import Frozen

    drafter = registry.load_drafter(path, target=target)
    return {e.hf_name for e in checkpoints.param_entries(drafter, registry.key_map_of(drafter))
            if isinstance(e.variable, Frozen) and e.hf_name is not None}


def planned_bytes(config_path: str, target: str, *, dtype_bytes: int = 2) -> int:
    """Bytes of the trainable parameters a drafter's training config makes for `target` (a
    checkpoint directory or .gguf), as the build exports them (bfloat16): the shipped drafter less
    its small files. From abstract shapes (nothing allocated, nothing trained)."""
    import jax
    from flax import nnx

    from specjax import checkpoints
    from specjax.drafters.registry import KINDS
    from specjax.models.decoder import CausalLM
    from specjax.training.config import load_train_config

    mc = load_train_config(config_path, [f"model.target={json.dumps(target)}"]).model
    tcfg = checkpoints.read_target_config(target)
    n = mc.draft_vocab_size

    def build() -> Any:
        drafter, _, _ = KINDS[mc.kind].build(mc.section, CausalLM(tcfg, rngs=nnx.Rngs(0)), tcfg, rngs=nnx.Rngs(0),
                                             dtype=mc.compute_dtype, param_dtype=mc.param_dtype,
                                             draft_ids=np.arange(n) if n else None)
        return drafter
    params = nnx.state(nnx.eval_shape(build), nnx.Param)
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))) * dtype_bytes


def lean_copy(src: str, dst: str, target: Any) -> list[str]:
    """Copy drafter directory `src` to `dst` without the frozen target copies (a DSpark drafter
    for a 49k-token target would otherwise carry the 28M-entry embedding); returns the names left
    out. Other files are copied as they are, but the trainer's progress file."""
    from specjax import checkpoints

    drop = frozen_tensor_names(src, target)
    os.makedirs(dst, exist_ok=True)
    weights = {checkpoints.SAFE_WEIGHTS, checkpoints.SAFE_INDEX, PROGRESS_NAME}
    for f in os.listdir(src):
        if f not in weights and not f.endswith(".safetensors"):
            shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    with checkpoints.SafetensorsDir(src) as reader:
        names = [n for n in reader if n not in drop]
        checkpoints.write_safetensors(dst, ((n, reader[n]) for n in names))
    return sorted(drop)


def with_shipped(s: "BuildSettings", sizes: dict[str, int]) -> dict[str, int]:
    """`sizes` (bytes by drafter name) plus those of the other drafters shipped in <out>/drafters."""
    drafters = os.path.join(s.out_dir, "drafters")
    kept = {n: dir_bytes(os.path.join(drafters, n))
            for n in (sorted(os.listdir(drafters)) if os.path.isdir(drafters) else [])
            if n not in sizes and not n.endswith(".tmp")}
    return {**kept, **sizes}


def check_budget(s: "BuildSettings", sizes: dict[str, int], verb: str) -> int:
    """The total of `sizes`; BuildError naming every drafter's size when it is over `budget_mb`."""
    total = sum(sizes.values())
    if total > s.budget_mb * 2**20:
        raise BuildError(f"the drafters {verb} {total / 2**20:.1f} MiB in all, over the {s.budget_mb:g} MiB "
                         "budget (--budget-mb): " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()))
    return total


def export_drafters(s: "BuildSettings", plans: Sequence["DrafterPlan"],
                    training_json: Callable[["DrafterPlan"], dict[str, Any]],
                    log: Callable[[str], None]) -> dict[str, int]:
    """Copy each trained export to <out>/drafters/<name> without the target's copies, with
    `training_json(plan)` as its training.json; refused (nothing replaced) when the drafters in
    <out> would take more than the budget. Returns the bytes of every shipped drafter (those
    shipped before and not rebuilt now count as they are)."""
    from specjax import checkpoints

    target, _ = checkpoints.load_target(s.target)
    for p in plans:
        tmp = s.shipped_dir(p.name) + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        dropped = lean_copy(s.export_dir(p.name), tmp, target)
        log(f"export {p.name}: left out the target's copies {dropped}")
        write_json_atomic(os.path.join(tmp, "training.json"), training_json(p))
    sizes = with_shipped(s, {p.name: dir_bytes(s.shipped_dir(p.name) + ".tmp") for p in plans})
    try:
        check_budget(s, sizes, "take")
    except BuildError:
        for p in plans:
            shutil.rmtree(s.shipped_dir(p.name) + ".tmp", ignore_errors=True)
        raise
    for p in plans:
        dst = s.shipped_dir(p.name)
        shutil.rmtree(dst, ignore_errors=True)
        os.replace(dst + ".tmp", dst)
    return sizes


def write_split(s: "BuildSettings") -> None:
    """<out>/split.json: the prepare stage's manifest (held-out ids, excluded evaluation files)
    plus `train_prompt_digests`, the `sharegpt.prompt_digest` of every answered prompt (seeded or
    regenerated); and
    the held-out prompts as <out>/prompts/heldout.jsonl."""
    from specjax.training.sharegpt import prompt_digest

    with open(os.path.join(s.sharegpt_dir, "manifest.json"), encoding="utf-8") as f:
        split = json.load(f)
    from specjax.training.answers import first_user_turn

    rows = read_jsonl(s.regen_prompts, objects=True, missing_ok=True)
    seeded = read_jsonl(s.regen_seed, objects=True, missing_ok=True)
    split["train_prompt_digests"] = sorted({prompt_digest(r["turns"][0]) for r in rows}
                                           | {prompt_digest(first_user_turn(r)) for r in seeded})
    write_json_atomic(os.path.join(s.out_dir, "split.json"), split)
    os.makedirs(os.path.join(s.out_dir, "prompts"), exist_ok=True)
    shutil.copyfile(os.path.join(s.sharegpt_dir, "heldout.jsonl"),
                    os.path.join(s.out_dir, "prompts", "heldout.jsonl"))


__all__ = ["PROGRESS_NAME", "BuildError", "build_vocab_files", "dir_bytes", "export_drafters",
           "check_budget", "frozen_tensor_names", "lean_copy", "planned_bytes", "read_draft_vocab",
           "with_shipped", "write_draft_vocab", "write_split"]
