"""The earlier toy target's benchmarks (the pystd target in specjax/assets/pystd, measured before
SmolLM2 became the default; kept reproducible until the real target's drafters are built): τ per shipped drafter on the held-out
stdlib prompts (Table-1 protocol, gamma 7, temperature 1 and 0), per-position conditional acceptance
(PNG), batch-1 wall-clock speedup over plain decoding per drafter, and the peer comparison with
transformers' assisted generation (`generate(assistant_model=...)`) using our standalone drafter;
and, when the benchmark-only block-15 drafters are built (`python -m train.build_embedded --stages
dspark-g15 dflash-g15`), the DSpark-over-DFlash gain at gamma 15 against gamma 7.

    python -m bench.embedded [--prompts 32] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from bench.common import command_line, log, machine_info, md_table, pyplot, write_results


def _shipped() -> list[str]:
    from specjax import embedded
    return [n for n in embedded.DRAFTER_NAMES if os.path.exists(os.path.join(embedded.drafter_dir(n), "config.json"))]


def _table1(drafters, prompts_path, cap, max_tokens, temperature, out_dir) -> dict:
    from specjax.eval.evaluate import EvalSettings, run_evaluation
    from specjax import embedded
    return run_evaluation(embedded.target_dir(), [embedded.drafter_dir(d) if d in embedded.DRAFTER_NAMES else d
                                                  for d in drafters], [prompts_path], out_dir, cap=cap,
                          settings=EvalSettings(temperature=temperature, max_new_tokens=max_tokens), progress=False)


G15 = ("dspark-g15", "dflash-g15")


def _gamma15(prompts_path, cap, max_tokens, out_dir) -> dict | None:
    """τ of the block-15 DSpark / DFlash drafters verified at gamma 7 and 15, T = 1 and 0."""
    from specjax import embedded
    # exported by the earlier pystd build (`runs/embedded/exports`); the SmolLM2 build makes none
    dirs = [os.path.join("runs", "embedded", "exports", n) for n in G15]
    if not all(os.path.exists(os.path.join(d, "config.json")) for d in dirs):
        return None
    from specjax.eval.evaluate import EvalSettings, run_evaluation
    res = {}
    for temp in (1.0, 0.0):
        for gamma in (7, 15):
            log(f"gamma-15 drafters at gamma {gamma}, T={temp:g}")
            t = run_evaluation(embedded.target_dir(), dirs, [prompts_path], os.path.join(out_dir, f"embedded_g15_T{int(temp)}_gamma{gamma}"),
                               cap=cap, gamma=gamma, progress=False,
                               settings=EvalSettings(temperature=temp, max_new_tokens=max_tokens))
            res[(temp, gamma)] = {"dspark": _tau(t, G15[0]), "dflash": _tau(t, G15[1])}
    return res


SCHEDULED = "dspark+confidence"  # DSpark with its scheduler (cost table measured at start) instead of fixed


def _speed(name: str | None, prompts: list[str], max_tokens: int, temperature: float) -> dict:
    """Batch-1 decoding of `prompts` one after another: plain (name None), a shipped drafter with
    fixed verification, or SCHEDULED (DSpark, the confidence policy on a cost table measured here)."""
    from specjax.api import LLM, SamplingParams
    from specjax.decoding.engine import EngineConfig
    policy = "plain" if name is None else ("confidence" if name == SCHEDULED else "fixed")
    cfg = EngineConfig(max_slots=1, max_len=512, policy=policy, slots_buckets=(1,),
                       tokens_buckets=None, prefill_buckets=(256,), max_prefill=256, prefill_batch_buckets=(1,))
    from specjax import embedded
    d = "dspark" if name == SCHEDULED else name
    llm = LLM(target=embedded.target_dir(), drafter=None if d is None else embedded.drafter_dir(d),
              engine_config=cfg)
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
    llm.generate([prompts[0]], SamplingParams(temperature=temperature, max_tokens=8))
    t0 = time.perf_counter()
    outs = [llm.generate([p], sp)[0] for p in prompts]
    sec = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    drafts = sum(o.metrics["num_drafts"] for o in outs)
    acc = sum(o.metrics["num_accepted_tokens"] for o in outs)
    return {"tokens": toks, "seconds": sec, "tokens_per_s": toks / sec, "tau": 1 + acc / drafts if drafts else 1.0,
            "token_ids": [o.token_ids for o in outs]}


def _peer(prompts: list[str], max_tokens: int) -> dict | None:
    """transformers assisted generation with our exported standalone drafter (greedy, batch 1)."""
    from specjax import embedded
    sd = embedded.drafter_dir("standalone")
    if not os.path.exists(os.path.join(sd, "config.json")):
        return None
    import torch
    import transformers
    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(embedded.target_dir(), local_files_only=True)
    target = transformers.Qwen3ForCausalLM.from_pretrained(embedded.target_dir(), torch_dtype=torch.float32).eval()
    assistant = transformers.Qwen3ForCausalLM.from_pretrained(sd, torch_dtype=torch.float32).eval()
    res = {}
    for label, kw in (("plain", {}), ("assisted (standalone drafter)", {"assistant_model": assistant})):
        with torch.no_grad():
            ids = tok(prompts[0], return_tensors="pt").input_ids
            target.generate(ids, max_new_tokens=4, do_sample=False, **kw)
            t0, n = time.perf_counter(), 0
            for p in prompts:
                ids = tok(p, return_tensors="pt").input_ids
                out = target.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=tok.eos_token_id, **kw)
                n += out.shape[1] - ids.shape[1]
            res[label] = n / (time.perf_counter() - t0)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts for the τ table")
    ap.add_argument("--speed-prompts", type=int, default=8, help="prompts for the batch-1 speed runs")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    from specjax import embedded
    drafters = _shipped()
    if not drafters:
        raise SystemExit("no shipped drafters: run `make embedded` first")
    prompts_path = embedded.prompts_path()
    prompts = [json.loads(x)["prompt"] for x in open(prompts_path) if x.strip()]
    log(f"shipped drafters: {drafters}")
    tables = {}
    for temp in (1.0, 0.0):
        log(f"Table 1 at temperature {temp}")
        tables[temp] = _table1(drafters, prompts_path, args.prompts, args.max_tokens, temp,
                               os.path.join(args.out_dir, f"embedded_eval_T{int(temp)}"))
    speed = {}
    for temp in (0.0, 1.0):
        for name in [None] + drafters + ([SCHEDULED] if "dspark" in drafters else []):
            label = name or "plain"
            log(f"speed {label} T={temp}")
            speed[(label, temp)] = _speed(name, prompts[:args.speed_prompts], args.max_tokens, temp)
    peer = _peer(prompts[:args.speed_prompts], args.max_tokens)
    g15 = _gamma15(prompts_path, args.prompts, args.max_tokens, args.out_dir)
    _report(drafters, tables, speed, peer, g15, args, argv)


def _tau(table: dict, drafter: str) -> float:
    row = next(r for r in table["table"] if r["drafter"] == drafter)
    return float(row["macro"])


def _report(drafters, tables, speed, peer, g15, args, argv):
    rows = []
    for d in drafters:
        rows.append([d, f"{_tau(tables[1.0], d):.2f}", f"{_tau(tables[0.0], d):.2f}"])
    md = (f"# Embedded default: drafters on held-out stdlib prompts\n\nCommand: `{command_line('bench.embedded', argv)}`\n\n"
          f"Target: the shipped pystd target (its training record: specjax/assets/pystd/target/training.json). "
          f"Held-out completion prompts ({args.prompts} per run), {args.max_tokens} new tokens, gamma = each drafter's "
          f"block (7 for the block drafters), fixed verification.\n\n## τ (accepted drafts + bonus per round)\n\n"
          + md_table(["drafter", "τ at T=1", "τ at T=0"], rows, "lrr"))
    goals = []
    if {"dspark", "dflash"} <= set(drafters):
        for t in (1.0, 0.0):
            goals.append(f"τ(DSpark)/τ(DFlash) at T={t:g}: {_tau(tables[t], 'dspark') / _tau(tables[t], 'dflash'):.2f} (goal >= 1.2)")
    if {"dspark", "eagle3"} <= set(drafters):
        for t in (1.0, 0.0):
            goals.append(f"τ(DSpark)/τ(Eagle3) at T={t:g}: {_tau(tables[t], 'dspark') / _tau(tables[t], 'eagle3'):.2f} (goal >= 1.3)")
    md += "\n" + "\n".join(f"- {g}" for g in goals) + "\n"
    if g15 is None:
        md += ("\n## gamma = 15\n\nNot run: the benchmark-only block-15 drafters are not built "
               "(`python -m train.build_embedded --stages dspark-g15 dflash-g15`).\n")
    else:
        grows = [[f"{t:g}", str(g), f"{v['dspark']:.2f}", f"{v['dflash']:.2f}", f"{v['dspark'] / v['dflash']:.2f}"]
                 for (t, g), v in sorted(g15.items(), key=lambda kv: (-kv[0][0], kv[0][1]))]
        md += ("\n## gamma = 15 against gamma = 7\n\nThe dspark / dflash recipes trained with block 15 "
               "(benchmark only: `python -m train.build_embedded --stages dspark-g15 dflash-g15`), the same "
               "prompts, verifying the first gamma draft tokens of every block (fixed policy).\n\n"
               + md_table(["T", "gamma", "τ DSpark", "τ DFlash", "DSpark / DFlash"], grows, "rrrrr"))
        for t in (1.0, 0.0):
            r7 = g15[(t, 7)]["dspark"] / g15[(t, 7)]["dflash"]
            r15 = g15[(t, 15)]["dspark"] / g15[(t, 15)]["dflash"]
            md += (f"- T={t:g}: gain at gamma 15 {r15:.2f} vs at gamma 7 {r7:.2f} "
                   f"(goal: larger at 15: {'met' if r15 > r7 else 'missed'})\n")
    md += ("\nPer-position acceptance and calibration: `bench/results/embedded_eval_T1/results.md`, "
           "`bench/results/embedded_eval_T1/acceptance_by_position.png`\n")
    srows = []
    for t in (0.0, 1.0):
        base = speed[("plain", t)]["tokens_per_s"]
        for label in [k for (k, tt) in speed if tt == t]:
            s = speed[(label, t)]
            same = "" if t != 0 else ("yes" if s["token_ids"] == speed[("plain", 0.0)]["token_ids"] else "NO")
            srows.append([label, f"{t:g}", f"{s['tokens_per_s']:.1f}", f"{s['tau']:.2f}", f"{s['tokens_per_s'] / base:.2f}x", same])
    md += ("\n## Batch-1 wall-clock speed\n\n" + md_table(
        ["decoding", "T", "tokens/s", "τ", "speedup vs plain", "greedy output = plain"], srows, "lrrrrl"))
    if peer:
        md += ("\n## Peer: transformers assisted generation (torch CPU, 1 thread, greedy, batch 1)\n\n"
               + md_table(["system", "tokens/s"], [[k, f"{v:.1f}"] for k, v in peer.items()]
                          + [["specjax standalone", f"{speed[('standalone', 0.0)]['tokens_per_s']:.1f}"]
                             if ("standalone", 0.0) in speed else ["specjax standalone", "-"],
                             ["specjax dspark", f"{speed[('dspark', 0.0)]['tokens_per_s']:.1f}"]
                             if ("dspark", 0.0) in speed else ["specjax dspark", "-"]], "lr"))

    def plot(path):
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for d in drafters:
            ov = tables[1.0]["drafters"][d]["overall"]["cond_accept"]
            ax.plot(range(1, len(ov) + 1), ov, "o-", label=d)
        ax.set_xlabel("draft position")
        ax.set_ylabel("conditional acceptance (T=1)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
        ax.set_title("per-position conditional acceptance (cf. DSpark Fig. 2)")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    clean = {f"{k[0]}@T{k[1]:g}": {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in speed.items()}
    write_results("embedded", {"machine": machine_info(), "drafters": drafters,
                               "tau": {str(t): {d: _tau(tables[t], d) for d in drafters} for t in tables},
                               "speed": clean, "peer": peer,
                               "gamma15": None if g15 is None else [
                                   {"temperature": t, "gamma": g, **v} for (t, g), v in g15.items()]}, md, out_dir=args.out_dir, plot=plot)
    log("wrote embedded results")


if __name__ == "__main__":
    main()
