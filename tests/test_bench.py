"""Benchmark harness helpers: timing, result writing, docs generation, prompt shaping, overhead math.

No model is compiled here (the benchmark programs themselves are run by `make bench`)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bench import common, run_all
from bench.decode import agreement, encode_fixed, repetitive_texts
from bench.drafters import overheads

from engine_fixtures import DEFAULT_CPU_EMITTERS


class FakeClock:
    """Stands in for bench.common's `time` module: perf_counter reads a clock that only `advance` moves."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_time_fn_times_batches_of_calls_with_sync_inside(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(common, "time", clock)
    calls, synced = [], []

    def fn():  # call i (from 1) takes i ms
        calls.append(1)
        clock.advance(0.001 * len(calls))
        return len(calls)

    def sync(r):  # waiting for the batch's last result costs 10 ms, inside the timed region
        synced.append(r)
        clock.advance(0.010)

    t = common.time_fn(fn, warmup=2, repeats=3, inner=2, sync=sync)
    assert len(calls) == 2 + 3 * 2
    assert synced == [1, 2, 4, 6, 8]  # each warmup call, then each batch's last result
    # batches: calls 3+4, 5+6, 7+8 ms plus one 10 ms sync each, divided by inner = 2
    np.testing.assert_allclose(t.samples, [0.0085, 0.0105, 0.0125])
    assert t.median == pytest.approx(0.0105) and t.min == pytest.approx(0.0085)
    d = t.as_dict()
    assert d["repeats"] == 3 and d["inner"] == 2 and len(d["load_1min"]) == 2


def test_time_fn_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats"):
        common.time_fn(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="inner"):
        common.time_interleaved({"a": lambda: None}, inner=0)


def test_time_interleaved_round_robin_order():
    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    res = common.time_interleaved(fns, warmup=0, repeats=3, inner=1)
    assert order == ["a", "b"] * 3
    assert set(res) == {"a", "b"} and all(len(t.samples) == 3 for t in res.values())
    order.clear()
    res = common.time_interleaved(fns, warmup=0, repeats=2, inner={"a": 2, "b": 1})
    assert order == ["a", "a", "b"] * 2 and res["a"].inner == 2 and res["b"].inner == 1


def test_md_table_alignment():
    md = common.md_table(["x", "y"], [[1, "a"]], align="rl")
    assert md.splitlines() == ["| x | y |", "|---:|---|", "| 1 | a |"]


def test_write_results_and_docs(tmp_path):
    res_dir = tmp_path / "results"
    paths = common.write_results("decode", {"v": np.float32(1.5), "a": np.arange(2)},
                                 "# Decode title\n\nCommand: `python -m bench.decode --x 1`\n\n## Sub\n| a |\n",
                                 out_dir=str(res_dir), plot=lambda p: open(p, "wb").write(b"png"))
    assert [os.path.basename(p) for p in paths] == ["decode.json", "decode.md", "decode.png"]
    assert json.loads((res_dir / "decode.json").read_text()) == {"v": 1.5, "a": [0, 1]}
    (res_dir / "scheduler.md").write_text("# Sched\n\n| t |\n")
    (res_dir / "scheduler.json").write_text(json.dumps({"load_average_1min": 3.25}))
    (res_dir / "zzz.md").write_text("no title line\n")
    docs = tmp_path / "docs" / "BENCHMARKS.md"
    run_all.write_docs(str(res_dir), str(docs))
    text = docs.read_text()
    # known benchmarks first in their fixed order, then the rest; titles become level-2 sections
    assert text.index("## Decode title") < text.index("## Sched") < text.index("## zzz")
    assert "Command: `python -m bench.decode --x 1`" in text
    assert text.count("python -m bench.decode --x 1") == 1  # the command appears once, in the header
    assert "Command: `python -m bench.scheduler`" in text  # default command when the md has none
    assert "### Sub" in text  # headings demoted
    assert "load average when measured: 3.2" in text  # taken from the JSON when the md has no load
    assert "](../results/decode.png)" in text
    assert "2-core" in text


def test_write_summary_merges_previous_runs(tmp_path):
    run_all.write_summary([{"name": "decode", "status": "ok", "seconds": 1.0}], [], str(tmp_path))
    run_all.write_summary([{"name": "scheduler", "status": "failed (exit 1)", "seconds": 2.0}], [], str(tmp_path))
    runs = json.loads((tmp_path / "run_all.json").read_text())["runs"]
    assert [(r["name"], r["status"]) for r in runs] == [("decode", "ok"), ("scheduler", "failed (exit 1)")]


def test_run_one_reports_failure_without_raising(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "boom.py").write_text("raise SystemExit(3)\n")
    assert run_all.bench_exists("boom", str(tmp_path)) and not run_all.bench_exists("nope", str(tmp_path))
    r = run_all.run_one("boom", timeout=60, root=str(tmp_path))
    assert r["returncode"] == 3 and r["status"] == "failed (exit 3)"


def test_a_variant_result_is_a_subsection_of_its_benchmark(tmp_path):
    """`gpu_check_draft_vocab32768.md` joins the GPU check's section, in the full page and when
    either result's section is rebuilt alone; the headline table opens the page."""
    res_dir, docs = tmp_path / "results", tmp_path / "docs" / "BENCHMARKS.md"
    res_dir.mkdir()
    (res_dir / "decode.md").write_text("# Decode\n\ndecode body\n")
    (res_dir / "gpu_check.md").write_text("# GPU check\n\nfull vocabulary\n\n## Curve\n")
    (res_dir / "gpu_check_draft_vocab32768.md").write_text("# GPU check, draft vocabulary\n\nsmall vocabulary\n")
    headline = tmp_path / "headline.md"
    headline.write_text("| goal | measured |\n|---|---|\n| g | 1 |\n")
    run_all.write_docs(str(res_dir), str(docs), str(headline))
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\n| goal | measured |")
    assert "## GPU check\n" in text and "### GPU check, draft vocabulary\n" in text and "### Curve" in text
    assert text.count("[gpu_check") == 1  # one entry under Contents
    (res_dir / "gpu_check_draft_vocab32768.md").write_text("# GPU check, draft vocabulary\n\nNEW small\n")
    run_all.write_section("gpu_check_draft_vocab32768", str(res_dir), str(docs))
    text = docs.read_text()
    assert "NEW small" in text and "small vocabulary" not in text and text.count("## GPU check\n") == 1
    assert text.index("decode body") < text.index("full vocabulary") < text.index("NEW small")
    assert run_all.parent("embedded_build") == "embedded_build" and run_all.parent("zzz_1") == "zzz_1"


