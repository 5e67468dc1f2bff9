"""Benchmark decoding throughput: specjax plain decoding vs transformers `generate`, and n-gram
speculation, at batch 1 and 8 on ordinary (chat) and repetitive (code) prompts.

    python -m bench.decode [--batches 1 8] [--prompts 8] [--prompt-len 64] [--new-tokens 128]
                           [--gamma 4] [--repeats 3] [--torch-threads 2 1] [--hf-prompts 1]
                           [--out-dir bench/results]

Target: the embedded default (SmolLM2-135M-Instruct, its GGUF dequantized to float32) when its
package is installed, else a random model of the same shape (the results say which). transformers
runs the very same dequantized weights: the specjax target is exported with
`specjax.checkpoints.export_target` and loaded with `transformers.AutoModelForCausalLM.from_pretrained`
(torch float32, CPU, KV cache, greedy,
`torch.set_num_threads(os.cpu_count())`). Both sides ignore eos (specjax: an LLM built with no eos
ids; transformers: `min_new_tokens = max_new_tokens`), so every request yields exactly
`--new-tokens` tokens. transformers is measured with `os.cpu_count()` torch threads and with 1
(multi-threaded torch collapses when the cores are oversubscribed); the >= 2x goal is judged
against the faster of the two. A "pass" generates all `--prompts` prompts at the given batch size
(batch 1: one after another; transformers: the first max(batch, `--hf-prompts`) of them) and is
timed end to end, prefill included; the measurements of one batch size are interleaved pass by
pass so they share the background load. Engine compile time (warm-up) is reported separately and
excluded.

Prompts are exactly `--prompt-len` tokens: "ordinary" = chat prompts (mt-bench, gsm8k and
humaneval first turns from ../shared/data/eval under the chat template; stdlib code for a random
stand-in), "repetitive" = code with repeated lines and structures (generated). With the random
target there is no tokenizer, so text becomes byte ids.

Writes decode.json, decode.md and decode.png to the output directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sysconfig
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

from bench.common import (BenchTarget, command_line, load_average, load_bench_target, log, machine_info, md_table,
                          pyplot, save_figure, write_results)

GOAL_RATIO = 2.0  # issue 2: specjax plain decoding >= 2x transformers generate
STDLIB_MODULES = ("textwrap", "shlex", "fractions", "heapq", "bisect", "colorsys", "queue", "sched",
                  "string", "calendar", "base64", "difflib", "glob", "locale", "numbers", "operator")
NAMES = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lam",
         "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega")


# ------------------------------------------------------------------------------------------ prompts
def repetitive_texts() -> list[str]:
    """Code whose lines repeat one structure with small changes (getters, tables, asserts, ...)."""
    n = NAMES
    blocks = [
        "class Config:\n" + "".join(f"    def get_{x}(self):\n        return self._{x}\n\n" for x in n),
        "TABLE = {\n" + "".join(f"    '{x}': {i},\n" for i, x in enumerate(n)) + "}\n",
        "def init(self):\n" + "".join(f"    self.{x} = {x}\n" for x in n),
        "def test_square():\n" + "".join(f"    assert square({i}) == {i * i}\n" for i in range(40)),
        "class Color(enum.Enum):\n" + "".join(f"    {x.upper()} = {i}\n" for i, x in enumerate(n)),
        "def apply(op, a, b):\n" + "".join(
            f"    {'if' if i == 0 else 'elif'} op == '{x}':\n        return a + b * {i}\n" for i, x in enumerate(n)),
        "ROWS = [\n" + "".join(f"    ({i}, '{x}', {i}.5),\n" for i, x in enumerate(n)) + "]\n",
        "def show(obj):\n" + "".join(f"    print('{x}:', obj.{x})\n" for x in n),
        "parser = argparse.ArgumentParser()\n" + "".join(
            f"parser.add_argument('--{x}', type=int, default={i})\n" for i, x in enumerate(n)),
        "def reset(self):\n" + "".join(f"    self._{x}_count = 0\n    self._{x}_total = 0.0\n" for x in n),
    ]
    return blocks


EVAL_SETS = ("mt-bench", "gsm8k", "humaneval")


def eval_dir() -> str:
    """`../shared/data/eval` beside the checkout (read in place, never copied)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(os.path.dirname(root), "shared", "data", "eval")


