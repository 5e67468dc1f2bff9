"""bench.gpu_check stays runnable: its tiny CPU preset runs every phase through the real engine and
writes JSON + Markdown + PNG and a docs section; the budget watchdog stops a run and still writes.

The tiny run is the slowest test here (about 30 s on an idle 2-core CPU, mostly compiling its nine
executables): it is the only thing that exercises the GPU check's code before a GPU is lent.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from conftest import run_dir

ROOT = Path(__file__).resolve().parents[1]
OTHER_SECTION = "## Scheduler latency\n\nCommand: `python -m bench.scheduler` — results: " \
                "[`scheduler.json`](x), [`scheduler.md`](x)\n\nkept as it is\n"


def _run(tmp_path: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # the run's compilation cache: these runs share their plain engine's and target's programs
    env = dict(os.environ, SPECJAX_COMPILATION_CACHE=run_dir("specjax-jit-cache-"), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _docs(tmp_path: Path) -> Path:
    docs = tmp_path / "docs" / "BENCHMARKS.md"
    docs.parent.mkdir()
    docs.write_text("# Benchmarks\n\nContents: [scheduler](#scheduler-latency)\n\n" + OTHER_SECTION)
    return docs


def test_tiny_run_measures_every_phase_and_writes_outputs(tmp_path):
    out, docs = tmp_path / "out", _docs(tmp_path)
    proc = _run(tmp_path, "--tiny", "--quiet", "--out-dir", str(out), "--docs", str(docs))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads((out / "gpu_check.json").read_text())
    p = gpu_check.PRESETS["tiny"]
    assert res["complete"] and res["stopped"] is None
    assert set(res["phases"]) == {"build", "plain", "curve", "async", "fixed"}
    curve = {(c["slots"], c["tokens"]): c["seconds"] for c in res["cost_curve"]}
    assert set(curve) == {(s, t) for s in p.slots for t in p.tokens} and all(v > 0 for v in curve.values())
    assert set(res["plain_round_seconds"]) == {str(s) for s in p.slots}
    got = {(r["engine"], r["concurrency"]): r for r in res["throughput"]}
    assert set(got) == {(e, c) for e in gpu_check.ENGINES for c in p.concurrency}
    for (engine, c), r in got.items():
        # no stop token: every request generates exactly max_tokens
        assert r["requests"] == 2 * c and r["tokens"] == 2 * c * p.max_tokens, (engine, c)
        assert r["tokens_per_s"] > 0
    assert got[("plain", 1)]["tau"] == 1.0 and got[("dspark-fixed", 1)]["tau"] > 1.0
    # every engine's greedy outputs of the prompts, the drafting engines' equal to plain's (lossless)
    assert set(res["greedy_outputs"]) == set(gpu_check.ENGINES)
    assert all(len(o) == 16 and all(len(x) == p.max_tokens for x in o) for o in res["greedy_outputs"].values())
    assert gpu_check.greedy_agreement(res) == {e: {"equal": 16, "requests": 16, "first_difference": None}
                                              for e in gpu_check.ENGINES[1:]}
    assert (out / "gpu_check.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "gpu_check.md").read_text()
    assert "Command: `python -m bench.gpu_check --tiny`" in md and "complete" in md
    assert "| dspark-fixed | 16 of 16 | - |" in md
    text = docs.read_text()
    assert "kept as it is" in text and "## GPU check: tiny-shaped target" in text
    assert "[gpu_check](#gpu-check-tiny-shaped-target-random-weights)" in text


def test_budget_stops_the_run_and_keeps_what_was_measured(tmp_path):
    out, docs = tmp_path / "out", _docs(tmp_path)
    proc = _run(tmp_path, "--tiny", "--quiet", "--budget", "1", "--out-dir", str(out), "--docs", str(docs),
                timeout=300)
    assert proc.returncode == gpu_check.EXIT_STOPPED, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert not res["complete"] and "budget ran out" in res["stopped"]
    assert "**partial**" in (out / "gpu_check.md").read_text()
    assert (out / "gpu_check.png").is_file() and "## GPU check" in docs.read_text()


def test_dry_run_writes_the_plan_marked_not_yet_run(tmp_path):
    out, docs = tmp_path / "out", _docs(tmp_path)
    (out).mkdir()
    (out / "gpu_check.png").write_bytes(b"an older picture")
    assert gpu_check.main(["--dry-run", "--out-dir", str(out), "--docs", str(docs)]) == 0
    md = (out / "gpu_check.md").read_text()
    assert "Command: `python -m bench.gpu_check`" in md and "Not yet run on GPU" in md
    assert "hidden 2560, 36 layers, 32/8 heads x 128, MLP 9728, vocab 151936" in md
    assert not (out / "gpu_check.png").exists()  # no stale picture next to a plan
    text = docs.read_text()
    assert "kept as it is" in text and "Not yet run on GPU" in text


@pytest.mark.parametrize("args, match", [
    (["--tokens", "1,2,4,8,16"], "exceeds gamma"),
    (["--concurrency", "1,256"], "exceeds the largest slots bucket"),
    (["--slots", "8,1"], "increasing"),
    (["--budget", "0"], "--budget"),
])
def test_bad_flags_name_the_flag(tmp_path, capsys, args, match):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--dry-run", "--out-dir", str(tmp_path), "--docs", "", *args])
    assert match in str(e.value) + capsys.readouterr().err


def test_reading_states_the_ratios_of_the_tables():
    """The report's reading lines are computed from the curve and throughput tables."""
    res = {"slots": [1, 8], "tokens": [1, 8], "concurrency": [1],
           "throughput": [{"engine": "plain", "concurrency": 1, "tokens_per_s": 100.0},
                          {"engine": "dspark-fixed", "concurrency": 1, "tokens_per_s": 150.0}]}
    curve = {(1, 1): 0.013, (1, 8): 0.026, (8, 1): 0.02}
    tput = {(r["engine"], r["concurrency"]): r for r in res["throughput"]}
    lines = gpu_check._reading(res, curve, {1: 0.010, 8: 0.01}, tput)
    text = "\n".join(lines)
    assert lines[0] == "## Reading"
    assert ("- 1 slot(s): a round of 8 tokens per slot costs 2.00x one of 1; a drafting round of 1 costs "
            "1.30x a plain round (what proposing a block adds); break-even τ at 8 tokens: 2.60") in text
    assert "- 8 slot(s)" not in text  # its 8-token entry is missing
    assert "- C=1, tokens/s against plain: dspark-fixed 1.50x" in text
    assert gpu_check._reading({"slots": [1], "tokens": [1], "concurrency": [1]}, {}, {}, {}) == []


