"""Prefix caching on the embedded default target (SmolLM2-135M-Instruct): two-turn conversations.

Each MT-Bench conversation is answered turn by turn, as a chat client does: the second turn's prompt
is the first turn, the target's answer to it and the second question. With prefix caching the
second turn finds the first one's cache rows in its slot and prefills only the new question; every
first turn after the first conversation still shares the chat template's opening. Per decoding
(plain, and a shipped drafter to show its state is cut back right) with prefix caching on and off:
prompt tokens and the share read from the cache, time to first token and the whole turn, τ, and
whether every answer equals the other setting's (T = 0).

Then a system prompt shared by concurrent requests: the conversations' first questions after one
system prompt, arriving one every few engine steps at 8 slots, so that each finds others running
(with prefix caching a request starts from a copy of a running request's rows, or a free slot's).

    python -m bench.prefix_cache [--drafters dspark] [--conversations 8] [--max-tokens 128] [--slots 8]

Batch 1, the conversations one after another, on this machine's CPU; the two settings of a decoding
alternate conversation by conversation, so they share the machine's background load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench.common import (command_line, load_average, log, machine_info, md_table, pyplot, require_shipped,
                          run_arrivals, save_figure, write_results)
from bench.decode import eval_dir

SETTINGS = ("on", "off")
SYSTEM = ("You are the assistant of a small travel agency. Answer in plain English, in at most three short "
          "paragraphs, and never invent prices, dates or opening hours: when a customer asks for one, say that "
          "an agent will confirm it by email. Be friendly but brief. If the question is not about travel, answer "
          "it anyway, as a well-read generalist would, and then offer help with planning a trip. Prefer trains "
          "over flights for trips under six hours, mention visa requirements only when the customer names a "
          "country, and always end with one practical tip the customer can use today.")


def conversations(path: str, n: int) -> list[list[str]]:
    """The first `n` two-turn conversations (user turns) of an eval file."""
    out = []
    with open(path) as f:
        for line in f:
            turns = json.loads(line)["turns"]
            if len(turns) >= 2:
                out.append(turns[:2])
            if len(out) == n:
                break
    return out


def _llm(drafter: str | None, caching: bool, slots: int = 1):
    from specjax.api import LLM
    from specjax.decoding.engine import EngineConfig
    cfg = EngineConfig(max_slots=slots, max_len=1024, policy="plain" if drafter is None else "fixed",
                       slots_buckets=(slots,), max_prefill=256, prefill_batch_buckets=(1,),
                       sampling_variants=("greedy",), prefix_caching=caching)
    return LLM(drafter=drafter, engine_config=cfg)


def _warm(llm) -> None:
    """Run every prefill bucket and the rounds once (random prompts: they share no prefix with a chat)."""
    import numpy as np
    from specjax.api import SamplingParams
    rng = np.random.default_rng(0)
    for n in llm.engine.buckets.prefill:
        llm.generate([rng.integers(100, llm.config.vocab_size, n).tolist()], SamplingParams(temperature=0.0,
                                                                                            max_tokens=8))


def _turn(llm, ids: list[int], max_tokens: int) -> dict:
    """One greedy request: its answer, cached tokens, time to first token and to the end, drafts."""
    from specjax.api import SamplingParams
    req = llm.make_request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    t0 = time.perf_counter()
    llm.engine.run([req], progress=False)
    m = req.metrics
    return {"prompt": len(ids), "cached": m.cached_tokens, "ttft": m.first_token_time - m.start_time,
            "seconds": time.perf_counter() - t0, "tokens": list(req.output_ids), "drafts": m.num_drafts,
            "accepted": m.num_accepted_tokens}


def _staggered(llm, tok, questions: list[str], max_tokens: int, every: int) -> list[dict]:
    """Requests of one system prompt (SYSTEM) and different questions, one arriving every `every` engine
    steps (queued while the slots are busy): each one's prompt length, cached tokens, time to first
    token and answer."""
    from specjax.api import SamplingParams
    from specjax.request_builder import encode_chat
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    reqs = [llm.make_request(encode_chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]),
                             sp) for q in questions]
    run_arrivals(llm.engine, reqs, every)
    return [{"prompt": len(r.prompt_ids), "cached": r.metrics.cached_tokens, "tokens": list(r.output_ids),
             "ttft": r.metrics.first_token_time - r.metrics.start_time} for r in reqs]


def _converse(llms: dict, tok, convs: list[list[str]], max_tokens: int) -> dict[str, list[list[dict]]]:
    """Per setting, per conversation: its two turns, the settings alternating conversation by conversation."""
    from specjax.request_builder import encode_chat
    out: dict[str, list[list[dict]]] = {s: [] for s in llms}
    for i, (q1, q2) in enumerate(convs):
        for s in (SETTINGS if i % 2 == 0 else SETTINGS[::-1]):
            llm = llms[s]
            first = _turn(llm, encode_chat(tok, [{"role": "user", "content": q1}]), max_tokens)
            answer = tok.decode(first["tokens"], skip_special_tokens=True)
            second = _turn(llm, encode_chat(tok, [{"role": "user", "content": q1},
                                                  {"role": "assistant", "content": answer},
                                                  {"role": "user", "content": q2}]), max_tokens)
            out[s].append([first, second])
    return out


def _summary(runs: list[list[dict]], turn: int) -> dict:
    rows = [conv[turn] for conv in runs]
    drafts = sum(r["drafts"] for r in rows)
    return {"prompt_tokens": statistics.mean(r["prompt"] for r in rows),
            "cached_tokens": statistics.mean(r["cached"] for r in rows),
            "ttft_s": statistics.median(r["ttft"] for r in rows),
            "turn_s": statistics.median(r["seconds"] for r in rows),
            "tau": 1 + sum(r["accepted"] for r in rows) / drafts if drafts else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="*", default=["dspark"], help="shipped drafters (plain decoding always runs)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=8, help="slots of the shared-system-prompt run (as many as its "
                    "requests: none waits for a slot, so time to first token is the admission's)")
    ap.add_argument("--every", type=int, default=6, help="engine steps between its requests' arrivals")
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    from specjax import checkpoints, default_target
    require_shipped(args.drafters)
    tok = checkpoints.load_tokenizer(default_target.gguf_path())
    convs = conversations(os.path.join(eval_dir(), "mt-bench.jsonl"), args.conversations)
    load0 = load_average()[0]
    res: dict[str, dict] = {}
    for drafter in [None, *args.drafters]:
        name = drafter or "plain"
        log(f"{name}: building the engines (prefix caching on and off)")
        llms = {s: _llm(drafter, s == "on") for s in SETTINGS}
        for llm in llms.values():
            _warm(llm)
        runs = _converse(llms, tok, convs, args.max_tokens)
        res[name] = {s: {"turns": [_summary(runs[s], t) for t in (0, 1)], "runs": runs[s]} for s in SETTINGS}
        same = [[t["tokens"] for t in c] for c in runs["on"]] == [[t["tokens"] for t in c] for c in runs["off"]]
        res[name]["same_answers"] = same
        on, off = (res[name][s]["turns"][1] for s in SETTINGS)
        log(f"  second turns: ttft {off['ttft_s'] * 1e3:.0f} -> {on['ttft_s'] * 1e3:.0f} ms, "
            f"{on['cached_tokens']:.0f} of {on['prompt_tokens']:.0f} prompt tokens cached, same answers {same}")
        del llms
    res["shared system prompt"] = _shared_system(tok, [c[0] for c in convs], args)
    _report(args, argv, res, len(convs), load0)


def _shared_system(tok, questions: list[str], args) -> dict:
    """Plain decoding of requests sharing SYSTEM, arriving while others run (`--slots`), caching on and off
    (run on, off, off, on: each figure is the mean of its two runs' medians)."""
    log(f"shared system prompt: {len(questions)} requests, {args.slots} slots, one every {args.every} steps")
    llms = {s: _llm(None, s == "on", slots=args.slots) for s in SETTINGS}
    for llm in llms.values():
        _warm(llm)
    runs: dict[str, list[list[dict]]] = {s: [] for s in SETTINGS}
    copies = 0
    for s in ("on", "off", "off", "on"):
        llms[s].reset_prefix_cache()  # no slot holds a record of the run before
        before = llms[s].engine.stats["prefix_copies"]
        runs[s].append(_staggered(llms[s], tok, questions, args.max_tokens, args.every))
        copies += llms[s].engine.stats["prefix_copies"] - before
    out = {s: {"ttft_s": statistics.mean(statistics.median(r["ttft"] for r in run) for run in runs[s]),
               "cached_tokens": statistics.mean(r["cached"] for r in runs[s][0]),
               "prompt_tokens": statistics.mean(r["prompt"] for r in runs[s][0])} for s in SETTINGS}
    out["copies_per_run"], out["slots"] = copies / 2, args.slots
    out["same_answers"] = all([r["tokens"] for r in run] == [r["tokens"] for r in runs["off"][0]]
                              for s in SETTINGS for run in runs[s])
    log(f"  ttft {out['off']['ttft_s'] * 1e3:.0f} -> {out['on']['ttft_s'] * 1e3:.0f} ms, {out['copies_per_run']:.1f} "
        f"copies a run, same answers {out['same_answers']}")
    return out


def _report(args, argv, res: dict, n: int, load0: float) -> None:
    shared = res.pop("shared system prompt")
    rows = []
    for name, r in res.items():
        for t, label in ((0, "first"), (1, "second")):
            on, off = r["on"]["turns"][t], r["off"]["turns"][t]
            tau = "" if on["tau"] is None else f"{off['tau']:.2f} / {on['tau']:.2f}"
            rows.append([name, label, f"{on['prompt_tokens']:.0f}", f"{on['cached_tokens']:.0f}",
                         f"{off['ttft_s'] * 1e3:.0f} / {on['ttft_s'] * 1e3:.0f}",
                         f"{off['ttft_s'] / on['ttft_s']:.2f}x", f"{off['turn_s']:.2f} / {on['turn_s']:.2f}", tau,
                         "yes" if r["same_answers"] else "NO"])
    md = (f"# Prefix caching: two-turn conversations\n\n"
          f"Command: `{command_line('bench.prefix_cache', argv)}`\n\n"
          f"{n} MT-Bench conversations (../shared/data/eval/mt-bench.jsonl) answered turn by turn through the "
          f"chat template, each turn's answer in the next turn's prompt; greedy, at most {args.max_tokens} tokens "
          f"a turn, batch 1 (one slot), SmolLM2-135M-Instruct on this CPU (load {load0:.1f} at the start), prefill "
          f"buckets 16-256. Prefix caching off / on for each figure (medians over the conversations; cached: "
          f"mean prompt tokens read from the slot's rows, usage.prompt_tokens_details.cached_tokens). A first "
          f"turn shares only the chat template's opening with the conversation before it.\n\n"
          + md_table(["decoding", "turn", "prompt tokens", "cached (on)", "time to first token, ms (off / on)",
                      "TTFT speedup", "whole turn, s (off / on)", "τ (off / on)", "answers equal"],
                     rows, "llrrrrrrl") + "\n")
    for name, r in res.items():
        on, off = r["on"]["turns"][1], r["off"]["turns"][1]
        md += (f"- {name}: second turns read {on['cached_tokens'] / on['prompt_tokens']:.0%} of their prompt from the "
               f"cache; time to first token {off['ttft_s'] * 1e3:.0f} -> {on['ttft_s'] * 1e3:.0f} ms "
               f"({off['ttft_s'] / on['ttft_s']:.1f}x)\n")
    md += _shared_md(args, shared)
    clean = {k: {s: (v[s] if s == "same_answers" else {"turns": v[s]["turns"]}) for s in v} for k, v in res.items()}
    write_results("prefix_cache", {"machine": machine_info(), "max_tokens": args.max_tokens, "conversations": n,
                                   "runs": clean, "shared_system_prompt": shared}, md, out_dir=args.out_dir,
                  plot=lambda path: _plot(res, shared, path))
    log("wrote prefix_cache results")


def _shared_md(args, shared: dict) -> str:
    on, off = shared["on"], shared["off"]
    return (f"\n**A system prompt shared by concurrent requests.** The first turns of the same conversations, "
            f"each after one system prompt ({on['prompt_tokens']:.0f} prompt tokens on average), plain decoding, "
            f"greedy, at most {args.max_tokens} tokens, {args.slots} slots; a request arrives every {args.every} "
            f"engine steps, so each finds others running (and none waits for a slot): with prefix caching such a "
            f"request starts from a copy of a "
            f"running request's rows ({shared['copies_per_run']:.1f} copies a run) or reuses a free slot's. Runs "
            f"on, off, off, on, each starting with no slot's rows kept; the median of each run, averaged per setting.\n\n"
            + md_table(["prompt tokens", "cached (on)", "time to first token, ms (off / on)", "TTFT speedup",
                        "answers equal"],
                       [[f"{on['prompt_tokens']:.0f}", f"{on['cached_tokens']:.0f}",
                         f"{off['ttft_s'] * 1e3:.0f} / {on['ttft_s'] * 1e3:.0f}",
                         f"{off['ttft_s'] / on['ttft_s']:.2f}x", "yes" if shared["same_answers"] else "NO"]]) + "\n")


def _plot(res: dict, shared: dict, path: str) -> None:
    """Time to first token, caching off and on: first and second turns per decoding, then the shared
    system prompt's requests."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels, off, on = [], [], []
    for name, r in res.items():
        for t, turn in ((0, "1st"), (1, "2nd")):
            labels.append(f"{name}\n{turn} turn")
            off.append(r["off"]["turns"][t]["ttft_s"] * 1e3)
            on.append(r["on"]["turns"][t]["ttft_s"] * 1e3)
    labels.append(f"shared system\nprompt, {shared['slots']} slots")
    off.append(shared["off"]["ttft_s"] * 1e3)
    on.append(shared["on"]["ttft_s"] * 1e3)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], off, width=0.4, label="prefix caching off")
    ax.bar([i + 0.2 for i in x], on, width=0.4, label="prefix caching on")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("time to first token, ms (median)")
    ax.set_title("prefix caching, SmolLM2-135M on this CPU")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
