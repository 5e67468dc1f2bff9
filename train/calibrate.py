"""Sequential Temperature Scaling (STS) of a DSpark drafter's confidence head on held-out prompts.

Usage: `python -m train.calibrate --target DIR --drafter DIR --prompts heldout.jsonl [...]`.

Decodes the prompts with every draft position verified (policy fixed; temperature 1.0 by default),
records each round's confidences and accepted prefix, fits one temperature per position in order
(paper §3.2.1; `specjax.scheduling.calibration.fit_sts`), prints the ECE before and after, and saves
`calibration.json` beside the drafter plus its config.json `confidence_temperatures`, which the
engine applies whenever the drafter directory is loaded.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _paths(values: list[str]) -> list[str]:
    return [p for v in values for p in v.split(",") if p.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    from specjax.eval.datasets import EVAL_SEED

    p = argparse.ArgumentParser(prog="python -m train.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="target: a Hugging Face directory (Qwen3, Llama, Qwen2)"
                   " or a .gguf file (default: the embedded target)")
    p.add_argument("--drafter", required=True, help="DSpark drafter directory (calibration is written into it)")
    p.add_argument("--prompts", required=True, action="append",
                   help="held-out prompts JSONL ({turns}/{conversations}/{prompt} rows); repeatable or comma-separated")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
    p.add_argument("--cap", type=int, default=None, help="at most this many prompts per file (seeded shuffle)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=EVAL_SEED + 7, help="sample i uses seed + i")
    p.add_argument("--bins", type=int, default=20, help="ECE bins")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: longest prompt + max new tokens")
    p.add_argument("--max-prefill", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--thinking", choices=("on", "off"), default="off")
    p.add_argument("--dry-run", action="store_true", help="fit and print, write nothing")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    from specjax.config import ConfigError
    from specjax.eval.evaluate import EvalSettings, run_calibration

    try:
        if args.cap is not None and args.cap < 1:
            raise ValueError(f"--cap must be >= 1, got {args.cap}")
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        settings = EvalSettings(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                seed=args.seed, bins=args.bins)
        result, path = run_calibration(
            args.target, args.drafter, _paths(args.prompts), tokenizer_dir=args.tokenizer, settings=settings,
            cap=args.cap, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            max_prefill=args.max_prefill, dtype=args.dtype, save=not args.dry_run, progress=not args.quiet,
            enable_thinking=args.thinking == "on")
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = result.summary()
    print(f"rounds: {s['num_rounds']}   temperatures: " + " ".join(f"{t:.3g}" for t in s["temperatures"]))
    print("position   count   ECE before   ECE after")
    for k, (n, b, a) in enumerate(zip(s["count"], s["ece_before"], s["ece_after"]), 1):
        fb = "-" if b is None else f"{100 * b:.2f}%"
        fa = "-" if a is None else f"{100 * a:.2f}%"
        print(f"{k:8d}  {n:6d}   {fb:>10}   {fa:>9}")
    wb, wa = s["ece_weighted_before"], s["ece_weighted_after"]
    print(f"weighted ECE: {'-' if wb is None else f'{100 * wb:.2f}%'} -> {'-' if wa is None else f'{100 * wa:.2f}%'}")
    print(json.dumps({"calibration": path, **s}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
