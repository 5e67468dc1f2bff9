"""Predicted outputs (OpenAI's `prediction`) on the embedded default target (SmolLM2-135M-Instruct):
code edits, answered plainly and with drafters, without a prediction and with one. The task asks to
rename the function of a HumanEval prompt's code and answer with the code; the prediction is either
the original code (what an editor sends: most of the answer repeats it) or the plain answer itself
(the ceiling: a prediction that is exactly right, e.g. an answer regenerated after a small change).
Per decoding: τ, tokens/s and the speedup over plain decoding, the predicted drafts accepted and
rejected, and whether every output equals plain decoding's (T = 0).

    python -m bench.prediction [--drafters ngram dspark] [--prompts 8] [--max-tokens 160]

Batch 1, the prompts one after another (`bench.embedded`'s engine shape), on this machine's CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re

from bench.common import (batch1_decode, command_line, log, machine_info, md_table, pyplot, require_shipped,
                          save_figure, write_results)
from bench.decode import eval_dir

PLAIN_AGAIN = "plain (again, last)"
PREDICTIONS = ("none", "original code", "the answer")


def edit_tasks(path: str, n: int) -> list[tuple[str, str]]:
    """(instruction, original code as a fenced block) for the first `n` HumanEval prompts: rename
    the code's last function to `solution`."""
    out = []
    with open(path) as f:
        for line in f:
            turn = json.loads(line)["turns"][0]
            code = re.search(r"```python\n(.*?)```", turn, re.S)
            names = re.findall(r"^def (\w+)\(", code.group(1) if code else "", re.M)
            if not names:
                continue
            block = "```python\n" + code.group(1).strip("\n") + "\n```"
            out.append((f"Rename the function `{names[-1]}` to `solution` in this code. Answer with the whole "
                        f"code only.\n\n{block}", block))
            if len(out) == n:
                break
    return out


def _llm(drafter: str | None, max_tokens: int, prompt_len: int, prediction_tokens: int):
    from specjax.api import LLM
    from specjax.decoding.buckets import next_pow2
    from specjax.decoding.engine import EngineConfig
    prefill = next_pow2(prompt_len)
    cfg = EngineConfig(max_slots=1, max_len=prefill + max_tokens + 16, policy="plain" if drafter is None else "fixed",
                       slots_buckets=(1,), prefill_buckets=(prefill,), max_prefill=prefill, prefill_batch_buckets=(1,),
                       sampling_variants=("greedy",), prediction_tokens=0 if drafter is None else prediction_tokens,
                       prefix_caching=False)  # runs repeat the prompts: decoding is timed, not the cache
    return LLM(drafter=drafter, engine_config=cfg)


def _decode(llm, prompts: list[list[int]], predictions: list[str | None], max_tokens: int) -> dict:
    """Greedy batch-1 decoding of `prompts` one after another, each with its prediction."""
    from specjax.api import SamplingParams
    outs, record = batch1_decode(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=max_tokens, prediction=p)
                                                for p in predictions])
    for k in ("accepted_prediction_tokens", "rejected_prediction_tokens"):
        record[k] = sum(o.metrics[k] for o in outs)
    return record


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", default=["ngram", "dspark"], help="ngram or shipped drafters")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    from specjax import checkpoints, default_target
    from specjax.api import SamplingParams
    from specjax.request_builder import encode_chat
    require_shipped(args.drafters)
    tok = checkpoints.load_tokenizer(default_target.gguf_path())
    tasks = edit_tasks(os.path.join(eval_dir(), "humaneval.jsonl"), args.prompts)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q, _ in tasks]
    pred_tokens = max(args.max_tokens, *(len(tok(c, add_special_tokens=False)["input_ids"]) for _, c in tasks))
    res: dict[str, dict] = {}
    log("plain: building the engine")
    llm = _llm(None, args.max_tokens, max(map(len, prompts)), pred_tokens)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4))
    res["plain"] = _decode(llm, prompts, [None] * len(prompts), args.max_tokens)
    answers = [tok.decode(ids, skip_special_tokens=True) for ids in res["plain"]["token_ids"]]
    by_kind = {"none": [None] * len(tasks), "original code": [c for _, c in tasks], "the answer": answers}
    plan = ["plain"]
    for d in args.drafters:
        log(f"{d}: building the engine")
        llm = _llm(d, args.max_tokens, max(map(len, prompts)), pred_tokens)
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4))
        for kind in PREDICTIONS:
            label = f"{d}, prediction: {kind}"
            res[label] = r = _decode(llm, prompts, by_kind[kind], args.max_tokens)
            plan.append(label)
            log(f"  {label}: {r['tokens_per_s']:.1f} tokens/s, τ {r['tau']:.2f}")
        del llm
    llm = _llm(None, args.max_tokens, max(map(len, prompts)), pred_tokens)
    res[PLAIN_AGAIN] = _decode(llm, prompts, [None] * len(prompts), args.max_tokens)
    _report(args, argv, plan + [PLAIN_AGAIN], res, tasks)


