"""The n-gram drafter reading other slots (`NGramDrafter(cross_slot=True)`) on the embedded default target.

Popular questions: MT-Bench first turns, each asked by two users, the second arriving while the first
is answered or after (one request every few engine steps, 4 slots, greedy). The second asker's answer
is the first's, which the first asker's row holds (while it runs, or kept in its freed slot until the
slot is reused); the own-history n-gram drafter sees only its request's text. Per setting: τ, engine
steps, generated tokens per second, and whether every answer equals the other setting's.

    python -m bench.ngram_cross_slot [--questions 6] [--max-tokens 96] [--slots 4] [--every 8]

Runs own, cross, cross, own on this machine's CPU (the settings share its background load); each
figure is the mean of a setting's two runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.common import command_line, load_average, log, machine_info, md_table, pyplot, write_results
from bench.decode import eval_dir
from bench.prefix_cache import conversations

SETTINGS = ("own", "cross")


def arrival_order(n: int) -> list[int]:
    """Each of n questions twice, asked again three arrivals later: 0 1 2 0 3 1 4 2 5 3 4 5 for n = 6."""
    order, seconds = [], []
    for i in range(n):
        order.append(i)
        seconds.append(i)
        if i >= 2:
            order.append(seconds.pop(0))
    return order + seconds


def _llm(model_config, cross: bool, slots: int):
    from specjax.api import LLM
    from specjax.decoding.engine import EngineConfig
    from specjax.drafters.ngram import NGramDrafter
    cfg = EngineConfig(max_slots=slots, max_len=1024, policy="fixed", slots_buckets=(slots,), max_prefill=256,
                       sampling_variants=("greedy",))
    model, config = model_config
    return LLM(target=(model, config), drafter=NGramDrafter(config.vocab_size, gamma=4, cross_slot=cross),
               engine_config=cfg)


def _run(llm, prompts: list[list[int]], max_tokens: int, every: int) -> dict:
    """The requests, one arriving every `every` engine steps: τ, steps, tokens/s, answers."""
    from specjax.api import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    reqs = [llm.make_request(p, sp) for p in prompts]
    engine, waiting, step = llm.engine, list(reqs), 0
    engine.prefixes.forget_all()  # no slot holds the run before's rows
    t0 = time.perf_counter()
    while waiting or engine.has_work():
        if waiting and step % every == 0:
            engine.add_request(waiting.pop(0))
        engine.step()
        step += 1
    seconds = time.perf_counter() - t0
    drafts = sum(r.metrics.num_drafts for r in reqs)
    return {"tau": 1 + sum(r.metrics.num_accepted_tokens for r in reqs) / drafts, "steps": step,
            "tokens_per_s": sum(len(r.output_ids) for r in reqs) / seconds, "seconds": seconds,
            "answers": [list(r.output_ids) for r in reqs]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--every", type=int, default=8, help="engine steps between arrivals")
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    from specjax import checkpoints, default_target
    from specjax.api import encode_chat
    model_config = checkpoints.load_target(default_target.gguf_path())
    tok = checkpoints.load_tokenizer(default_target.gguf_path())
    questions = [c[0] for c in conversations(os.path.join(eval_dir(), "mt-bench.jsonl"), args.questions)]
    order = arrival_order(len(questions))
    prompts = [encode_chat(tok, [{"role": "user", "content": questions[i]}]) for i in order]
    load0 = load_average()[0]
    llms = {s: _llm(model_config, s == "cross", args.slots) for s in SETTINGS}
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for s in ("own", "cross", "cross", "own"):
        runs[s].append(_run(llms[s], prompts, args.max_tokens, args.every))
        r = runs[s][-1]
        log(f"{s}: τ {r['tau']:.2f}, {r['steps']} steps, {r['tokens_per_s']:.1f} tok/s")
    res = {s: {k: statistics.mean(r[k] for r in runs[s]) for k in ("tau", "steps", "tokens_per_s")} for s in SETTINGS}
    res["same_answers"] = all(r["answers"] == runs["own"][0]["answers"] for s in SETTINGS for r in runs[s])
    _report(args, argv, res, order, load0)


def _report(args, argv, res: dict, order: list[int], load0: float) -> None:
    own, cross = res["own"], res["cross"]
    md = (f"# The n-gram drafter reading other slots\n\nCommand: `{command_line('bench.ngram_cross_slot', argv)}`\n\n"
          f"{len(order) // 2} MT-Bench first turns (../shared/data/eval/mt-bench.jsonl), each asked twice (arrival "
          f"order {' '.join(map(str, order))}), one request every {args.every} engine steps, {args.slots} slots, "
          f"greedy, at most {args.max_tokens} tokens, n-gram drafter gamma 4 at fixed verification, "
          f"SmolLM2-135M-Instruct on this CPU (load {load0:.1f} at the start), prefix caching on. own: the "
          f"drafter looks up its request's history; cross: every slot's of the bucket (`cross_slot`). Runs own, "
          f"cross, cross, own; means of each setting's two runs.\n\n"
          + md_table(["drafter lookup", "τ", "engine steps", "tokens/s", "answers equal"],
                     [[s, f"{res[s]['tau']:.2f}", f"{res[s]['steps']:.0f}", f"{res[s]['tokens_per_s']:.1f}",
                       "yes" if res["same_answers"] else "NO"] for s in SETTINGS], "lrrrl")
          + f"\n- cross over own: τ {own['tau']:.2f} -> {cross['tau']:.2f}, steps {own['steps'] / cross['steps']:.2f}x "
            f"fewer, tokens/s {cross['tokens_per_s'] / own['tokens_per_s']:.2f}x\n")
    write_results("ngram_cross_slot", {"machine": machine_info(), "args": vars(args), "order": order, "runs": res}, md,
                  out_dir=args.out_dir, plot=lambda path: _plot(res, path))
    log("wrote ngram_cross_slot results")


def _plot(res: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(6, 2.8))
    for ax, key, label in ((axes[0], "tau", "τ"), (axes[1], "tokens_per_s", "tokens/s")):
        ax.bar(list(SETTINGS), [res[s][key] for s in SETTINGS], color=["tab:gray", "tab:blue"])
        ax.set_ylabel(label)
    fig.suptitle("n-gram drafter: own history vs every slot's (popular questions)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