def test_headline_values_are_those_of_the_results_and_link_to_their_sections():
    """Each headline row's numbers appear in the result of the benchmark its command names, and
    its link is a section of docs/BENCHMARKS.md."""
    import re

    rows = [line for line in open(run_all.HEADLINE, encoding="utf-8") if line.startswith("| [")]
    assert rows
    page = open(run_all.DOCS_PATH if os.path.isabs(run_all.DOCS_PATH)
                else os.path.join(run_all.REPO_ROOT, run_all.DOCS_PATH), encoding="utf-8").read()
    anchors = {run_all._anchor(line) for line in page.splitlines(keepends=False) if line.startswith("## ")}
    for row in rows:
        goal, measured, met, command, date = [c.strip() for c in row.strip().strip("|").split(" | ")]
        anchor = re.search(r"\]\(#([^)]+)\)", goal).group(1)
        assert anchor in anchors, goal
        bench = re.search(r"python -m bench\.(\w+)", command).group(1)
        suffix = re.search(r"--suffix (\w+)", command)  # a variant result: <bench>_<suffix>.md
        name = bench + (f"_{suffix.group(1)}" if suffix else "")
        with open(os.path.join(run_all.REPO_ROOT, run_all.RESULTS_DIR, f"{name}.md"), encoding="utf-8") as f:
            result = f.read()
        for number in re.findall(r"\d+(?:\.\d+)?", measured):
            assert number in result, (goal, number)
        assert met in ("yes", "no", "no (within noise)") and re.fullmatch(r"\d{4}-\d\d-\d\d", date)


def test_encode_fixed_exact_length_and_reuse():
    enc = lambda s: list(s.encode())
    out = encode_fixed(["short", "x" * 50, "y" * 80], enc, 3, 40, "test")
    assert len(out) == 3 and all(len(p) == 40 for p in out)
    assert out[0] == [ord("x")] * 40 and out[1] == [ord("y")] * 40 and out[2] == out[0]
    out = encode_fixed(["ab" * 30, "x" * 50], enc, 5, 40, "test", keep="tail")
    assert [p[-1] for p in out] == [ord("b"), ord("x"), ord("b"), ord("x"), ord("b")]  # cycled in order
    assert out[0][0] == ord("a") and len(out[0]) == 40
    with pytest.raises(ValueError, match="no test prompt has 40 tokens"):
        encode_fixed(["short"], enc, 2, 40, "test")


def test_repetitive_prompts_repeat_lines():
    for text in repetitive_texts():
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        # the same line shape (digits and names stripped) recurs many times
        shapes = [''.join(c for c in ln if not c.isalnum()) for ln in lines]
        assert max(shapes.count(s) for s in set(shapes)) >= 10, text[:80]
        assert len(text.encode()) >= 256


def test_agreement_prefix_fraction():
    assert agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert agreement([[1, 2], [5, 6]], [[1, 2], [5, 6]]) == 1.0


def test_overheads_paired_median():
    base = {"batch": 1, "gamma": 4, "verify_samples_ms": [10.0, 10.0, 10.0]}
    rows = [dict(base, drafter="dflash", samples_ms=[2.0, 2.0, 2.0]),
            dict(base, drafter="dspark_markov", samples_ms=[2.6, 3.2, 2.6]),
            dict(base, drafter="ngram", samples_ms=[0.1, 0.1, 0.1])]
    (o,) = overheads(rows)
    assert o["head"] == "dspark_markov"
    assert o["overhead_pct_of_round"] == pytest.approx(5.0)  # 0.6 / 12
    assert o["overhead_pct_of_proposal"] == pytest.approx(30.0)  # 0.6 / 2


def _pt(c, agg, pu):
    return {"concurrency": c, "aggregate_tokens_per_s": agg, "per_user_tokens_per_s": pu}


def test_per_user_at_interpolates_and_refuses_outside_range():
    from bench.frontier import per_user_at
    pts = [_pt(1, 100.0, 100.0), _pt(2, 180.0, 90.0), _pt(4, 300.0, 75.0)]
    assert per_user_at(pts, 140.0) == pytest.approx(95.0)
    assert per_user_at(pts, 300.0) == pytest.approx(75.0)
    assert per_user_at(pts, 50.0) is None and per_user_at(pts, 301.0) is None


def test_matched_throughput_rows_ratio_against_mtp1():
    from bench.frontier import matched_throughput_rows
    res = {"mtp1": [_pt(1, 100.0, 100.0), _pt(4, 200.0, 50.0)],
           "confidence_async": [_pt(1, 150.0, 150.0), _pt(4, 250.0, 100.0)]}
    rows = matched_throughput_rows(res)
    assert rows[0][-2:] == ["-", "-"]  # 100 tok/s lies below the policy's frontier
    assert rows[1][4] == "125.0" and rows[1][5] == "2.50"  # at 200 tok/s: 125 vs 50 per user


def test_goal_rows_report_each_frontier_goal():
    from bench.frontier import goal_rows
    res = {"plain": [_pt(1, 100.0, 100.0), _pt(4, 300.0, 75.0)],
           "mtp1": [_pt(1, 120.0, 120.0), _pt(4, 320.0, 80.0)],
           "fixed-dspark": [_pt(1, 150.0, 150.0), _pt(4, 200.0, 50.0)],
           "confidence_async": [_pt(1, 150.0, 150.0), _pt(4, 330.0, 110.0)]}
    rows = {r[0].split(" (")[0].split(" at ")[0]: r for r in goal_rows(res)}
    assert rows["best confidence >= 0.97x best fixed"][1:] == ["min 1.00", "yes"]
    assert rows["best confidence never below plain"][1:] == ["min 1.10 (C=4)", "yes"]
    assert rows["best confidence >= 1.1x fixed gamma 7"][1:] == ["1.65", "yes"]
    per_user = rows["per-user tok/s"]
    assert per_user[2] == "no" and per_user[1].startswith("min ")  # at 320 tok/s: ~107.6 vs 80 -> 1.34
    res["plain"][1]["aggregate_tokens_per_s"] = 400.0
    assert {r[0]: r[2] for r in goal_rows(res)}["best confidence never below plain"] == "no"