def _report(args, argv, plan, res, tasks) -> None:
    base = max(res[k]["tokens_per_s"] for k in ("plain", PLAIN_AGAIN))
    rows = []
    for label in plan:
        r = res[label]
        same = "yes" if r["token_ids"] == res["plain"]["token_ids"] else "NO"
        pred = (f"{r['accepted_prediction_tokens']} / {r['rejected_prediction_tokens']}"
                if r["accepted_prediction_tokens"] + r["rejected_prediction_tokens"] else "")
        rows.append([label, f"{r['tau']:.2f}" if label not in ("plain", PLAIN_AGAIN) else "",
                     f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / base:.2f}x", pred, same, f"{r['load']:.1f}"])
    md = (f"# Predicted outputs: code edits\n\n"
          f"Command: `{command_line('bench.prediction', argv)}`\n\n"
          f"{len(tasks)} HumanEval prompts' code (../shared/data/eval/humaneval.jsonl), each with the instruction to "
          f"rename its function to `solution` and answer with the whole code; greedy, batch 1, at most "
          f"{args.max_tokens} tokens, SmolLM2-135M-Instruct on this CPU, fixed verification (n-gram: gamma 4, "
          f"prompt lookup over the context; DSpark: the shipped drafter, gamma 7). Predictions: *original code* = "
          f"the code block of the prompt (OpenAI's use: the file being edited); *the answer* = plain decoding's "
          f"output (a prediction exactly right: the ceiling). Predicted drafts accepted / rejected: "
          f"usage.completion_tokens_details.\n\n"
          + md_table(["decoding", "τ", "tokens/s", "vs plain (faster of its two runs)",
                      "predicted drafts accepted / rejected", "greedy output = plain", "load"],
                     rows, "lrrrrlr") + "\n")
    for d in args.drafters:
        none = res[f"{d}, prediction: none"]
        for kind in PREDICTIONS[1:]:
            r = res[f"{d}, prediction: {kind}"]
            md += (f"- {d}, prediction {kind}: τ {none['tau']:.2f} -> {r['tau']:.2f}, "
                   f"{r['tokens_per_s'] / base:.2f}x plain ({r['tokens_per_s'] / none['tokens_per_s']:.2f}x "
                   f"{d} without a prediction)\n")
    clean = {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in res.items()}
    write_results("prediction", {"machine": machine_info(), "max_tokens": args.max_tokens,
                                 "instructions": [q for q, _ in tasks], "runs": clean}, md, out_dir=args.out_dir,
                  plot=lambda path: _plot(args.drafters, res, base, path))
    log("wrote prediction results")


def _plot(drafters, res, base, path) -> None:
    """Speed over plain decoding per drafter and prediction."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = range(len(drafters))
    top = 0.0
    for i, kind in enumerate(PREDICTIONS):
        speed = [res[f"{d}, prediction: {kind}"]["tokens_per_s"] / base for d in drafters]
        ax.bar([j + (i - 1) * 0.27 for j in x], speed, width=0.27, label=f"prediction: {kind}")
        top = max(top, *speed)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(list(x), drafters)
    ax.set_ylabel("tokens/s vs plain decoding")
    ax.set_title("code edits, SmolLM2-135M, batch 1, T=0")
    ax.set_ylim(0, top * 1.3)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
