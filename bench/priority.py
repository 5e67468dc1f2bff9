"""Priority scheduling on the embedded default target (SmolLM2-135M-Instruct): interactive requests
beside a batch backlog.

A backlog of batch requests (MT-Bench first turns, priority 1) is queued at once on a few slots;
interactive requests (other first turns, priority 0) arrive one every few engine steps while the
backlog runs. Under `fcfs` (the default) an interactive request waits behind the whole backlog
queued before it; under `priority` it takes a slot at once: a free one, else a running batch
request's (preemption: that request waits again and continues from its prompt and output when
readmitted). Per policy and request class: median time in the queue, to the first token and to the
end; the whole run's time, tokens/s and preemptions; whether every answer equals the other policy's
(greedy).

    python -m bench.priority [--slots 4] [--backlog 24] [--interactive 6] [--every 24] [--max-tokens 64]

Plain decoding, greedy, on this machine's CPU; the policies run fcfs, priority, priority, fcfs (each
figure is the mean of its two runs), so they share the machine's background load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench.common import command_line, load_average, log, machine_info, md_table, pyplot, save_figure, write_results
from bench.decode import eval_dir

POLICIES = ("fcfs", "priority")
CLASSES = ("interactive", "batch")


def questions(path: str, n: int) -> list[str]:
    """The first user turns of the first `n` conversations of an eval file."""
    out = []
    with open(path) as f:
        for line in f:
            out.append(json.loads(line)["turns"][0])
            if len(out) == n:
                break
    if len(out) < n:
        raise SystemExit(f"{path} holds {len(out)} conversations; --backlog + --interactive asks for {n}")
    return out


def _llm(policy: str, slots: int):
    from specjax.api import LLM
    from specjax.decoding.engine import EngineConfig
    cfg = EngineConfig(max_slots=slots, max_len=512, policy="plain", slots_buckets=(slots,), max_prefill=128,
                       prefill_buckets=(32, 64, 128), prefill_batch_buckets=(1, slots), sampling_variants=("greedy",),
                       prefix_caching=False, scheduling_policy=policy)
    return LLM(engine_config=cfg)


def _run(llm, prompts: dict[str, list[list[int]]], policy: str, args) -> dict:
    """The backlog queued at step 0, an interactive request added every `args.every` steps from step
    `args.every`; per request its class, times (s), place in the finishing order and answer, and the
    run's seconds and tokens."""
    from specjax.api import SamplingParams
    sp = {c: SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            priority=(1 if c == "batch" else 0) if policy == "priority" else 0) for c in CLASSES}
    eng = llm.engine
    preemptions0 = eng.stats["preemptions"]
    made = [(c, llm.make_request(ids, sp[c])) for c in CLASSES for ids in prompts[c]]
    late = [r for c, r in made if c == "interactive"]
    t0, step = time.perf_counter(), 0
    for c, r in made:
        if c == "batch":
            eng.add_request(r)
    while late or eng.has_work():
        step += 1
        if late and step % args.every == 0:
            eng.add_request(late.pop(0))
        eng.step()
    seconds = time.perf_counter() - t0
    rank = {id(r): k for k, (_, r) in enumerate(sorted(made, key=lambda cr: cr[1].metrics.finish_time))}
    out = []
    for c, r in made:
        lat = r.metrics.latencies(len(r.output_ids))
        out.append({"class": c, "queue": lat["queue"], "ttft": lat["ttft"], "e2e": lat["e2e"],
                    "finished": rank[id(r)], "tokens": list(r.output_ids)})
    return {"requests": out, "seconds": seconds, "tokens": sum(len(r["tokens"]) for r in out),
            "preemptions": eng.stats["preemptions"] - preemptions0}


