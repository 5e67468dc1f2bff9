"""Run the benchmarks, then rebuild docs/BENCHMARKS.md from the per-benchmark Markdown results.

    python -m bench.run_all [--only decode drafters] [--skip training] [--docs-only] [--timeout 1800]
    python -m bench.run_all --section scheduler   # refresh one section of the page, nothing else

`make bench` runs every CPU benchmark of BENCHMARKS, each as its own subprocess `python -m
bench.<name>`, so one failure or crash does not stop the rest; the exit code is non-zero if any
failed. `gpu_check` needs a GPU and runs only when named (`--only gpu_check`). Afterwards
docs/BENCHMARKS.md is regenerated: the headline table of bench/headline.md, then one section per
benchmark from bench/results/<name>.md (plus links to the JSON and the PNG), each with the command
that made it. A result named `<benchmark>_<variant>` (e.g. gpu_check_draft_vocab32768) is a
subsection of its benchmark's section. `--docs-only` only regenerates the page; `--section NAME`
replaces (or adds) just the section of NAME and leaves the rest of the page as it is.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

from bench.common import load_average, machine_info

BENCHMARKS = ("decode", "verify_cost", "round_ops", "startup", "drafters", "draft_vocab", "scheduler", "training",
              "frontier", "embedded", "online_confidence", "guided", "prediction", "prefix_cache",
              "ngram_cross_slot", "priority", "chunked_prefill", "embedded_build",
              "server_load")
GPU_BENCHMARKS = ("gpu_check",)
SECTIONS = BENCHMARKS + GPU_BENCHMARKS  # the page's order
HEADLINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "headline.md")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join("bench", "results")
DOCS_PATH = os.path.join("docs", "BENCHMARKS.md")
SUMMARY = "run_all.json"
_COMMAND_RE = re.compile(r"^\s*Command:\s*`([^`]+)`", re.MULTILINE)

INTRO = """\
`make bench` (= `python -m bench.run_all`) runs every CPU benchmark under `bench/` and rebuilds
this page from their results in `bench/results/` (one `.json` with every number, one `.md` table and
one `.png` picture per benchmark); `python -m bench.gpu_check` runs on a GPU. Each section names the
exact command that produced it; run that command to refresh a single section, then
`python -m bench.run_all --docs-only` to rebuild this page. Experiments (one-off studies of drafter
training) are written up in [EXPERIMENTS.md](EXPERIMENTS.md).

**Machine and noise.** Unless a section says otherwise the numbers come from a small development
machine: a 2-core x86-64 CPU, JAX on its CPU backend, no accelerator. That machine is shared, so
absolute timings are noisy (often by 2x). Every result records the 1-minute load average next to
each figure (a load above 2 on 2 cores means the benchmark competed for the CPUs), and the
benchmarks time the things they compare round-robin so that ratios share the same background load;
ratios are the steadier figures, absolute numbers are lower bounds of what an idle machine gives.
"""


def bench_exists(name: str, root: str = REPO_ROOT) -> bool:
    """Whether `bench.<name>` is a module or package in this checkout."""
    return (os.path.isfile(os.path.join(root, "bench", f"{name}.py"))
            or os.path.isfile(os.path.join(root, "bench", name, "__init__.py")))


def run_one(name: str, timeout: float, root: str = REPO_ROOT) -> dict[str, Any]:
    """Run `python -m bench.<name>` in `root`, streaming its output; returns status and timing."""
    cmd = [sys.executable, "-m", f"bench.{name}"]
    print(f"\n===== bench.{name}: {' '.join(cmd[1:])} (load {load_average()[0]:.1f}) =====", flush=True)
    t0 = time.perf_counter()
    load0 = load_average()[0]
    try:
        rc = subprocess.run(cmd, cwd=root, timeout=timeout).returncode
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        rc, status = None, f"timed out after {timeout:.0f} s"
    dt = time.perf_counter() - t0
    print(f"===== bench.{name}: {status} in {dt:.0f} s =====", flush=True)
    return {"name": name, "command": f"python -m bench.{name}", "status": status, "returncode": rc,
            "seconds": round(dt, 1), "load_1min": [load0, load_average()[0]]}


def write_summary(runs: list[dict[str, Any]], missing: list[str], results_dir: str = RESULTS_DIR) -> str:
    """Record this run's statuses in results/run_all.json, keeping earlier entries of benchmarks
    that were not run this time. Returns the path."""
    path = os.path.join(results_dir, SUMMARY)
    old: list[dict[str, Any]] = []
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f).get("runs", [])
        except (OSError, ValueError, AttributeError):
            old = []
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for r in runs:
        r["finished"] = now
    done = {r["name"] for r in runs}
    merged = [r for r in old if isinstance(r, dict) and r.get("name") not in done] + runs
    merged.sort(key=lambda r: SECTIONS.index(r["name"]) if r.get("name") in SECTIONS else len(SECTIONS))
    os.makedirs(results_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"finished": now, "runs": merged, "skipped_missing": missing, "machine": machine_info()},
                  f, indent=1)
        f.write("\n")
    return path


def _demote(md: str) -> str:
    """Shift Markdown headings down one level (outside code fences)."""
    out, fence = [], False
    for line in md.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        if not fence and re.match(r"^#{1,5} ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out)


def parent(name: str) -> str:
    """The section that holds result `name`: its own, or benchmark B's for a variant `B_<variant>`."""
    if name in SECTIONS:
        return name
    return next((b for b in sorted(SECTIONS, key=len, reverse=True) if name.startswith(b + "_")), name)


