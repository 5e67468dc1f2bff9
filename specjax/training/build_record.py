"""The drafter build's record, `<out>/BUILD.json` (written atomically after every stage): the
wall time of every stage (summed over the runs that worked on it), whether it is complete, sizes,
the settings and the machine; and each shipped drafter's `training.json` (its provenance). Paths
inside the work directory are written as `<work>/...`, so no machine path ships."""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
from typing import TYPE_CHECKING, Any

import yaml

from specjax.eval.curve import CURVE_LOG
from specjax.io import read_jsonl, write_json_atomic
from specjax.training.build_outputs import dir_bytes

if TYPE_CHECKING:
    from specjax.training.build_plan import BuildSettings, DrafterPlan

RECORD_NAME = "BUILD.json"


def now() -> str:
    """The current UTC time, to the second (ISO 8601)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def count_rows(path: str) -> int:
    """Rows of a JSONL file (0 when it does not exist; a torn last line is cut first)."""
    return len(read_jsonl(path, objects=True, repair_torn_tail=True, missing_ok=True))


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


def work_label(s: "BuildSettings", path: str) -> str:
    """A path inside the work directory as '<work>/...' (no machine path in shipped files)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(s.work_dir))
    return "<work>/" + rel if not rel.startswith("..") else os.path.basename(path)


def target_label(s: "BuildSettings") -> str:
    """How the record names the target (default: its file name)."""
    return s.target_label or os.path.basename(os.path.normpath(s.target))


def note_stage(record: dict[str, Any], s: "BuildSettings", key: str, seconds: float,
               complete: bool, *, ran: bool, layers: tuple[int, ...] | None,
               wants_text: bool, machine_info: dict[str, Any], facts: dict[str, Any] | None = None,
               error: str | None = None) -> None:
    """Add a stage run (or, with ran=False, only its completeness) to `record` and write
    BUILD.json atomically; `facts` (what the run did: samples, tokens/s, steps) replace the
    stage's `last_run` facts; `error` is the run's failure (`last_error`, None after a run
    that did not fail); `machine_info` is the machine that runs the stages (`machine()`)."""
    st = record["stages"].setdefault(key, {"wall_s": 0.0, "runs": 0})
    if ran:
        st["wall_s"] = round(st["wall_s"] + seconds, 1)
        st["runs"] += 1
        st["last_run_s"] = round(seconds, 1)
        if facts:
            st["last_run"] = facts
        if error is not None or "last_error" in st:
            st["last_error"] = error
    st["complete"] = complete
    st["finished"] = now() if complete else None
    r = record
    r["target"] = target_label(s)
    r["total_wall_s"] = round(sum(v["wall_s"] for v in r["stages"].values()), 1)
    # a build of some drafters into an existing record keeps the others it lists
    built = (r.get("settings") or {}).get("drafters") or []
    drafters = built + [d for d in s.drafters if d not in built]
    r["settings"] = {**dataclasses.asdict(s.scale), "drafters": drafters,
                     "heldout_fraction": s.heldout_fraction, "regen_slots": s.regen_slots,
                     "sampling": {"temperature": s.temperature, "top_p": s.top_p,
                                  "top_k": s.top_k},
                     "cache_layers": (list(layers) if layers is not None
                                      else (r.get("settings") or {}).get("cache_layers")),
                     "budget_mb": s.budget_mb, "seed": s.seed, "budget_s": s.budget_s,
                     "seed_answers": os.path.basename(s.seed_answers) if s.seed_answers else None}
    r["data"] = {**r.get("data", {}), **data_facts(s, wants_text)}
    r["machine"] = machine_info
    os.makedirs(s.out_dir, exist_ok=True)
    write_json_atomic(s.record_path, r)


def machine() -> dict[str, Any]:
    """This process's machine: platform, CPUs and the accelerator jax uses (JSON-able)."""
    import jax

    dev = jax.devices()[0]
    return {"platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "jax_backend": dev.platform,
            "device": getattr(dev, "device_kind", dev.platform), "device_count": jax.device_count(),
            "jax": jax.__version__}