def test_per_user_rate_is_the_decode_speed_without_the_time_to_the_first_token():
    from types import SimpleNamespace as NS
    from bench.frontier import per_user_decode_rate
    from specjax.decoding.requests import RequestMetrics

    def req(n, start, first, finish):
        return NS(output_ids=[0] * n, metrics=RequestMetrics(start_time=start, first_token_time=first,
                                                             finish_time=finish))
    # 9 tokens after the first in 0.5 s -> 18 tok/s, 4 in 1.0 s -> 4 tok/s; a long wait for the first
    # token (queueing, prefill) does not count (from the arrival: (10 / 3.5 + 5 / 1.5) / 2 = 3.1);
    # a one-token request has no decode time and is skipped
    done = [req(10, 0.0, 3.0, 3.5), req(5, 1.0, 1.5, 2.5), req(1, 0.0, 0.2, 0.2)]
    assert per_user_decode_rate(done) == pytest.approx(11.0)
    with pytest.raises(ValueError, match="two or more tokens"):
        per_user_decode_rate(done[2:])


def test_median_run_keeps_the_median_run_and_lists_all():
    from bench.frontier import median_run
    r = median_run([_pt(4, 300.0, 90.0), _pt(4, 100.0, 30.0), _pt(4, 200.0, 60.0)])
    assert r["aggregate_tokens_per_s"] == 200.0 and r["per_user_tokens_per_s"] == 60.0
    assert r["aggregate_runs"] == [100.0, 200.0, 300.0]


def test_drafting_ceiling_states_each_drafter_relative_to_plain():
    from bench.frontier import drafting_ceiling
    res = {"plain": [_pt(1, 100.0, 100.0), _pt(4, 300.0, 75.0)], "mtp1": [_pt(1, 90.0, 90.0)],
           "fixed-dspark": [_pt(1, 60.0, 60.0)]}
    text = drafting_ceiling(res)
    assert "C=1" in text and "mtp1 0.90x" in text and "fixed-dspark 0.60x" in text
    assert drafting_ceiling({"mtp1": res["mtp1"]}) == ""


def test_goal_rows_judge_never_below_plain_from_paired_runs():
    from bench.frontier import goal_rows
    res = {"plain": [_pt(1, 100.0, 100.0), _pt(4, 300.0, 75.0)],
           "fixed-dspark": [_pt(1, 50.0, 50.0), _pt(4, 100.0, 25.0)],
           "confidence_async": [_pt(1, 90.0, 90.0), _pt(4, 250.0, 62.0)]}  # sweeps alone: 0.83x plain
    rows = {r[0]: r for r in goal_rows(res, paired={1: [0.97, 1.02, 1.01], 4: [1.0, 1.03, 0.99]})}
    row = rows["best confidence never below plain (confidence_async vs plain, paired runs)"]
    assert row[1].startswith("min median 1.000 (C=4") and row[2] == "yes"
    rows = {r[0]: r for r in goal_rows(res, paired={1: [0.9, 0.95, 0.97], 4: [1.0, 1.0, 1.0]})}
    assert rows["best confidence never below plain (confidence_async vs plain, paired runs)"][2] == "no"


def test_paired_runs_alternate_the_order_so_its_effect_cancels(monkeypatch):
    import bench.frontier as fr
    calls = []

    def fake_loop(engine, prompts, c, n, max_tokens, temperature):
        calls.append(engine)  # equal engines, but the second run of each pair is 5% faster
        return {"aggregate_tokens_per_s": 100.0 * (1.05 if len(calls) % 2 == 0 else 1.0)}
    monkeypatch.setattr(fr, "closed_loop", fake_loop)
    engines = {"plain": "plain", "confidence_async": "confidence_async"}
    out = fr.paired_ratios(engines, [], [4], 8, 4, lambda c: c)
    assert calls == ["plain", "confidence_async", "confidence_async", "plain"] * 2
    assert np.exp(np.mean(np.log(out[4]))) == pytest.approx(1.0)
    lo, hi = fr.ratio_interval(out[4])
    assert lo < 1.0 < hi  # the pairs cannot tell equal engines apart
    # control: a fixed order credits the order's effect to the engine that always runs second
    calls.clear()
    monkeypatch.setattr(fr, "pair_order", lambda i: ("plain", "confidence_async"))
    fixed = fr.paired_ratios(engines, [], [4], 8, 4, lambda c: c)
    assert fixed[4] == pytest.approx([1.05] * 4) and fr.ratio_interval(fixed[4])[0] > 1.0


def test_ratio_interval_tells_a_shortfall_from_noise():
    from bench.frontier import goal_rows, ratio_interval
    lo, hi = ratio_interval([0.95, 0.96, 0.94, 0.95, 0.955, 0.945])
    assert hi < 1.0 and lo > 0.93
    lo, hi = ratio_interval([0.97, 1.03, 0.99, 1.02, 0.98, 1.01])
    assert lo < 1.0 < hi
    with pytest.raises(ValueError, match="positive and finite"):
        ratio_interval([1.0, 0.0])
    res = {"plain": [_pt(1, 100.0, 100.0)], "fixed-dspark": [_pt(1, 50.0, 50.0)],
           "confidence_async": [_pt(1, 90.0, 90.0)]}
    row = [r for r in goal_rows(res, paired={1: [0.97, 1.03, 0.99, 1.02, 0.98, 0.995]}) if "paired" in r[0]][0]
    assert "geometric mean 95% interval" in row[1] and row[2] == "no (within noise)"
    row = [r for r in goal_rows(res, paired={1: [0.95, 0.96, 0.94, 0.95]}) if "paired" in r[0]][0]
    assert row[2] == "no"  # the pairs show it slower
    # a level shown slower decides even when another level has the lower median
    paired = {1: [0.98, 0.985, 0.975, 0.98], 4: [0.80, 1.15, 0.85, 1.10]}
    row = [r for r in goal_rows(res, paired=paired) if "paired" in r[0]][0]
    assert row[2] == "no" and "(C=4); C=1:" in row[1]