def section(name: str, results_dir: str, docs_dir: str) -> str | None:
    """The BENCHMARKS.md section of one benchmark from results/<name>.md, with a subsection per
    variant result `<name>_*.md` (None if it has no results)."""
    own = _block(name, 2, results_dir, docs_dir)
    if own is None:
        return None
    variants = sorted(f[:-3] for f in os.listdir(results_dir)
                      if f.endswith(".md") and f[:-3] != name and parent(f[:-3]) == name)
    return "\n".join([own] + [_block(v, 3, results_dir, docs_dir) or "" for v in variants])


def _block(name: str, level: int, results_dir: str, docs_dir: str) -> str | None:
    """results/<name>.md under a heading of `level`: title, command and links, picture, body."""
    md_path = os.path.join(results_dir, f"{name}.md")
    if not os.path.isfile(md_path):
        return None
    with open(md_path, encoding="utf-8") as f:
        md = f.read().strip()
    lines = md.splitlines()
    title = name
    if lines and lines[0].startswith("# "):
        title, md = lines[0][2:].strip(), "\n".join(lines[1:]).strip()
    m = _COMMAND_RE.search(md)
    command = m.group(1) if m else f"python -m bench.{name}"
    if m:  # shown once, in the section header
        md = (md[:m.start()] + md[m.end():]).strip()
    rel = os.path.relpath(results_dir, docs_dir).replace(os.sep, "/")
    parts = [f"{'#' * level} {title}\n", f"Command: `{command}` — results: [`{name}.json`]({rel}/{name}.json), "
             f"[`{name}.md`]({rel}/{name}.md)\n"]
    if "load" not in md.lower():  # older results without load in their table: take it from the JSON
        load = _json_load_average(os.path.join(results_dir, f"{name}.json"))
        if load is not None:
            parts.append(f"1-minute load average when measured: {load:.1f}.\n")
    if os.path.isfile(os.path.join(results_dir, f"{name}.png")):
        parts.append(f"![{title}]({rel}/{name}.png)\n")
    for _ in range(level - 1):
        md = _demote(md)
    parts.append(md + "\n")
    return "\n".join(parts)


