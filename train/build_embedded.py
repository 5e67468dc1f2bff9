"""Rebuild every embedded asset from scratch: `make embedded` (= `python -m train.build_embedded`).

Stages, in order (each skipped when its output exists, unless --force; each resumable itself):

    target       python -m train.pretrain_target --out specjax/assets/pystd
                 -> target/ (config.json, model.safetensors, tokenizer), prompts/, split.json
    regen        the train prompts of at most --regen-prompt-tokens tokens, --regen-samples times
                 (at most --regen-rows rows), completed by the target with §7.2 sampling (temperature 0.7, top-p 0.8, top-k 20,
                 --regen-max-tokens) through python -m train.regenerate -> runs/embedded/regen.jsonl
    <drafter>    python -m train.train_draft --config configs/embedded/<drafter>.yaml, exported
                 (bfloat16, DeepSpec names) to specjax/assets/pystd/drafters/<drafter>/
                 for dspark, calibrate, dflash, eagle3, mtp1, standalone, dspark-rnn
    calibrate    STS of the DSpark confidence head on held-out prompts (python -m train.calibrate)
                 -> drafters/dspark/calibration.json + config.json confidence_temperatures

Benchmark-only stages (not shipped, not run by default; `--stages dspark-g15 dflash-g15`):

    dspark-g15, dflash-g15
                 configs/embedded/dspark.yaml / dflash.yaml with block 15 (`BENCH_RECIPES`), exported
                 to runs/embedded/exports/<name>/ for bench.embedded's gamma = 15 comparison

Every stage runs as a child process (its output streams through). The wall time of each stage
that ran, and the sum over the recorded stages, go to specjax/assets/pystd/BUILD.json (stages
that were skipped keep the time recorded when they last ran) and to the "Embedded default build"
section at the end of docs/BENCHMARKS.md (and bench/results/embedded_build.{md,json}, from which
`python -m bench.run_all --docs-only` rebuilds that section).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from specjax import embedded as emb
from specjax.io import read_jsonl

DRAFTER_ORDER = ("dspark", "calibrate", "dflash", "eagle3", "mtp1", "standalone", "dspark-rnn")
STAGES = ("target", "regen") + DRAFTER_ORDER
# benchmark-only stage -> (shipped recipe it reuses, overrides of that recipe)
BENCH_RECIPES = {"dspark-g15": ("dspark", ("model.block_size=15",)),
                 "dflash-g15": ("dflash", ("model.block_size=15",))}
BENCH_STAGES = tuple(BENCH_RECIPES)
RUN_DIR = os.path.join("runs", "embedded")
CONFIG_DIR = os.path.join("configs", "embedded")
DOCS_PATH = os.path.join("docs", "BENCHMARKS.md")
RESULTS_DIR = os.path.join("bench", "results")
SECTION_TITLE = "## Embedded default build"
REGEN_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


def _log(msg: str) -> None:
    print(f"[build_embedded {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _run(cmd: Sequence[str]) -> None:
    """Run a child `python -m ...` command; a failure raises naming the command."""
    _log("$ " + " ".join(cmd))
    rc = subprocess.call(list(cmd))
    if rc != 0:
        raise RuntimeError(f"stage command failed with exit status {rc}: {' '.join(cmd)}")


def _rel(path: str) -> str:
    """`path` relative to the working directory when it lies below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


# ------------------------------------------------------------------------------------------------
# stages