def test_write_section_replaces_one_section_and_keeps_the_rest(tmp_path):
    res_dir, docs = tmp_path / "results", tmp_path / "docs" / "BENCHMARKS.md"
    res_dir.mkdir()
    (res_dir / "decode.md").write_text("# Decode\n\nold decode\n")
    (res_dir / "scheduler.md").write_text("# Sched\n\nold sched\n")
    run_all.write_docs(str(res_dir), str(docs))
    # others' results changed too, but only the named section may be rebuilt
    (res_dir / "decode.md").write_text("# Decode\n\nNEW decode\n")
    (res_dir / "scheduler.md").write_text("# Scheduler latency\n\nCommand: `python -m bench.scheduler --calls 9`\n\nNEW sched\n")
    run_all.write_section("scheduler", str(res_dir), str(docs))
    text = docs.read_text()
    assert "old decode" in text and "NEW decode" not in text
    assert "NEW sched" in text and "old sched" not in text and "## Sched\n" not in text
    assert "Command: `python -m bench.scheduler --calls 9`" in text
    assert "[scheduler](#scheduler-latency)" in text
    # a section the page lacks is appended and listed under Contents
    (res_dir / "gpu_check.md").write_text("# GPU check\n\nnot yet run\n")
    run_all.write_section("gpu_check", str(res_dir), str(docs))
    text = docs.read_text()
    assert text.index("NEW sched") < text.index("## GPU check") and "[gpu_check](#gpu-check)" in text
    run_all.write_section("gpu_check", str(res_dir), str(docs))  # idempotent
    assert docs.read_text() == text
    with pytest.raises(ValueError, match="nope.md"):
        run_all.write_section("nope", str(res_dir), str(docs))


def test_verify_cost_ratios_goal_and_markdown():
    from bench import verify_cost as vc
    curve = [{"rows": r, "tokens": t, "ms_median": base * f, "ms_min": base * f, "compile_s": 1.0,
              "load_1min": 1.0}
             for r, base in ((1, 10.0), (8, 40.0)) for t, f in ((1, 1.0), (8, 1.5))]
    rat = vc.ratios(curve)
    assert rat == {1: {1: 1.0, 8: 1.5}, 8: {1: 1.0, 8: 1.5}}
    res = {"curve": curve, "ratios": rat, "target": "t", "cache_len": 512, "context": 256, "repeats": 3,
           "load_1min": [1.0, 1.0], "machine": {"cpu_count": 2},
           "goal": {"measured": 1.5, "met": 1.5 <= vc.GOAL_C8}, "notes": ""}
    md = vc.markdown(res, "python -m bench.verify_cost")
    assert "15.0 (1.50)" in md and "measured **1.50** — met" in md
    res["goal"] = {"measured": 2.2, "met": False}
    assert "not met" in vc.markdown(res, "x")


def test_startup_markdown_judges_the_warm_start():
    from bench import startup
    starts = [{"wall_s": w, "import_s": 1.0, "load_s": 2.0, "engine_s": w - 4, "first_token_s": 1.0,
               "load_1min": 0.5} for w in (90.0, 15.0)]
    md = startup.markdown({"starts": starts, "warm_start_s": 15.0}, "python -m bench.startup")
    assert "measured **15.0 s** — met" in md
    md = startup.markdown({"starts": starts, "warm_start_s": 25.0}, "python -m bench.startup")
    assert "not met" in md


def test_training_reads_block_is_replaced_or_appended():
    from bench import training

    block = training.reads_markdown({"command": "python -m bench.training --reads-only", "batch": 8, "repeats": 3,
                                     "cache": {"samples": 4, "tokens": 40, "bytes_on_disk": 2**20},
                                     "pools": {"none (before)": {"ms_median": 2.0, "ms_min": 1.5,
                                                                 "load_1min": [1.0, 1.0]}}})
    assert block.startswith(training.READS_BEGIN) and block.endswith(training.READS_END + "\n")
    assert "| none (before) | 2.00 | 1.50 | 1.0 |" in block
    md = "# T\n\ntable\n"
    once = training._replace_reads(md, block)
    assert once == md + "\n" + block
    newer = block.replace("2.00", "3.00")
    assert training._replace_reads(once + "tail\n", newer) == md + "\n" + newer + "tail\n"


def _embedded_table(tau: dict, command: str) -> dict:
    """A `train.evaluate` result as bench.embedded reads it: every set at each drafter's τ."""
    from bench.embedded import EVAL_SETS
    return {"table": [{"drafter": d, **{s: tau[d] for s in EVAL_SETS}, "macro": tau[d]} for d in tau],
            "drafters": {d: {"overall": {"cond_accept": [0.5, 0.4]}} for d in tau}, "command": command}


def test_embedded_table_only_refreshes_tables_and_keeps_the_speed_sections(tmp_path):
    """`bench.embedded --table-only` rewrites the report's τ tables and JSON τ from the new
    evaluation, keeps the last speed and peer sections verbatim with the command that timed them, says they were not rerun; with
    no speed section to keep it refuses."""
    import argparse

    from bench import embedded as E

    old_speed = f"{E.SPEED_HEADING} (10 prompts, 2 per set)\n\n| decoding | tokens/s |\n| plain | 24.0 |\n"
    (tmp_path / "embedded.md").write_text("# old\n\nCommand: `python -m bench.embedded --skip-table` (Table 1: `x`)\n\n"
                                          "## τ at T=0\n\n| dspark | 9.99 |\n" + old_speed)
    (tmp_path / "embedded.json").write_text(json.dumps({"tau": {"0.0": {"dspark": 9.99}}, "speed": {"plain@T0": 1}}))
    tables = {0.0: _embedded_table({"dspark": 1.31, "standalone": 1.2}, "cmd"),
              1.0: _embedded_table({"dspark": 1.25, "standalone": 1.1}, "cmd")}
    args = argparse.Namespace(out_dir=str(tmp_path), cap=8, max_tokens=64)
    E._refresh_tables(["dspark", "standalone"], tables, args, ["--table-only"])
    md = (tmp_path / "embedded.md").read_text()
    assert "9.99" not in md and "| standalone | 1.20 |" in md and md.endswith(old_speed)
    assert "not rerun with these tables" in md
    # the report still names the run that timed it; Table 1 names the run that made the tables
    assert "Command: `python -m bench.embedded --skip-table` (Table 1: `cmd`)" in md
    res = json.loads((tmp_path / "embedded.json").read_text())
    assert res["tau"]["0.0"] == {"dspark": 1.31, "standalone": 1.2} and res["speed"] == {"plain@T0": 1}
    (tmp_path / "embedded.md").write_text("# a report without its speed part\n")
    with pytest.raises(SystemExit, match="no batch-1 speed section"):
        E._refresh_tables(["dspark", "standalone"], tables, args, ["--table-only"])