def _summary(runs: list[dict]) -> dict:
    """Per class the medians of each run, averaged over the runs; the runs' mean seconds and tokens/s."""
    out: dict = {}
    for c in CLASSES:
        out[c] = {k: statistics.mean(statistics.median(r[k] for r in run["requests"] if r["class"] == c)
                                     for run in runs) for k in ("queue", "ttft", "e2e")}
    out["seconds"] = statistics.mean(run["seconds"] for run in runs)
    out["tokens_per_s"] = statistics.mean(run["tokens"] / run["seconds"] for run in runs)
    out["preemptions"] = statistics.mean(run["preemptions"] for run in runs)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--backlog", type=int, default=24, help="batch requests queued at once (priority 1)")
    ap.add_argument("--interactive", type=int, default=6, help="interactive requests arriving later (priority 0)")
    ap.add_argument("--every", type=int, default=24, help="engine steps between interactive arrivals")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    from specjax import checkpoints, default_target
    from specjax.request_builder import encode_chat
    tok = checkpoints.load_tokenizer(default_target.gguf_path())
    qs = questions(os.path.join(eval_dir(), "mt-bench.jsonl"), args.backlog + args.interactive)
    ids = [encode_chat(tok, [{"role": "user", "content": q}]) for q in qs]
    prompts = {"batch": ids[:args.backlog], "interactive": ids[args.backlog:]}
    load0 = load_average()[0]
    llms = {}
    for p in POLICIES:
        log(f"{p}: building the engine ({args.slots} slots, plain decoding)")
        llms[p] = _llm(p, args.slots)
        _run(llms[p], {"batch": prompts["batch"][:args.slots], "interactive": []}, p, args)  # warm-up
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for p in ("fcfs", "priority", "priority", "fcfs"):
        runs[p].append(_run(llms[p], prompts, p, args))
        log(f"  {p}: {runs[p][-1]['seconds']:.1f} s")
    res = {p: _summary(runs[p]) for p in POLICIES}
    res["same_answers"] = all([r["tokens"] for r in run["requests"]] == [r["tokens"] for r in runs["fcfs"][0]["requests"]]
                              for p in POLICIES for run in runs[p])
    f, q = res["fcfs"]["interactive"], res["priority"]["interactive"]
    log(f"interactive ttft {f['ttft']:.2f} -> {q['ttft']:.2f} s, same answers {res['same_answers']}")
    _report(args, argv, res, load0)


def _report(args, argv, res: dict, load0: float) -> None:
    rows = []
    for c in CLASSES:
        f, q = res["fcfs"][c], res["priority"][c]
        rows.append([c, f"{args.interactive if c == 'interactive' else args.backlog}",
                     f"{f['queue']:.2f} / {q['queue']:.2f}", f"{f['ttft']:.2f} / {q['ttft']:.2f}",
                     f"{f['e2e']:.2f} / {q['e2e']:.2f}"])
    f, q = res["fcfs"], res["priority"]
    md = (f"# Priority scheduling: interactive requests beside a batch backlog\n\n"
          f"Command: `{command_line('bench.priority', argv)}`\n\n"
          f"{args.backlog} batch requests (MT-Bench first turns, ../shared/data/eval/mt-bench.jsonl; priority 1) "
          f"queued at once on {args.slots} slots, and {args.interactive} interactive requests (the next first "
          f"turns; priority 0) arriving one every {args.every} engine steps while the backlog runs; plain "
          f"decoding, greedy, at most {args.max_tokens} tokens each, SmolLM2-135M-Instruct on this CPU (load "
          f"{load0:.1f} at the start). `--scheduling-policy fcfs` (the default: priorities unused) / `priority` "
          f"for each figure: per class the median over its requests in seconds, the mean of two runs per policy "
          f"(run fcfs, priority, priority, fcfs).\n\n"
          + md_table(["requests", "count", "queue, s (fcfs / priority)", "time to first token, s",
                      "end to end, s"], rows, "lrrrr")
          + f"\n- interactive requests start {f['interactive']['ttft'] / q['interactive']['ttft']:.1f}x sooner "
            f"({f['interactive']['ttft']:.2f} -> {q['interactive']['ttft']:.2f} s to the first token); the batch "
            f"requests' median end-to-end time moves {f['batch']['e2e']:.2f} -> {q['batch']['e2e']:.2f} s\n"
          f"- the whole run: {f['seconds']:.1f} / {q['seconds']:.1f} s, {f['tokens_per_s']:.0f} / "
          f"{q['tokens_per_s']:.0f} tokens/s (the same answers in another order, and under `priority` "
          f"{q['preemptions']:.0f} preemptions a run: a batch request's prompt and output prefilled again when "
          f"it returns); answers equal: {'yes' if res['same_answers'] else 'NO'}\n")
    write_results("priority", {"machine": machine_info(), "args": vars(args), "results": res}, md,
                  out_dir=args.out_dir, plot=lambda path: _plot(res, path))
    log("wrote priority results")


def _plot(res: dict, path: str) -> None:
    """Median time to first token and end to end per class, fcfs vs priority."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [f"{c}\n{k}" for c in CLASSES for k in ("first token", "end to end")]
    x = range(len(labels))
    for shift, p in ((-0.2, "fcfs"), (0.2, "priority")):
        ax.bar([i + shift for i in x], [res[p][c][k] for c in CLASSES for k in ("ttft", "e2e")], width=0.4,
               label=f"--scheduling-policy {p}")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("seconds (median)")
    ax.set_ylim(0, 1.3 * max(res[p][c][k] for p in POLICIES for c in CLASSES for k in ("ttft", "e2e")))
    ax.set_title("priority scheduling, SmolLM2-135M on this CPU")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