class Build:
    """Paths and options of one build; `stage_<name>` runs a stage, `done_<name>` checks it."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.asset = _rel(emb.asset_dir())  # relative paths: records carry no machine paths
        self.target = _rel(emb.target_dir())
        self.run_dir = RUN_DIR
        self.regen_prompts = os.path.join(RUN_DIR, "regen_prompts.jsonl")
        self.regen_out = os.path.join(RUN_DIR, "regen.jsonl")
        self.py = sys.executable

    # target ---------------------------------------------------------------------------------
    def done_target(self) -> bool:
        return all(os.path.exists(p) for p in (
            os.path.join(self.target, "config.json"), os.path.join(self.target, "model.safetensors"),
            emb.prompts_path("train"), emb.prompts_path("heldout")))

    def stage_target(self, force: bool) -> None:
        cmd = [self.py, "-m", "train.pretrain_target", "--out", self.asset, "--no-progress"]
        _run(cmd + (["--fresh"] if force else []))

    # regen ----------------------------------------------------------------------------------
    def select_regen_prompts(self) -> int:
        """Train prompts of <= --regen-prompt-tokens tokens (file order), each --regen-samples
        times (ids "<prompt index>.<sample>"), first --regen-rows rows."""
        from specjax import checkpoints

        tok = checkpoints.load_tokenizer(self.target)
        rows = emb.load_prompts("train")
        short = [(i, r["prompt"]) for i, r in enumerate(rows)
                 if len(tok(r["prompt"], add_special_tokens=False)["input_ids"])
                 <= self.args.regen_prompt_tokens]
        # sample k of every prompt after sample k-1 of all of them (each row has its own seed)
        keep = [{"id": f"{i}.{k}", "prompt": p} for k in range(self.args.regen_samples)
                for i, p in short][:self.args.regen_rows]
        if not keep:
            raise ValueError(f"no train prompt has <= {self.args.regen_prompt_tokens} tokens")
        return emb.write_jsonl(keep, self.regen_prompts)

    def done_regen(self) -> bool:
        n = _count_lines(self.regen_prompts)
        return n > 0 and _count_lines(self.regen_out) + _count_lines(self._regen_errors()) >= n

    def _regen_errors(self) -> str:
        return os.path.join(RUN_DIR, "regen.errors.jsonl")

    def stage_regen(self, force: bool) -> None:
        os.makedirs(RUN_DIR, exist_ok=True)
        if force or not os.path.exists(self.regen_prompts):
            for p in (self.regen_out, self._regen_errors()):
                if os.path.exists(p):
                    os.remove(p)
            n = self.select_regen_prompts()
            _log(f"regen: {n} prompts -> {self.regen_prompts}")
        _run([self.py, "-m", "train.regenerate", "--target", self.target,
              "--prompts", self.regen_prompts, "--out", self.regen_out,
              "--errors", self._regen_errors(),
              "--temperature", str(REGEN_SAMPLING["temperature"]),
              "--top-p", str(REGEN_SAMPLING["top_p"]), "--top-k", str(REGEN_SAMPLING["top_k"]),
              "--max-tokens", str(self.args.regen_max_tokens),
              "--max-num-seqs", str(self.args.regen_slots),
              "--max-model-len", str(self.args.regen_prompt_tokens + self.args.regen_max_tokens + 8),
              "--quiet"])

    # drafters -------------------------------------------------------------------------------
    def drafter_out(self, name: str) -> str:
        """Export directory: the package for shipped drafters, runs/ for benchmark-only ones."""
        return bench_drafter_dir(name) if name in BENCH_STAGES else _rel(emb.drafter_dir(name))

    def done_drafter(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.drafter_out(name), "config.json"))

    def stage_drafter(self, name: str, force: bool) -> None:
        recipe, overrides = BENCH_RECIPES.get(name, (name, ()))
        cfg = os.path.join(CONFIG_DIR, f"{recipe}.yaml")
        if not os.path.exists(cfg):
            raise FileNotFoundError(f"drafter config not found: {cfg}")
        out = self.drafter_out(name)
        run = os.path.join(RUN_DIR, name)
        if force:
            for p in (run, out):
                if os.path.isdir(p):
                    shutil.rmtree(p)
        _run([self.py, "-m", "train.train_draft", "--config", cfg, "--export-dtype", "bfloat16",
              *[a for o in overrides for a in ("--set", o)],
              "--set", f"export_dir={out}",
              "--set", f"checkpoint.directory={os.path.join(run, 'checkpoints')}",
              "--set", f"logging.directory={os.path.join(run, 'logs')}"])
        _write_drafter_provenance(name, run, out, cfg)

    # calibrate ------------------------------------------------------------------------------
    def done_calibrate(self) -> bool:
        return os.path.exists(os.path.join(emb.drafter_dir("dspark"), "calibration.json"))

    def stage_calibrate(self, force: bool) -> None:
        del force
        if not self.done_drafter("dspark"):
            raise RuntimeError("calibrate needs the dspark drafter (stage dspark) first")
        _run([self.py, "-m", "train.calibrate", "--drafter", _rel(emb.drafter_dir("dspark")),
              "--target", self.target, "--prompts", _rel(emb.prompts_path("heldout")),
              "--cap", str(self.args.calibrate_prompts),
              "--max-new-tokens", str(self.args.calibrate_tokens), "--quiet"])

    def stage(self, name: str) -> tuple[Callable[[], bool], Callable[[bool], None]]:
        if name in ("target", "regen", "calibrate"):
            return getattr(self, f"done_{name}"), getattr(self, f"stage_{name}")
        return (lambda: self.done_drafter(name)), (lambda force: self.stage_drafter(name, force))


def bench_drafter_dir(name: str) -> str:
    """Where a benchmark-only stage (`BENCH_STAGES`) exports its drafter."""
    return os.path.join(RUN_DIR, "exports", name)


def _write_drafter_provenance(name: str, run: str, out: str, cfg: str) -> None:
    """training.json beside an exported drafter: steps, last metrics, the run's config."""
    metrics_path = os.path.join(run, "logs", "metrics.jsonl")
    last: dict[str, Any] = {}
    if os.path.exists(metrics_path):
        rows = read_jsonl(metrics_path)
        if rows:
            last = rows[-1]
    cfg_path = os.path.join(run, "checkpoints", "train_config.yaml")
    info = {"drafter": name, "config": cfg,
            "final_step": last.get("step"), "final_metrics": last,
            "machine": emb.machine_description(), "finished": _now()}
    if os.path.exists(cfg_path):
        import yaml

        with open(cfg_path) as f:
            info["train_config"] = yaml.safe_load(f)
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")