def test_embedded_full_report_names_its_command_and_speed_goals(tmp_path):
    """A full `bench.embedded` report names the command line that made it (not a placeholder),
    lists each run's speedup against plain and marks the greedy-equality column; a `--table-only`
    refresh of it then keeps that command."""
    import argparse

    from bench import embedded as E

    tables = {0.0: _embedded_table({"dspark": 1.3}, "tcmd"), 1.0: _embedded_table({"dspark": 1.2}, "tcmd")}
    speed = {}
    for t in (0.0, 1.0):
        speed[("plain", t)] = {"tokens_per_s": 20.0, "tau": 1.0, "token_ids": [[1, 2]], "load": 1.0}
        speed[("dspark+confidence_async", t)] = {"tokens_per_s": 30.0, "tau": 1.5,
                                                 "token_ids": [[1, 3]] if t == 0 else [[9]], "load": 1.0}
    args = argparse.Namespace(out_dir=str(tmp_path), cap=8, max_tokens=64, speed_per_set=2, torch_threads=2)
    E._report(["dspark"], tables, speed, {"transformers plain": 12.0}, args, ["--skip-table"])
    md = (tmp_path / "embedded.md").read_text()
    assert "Command: `python -m bench.embedded --skip-table` (Table 1: `tcmd`)" in md
    assert "| dspark+confidence_async | 0 | 30.0 | 1.50 | 1.50x | NO | 1.0 |" in md
    assert "`confidence_async` scheduler at T=1: 1.50x plain (goal >= 1.5x: met)" in md
    assert "`confidence_async` scheduler at T=0: 1.50x plain (goal >= 2.0x: missed)" in md
    E._refresh_tables(["dspark"], tables, args, ["--table-only"])
    assert "Command: `python -m bench.embedded --skip-table` (Table 1: `tcmd`)" in (tmp_path / "embedded.md").read_text()


def test_round_ops_counts_branches_and_loops_of_a_known_program():
    import jax
    import jax.numpy as jnp

    from bench.round_ops import compiled_report

    def branchy(pred, x):
        return jax.lax.cond(pred, jnp.sin, jnp.cos, x)

    def loopy(n, x):
        return jax.lax.fori_loop(0, n, lambda _, y: y * 2.0 + 1.0, x)
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    one_cond = compiled_report(jax.jit(branchy).lower(jax.ShapeDtypeStruct((), bool), x))
    assert (one_cond["conditionals"], one_cond["whiles"]) == (1, 0)  # negative control: a lax.cond counts
    one_loop = compiled_report(jax.jit(loopy).lower(jax.ShapeDtypeStruct((), jnp.int32), x))
    assert (one_loop["conditionals"], one_loop["whiles"]) == (0, 1)
    plain = compiled_report(jax.jit(lambda x: jnp.sin(x) * 2.0).lower(x))
    assert (plain["conditionals"], plain["whiles"]) == (0, 0) and plain["top_level_ops"] >= 1
    assert plain["bytes_accessed"] > 0


def test_round_ops_bytes_breakdown_counts_a_kernel_writing_in_place_at_its_reads():
    """A custom call whose output aliases an operand (the attention kernel writing into the cache)
    counts that output apart (whole_buffer), its reads as touched; without the alias (control) the
    output counts as written."""
    from bench.round_ops import bytes_breakdown

    def hlo(aliasing: str) -> str:
        return ("HloModule m\n\nENTRY %main (p0: f32[1024,256], p1: f32[8,256]) -> (f32[8,256], f32[1024,256]) {\n"
                "  %p0 = f32[1024,256]{1,0} parameter(0)\n  %p1 = f32[8,256]{1,0} parameter(1)\n"
                "  ROOT %k = (f32[8,256]{1,0}, f32[1024,256]{1,0}) custom-call(%p1, %p0), "
                f'custom_call_target="__gpu$xla.gpu.triton"{aliasing}\n}}\n')
    buf, small = 1024 * 256 * 4, 8 * 256 * 4
    kernel = bytes_breakdown(hlo(", output_to_operand_aliasing={{1}: (1, {})}"))
    assert kernel == {"xla": 2 * buf + 2 * small, "touched": buf + 2 * small, "convert": 0, "whole_buffer": buf}
    copy = bytes_breakdown(hlo(""))
    assert copy["touched"] == copy["xla"] == 2 * buf + 2 * small and copy["whole_buffer"] == 0