def _json_load_average(path: str) -> float | None:
    """The 1-minute load average recorded in a result JSON (top level or under "machine")."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict):
        return None
    v = d.get("load_average_1min")
    if v is None and isinstance(d.get("machine"), dict):
        la = d["machine"].get("load_average")
        v = la[0] if isinstance(la, list) and la else None
    return float(v) if isinstance(v, (int, float)) else None


def write_docs(results_dir: str = RESULTS_DIR, docs_path: str = DOCS_PATH, headline: str = HEADLINE) -> str:
    """Rebuild docs/BENCHMARKS.md: the headline table (the file `headline`, when present), then a
    section per `<name>.md` in `results_dir` (known benchmarks first, in SECTIONS order, then any
    others alphabetically; variants inside their benchmark's section). Returns the path written."""
    docs_dir = os.path.dirname(os.path.abspath(docs_path))
    names = [n for n in SECTIONS if os.path.isfile(os.path.join(results_dir, f"{n}.md"))]
    extra = sorted(f[:-3] for f in os.listdir(results_dir)
                   if f.endswith(".md") and f[:-3] not in names and parent(f[:-3]) == f[:-3]) \
        if os.path.isdir(results_dir) else []
    sections = [(n, section(n, results_dir, docs_dir)) for n in names + extra]
    sections = [(n, s) for n, s in sections if s]
    out = ["# Benchmarks\n"]
    if os.path.isfile(headline):
        with open(headline, encoding="utf-8") as f:
            out.append(f.read().strip() + "\n")
    out.append(INTRO)
    summary_path = os.path.join(results_dir, SUMMARY)
    if os.path.isfile(summary_path):
        with open(summary_path, encoding="utf-8") as f:
            summ = json.load(f)
        mi = summ.get("machine", {})
        out.append(f"Last runs through `python -m bench.run_all` ({mi.get('cpu_count', '?')} CPUs, "
                   f"{mi.get('platform', '?')}, Python {mi.get('python', '?')}):\n")
        out.append("| benchmark | status | seconds | load 1-min (start..end) | finished |\n"
                   "|---|---|---:|---:|---|")
        for r in summ.get("runs", []):
            la = r.get("load_1min", [float("nan")] * 2)
            out.append(f"| {r['name']} | {r['status']} | {r['seconds']:.0f} | {la[0]:.1f}..{la[1]:.1f} "
                       f"| {r.get('finished', '?')} |")
        out.append("")
    out.append("Contents: " + ", ".join(f"[{n}](#{_anchor(s)})" for n, s in sections) + "\n")
    for _, s in sections:
        out.append(s)
    os.makedirs(docs_dir, exist_ok=True)
    with open(docs_path, "w", encoding="utf-8") as f:
        f.write("\n".join(out).rstrip() + "\n")
    return docs_path


def write_section(name: str, results_dir: str = RESULTS_DIR, docs_path: str = DOCS_PATH) -> str:
    """Replace the section of `name` (of its benchmark, for a variant result) in docs/BENCHMARKS.md
    (found by its link to `name`.md) with one rebuilt from results/`name`.md, or append it (and list it under Contents) if the page has none;
    every other section stays as it is. Builds the whole page when there is none. Returns the path."""
    docs_dir = os.path.dirname(os.path.abspath(docs_path))
    name = parent(name)
    new = section(name, results_dir, docs_dir)
    if new is None:
        raise ValueError(f"no results to document: {os.path.join(results_dir, name + '.md')} does not exist")
    if not os.path.isfile(docs_path):
        return write_docs(results_dir, docs_path)
    with open(docs_path, encoding="utf-8") as f:
        text = f.read()
    new = new.rstrip() + "\n"
    link = f"[{name}](#{_anchor(new)})"
    i = text.find(f"[`{name}.md`](")
    if i >= 0:
        start = text.rfind("\n## ", 0, i) + 1
        end = text.find("\n## ", i)
        text = text[:start] + new + ("\n" + text[end + 1:] if end >= 0 else "")
        text = re.sub(rf"\[{re.escape(name)}\]\(#[^)]*\)", lambda _: link, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + new
        text = re.sub(r"^(Contents: .*)$", lambda m: f"{m.group(1)}, {link}", text, count=1, flags=re.MULTILINE)
    with open(docs_path, "w", encoding="utf-8") as f:
        f.write(text.rstrip() + "\n")
    return docs_path


def _anchor(section_md: str) -> str:
    """GitHub's anchor for a section's `## Title` line."""
    title = section_md.splitlines()[0][3:].strip().lower()
    title = re.sub(r"[^\w\- ]", "", title)
    return title.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run just these benchmarks")
    parser.add_argument("--skip", nargs="+", choices=BENCHMARKS, default=[], help="benchmarks not to run")
    parser.add_argument("--docs-only", action="store_true", help="only rebuild docs/BENCHMARKS.md")
    parser.add_argument("--section", metavar="NAME",
                        help="only replace (or add) the section of bench/results/NAME.md in docs/BENCHMARKS.md")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per benchmark")
    args = parser.parse_args(argv)
    os.chdir(REPO_ROOT)
    if args.section:
        print(f"wrote {write_section(args.section)}", flush=True)
        return 0
    runs: list[dict[str, Any]] = []
    if not args.docs_only:
        names = [n for n in (args.only or BENCHMARKS) if n not in args.skip]
        missing = [n for n in names if not bench_exists(n)]
        for n in missing:
            print(f"bench.{n}: not present in this checkout, skipped", flush=True)
        for n in names:
            if n not in missing:
                runs.append(run_one(n, args.timeout))
        write_summary(runs, missing)
    path = write_docs()
    print(f"wrote {path}", flush=True)
    for r in runs:
        print(f"  {r['name']:<10} {r['status']:<22} {r['seconds']:7.0f} s")
    return 0 if all(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