# ------------------------------------------------------------------------------------------------
# records


def build_json_path() -> str:
    return os.path.join(emb.asset_dir(), "BUILD.json")


def load_build_record(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {"stages": {}}
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("stages", {}), dict):
        raise ValueError(f"{path}: expected an object with a 'stages' mapping")
    d.setdefault("stages", {})
    return d


def _target_pretrain_seconds(target_dir: str) -> float | None:
    """The pre-training wall time recorded in target/training.json, if any."""
    path = os.path.join(target_dir, "training.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        d = json.load(f)
    wall = d.get("wall_time_s")
    if isinstance(wall, dict) and isinstance(wall.get("this_invocation"), (int, float)):
        return float(wall["this_invocation"])
    for key in ("wall_seconds", "wall_s", "train_seconds", "elapsed_s", "total_seconds"):
        v = d.get(key)
        if isinstance(v, (int, float)):
            return float(v)
    for sub in d.values():
        if isinstance(sub, dict):
            for key in ("wall_seconds", "wall_s", "train_seconds", "elapsed_s"):
                v = sub.get(key)
                if isinstance(v, (int, float)):
                    return float(v)
    return None


def markdown_section(record: dict[str, Any]) -> str:
    """The "Embedded default build" Markdown section of a BUILD.json record."""
    m = record.get("machine", {})
    lines = [SECTION_TITLE, "",
             "Command: `make embedded` (= `python -m train.build_embedded`; `--force` rebuilds, "
             "`--stages` picks stages). Wall time of each stage as last run on a "
             f"{m.get('cpu_count', '?')}-core CPU machine ({m.get('machine', '?')}, shared with "
             "other work, so times are upper bounds), from `specjax/assets/pystd/BUILD.json`:", "",
             "| stage | wall s | finished | note |", "|---|---:|---|---|"]
    for name in STAGES + tuple(b for b in BENCH_STAGES if b in record["stages"]):
        st = record["stages"].get(name)
        if not st:
            lines.append(f"| {name} | - | - | not built |")
            continue
        w = st.get("wall_s")
        note = st.get("note", "") or ("benchmark only, not shipped, not in the total"
                                      if name in BENCH_STAGES else "")
        lines.append(f"| {name} | {'-' if w is None else f'{w:.0f}'} | {st.get('finished') or '-'} "
                     f"| {note} |")
    tot = record.get("total_wall_s")
    lines += ["", f"Total of the recorded shipped-asset stages: {'-' if tot is None else f'{tot:.0f}'} s "
              f"({'-' if tot is None else f'{tot / 60:.1f}'} min).", ""]
    return "\n".join(lines)


def write_docs(record: dict[str, Any], docs_path: str = DOCS_PATH,
               results_dir: str = RESULTS_DIR) -> None:
    """Replace (or append) the section at the end of BENCHMARKS.md; also write
    bench/results/embedded_build.{md,json} for `bench.run_all --docs-only`."""
    section = markdown_section(record)
    text = ""
    if os.path.exists(docs_path):
        with open(docs_path, encoding="utf-8") as f:
            text = f.read()
    i = text.find(SECTION_TITLE)
    if i >= 0:
        j = text.find("\n## ", i + len(SECTION_TITLE))
        rest = text[j + 1:] if j >= 0 else ""
        text = text[:i] + section + ("\n" + rest if rest else "")
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    os.makedirs(os.path.dirname(docs_path) or ".", exist_ok=True)
    with open(docs_path, "w", encoding="utf-8") as f:
        f.write(text.rstrip("\n") + "\n")
    if os.path.isdir(results_dir):
        body = section.replace(SECTION_TITLE, "# Embedded default build", 1)
        body = body.replace("Command: `make embedded` (= `python -m train.build_embedded`;",
                            "Command: `python -m train.build_embedded`\n\n(`make embedded`;", 1)
        with open(os.path.join(results_dir, "embedded_build.md"), "w", encoding="utf-8") as f:
            f.write(body)
        with open(os.path.join(results_dir, "embedded_build.json"), "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


# ------------------------------------------------------------------------------------------------
# main


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.build_embedded",
                                description=__doc__.split("\n")[0])
    p.add_argument("--stages", nargs="+", choices=STAGES + BENCH_STAGES, default=list(STAGES),
                   help="stages to consider, run in the fixed order (default: every shipped asset; "
                        "the benchmark-only stages run only when named)")
    p.add_argument("--force", action="store_true",
                   help="rerun the chosen stages even when their output exists")
    p.add_argument("--regen-rows", type=int, default=3200, help="at most this many completions")
    p.add_argument("--regen-samples", type=int, default=4,
                   help="completions per train prompt (different seeds)")
    p.add_argument("--regen-prompt-tokens", type=int, default=128,
                   help="only train prompts of at most this many tokens")
    p.add_argument("--regen-max-tokens", type=int, default=128, help="tokens per completion")
    p.add_argument("--regen-slots", type=int, default=16, help="requests decoded together")
    p.add_argument("--calibrate-prompts", type=int, default=32, help="held-out prompts for STS")
    p.add_argument("--calibrate-tokens", type=int, default=96, help="new tokens per prompt")
    p.add_argument("--keep-going", action="store_true",
                   help="continue with later stages when one fails (it is reported at the end)")
    args = p.parse_args(argv)
    for name in ("regen_rows", "regen_samples", "regen_prompt_tokens", "regen_max_tokens", "regen_slots",
                 "calibrate_prompts", "calibrate_tokens"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2

    build = Build(args)
    rec_path = build_json_path()
    try:
        record = load_build_record(rec_path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    chosen = [s for s in STAGES + BENCH_STAGES if s in args.stages]
    failed: list[str] = []
    t_all = time.perf_counter()
    for i, name in enumerate(chosen, 1):
        done, run = build.stage(name)
        if done() and not args.force:
            _log(f"[{i}/{len(chosen)}] {name}: output exists, skipped (--force reruns it)")
            if name == "target" and name not in record["stages"]:
                secs = _target_pretrain_seconds(build.target)
                if secs is not None:
                    record["stages"]["target"] = {"wall_s": secs, "finished": None,
                                                  "note": "from target/training.json"}
            continue
        _log(f"[{i}/{len(chosen)}] {name}: running")
        t0 = time.perf_counter()
        try:
            run(args.force)
        except (RuntimeError, ValueError, FileNotFoundError) as e:
            _log(f"{name}: FAILED: {e}")
            failed.append(name)
            if not args.keep_going:
                break
            continue
        wall = time.perf_counter() - t0
        record["stages"][name] = {"wall_s": round(wall, 1), "finished": _now(), "note": ""}
        record["total_wall_s"] = round(sum(s["wall_s"] for n, s in record["stages"].items()
                                           if n in STAGES and isinstance(s.get("wall_s"), (int, float))), 1)
        record["machine"] = emb.machine_description()
        record["regen"] = {"rows": args.regen_rows, "samples": args.regen_samples, "prompt_tokens": args.regen_prompt_tokens,
                           "max_tokens": args.regen_max_tokens, **REGEN_SAMPLING}
        with open(rec_path, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        write_docs(record)
        _log(f"[{i}/{len(chosen)}] {name}: done in {wall:.0f} s")
    if record["stages"]:
        record.setdefault("machine", emb.machine_description())
        with open(rec_path, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        write_docs(record)
    _log(f"this run: {time.perf_counter() - t_all:.0f} s; recorded total "
         f"{record.get('total_wall_s', 0):.0f} s -> {rec_path}")
    if failed:
        _log(f"failed stages: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