def test_round_ops_bytes_breakdown_counts_what_a_program_touches():
    """In-place writes and gathers (also of elementwise expressions) count at the rows they touch,
    dtype-only ops apart (a bf16 matmul's weight at its stored bytes); a program that streams its
    whole input counts whole (control)."""
    import jax
    import jax.numpy as jnp

    from bench.round_ops import bytes_breakdown

    def split(fn, *args, **jit_kw):
        compiled = jax.jit(fn, **jit_kw).lower(*args).compile(compiler_options=DEFAULT_CPU_EMITTERS)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        out = bytes_breakdown(compiled.as_text())
        assert out["xla"] == out["touched"] + out["convert"] + out["whole_buffer"]
        assert abs(out["xla"] - cost["bytes accessed"]) <= 0.01 * cost["bytes accessed"]
        return out
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    s32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    buf_bytes = 1024 * 256 * 4
    scatter = split(lambda b, u, i: b.at[i].set(u), f32(1024, 256), f32(2, 256), s32(2), donate_argnums=0)
    assert scatter["xla"] >= 2 * buf_bytes and scatter["touched"] < 0.01 * buf_bytes
    assert scatter["whole_buffer"] >= 1.9 * buf_bytes and scatter["convert"] == 0
    dus = split(lambda b, u, i: jax.lax.dynamic_update_slice(b, u, (i, 0)), f32(1024, 256), f32(1, 256), s32(),
                donate_argnums=0)  # XLA itself counts a dynamic-update-slice in place
    assert dus["touched"] == dus["xla"] < 0.01 * buf_bytes
    gather = split(lambda t, i: t[i] * 2.0, f32(1024, 256), s32(4))
    assert gather["xla"] >= buf_bytes and gather["touched"] < 0.05 * buf_bytes
    # a slice reads its part (XLA's count too), also as a matmul's operand (a key/value half)
    half = split(lambda b: b[:512] * 2.0, f32(1024, 256))
    assert half["touched"] == half["xla"] == buf_bytes
    kv = split(lambda b, x: x @ b[0], f32(2, 256, 256), f32(8, 256))
    half_bytes = 256 * 256 * 4  # read by the slice (and on XLA:CPU written as a copy and read by the dot)
    assert kv["touched"] <= 3 * half_bytes + 2 * 8 * 256 * 4 and kv["whole_buffer"] == 0
    # a gather (or a row) of an elementwise expression reads its input at the picked positions only;
    # the same expression also summed reads all of it (control)
    picked = split(lambda t, i: jnp.exp(t * 2.0)[i], f32(1024, 256), s32(4))
    assert picked["touched"] < 0.01 * buf_bytes and picked["whole_buffer"] >= 0.99 * buf_bytes
    row = split(lambda t, i: jnp.take_along_axis(jnp.exp(t), i[:, None, None], axis=1)[:, 0].sum(-1),
                f32(16, 64, 256), s32(16))
    assert row["touched"] < 0.05 * buf_bytes
    summed = split(lambda t, i: (jnp.exp(t)[i], jnp.sum(jnp.exp(t))), f32(1024, 256), s32(4))
    assert summed["touched"] >= buf_bytes
    stream = split(lambda b: b * 2.0 + 1.0, f32(1024, 256))  # negative control: every byte is touched
    assert stream["touched"] == stream["xla"] >= 2 * buf_bytes and stream["whole_buffer"] == 0
    bf16 = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((8, 512), jnp.bfloat16)
    mm = split(lambda w, x: x @ w, bf16, x)
    w_bytes = 512 * 512 * 2
    assert w_bytes <= mm["touched"] <= 1.2 * (w_bytes + 2 * 8 * 512 * 4)
    if jax.default_backend() == "cpu":  # XLA:CPU upcasts bf16 dots: the copies count apart
        assert mm["convert"] >= 3 * w_bytes


def test_round_ops_counts_the_weights_and_caches_a_program_reads():
    """`inputs_read` takes the weights and KV caches by their argument names: a cache the program
    only writes into in place (and returns) is not read; one it also reads (control), or reads after
    writing into it, is; a weight it does not use is not an input at all."""
    import jax
    import jax.numpy as jnp

    from bench.round_ops import inputs_read
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731

    def program(reads_dstate: bool, after_write: bool = False):
        def f(t_params, d_params, cache_kv, dstate_kv, i):
            y = cache_kv[0] @ t_params["w"]
            new = jax.lax.dynamic_update_slice(dstate_kv, y[None, :1], (0, i, 0))
            if reads_dstate:
                y = y + (new if after_write else dstate_kv)[1] @ d_params["u"]
            return y, new
        args = ({"w": f32(64, 64)}, {"u": f32(64, 64)}, f32(2, 64, 64), f32(2, 64, 64),
                jax.ShapeDtypeStruct((), jnp.int32))
        return jax.jit(f, donate_argnums=(3,)).lower(*args).compile().as_text()
    w, kv = 64 * 64 * 4, 2 * 64 * 64 * 4
    assert inputs_read(program(False)) == {"weights": w, "kv": kv}
    assert inputs_read(program(True)) == {"weights": 2 * w, "kv": 2 * kv}
    assert inputs_read(program(True, after_write=True)) == {"weights": 2 * w, "kv": 2 * kv}


def test_round_ops_counts_a_loop_once_per_iteration():
    """A loop's body counts once per iteration (XLA's own count takes one): four matmuls with a
    weight read four times against one (control)."""
    import jax
    import jax.numpy as jnp

    from bench.round_ops import bytes_breakdown

    def touched(n: int) -> int:
        def f(w, x):
            return jax.lax.fori_loop(0, n, lambda _, y: jnp.tanh(y @ w), x)
        args = (jax.ShapeDtypeStruct((256, 256), jnp.float32), jax.ShapeDtypeStruct((8, 256), jnp.float32))
        return bytes_breakdown(jax.jit(f).lower(*args).compile().as_text())["touched"]
    w = 256 * 256 * 4
    assert 4 * w <= touched(4) < 5 * w
    assert touched(2) < 3 * w


def test_round_ops_runs_the_runners_programs_on_a_tiny_shape(tmp_path):
    from bench import round_ops
    res = round_ops.run(["tiny"], [2], 64, "python -m bench.round_ops --presets tiny", families=("lite", "draft"),
                        variants=("plain",))
    rows = res["shapes"]["tiny"]
    assert [(r["family"], r["variant"]) for r in rows] == [("lite", "plain"), ("draft", "plain")]
    for r in rows:
        assert r["top_level_ops"] > 0 and r["bytes_accessed"] > 0 and r["weight_bytes"] > 0
        assert r["ops_per_layer"] == round(r["top_level_ops"] / 2, 1)
    md = round_ops._markdown(res)
    assert md.startswith("# ") and "Command: `python -m bench.round_ops" in md