def ordinary_texts(tokenizer: Any = None) -> tuple[list[str], str, str]:
    """Chat prompts: the first turns of mt-bench, gsm8k and humaneval (taken in turn) under the
    target's chat template, their last tokens kept (so every prompt ends where the assistant's
    answer starts). Without a tokenizer (a random stand-in target) or the prompt files, the first
    lines of stdlib modules. Returns (texts, where they came from, "tail" or "head")."""
    d = eval_dir()
    if tokenizer is not None and all(os.path.isfile(os.path.join(d, f"{n}.jsonl")) for n in EVAL_SETS):
        from specjax.io import read_jsonl
        sets = [[r["turns"][0] for r in read_jsonl(os.path.join(d, f"{n}.jsonl"))] for n in EVAL_SETS]
        turns = [t for group in zip(*sets) for t in group]  # mt-bench, gsm8k, humaneval, mt-bench, ...
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in turns]
        return texts, (f"first turns of {', '.join(EVAL_SETS)} ({os.path.relpath(d)}) in turn, under the "
                       "chat template, last tokens kept"), "tail"
    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for m in STDLIB_MODULES:
        p = os.path.join(root, m + ".py")
        if os.path.isfile(p):
            with open(p, encoding="utf-8") as f:
                texts.append(f.read(4000))
    return texts, "first lines of stdlib modules " + ", ".join(STDLIB_MODULES), "head"


def encode_fixed(texts: Sequence[str], encode: Callable[[str], list[int]], n: int, length: int,
                 what: str, *, keep: str = "head") -> list[list[int]]:
    """Exactly `length` token ids from each of the first `n` texts that have at least that many:
    the first ones (`keep="head"`) or the last ones (`keep="tail"`: a completion prompt keeps the
    point where its continuation starts). Too few long texts are reused in order."""
    if keep not in ("head", "tail"):
        raise ValueError(f"keep must be 'head' or 'tail', got {keep!r}")
    out: list[list[int]] = []
    for t in texts:
        ids = encode(t)
        if len(ids) >= length:
            out.append(ids[:length] if keep == "head" else ids[len(ids) - length:])
        if len(out) == n:
            return out
    if not out:
        raise ValueError(f"no {what} prompt has {length} tokens")
    k = len(out)
    while len(out) < n:
        out.append(out[len(out) % k])
    return out


def make_encoder(target: BenchTarget) -> tuple[Callable[[str], list[int]], str]:
    if target.tokenizer is not None:
        tok = target.tokenizer
        return (lambda s: list(tok(s, add_special_tokens=False)["input_ids"])), "embedded tokenizer"
    vocab = target.config.vocab_size
    if vocab < 256:
        raise ValueError(f"byte-level prompts need vocab_size >= 256, got {vocab}")
    return (lambda s: list(s.encode("utf-8"))), "UTF-8 bytes as token ids (no tokenizer)"


# ------------------------------------------------------------------------------------------ systems
def make_llm(target: BenchTarget, *, batch: int, max_len: int, prompt_len: int, gamma: int | None):
    """A specjax LLM with no eos ids and tight buckets; returns (llm, warm-up seconds)."""
    from specjax.api import LLM
    from specjax.decoding.engine import EngineConfig
    cfg = dataclasses.replace(target.config, eos_token_ids=())
    ecfg = EngineConfig(max_slots=batch, max_len=max_len, gamma=gamma,
                        policy="plain" if gamma is None else "fixed", max_prefill=prompt_len,
                        slots_buckets=(batch,), tokens_buckets=(1,) if gamma is None else (1, gamma + 1),
                        prefill_buckets=(prompt_len,), prefill_batch_buckets=(batch,),
                        prefix_caching=False)  # passes repeat the prompts: decoding is timed, not the cache
    t0 = time.perf_counter()
    llm = LLM(target=(target.model, cfg), drafter=None if gamma is None else "ngram",
              num_speculative_tokens=gamma, engine_config=ecfg)
    return llm, time.perf_counter() - t0


