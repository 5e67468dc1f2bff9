"""The confidence scheduler for every drafter: batch-1 speed on the embedded default target
(SmolLM2-135M-Instruct) of drafters without a confidence head under fixed verification and under
`confidence_async` reading the online acceptance estimate (`decoding.acceptance`), and of DSpark under
`confidence_async` reading its confidence head and reading the estimate instead
(`EngineConfig.confidence_source = "online"`), beside plain decoding.

    python -m bench.online_confidence [--drafters eagle3 dflash] [--speed-per-set 2] [--max-tokens 64]

Bench.embedded's speed prompts and engine shape (the first prompts of Table 1's five sets, one
after another), at T = 0 and T = 1, on this machine's CPU.
"""
from __future__ import annotations

import argparse
import os

from bench.common import (command_line, log, machine_info, md_table, pyplot, require_shipped, save_figure,
                          write_results)
from bench.embedded import PLAIN_AGAIN, _speed_prompts, speed_run


def plan(drafters: list[str]) -> list[tuple[str, str | None, str, str]]:
    """(label, drafter, policy, confidence source) of every run, plain first and again last."""
    runs = [("plain", None, "plain", "drafter")]
    for d in drafters:
        runs += [(f"{d} fixed", d, "fixed", "drafter"), (f"{d} confidence_async (online estimate)", d,
                                                         "confidence_async", "drafter")]
    runs += [("dspark confidence_async (head)", "dspark", "confidence_async", "drafter"),
             ("dspark confidence_async (online estimate)", "dspark", "confidence_async", "online"),
             (PLAIN_AGAIN, None, "plain", "drafter")]
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", default=["eagle3", "dflash"],
                    help="shipped drafters without a confidence head")
    ap.add_argument("--speed-per-set", type=int, default=2, help="prompts per evaluation set")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    require_shipped(args.drafters + ["dspark"])
    prompts = _speed_prompts(args.speed_per_set)
    runs = plan(args.drafters)
    res: dict[tuple[str, float], dict] = {}
    for temp in (0.0, 1.0):
        for label, drafter, policy, source in runs:
            log(f"{label} T={temp:g}")
            res[(label, temp)] = r = speed_run(drafter, policy, prompts, args.max_tokens, temp, source)
            log(f"  {r['tokens_per_s']:.1f} tokens/s, τ {r['tau']:.2f}")
    _report(args, argv, runs, res, len(prompts))


def _report(args, argv, runs, res, n: int) -> None:
    rows = []
    for temp in (0.0, 1.0):
        base = max(res[(k, temp)]["tokens_per_s"] for k in ("plain", PLAIN_AGAIN))
        for label, drafter, _, _ in runs:
            r = res[(label, temp)]
            same = "" if temp else ("yes" if r["token_ids"] == res[("plain", 0.0)]["token_ids"] else "NO")
            rows.append([label, f"{temp:g}", f"{r['tau']:.2f}" if drafter else "", f"{r['tokens_per_s']:.1f}",
                         f"{r['tokens_per_s'] / base:.2f}x", same, f"{r['load']:.1f}"])
    md = (f"# The confidence scheduler for every drafter: the online acceptance estimate\n\n"
          f"Command: `{command_line('bench.online_confidence', argv)}`\n\n"
          f"{n} prompts (the first {args.speed_per_set} of each of Table 1's five sets), batch 1, {args.max_tokens} "
          f"new tokens, SmolLM2-135M-Instruct on this CPU, the shipped drafters. `confidence_async` measures its "
          f"cost table at start-up and reads draft confidences from the drafter's confidence head (DSpark) or, for "
          f"a drafter without one (and for DSpark with `confidence_source: online`), from the online acceptance "
          f"estimate: each request's moving average of what verification accepted at each draft position, "
          f"starting from the engine's. τ counts drafting rounds only (1.00: no round drafted, the scheduler "
          f"judging plain rounds faster from the measured costs).\n\n"
          + md_table(["decoding", "T", "τ", "tokens/s", "vs plain (faster of its two runs)", "greedy output = plain",
                      "load"], rows, "lrrrrlr") + "\n")
    for temp in (0.0, 1.0):
        base = max(res[(k, temp)]["tokens_per_s"] for k in ("plain", PLAIN_AGAIN))
        for d in args.drafters:
            fixed, est = res[(f"{d} fixed", temp)], res[(f"{d} confidence_async (online estimate)", temp)]
            md += (f"- {d} at T={temp:g}: fixed {fixed['tokens_per_s'] / base:.2f}x plain, confidence_async with "
                   f"the estimate {est['tokens_per_s'] / base:.2f}x\n")
        head = res[("dspark confidence_async (head)", temp)]
        est = res[("dspark confidence_async (online estimate)", temp)]
        md += (f"- dspark at T={temp:g}: confidence_async with its head {head['tokens_per_s'] / base:.2f}x plain, "
               f"with the estimate instead {est['tokens_per_s'] / base:.2f}x\n")
    clean = {f"{k[0]}@T{k[1]:g}": {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in res.items()}
    write_results("online_confidence", {"machine": machine_info(), "max_tokens": args.max_tokens,
                                        "drafters": args.drafters, "runs": clean}, md, out_dir=args.out_dir,
                  plot=lambda path: _plot(runs, res, path))
    log("wrote online_confidence results")


def _plot(runs, res, path) -> None:
    """Speed over plain decoding per run, T = 0 and T = 1."""
    plt = pyplot()
    labels = [label for label, drafter, _, _ in runs if drafter]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for off, temp in ((-0.2, 0.0), (0.2, 1.0)):
        base = max(res[(k, temp)]["tokens_per_s"] for k in ("plain", PLAIN_AGAIN))
        ax.barh([i + off for i in range(len(labels))], [res[(lb, temp)]["tokens_per_s"] / base for lb in labels],
                height=0.4, label=f"T={temp:g}")
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yticks(range(len(labels)), [lb.replace(" (", "\n(") for lb in labels], fontsize=7)
    ax.set_xlabel("tokens/s vs plain decoding")
    ax.set_title("SmolLM2-135M, batch 1: fixed vs confidence_async")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