def test_round_ops_compiles_with_the_xla_options_it_is_given():
    """--xla-option NAME=VALUE reaches every compile (an option XLA does not know fails the compile,
    naming it) and the result records and prints it; a malformed pair is refused naming the flag."""
    import jax

    from bench import round_ops
    assert round_ops.xla_options(["xla_gpu_enable_triton_gemm=false", "xla_backend_optimization_level=0",
                                  "xla_dump_to=/tmp/x"]) == {
        "xla_gpu_enable_triton_gemm": False, "xla_backend_optimization_level": 0, "xla_dump_to": "/tmp/x"}
    for bad in ("xla_gpu_enable_triton_gemm", "enable=1"):
        with pytest.raises(SystemExit, match="--xla-option must be NAME=VALUE"):
            round_ops.xla_options([bad])
    kw = dict(families=("lite",), variants=("plain",))
    res = round_ops.run(["tiny"], [2], 64, "cmd", compiler_options={"xla_backend_optimization_level": 0}, **kw)
    assert res["compiler_options"] == {"xla_backend_optimization_level": 0} and res["shapes"]["tiny"][0]["top_level_ops"] > 0
    assert "`xla_backend_optimization_level=0`" in round_ops._markdown(res)
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option"):
        round_ops.run(["tiny"], [2], 64, "cmd", compiler_options={"xla_no_such_option": True}, **kw)


@pytest.mark.parametrize("argv", [["--attention-len", "16"], ["--attention-len", "4096"]])
def test_drafters_refuses_an_attention_len_outside_context_and_max_len(argv, capsys):
    """--attention-len must cover the context plus a block and fit the cache: refused before any
    model is loaded, naming the flag and the bound."""
    from bench import drafters
    with pytest.raises(SystemExit):
        drafters.main(["--context", "64", "--max-len", "256", "--gammas", "8", *argv])
    err = capsys.readouterr().err
    assert "--attention-len" in err and "max gamma + 1 = 73" in err, err


def test_embedded_build_curve_section_tabulates_a_learning_curve(tmp_path):
    from bench import embedded_build

    curve = tmp_path / "learning_curve.jsonl"
    curve.write_text("".join(json.dumps({"step": s, "sets": {"train": {"tau": t, "rounds": 40},
                                                           "heldout": {"tau": h, "rounds": 41}}}) + "\n"
                             for s, t, h in ((100, 1.5, 1.4), (200, 1.9, 1.6))))
    embedded_build.main(["--curve", str(curve), "--out-dir", str(tmp_path)])
    md = (tmp_path / "embedded_build_curve.md").read_text()
    assert "| 200 | 1.900 | 1.600 | +0.300 |" in md and "Command: `python -m bench.embedded_build --curve" in md
    assert (tmp_path / "embedded_build_curve.png").stat().st_size > 0
    curve.write_text("")
    with pytest.raises(SystemExit, match="no learning-curve point"):
        embedded_build.main(["--curve", str(curve), "--out-dir", str(tmp_path)])


def test_round_ops_lowers_the_runner_on_the_mesh_it_is_given():
    """An abstract runner placed on a mesh (as for a compile-only GPU) carries the mesh's shardings
    into its state and compiles for the mesh's devices; without a mesh the state has none."""
    import jax
    from bench import round_ops
    from specjax import sharding as shd
    shape = round_ops.presets()["tiny"]
    mesh = shd.make_mesh((1, 1), shd.SERVE_AXES)
    runner = round_ops.abstract_runner(shape, 2, 64, mesh=mesh)
    leaves = jax.tree.leaves((runner.t_params, runner.cache, runner.row_state, runner.stop_ids))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding.mesh == mesh for x in leaves)
    rows = round_ops.measure(shape, 2, 64, families=("lite",), variants=("greedy",), mesh=mesh)
    assert rows[0]["platform"] == "cpu" and rows[0]["top_level_ops"] > 0 and rows[0]["conditionals"] == 0
    bare = round_ops.abstract_runner(shape, 2, 64)
    assert all(x.sharding is None for x in jax.tree.leaves(bare.cache))


def test_compile_target_names_a_missing_plugin_and_an_unknown_target(tmp_path, monkeypatch):
    from bench import compile_target
    assert compile_target.targets()[0] == "host" and "h200" in compile_target.targets()
    with pytest.raises(ValueError, match="unknown compile target 'b300'.*h200"):
        compile_target.compile_only_mesh("b300")
    monkeypatch.setenv("SPECJAX_CUDA_PJRT", str(tmp_path / "xla_cuda_plugin.so"))
    with pytest.raises(FileNotFoundError, match="xla_cuda_plugin.so is not installed: run `make gpu-compiler`"):
        compile_target.compile_only_mesh("h200")


@pytest.mark.skipif(not os.path.isfile(os.environ.get("SPECJAX_CUDA_PJRT", "")) and
                    not os.path.isfile(os.path.join(os.path.dirname(__file__), "..", ".gpu-compiler", "jax_plugins",
                                                    "xla_cuda12", "xla_cuda_plugin.so")),
                    reason="XLA's GPU compiler is not installed (make gpu-compiler)")
def test_round_ops_compiles_for_a_gpu_this_machine_does_not_have(tmp_path):
    """With `make gpu-compiler` installed: the round programs compile for the H200 description and
    the HLO is the GPU compiler's (Triton/cuBLAS gemm fusions), not the host's."""
    import subprocess
    import sys
    out = tmp_path / "res"
    subprocess.run([sys.executable, "-m", "bench.round_ops", "--presets", "tiny", "--slots", "2", "--families", "lite",
                    "--variants", "greedy", "--target", "h200", "--out-dir", str(out), "--docs", ""],
                   check=True, cwd=os.path.join(os.path.dirname(__file__), ".."))
    res = json.loads((out / "round_ops.json").read_text())
    assert res["target"] == "h200" and res["backend"].startswith("h200 (compile-only")
    row = res["shapes"]["tiny"][0]
    assert row["platform"] == "gpu" and row["top_level_ops"] > 0 and row["bytes_accessed"] > 0


