"""Chunked prefill on the embedded default target (SmolLM2-135M-Instruct): running streams while a
long prompt arrives.

A few requests decode (MT-Bench first turns); then a long prompt (several MT-Bench questions in one
message, about --long-tokens tokens) arrives. Without chunked prefill its whole prefill (one call per
--max-prefill tokens) runs at admission and every running stream waits for it; with it (vLLM's, the
default) each engine step runs one of its prefill calls and then a decoding round. Per setting: the
running streams' longest gap between two tokens while the long prompt is prefilled, their median gap
outside it, and the long prompt's time to first token; whether every answer equals the other
setting's (greedy).

    python -m bench.chunked_prefill [--running 3] [--long-tokens 900] [--max-prefill 128] [--max-tokens 160]

Plain decoding, greedy, on this machine's CPU; the settings run off, on, on, off (each figure is the
mean of its two runs), so they share the machine's background load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench.common import command_line, load_average, log, machine_info, md_table, pyplot, save_figure, write_results
from bench.decode import eval_dir

SETTINGS = ("off", "on")


def _llm(on: bool, args):
    from specjax.api import LLM
    from specjax.decoding.engine import EngineConfig
    slots = args.running + 1
    cfg = EngineConfig(max_slots=slots, max_len=1536, policy="plain", slots_buckets=(slots,),
                       max_prefill=args.max_prefill, prefill_buckets=(32, args.max_prefill),
                       prefill_batch_buckets=(1, slots), sampling_variants=("greedy",), prefix_caching=False,
                       chunked_prefill=on)
    return LLM(engine_config=cfg)


def prompts(tok, args) -> tuple[list[list[int]], list[int]]:
    """The running requests' prompts (first turns) and the long prompt (the next questions in one
    message, up to `--long-tokens`)."""
    from specjax.request_builder import encode_chat
    with open(os.path.join(eval_dir(), "mt-bench.jsonl")) as f:
        turns = [json.loads(line)["turns"][0] for line in f]
    running = [encode_chat(tok, [{"role": "user", "content": q}]) for q in turns[:args.running]]
    text, k = "", args.running
    while k < len(turns) and len(tok(text + turns[k], add_special_tokens=False)["input_ids"]) < args.long_tokens:
        text, k = text + turns[k] + "\n\n", k + 1
    return running, encode_chat(tok, [{"role": "user", "content": "Answer the last question only.\n\n" + text}])


def _run(llm, running_ids: list[list[int]], long_ids: list[int], args) -> dict:
    """Running requests decode 8 tokens, then the long one is added; per step the time and each
    running request's token count, until the long request has its first token and 8 more steps ran."""
    from specjax.api import SamplingParams
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    running = [llm.make_request(ids, sp) for ids in running_ids]
    long = llm.make_request(long_ids, SamplingParams(temperature=0.0, max_tokens=16))
    for r in running:
        eng.add_request(r)
    while min(len(r.output_ids) for r in running) < 8:
        eng.step()
    t_add, after = time.perf_counter(), 0
    eng.add_request(long)
    times, counts = [t_add], [[len(r.output_ids) for r in running]]
    while after < 8 and eng.has_work():
        eng.step()
        times.append(time.perf_counter())
        counts.append([len(r.output_ids) for r in running])
        after += bool(long.output_ids)
    t_first = long.metrics.first_token_time
    gaps_in, gaps_out = [], []
    for j in range(len(running)):
        last = times[0]
        for t, (c0, c1) in zip(times[1:], zip([c[j] for c in counts], [c[j] for c in counts[1:]])):
            if c1 > c0:
                (gaps_in if last < t_first else gaps_out).append(t - last)
                last = t
    while eng.has_work():
        eng.step()
    return {"max_gap_in": max(gaps_in), "median_gap_out": statistics.median(gaps_out),
            "long_ttft": t_first - t_add, "tokens": [list(r.output_ids) for r in running + [long]]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=3, help="requests decoding when the long prompt arrives")
    ap.add_argument("--long-tokens", type=int, default=900, help="about this many tokens in the long prompt")
    ap.add_argument("--max-prefill", type=int, default=128, help="prompt tokens per prefill call")
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens of each running request")
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    from specjax import checkpoints, default_target
    tok = checkpoints.load_tokenizer(default_target.gguf_path())
    running, long_ids = prompts(tok, args)
    load0 = load_average()[0]
    llms = {}
    for s in SETTINGS:
        log(f"chunked prefill {s}: building the engine")
        llms[s] = _llm(s == "on", args)
        _run(llms[s], running, long_ids[:args.max_prefill * 2], args)  # warm-up
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for s in ("off", "on", "on", "off"):
        runs[s].append(_run(llms[s], running, long_ids, args))
        log(f"  {s}: longest gap {runs[s][-1]['max_gap_in'] * 1e3:.0f} ms, long ttft {runs[s][-1]['long_ttft']:.2f} s")
    res = {s: {k: statistics.mean(run[k] for run in runs[s]) for k in ("max_gap_in", "median_gap_out", "long_ttft")}
           for s in SETTINGS}
    res["same_answers"] = all(run["tokens"] == runs["off"][0]["tokens"] for s in SETTINGS for run in runs[s])
    res["long_prompt_tokens"], res["prefill_calls"] = len(long_ids), -(-len(long_ids) // args.max_prefill)
    _report(args, argv, res, load0)


def _report(args, argv, res: dict, load0: float) -> None:
    off, on = res["off"], res["on"]
    md = (f"# Chunked prefill: running streams while a long prompt arrives\n\n"
          f"Command: `{command_line('bench.chunked_prefill', argv)}`\n\n"
          f"{args.running} requests (MT-Bench first turns, ../shared/data/eval/mt-bench.jsonl) decode on "
          f"{args.running + 1} slots; after their 8th token a {res['long_prompt_tokens']}-token prompt (later "
          f"questions in one message) arrives: {res['prefill_calls']} prefill calls of at most {args.max_prefill} "
          f"tokens. Plain decoding, greedy, SmolLM2-135M-Instruct on this CPU (load {load0:.1f} at the start). "
          f"`--no-enable-chunked-prefill` / `--enable-chunked-prefill` (the default) for each figure, the mean "
          f"of two runs (run off, on, on, off).\n\n"
          + md_table(["", "chunked prefill off", "on"],
                     [["running streams: longest gap between two tokens while the prompt is prefilled, ms",
                       f"{off['max_gap_in'] * 1e3:.0f}", f"{on['max_gap_in'] * 1e3:.0f}"],
                      ["running streams: median gap after it, ms", f"{off['median_gap_out'] * 1e3:.0f}",
                       f"{on['median_gap_out'] * 1e3:.0f}"],
                      ["long prompt: time to first token, s", f"{off['long_ttft']:.2f}", f"{on['long_ttft']:.2f}"]],
                     "lrr")
          + f"\n- the running streams' longest stall falls {off['max_gap_in'] / on['max_gap_in']:.1f}x "
            f"({off['max_gap_in'] * 1e3:.0f} -> {on['max_gap_in'] * 1e3:.0f} ms: one prefill call and a round); "
            f"the long prompt's time to first token {off['long_ttft']:.2f} -> {on['long_ttft']:.2f} s (a decoding "
            f"round runs between its calls); answers equal: {'yes' if res['same_answers'] else 'NO'}\n")
    write_results("chunked_prefill", {"machine": machine_info(), "args": vars(args), "results": res}, md,
                  out_dir=args.out_dir, plot=lambda path: _plot(res, path))
    log("wrote chunked_prefill results")


def _plot(res: dict, path: str) -> None:
    """The running streams' longest gap and the long prompt's time to first token, off vs on."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(7, 3))
    for ax, key, scale, label in ((axes[0], "max_gap_in", 1e3, "running streams: longest gap, ms"),
                                  (axes[1], "long_ttft", 1.0, "long prompt: time to first token, s")):
        ax.bar(["off", "on"], [res[s][key] * scale for s in SETTINGS], color=["tab:blue", "tab:orange"])
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("chunked prefill")
    fig.suptitle("chunked prefill, SmolLM2-135M on this CPU", fontsize=10)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
