"""Structured outputs under speculation on the embedded default target (SmolLM2-135M-Instruct): JSON
answers to a schema (guided_json) decoded plainly and with shipped drafters whose drafts are free (the
verifier rejects those the schema's automaton does not allow) or guided (drawn only from the tokens it
allows, `EngineConfig.guided_drafts`, the default). Per decoding: τ, tokens/s and the speedup over plain
guided decoding, at T = 0 and T = 1; at T = 0 whether every output equals plain guided decoding's, and
at both whether every answer parses as JSON with the schema's keys.

    python -m bench.guided [--drafters dspark eagle3] [--max-tokens 96]

Batch 1, the prompts one after another (`bench.embedded`'s engine shape), on this machine's CPU.
"""
from __future__ import annotations

import argparse
import json
import os

from bench.common import (batch1_decode, command_line, log, machine_info, md_table, pyplot, require_shipped,
                          save_figure, write_results)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"},
                                           "hobbies": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "hobbies"]}
PEOPLE = ["Alice, aged 30, from Paris, who likes chess and tennis", "Bob, 42, living in Tokyo, into hiking",
          "Carla, a 25 year old from Rome who paints", "Dmitri, 61, Moscow, fishing and reading",
          "Eve, 19, Berlin, plays guitar", "Farid, 35, Cairo, football and cooking",
          "Grace, 52, a baker in Lyon who sings in a choir", "Hiro, 28, Osaka, climbing and photography"]
PLAIN_AGAIN = "plain (again, last)"


def _llm(drafter: str | None, guided_drafts: bool, max_tokens: int, prompt_len: int):
    from specjax.api import LLM
    from specjax.decoding.buckets import next_pow2
    from specjax.decoding.engine import EngineConfig
    prefill = next_pow2(prompt_len)
    cfg = EngineConfig(max_slots=1, max_len=prefill + max_tokens + 16, policy="plain" if drafter is None else "fixed",
                       slots_buckets=(1,), prefill_buckets=(prefill,), max_prefill=prefill, prefill_batch_buckets=(1,),
                       sampling_variants=("greedy", "plain"), guided_regex=True, guided_drafts=guided_drafts,
                       prefix_caching=False)  # runs repeat the prompts: decoding is timed, not the cache
    llm = LLM(drafter=drafter, engine_config=cfg)
    llm.engine.warmup()
    return llm


def _decode(llm, prompts: list[list[int]], max_tokens: int, temperature: float) -> dict:
    """Batch-1 guided decoding of `prompts` one after another (after one untimed request)."""
    from specjax.api import SamplingParams
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0, guided_json=SCHEMA)
    llm.generate([prompts[0]], sp)  # compiles the schema's automaton, loads it
    outs, record = batch1_decode(llm, prompts, sp)
    return {**record, "valid": sum(_valid(o.text) for o in outs), "cut": sum(o.finish_reason == "length" for o in outs)}


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(SCHEMA["required"]) <= set(obj)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", default=["dspark", "eagle3"], help="shipped drafters to run")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    from specjax import checkpoints, default_target
    from specjax.request_builder import encode_chat
    require_shipped(args.drafters)
    tok = checkpoints.load_tokenizer(default_target.gguf_path())
    prompts = [encode_chat(tok, [{"role": "user", "content": f"Write a JSON record for {p}."}]) for p in PEOPLE]
    # plain first and again last: the faster of the two is the baseline (a slow spell of the machine
    # during one of them cannot inflate the speedups)
    plan = [("plain", None, True)] + [(f"{d} {mode}", d, mode == "guided") for d in args.drafters
                                      for mode in ("free", "guided")] + [(PLAIN_AGAIN, None, True)]
    res: dict[tuple[str, float], dict] = {}
    for label, drafter, guided in plan:
        log(f"{label}: building the engine")
        llm = _llm(drafter, guided, args.max_tokens, max(len(p) for p in prompts))
        for temp in (0.0, 1.0):
            res[(label, temp)] = r = _decode(llm, prompts, args.max_tokens, temp)
            log(f"  T={temp:g}: {r['tokens_per_s']:.1f} tokens/s, τ {r['tau']:.2f}, {r['valid']}/{len(prompts)} valid")
        del llm
    _report(args, argv, plan, res, len(prompts))


def _report(args, argv, plan, res, n: int) -> None:
    rows = []
    for temp in (0.0, 1.0):
        base = max(res[(k, temp)]["tokens_per_s"] for k in ("plain", PLAIN_AGAIN))
        for label, _, _ in plan:
            r = res[(label, temp)]
            same = "" if temp else ("yes" if r["token_ids"] == res[("plain", 0.0)]["token_ids"] else "NO")
            rows.append([label, f"{temp:g}", f"{r['tau']:.2f}", f"{r['tokens_per_s']:.1f}",
                         f"{r['tokens_per_s'] / base:.2f}x", same, f"{r['valid']}/{n} ({r['cut']})",
                         f"{r['load']:.1f}"])
    md = (f"# Structured outputs under speculation: guided drafts\n\n"
          f"Command: `{command_line('bench.guided', argv)}`\n\n"
          f"{n} JSON records to one schema (guided_json: name, age, city, hobbies), batch 1, at most {args.max_tokens} "
          f"tokens, SmolLM2-135M-Instruct on this CPU. *free*: the drafter proposes as without a schema and "
          f"verification rejects what the schema's automaton does not allow; *guided*: it draws only the tokens the "
          f"automaton allows after its drafts before (`EngineConfig.guided_drafts`, the default).\n\n"
          + md_table(["decoding", "T", "τ", "tokens/s", "vs plain (faster of its two runs)", "greedy output = plain",
                      "valid JSON (cut at max_tokens)", "load"], rows, "lrrrrllr") + "\n")
    for d in args.drafters:
        for temp in (0.0, 1.0):
            free, guided = res[(f"{d} free", temp)], res[(f"{d} guided", temp)]
            speed = guided['tokens_per_s'] / free['tokens_per_s']
            md += (f"- {d} at T={temp:g}: τ {free['tau']:.2f} -> {guided['tau']:.2f} with guided drafts "
                   f"({guided['tau'] / free['tau']:.2f}x), tokens/s {speed:.2f}x\n")
    clean = {f"{k[0]}@T{k[1]:g}": {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in res.items()}
    write_results("guided", {"machine": machine_info(), "schema": SCHEMA, "prompts": PEOPLE,
                             "max_tokens": args.max_tokens, "runs": clean}, md, out_dir=args.out_dir,
                  plot=lambda path: _plot(args.drafters, res, path))
    log("wrote guided results")


def _plot(drafters, res, path) -> None:
    """τ of free and guided drafts per drafter and temperature."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"{d}\nT={t:g}" for d in drafters for t in (0.0, 1.0)]
    x = range(len(labels))
    for off, mode in ((-0.2, "free"), (0.2, "guided")):
        ax.bar([i + off for i in x], [res[(f"{d} {mode}", t)]["tau"] for d in drafters for t in (0.0, 1.0)],
               width=0.4, label=f"{mode} drafts")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("τ (tokens per round)")
    ax.set_title("guided_json, SmolLM2-135M: free vs guided drafts")
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