def compiled_buckets(engine) -> dict[str, float]:
    """Compile seconds of every executable bucket an engine warmed, e.g. {"fused(8, 5)": 3.1}."""
    return {f"{name}{tuple(key)}": round(sec, 2) for name, exe in engine.runner.exes.items()
            for key, sec in exe.compile_seconds.items()}


def specjax_pass(llm, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Generate every prompt (greedy); returns seconds, token ids and speculative counters."""
    from specjax.api import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    r0 = llm.engine.stats["round_seconds"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    m = [o.metrics for o in outs]
    drafts = sum(x["num_drafts"] for x in m)
    acc = sum(x["num_accepted_tokens"] for x in m)
    return {"seconds": dt, "round_seconds": llm.engine.stats["round_seconds"] - r0,
            "tokens": [o.token_ids for o in outs], "num_drafts": drafts, "num_accepted": acc,
            "num_draft_tokens": sum(x["num_draft_tokens"] for x in m),
            "rounds": sum(x["num_rounds"] for x in m)}


class HFRunner:
    """transformers CausalLM on the same weights (exported by specjax.checkpoints.export_target)."""

    def __init__(self, target: BenchTarget, tmp_dir: str):
        import torch
        import transformers

        from specjax import checkpoints
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        checkpoints.export_target(target.model, target.config, tmp_dir, dtype="float32")
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_dir, dtype=torch.float32, local_files_only=True).eval()
        self.attn = getattr(self.model.config, "_attn_implementation", "unknown")

    def generate(self, batch_ids: list[list[int]], new_tokens: int, threads: int) -> list[list[int]]:
        """Greedy `generate` with KV cache of exactly `new_tokens` tokens per row on `threads` threads."""
        torch = self.torch
        torch.set_num_threads(threads)
        ids = torch.tensor(batch_ids, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, num_beams=1, use_cache=True, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    def run_pass(self, prompts: list[list[int]], batch: int, new_tokens: int, threads: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        toks: list[list[int]] = []
        for i in range(0, len(prompts), batch):
            toks += self.generate(prompts[i:i + batch], new_tokens, threads)
        return {"seconds": time.perf_counter() - t0, "tokens": toks}


# ------------------------------------------------------------------------------------------ run
def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each sequence's tokens before the first difference."""
    fr = []
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        k = next((i for i in range(n) if x[i] != y[i]), n)
        fr.append(k / max(len(x), 1))
    return float(np.mean(fr)) if fr else float("nan")


def summarise(system: str, mode: str, prompts: str, passes: list[dict], batch: int, loads: list[float],
              **extra: Any) -> dict[str, Any]:
    """One result row from the timed passes of one measurement."""
    secs = [p["seconds"] for p in passes]
    ntok = sum(len(t) for t in passes[0]["tokens"])
    tps = [ntok / s for s in secs]
    row = {"system": system, "mode": mode, "prompts": prompts, "batch": batch,
           "tokens_per_s": round(statistics.median(tps), 1), "tokens_per_s_min": round(min(tps), 1),
           "tokens_per_s_max": round(max(tps), 1), "tokens_per_s_per_pass": [round(x, 1) for x in tps],
           "pass_seconds": [round(s, 4) for s in secs], "requests_per_pass": len(passes[0]["tokens"]),
           "new_tokens_per_pass": ntok, "load_1min": [round(min(loads), 2), round(max(loads), 2)],
           "distinct_tokens_per_output": round(float(np.mean([len(set(t)) for t in passes[0]["tokens"]])), 1)}
    if "round_seconds" in passes[0]:
        rs = statistics.median(p["round_seconds"] for p in passes)
        row["decode_only_tokens_per_s"] = round((ntok - len(passes[0]["tokens"])) / rs, 1) if rs > 0 else None
        drafts = passes[0]["num_drafts"]
        row["rounds_per_pass"] = passes[0]["rounds"]
        row["tau"] = round(1.0 + passes[0]["num_accepted"] / drafts, 3) if drafts else None
        row["draft_acceptance_rate"] = round(passes[0]["num_accepted"] / passes[0]["num_draft_tokens"], 3) \
            if passes[0]["num_draft_tokens"] else None
    row.update(extra)
    return row


def hf_thread_counts(requested: list[int] | None) -> list[int]:
    """torch thread counts to measure: default os.cpu_count() (the stated setting) and 1 (on a
    busy machine multi-threaded torch can be many times slower, and the comparison must not be won
    against a handicapped baseline)."""
    n = os.cpu_count() or 1
    return list(dict.fromkeys(requested or [n, 1]))


def run(args: argparse.Namespace) -> dict[str, Any]:
    target = load_bench_target(use_embedded=not args.random_target)
    log(f"target: {target.description}")
    encode, enc_desc = make_encoder(target)
    ord_texts, ord_desc, ord_keep = ordinary_texts(target.tokenizer)
    prompt_sets = {
        "ordinary": encode_fixed(ord_texts, encode, args.prompts, args.prompt_len, "ordinary", keep=ord_keep),
        "repetitive": encode_fixed(repetitive_texts(), encode, args.prompts, args.prompt_len, "repetitive"),
    }
    max_len = -(-(args.prompt_len + args.new_tokens + args.gamma + 1) // 64) * 64
    threads = [] if args.no_hf else hf_thread_counts(args.torch_threads)
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    warmups: list[dict[str, Any]] = []
    hf_runner = None
    with tempfile.TemporaryDirectory() as tmp:
        if threads:
            log("exporting the target and loading it with transformers")
            hf_runner = HFRunner(target, tmp)
        for batch in args.batches:
            if args.prompts % batch:
                raise SystemExit(f"--prompts ({args.prompts}) must be a multiple of every batch size ({batch})")
            log(f"batch {batch}: building engines (plain, ngram gamma={args.gamma})")
            plain, w_plain = make_llm(target, batch=batch, max_len=max_len, prompt_len=args.prompt_len, gamma=None)
            ngram, w_ngram = make_llm(target, batch=batch, max_len=max_len, prompt_len=args.prompt_len,
                                      gamma=args.gamma)
            warmups += [{"batch": batch, "engine": "plain", "warmup_s": round(w_plain, 2),
                         "compiled": compiled_buckets(plain.engine)},
                        {"batch": batch, "engine": "ngram", "warmup_s": round(w_ngram, 2),
                         "compiled": compiled_buckets(ngram.engine)}]
            log(f"batch {batch}: warm-up {w_plain:.1f} s (plain), {w_ngram:.1f} s (ngram)")
            # (system, mode, prompt set) -> one timed pass
            measures: dict[tuple[str, str, str], Callable[[], dict]] = {}
            for ps, prompts in prompt_sets.items():
                measures[("specjax", "plain", ps)] = (
                    lambda p=prompts, llm=plain: specjax_pass(llm, p, args.new_tokens))
                measures[("specjax", "ngram", ps)] = (
                    lambda p=prompts, llm=ngram: specjax_pass(llm, p, args.new_tokens))
            # transformers: the first max(batch, --hf-prompts) ordinary prompts (a multiple of batch)
            n_hf = min(args.prompts, -(-max(batch, args.hf_prompts) // batch) * batch)
            hf_prompts = prompt_sets["ordinary"][:n_hf]
            for t in threads:
                measures[(f"transformers-{t}t", "plain", "ordinary")] = (
                    lambda t=t, b=batch: hf_runner.run_pass(hf_prompts, b, args.new_tokens, t))
            first: dict[str, float] = {}
            for key, fn in measures.items():  # untimed first call of each (first-call costs)
                t0 = time.perf_counter()
                if key[0].startswith("transformers"):
                    hf_runner.generate(hf_prompts[:batch], 8, int(key[0].split("-")[1][:-1]))
                else:
                    fn()
                first["/".join(key)] = time.perf_counter() - t0
            log(f"batch {batch}: first passes " + ", ".join(f"{k} {v:.2f}s" for k, v in first.items()))
            results: dict[tuple[str, str, str], list[dict]] = {k: [] for k in measures}
            loads: list[float] = [load_average()[0]]
            for r in range(args.repeats):
                for key, fn in measures.items():
                    results[key].append(fn())
                    loads.append(load_average()[0])
                log(f"batch {batch}: repeat {r + 1}/{args.repeats}: " + ", ".join(
                    f"{'/'.join(k)} {results[k][-1]['seconds']:.2f}s" for k in measures))
            for (system, mode, ps), passes in results.items():
                extra = {"torch_threads": int(system.split("-")[1][:-1])} if system.startswith("transformers") else {}
                rows.append(summarise(system, mode, ps, passes, batch, loads, **extra))
            # correctness side checks: greedy speculation must equal plain greedy; HF agreement
            for ps in prompt_sets:
                a, b = results[("specjax", "plain", ps)][0]["tokens"], results[("specjax", "ngram", ps)][0]["tokens"]
                checks.append({"batch": batch, "prompts": ps, "check": "n-gram == plain (greedy)",
                               "identical": sum(x == y for x, y in zip(a, b)), "of": len(a)})
            if threads:
                a = results[("specjax", "plain", "ordinary")][0]["tokens"][:n_hf]
                b = results[(f"transformers-{threads[0]}t", "plain", "ordinary")][0]["tokens"]
                checks.append({"batch": batch, "prompts": "ordinary", "check": "specjax == transformers (greedy)",
                               "identical": sum(x == y for x, y in zip(a, b)), "of": len(b),
                               "mean_prefix_agreement": round(agreement(a, b), 4)})
            del plain, ngram
    ratios = []
    for batch in args.batches:
        sj = next(r for r in rows if (r["system"], r["mode"], r["prompts"], r["batch"])
                  == ("specjax", "plain", "ordinary", batch))
        for tf in (r for r in rows if r["system"].startswith("transformers") and r["batch"] == batch):
            # per-repeat ratios: the passes were interleaved, so each pair shares its load
            per = [a / b for a, b in zip(sj["tokens_per_s_per_pass"], tf["tokens_per_s_per_pass"])]
            ratios.append({"batch": batch, "torch_threads": tf["torch_threads"],
                           "specjax_tokens_per_s": sj["tokens_per_s"], "transformers_tokens_per_s": tf["tokens_per_s"],
                           "ratio": round(sj["tokens_per_s"] / tf["tokens_per_s"], 2),
                           "ratio_per_repeat": [round(x, 2) for x in per]})
    headline = []
    for batch in args.batches:
        rs = [r for r in ratios if r["batch"] == batch]
        if rs:  # against the fastest transformers configuration measured
            best = min(rs, key=lambda r: r["ratio"])
            headline.append({"batch": batch, "ratio": best["ratio"], "vs_torch_threads": best["torch_threads"],
                             "meets_goal": best["ratio"] >= GOAL_RATIO})
    return {"benchmark": "decode", "target": target.description, "target_source": target.source,
            "prompt_encoding": enc_desc, "ordinary_prompts": ord_desc,
            "repetitive_prompts": "generated code with repeated lines/structures (bench.decode.repetitive_texts)",
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "prompts_per_pass": args.prompts,
            "hf_prompts_batch1": args.hf_prompts, "gamma": args.gamma, "max_len": max_len,
            "repeats": args.repeats, "goal_ratio": GOAL_RATIO,
            "transformers": None if hf_runner is None else {"attn_implementation": hf_runner.attn,
                                                            "torch_threads": threads},
            "warmup": warmups, "rows": rows, "ratios": ratios, "headline": headline, "checks": checks,
            "machine": machine_info(packages=("jax", "jaxlib", "flax", "numpy", "torch", "transformers"))}


# ------------------------------------------------------------------------------------------ output
def markdown(res: dict[str, Any], command: str) -> str:
    m = res["machine"]
    out = ["# Decoding throughput: plain, n-gram speculation, transformers `generate`\n",
           f"Command: `{command}`\n",
           f"- Target: {res['target']}.",
           f"- Prompts: {res['prompts_per_pass']} per pass, exactly {res['prompt_len']} tokens each "
           f"({res['prompt_encoding']}); {res['new_tokens']} new tokens per request, greedy, eos ignored. "
           f"Ordinary = {res['ordinary_prompts']}; repetitive = {res['repetitive_prompts']}.",
           f"- A pass generates all prompts at the batch size (batch 1: one after another), timed end to "
           f"end with prefill; median of {res['repeats']} passes, all measurements of one batch size interleaved "
           f"pass by pass. n-gram: gamma = {res['gamma']}, fixed verification length. Engine cache max_len "
           f"{res['max_len']}; tight buckets. transformers passes use the first max(batch, "
           f"{res['hf_prompts_batch1']}) ordinary prompts (its speed does not depend on the content).",
           f"- Machine: {m['cpu_count']} CPUs ({m['processor']}), jax {m['versions'].get('jax')} "
           f"({m.get('jax_backend')}), torch {m['versions'].get('torch')}, transformers "
           f"{m['versions'].get('transformers')}"
           + ("" if res["transformers"] is None else
              f" (attn {res['transformers']['attn_implementation']}, torch threads "
              f"{' and '.join(str(t) for t in res['transformers']['torch_threads'])})") + ".\n"]
    if res["ratios"]:
        out.append("## specjax plain decoding vs transformers `generate` (same weights)\n")
        out.append(md_table(
            ["batch", "torch threads", "specjax tok/s", "transformers tok/s", "ratio", "per-repeat ratios"],
            [[r["batch"], r["torch_threads"], f"{r['specjax_tokens_per_s']:.0f}",
              f"{r['transformers_tokens_per_s']:.0f}", f"{r['ratio']:.2f}x",
              ", ".join(f"{x:.2f}" for x in r["ratio_per_repeat"])] for r in res["ratios"]]))
        out.append("")
        out.append(md_table(
            ["batch", "ratio vs the fastest transformers setting", f"goal >= {GOAL_RATIO:g}x"],
            [[h["batch"], f"**{h['ratio']:.2f}x** (torch {h['vs_torch_threads']} thread"
              f"{'s' if h['vs_torch_threads'] != 1 else ''})", "met" if h["meets_goal"] else "MISSED"]
             for h in res["headline"]], align="rlr"))
        out.append(f"\ntorch threads: {os.cpu_count()} = `torch.set_num_threads(os.cpu_count())`; 1 is measured "
                   "as well because multi-threaded torch slows down sharply when the cores are "
                   "oversubscribed (other processes running), and the goal is judged against the faster "
                   "setting.\n")
    out.append("\n## All measurements\n")
    out.append(md_table(
        ["system", "mode", "prompts", "batch", "tok/s (median)", "min..max", "decode-only tok/s", "tau",
         "accept rate", "target passes", "distinct tokens / output", "load 1-min"],
        [[r["system"], r["mode"], r["prompts"], r["batch"], f"{r['tokens_per_s']:.0f}",
          f"{r['tokens_per_s_min']:.0f}..{r['tokens_per_s_max']:.0f}",
          "" if r.get("decode_only_tokens_per_s") is None else f"{r['decode_only_tokens_per_s']:.0f}",
          "" if r.get("tau") is None else f"{r['tau']:.2f}",
          "" if r.get("draft_acceptance_rate") is None else f"{r['draft_acceptance_rate']:.2f}",
          r.get("rounds_per_pass", ""), f"{r['distinct_tokens_per_output']:.0f}",
          f"{r['load_1min'][0]:.1f}..{r['load_1min'][1]:.1f}"]
         for r in res["rows"]], align="lllrrrrrrrrr"))
    out.append("\ntau = mean acceptance length including the bonus token (vLLM's definition); decode-only "
               "tok/s excludes prefill (engine round time); target passes = verify rounds per pass; distinct "
               f"tokens / output = distinct ids among each request's {res['new_tokens']} generated tokens "
               "(low = the continuation loops).\n")
    distinct = [r["distinct_tokens_per_output"] for r in res["rows"] if r["system"] == "specjax"]
    if res["target_source"] == "random":
        out.append("**Random target:** an untrained model's greedy continuations loop on a few tokens, which "
                   "the n-gram drafter predicts perfectly; its tau here says nothing about real code. The "
                   "plain-decoding speeds and the transformers ratio do not depend on the weights.\n")
    elif distinct and max(distinct) < res["new_tokens"] / 8:
        out.append(f"**Looping continuations:** the target's greedy outputs use at most {max(distinct):.0f} distinct "
                   f"tokens per {res['new_tokens']}-token continuation (it repeats itself), which favours the "
                   "n-gram drafter on every prompt kind; tau will differ with a stronger target. The "
                   "plain-decoding speeds and the transformers ratio do not depend on the weights.\n")
    out.append("\n## Warm-up (excluded above)\n")
    out.append(md_table(["batch", "engine", "warm-up s", "buckets compiled (compile s)"],
                        [[w["batch"], w["engine"], f"{w['warmup_s']:.1f}",
                          ", ".join(f"{k} {v:.1f}s" for k, v in w["compiled"].items())] for w in res["warmup"]],
                        align="rlrl"))
    out.append("\n## Checks\n")
    out.append(md_table(["batch", "prompts", "check", "identical outputs", "prefix agreement"],
                        [[c["batch"], c["prompts"], c["check"], f"{c['identical']}/{c['of']}",
                          "" if "mean_prefix_agreement" not in c else f"{c['mean_prefix_agreement']:.3f}"]
                         for c in res["checks"]], align="rlllr"))
    la = m["load_average"]
    out.append(f"\nLoad average at the end (1/5/15 min): {la[0]}/{la[1]}/{la[2]} on {m['cpu_count']} CPUs; "
               "the machine was shared, so absolute numbers are noisy — the interleaved ratios are the "
               "steadier figure.\n")
    return "\n".join(out)


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    rows = res["rows"]
    groups = [(ps, b) for ps in ("ordinary", "repetitive") for b in sorted({r["batch"] for r in rows})]
    series = [(f"transformers-{t}t", "plain", f"transformers generate ({t} torch thread{'s' if t != 1 else ''})")
              for t in (res["transformers"] or {}).get("torch_threads", [])]
    series += [("specjax", "plain", "specjax plain"), ("specjax", "ngram", f"specjax n-gram (gamma={res['gamma']})")]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(series)
    for k, (sysname, mode, label) in enumerate(series):
        xs, ys, taus = [], [], []
        for g, (ps, b) in enumerate(groups):
            r = next((r for r in rows if (r["system"], r["mode"], r["prompts"], r["batch"])
                      == (sysname, mode, ps, b)), None)
            if r is not None:
                xs.append(g + k * width)
                ys.append(r["tokens_per_s"])
                taus.append(r.get("tau"))
        bars = ax.bar(xs, ys, width, label=label)
        for bar, y, tau in zip(bars, ys, taus):
            label = f"{y:.0f}" + ("" if tau is None else f"\nτ={tau:.2f}")
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(np.arange(len(groups)) + width * (len(series) - 1) / 2,
                  [f"{ps}\nbatch {b}" for ps, b in groups])
    ax.set_ylabel("generated tokens / s (median pass)")
    ax.margins(y=0.12)
    ax.set_title(f"Decoding throughput ({res['target_source']} target, {res['machine']['cpu_count']} CPUs, "
                 f"{res['new_tokens']} new tokens)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (slots)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per pass (a multiple of each batch)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--gamma", type=int, default=4, help="n-gram draft tokens per round")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per measurement")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=None,
                        help="torch intra-op thread counts for transformers (default: os.cpu_count() and 1)")
    parser.add_argument("--hf-prompts", type=int, default=1,
                        help="prompts per transformers pass at batch 1 (at batch B: max(B, this))")
    parser.add_argument("--random-target", action="store_true", help="use a random target even if the "
                        "embedded one exists")
    parser.add_argument("--out-dir", default=os.path.join("bench", "results"))
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    for name in ("prompts", "prompt_len", "new_tokens", "gamma", "repeats", "hf_prompts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in args.batches):
        parser.error("--batches must be >= 1")
    res = run(args)
    md = markdown(res, command_line("bench.decode", argv))
    print(md)
    paths = write_results("decode", res, md, out_dir=args.out_dir,
                          plot=None if args.no_plot else (lambda p: plot(res, p)))
    log("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