def test_draft_vocab_run_of_chosen_phases_writes_its_own_outputs(tmp_path):
    """--draft-vocab builds the drafter over a subset of the target ids and names its outputs apart
    (the full-vocabulary results stay); --phases runs only the phases asked for and the run still
    counts as complete."""
    out = tmp_path / "out"
    proc = _run(tmp_path, "--tiny", "--quiet", "--draft-vocab", "64", "--phases", "plain,curve",
                "--out-dir", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert not (out / "gpu_check.json").exists()
    res = json.loads((out / "gpu_check_draft_vocab64.json").read_text())
    assert res["complete"] and res["drafter"]["draft_vocab_size"] == 64
    assert {k: v["status"] for k, v in res["phases"].items()} == {
        "build": "done", "plain": "done", "curve": "done", "async": gpu_check.NOT_ASKED, "fixed": gpu_check.NOT_ASKED}
    assert {r["engine"] for r in res["throughput"]} == {"plain", "dspark-confidence"}
    assert len(res["cost_curve"]) == len(gpu_check.PRESETS["tiny"].tokens)
    md = (out / "gpu_check_draft_vocab64.md").read_text()
    assert md.startswith("# GPU check: tiny-shaped target, random weights, draft vocabulary 64")
    assert "Command: `python -m bench.gpu_check --tiny --draft-vocab 64 --phases plain,curve`" in md


@pytest.mark.parametrize("args, match", [(["--draft-vocab", "256"], "--draft-vocab must be in 1..255"),
                                         (["--phases", "plain,warp"], "unknown phase")])
def test_draft_vocab_and_phases_refusals(tmp_path, args, match):
    proc = _run(tmp_path, "--tiny", "--dry-run", "--out-dir", str(tmp_path / "o"), *args)
    assert proc.returncode == 2 and match in proc.stderr


def test_pallas_kernels_run_writes_its_own_outputs(tmp_path):
    """--attention pallas --mlp pallas runs the engine with the Pallas attention and MLP kernels
    (interpreted on CPU) and names its outputs apart; the default results stay."""
    out = tmp_path / "out"
    proc = _run(tmp_path, "--tiny", "--quiet", "--attention", "pallas", "--mlp", "pallas", "--phases", "plain",
                "--out-dir", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert not (out / "gpu_check.json").exists()
    res = json.loads((out / "gpu_check_pallas_mlp_pallas.json").read_text())
    assert res["complete"] and (res["attention"], res["mlp"]) == ("pallas", "pallas")
    assert res["phases"]["plain"]["status"] == "done"
    assert {r["engine"] for r in res["throughput"]} == {"plain"}
    assert "Command: `python -m bench.gpu_check --tiny --attention pallas --mlp pallas --phases plain`" in (
        out / "gpu_check_pallas_mlp_pallas.md").read_text()


def test_greedy_agreement_counts_outputs_that_differ_from_plain():
    """A drafting engine's output that differs from plain's at token 3 counts as unequal with its
    first difference; an engine not run is left out, and without plain's outputs nothing is compared."""
    plain = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    res = {"greedy_outputs": {"plain": plain, "dspark-fixed": [[1, 2, 3, 0, 5], [6, 7, 8, 9, 10]],
                              "dspark-confidence": [list(x) for x in plain]}}
    assert gpu_check.greedy_agreement(res) == {
        "dspark-confidence": {"equal": 2, "requests": 2, "first_difference": None},
        "dspark-fixed": {"equal": 1, "requests": 2, "first_difference": 3}}
    assert gpu_check.greedy_agreement({"greedy_outputs": {"dspark-fixed": plain}}) == {}