def drafter_build(s: "BuildSettings", progress: dict[str, Any] | None,
                  machine_info: dict[str, Any]) -> dict[str, Any]:
    """Who built a shipped drafter: the machine, the command and the steps trained."""
    progress = progress or {}
    return {"machine": machine_info, "command": s.command, "finished": now(),
            "steps": progress.get("step"), "total_steps": progress.get("total_steps")}


def data_facts(s: "BuildSettings", wants_text: bool) -> dict[str, Any]:
    """Sizes of the build's data so far (prompts read, rows regenerated, cache bytes, ...)."""
    facts: dict[str, Any] = {}
    man = os.path.join(s.sharegpt_dir, "manifest.json")
    if os.path.isfile(man):
        with open(man, encoding="utf-8") as f:
            m = json.load(f)
        facts["sharegpt"] = {"read": m.get("read"), "prompts": m.get("prompts")}
    if os.path.isfile(s.regen_out):
        rows = read_jsonl(s.regen_out, objects=True, repair_torn_tail=True)
        facts["regenerated_rows"] = len(rows)
        facts["regen_errors"] = count_rows(s.regen_errors)
    if os.path.isfile(s.regen_seed):
        facts["seeded_rows"] = count_rows(s.regen_seed)
    if os.path.isdir(s.cache_dir):
        facts["cache_bytes"] = dir_bytes(s.cache_dir)
    if wants_text and os.path.isfile(s.text_out):
        facts["text_rows"] = count_rows(s.text_out)
    if s.scale.reference_rows and os.path.isfile(s.references_out):
        facts["reference_rows"] = count_rows(s.references_out)
        facts["references_cache_bytes"] = dir_bytes(s.references_cache_dir)
    return facts


def provenance(s: "BuildSettings", p: "DrafterPlan") -> dict[str, Any]:
    """A shipped drafter's training.json: its config (work paths as <work>/...), final step and
    metrics, and its learning curve when it recorded one."""
    logs = os.path.join(s.run_dir(p.name), "logs", "metrics.jsonl")
    rows = read_jsonl(logs, objects=True, repair_torn_tail=True, missing_ok=True)
    last = rows[-1] if rows else {}
    cfg_copy = os.path.join(s.run_dir(p.name), "checkpoints", "train_config.yaml")
    train_cfg = None
    if os.path.isfile(cfg_copy):
        with open(cfg_copy, encoding="utf-8") as f:
            train_cfg = yaml.safe_load(f)
        train_cfg["model"]["target"] = target_label(s)
        for key, val in (("checkpoint", "directory"), ("logging", "directory")):
            train_cfg.get(key, {}).pop(val, None)
        train_cfg.pop("export_dir", None)
        data = train_cfg.get("data", {})
        for key in ("cache_dir", "extra_cache_dirs", "train_jsonl"):  # paths inside <work>
            if isinstance(data.get(key), str):
                data[key] = work_label(s, data[key])
            elif data.get(key):
                data[key] = [work_label(s, x) for x in data[key]]
        curve = train_cfg.get("curve") or {}
        if curve.get("texts"):
            curve["texts"] = work_label(s, curve["texts"])
        for cs in curve.get("sets") or []:
            cs["files"] = [work_label(s, x) for x in cs["files"]]
    points = read_jsonl(os.path.join(s.run_dir(p.name), "logs", CURVE_LOG), objects=True,
                        repair_torn_tail=True, missing_ok=True)
    return {"drafter": p.name, "config": os.path.basename(p.config),
            "final_step": last.get("step"), "final_metrics": last,
            "train_config": train_cfg, "finished": now(), **({"learning_curve": points} if points else {})}


__all__ = ["RECORD_NAME", "count_rows", "data_facts", "drafter_build", "load_record", "machine",
           "note_stage", "now",
           "provenance", "target_label", "work_label"]