def test_round_ops_table_records_a_program_the_compiler_failed_on():
    """A compile-only target's compiler failure is a row saying so (no figures) plus the message; a
    program compiled again without Triton matmuls is marked and the note says why."""
    from bench import round_ops
    ok = {"family": "lite", "variant": "greedy", "slots": 8, "draft_vocab": 0, "top_level_ops": 60, "ops_per_layer": 30.0,
          "conditionals": 0, "whiles": 0, "prng_whiles": 0, "bytes_accessed": 2e6, "touched_bytes": 1e6,
          "convert_bytes": 0.0, "weight_bytes": 1e6, "kv_cache_bytes": 5e5, "touched_over_weights_kv": 0.667,
          "compile_s": 1.0, "layers": 2, "dtype": "float32"}
    bad = {k: ok[k] for k in ("slots", "draft_vocab", "weight_bytes", "kv_cache_bytes", "layers", "dtype")}
    bad.update(family="draft", variant="plain", error="INTERNAL: Couldn't find output tile sizes")
    retried = {**ok, "family": "fused", "compiler_options": round_ops.NO_TRITON_GEMM_TEXT,
               "first_error": "INTERNAL: tile sizes"}
    res = {"command": "python -m bench.round_ops --target h200", "backend": "h200 (compile-only)", "target": "h200",
           "max_len": 64, "shapes": {"tiny": [ok, bad, retried]}}
    md = round_ops._markdown(res)
    rows = [line for line in md.splitlines() if line.startswith(("| lite", "| draft", "| fused"))]
    assert len(rows) == 3 and all(r.count("|") == 17 for r in rows), rows
    assert "compile failed" in rows[1] and "| 30.0 |" in rows[0] and rows[2].startswith("| fused* | greedy")
    assert "`*`: compiled with `xla_gpu_enable_triton_gemm=false`" in md and "`INTERNAL: tile sizes`" in md
    assert "Compiler failures (no row figures): draft plain: `INTERNAL: Couldn't find output tile sizes`" in md


def test_command_line_leaves_out_the_docs_page():
    assert common.command_line("bench.round_ops", ["--target", "h200", "--docs", "", "--suffix", "h200"]) == \
        "python -m bench.round_ops --target h200 --suffix h200"
    assert common.command_line("bench.x", ["--docs=a.md", "--slots", "8"]) == "python -m bench.x --slots 8"


def test_ngram_cross_slot_asks_each_question_twice_the_repeat_three_arrivals_later():
    from bench.ngram_cross_slot import arrival_order
    assert arrival_order(6) == [0, 1, 2, 0, 3, 1, 4, 2, 5, 3, 4, 5]
    assert arrival_order(2) == [0, 1, 0, 1]


def test_ngram_cross_slot_times_both_proposals_at_each_shape():
    from bench.ngram_cross_slot import _proposal_cost
    (row,) = _proposal_cost(64, shapes=((2, 16),), repeats=2)
    assert (row["slots"], row["attention"], row["vocab"]) == (2, 16, 64) and row["own"] > 0 and row["cross"] > 0


def test_run_arrivals_adds_one_request_every_n_steps_until_all_end():
    from bench.common import run_arrivals

    class Engine:  # each request takes 3 steps once added
        def __init__(self):
            self.left, self.added = [], []

        def add_request(self, r):
            self.added.append((r, self.steps))
            self.left.append(3)

        def has_work(self):
            return any(self.left)

        def step(self):
            self.left = [n - 1 for n in self.left if n > 1]
            self.steps += 1
    eng = Engine()
    eng.steps = 0
    assert run_arrivals(eng, ["a", "b", "c"], every=2) == 7 and eng.added == [("a", 0), ("b", 2), ("c", 4)]


def test_priority_bench_serves_late_interactive_requests_first_only_under_priority():
    """bench.priority's run on a tiny target with one slot: the interactive requests, added after the
    backlog, finish first under `priority` (the first takes the running batch request's slot; the second
    arrives while the first runs and goes next), and last under `fcfs` (control); greedy answers are the
    same."""
    from types import SimpleNamespace

    from bench.priority import POLICIES, _run
    from specjax.api import LLM
    from specjax.decoding.engine import EngineConfig
    from tests.serving_fixtures import tiny_target

    prompts = {"batch": [[3 + i, 4, 5] for i in range(4)], "interactive": [[9, 10, 11 + i] for i in range(2)]}
    runs = {}
    for p in POLICIES:
        cfg = EngineConfig(max_slots=1, max_len=64, policy="plain", slots_buckets=(1,), max_prefill=16,
                           prefill_buckets=(16,), prefill_batch_buckets=(1,), sampling_variants=("greedy",),
                           prefix_caching=False, scheduling_policy=p)
        runs[p] = _run(LLM(target=tiny_target(0), engine_config=cfg), prompts, p, SimpleNamespace(every=2, max_tokens=6))
    ranks = {p: sorted(r["finished"] for r in runs[p]["requests"] if r["class"] == "interactive") for p in POLICIES}
    assert ranks == {"fcfs": [4, 5], "priority": [0, 1]}, ranks
    assert (runs["fcfs"]["preemptions"], runs["priority"]["preemptions"]) == (0, 1)
    assert [r["tokens"] for r in runs["fcfs"]["requests"]] == [r["tokens"] for r in runs["priority"]["requests"]]
    assert all(r["queue"] >= 0 and r["ttft"] >= r["queue"] for p in POLICIES for r in runs[p]["requests"])


def test_chunked_prefill_bench_measures_the_running_streams_gaps_in_both_settings():
    """bench.chunked_prefill's run on a tiny target (one running request, a 4-call prompt) with chunked
    prefill off and on: the same tokens and prefill calls, and every gap measured (tests/
    test_chunked_prefill.py shows the rounds between the calls)."""
    from types import SimpleNamespace

    from bench.chunked_prefill import _run
    from specjax.api import LLM
    from specjax.decoding.engine import EngineConfig
    from tests.serving_fixtures import tiny_target

    runs = {}
    for on in (False, True):
        cfg = EngineConfig(max_slots=2, max_len=64, policy="plain", slots_buckets=(2,), max_prefill=8,
                           prefill_buckets=(8,), prefill_batch_buckets=(1, 2), sampling_variants=("greedy",),
                           prefix_caching=False, chunked_prefill=on)
        llm = LLM(target=tiny_target(0), engine_config=cfg)
        calls = []
        real = llm.engine._prefill_call
        llm.engine._prefill_call = lambda entries: (calls.append(len(llm.engine._prefilling)), real(entries))[1]
        runs[on] = _run(llm, [[3, 4, 5]], [7 + k % 20 for k in range(30)], SimpleNamespace(max_tokens=40))
        runs[on]["calls"] = len(calls)
    assert runs[False]["tokens"] == runs[True]["tokens"]
    assert runs[False]["calls"] == runs[True]["calls"] == 1 + 4  # the running prompt's, the long one's
    assert all(r["max_gap_in"] > 0 and r["median_gap_out"] > 0 and r["long_ttft"] > 0 for r in runs.values())
