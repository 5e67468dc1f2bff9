"""Evaluate drafters with the DSpark Table-1 protocol and write a report.

Usage: `specjax-eval --target DIR --drafter a,b,c --data gsm8k.jsonl,mt-bench.jsonl --out DIR` (or
`python -m train.evaluate ...`).

Per drafter and dataset: τ (accepted draft tokens + bonus per round), per-position unconditional and
conditional acceptance, and for confidence heads ECE / AUROC / Brier per position before and after
calibration. Writes results.json, results.md (a Table-1 style table), acceptance_by_position.png
and reliability_<drafter>.png into --out. Datasets: `{"turns": [...]}` files (first turn, chat
template, thinking off) or `{"prompt": "..."}` completion files; the paper's caps apply to known
names (override with --cap). See `specjax.eval.evaluate` for the protocol details.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _list(values: list[str]) -> list[str]:
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


def build_parser() -> argparse.ArgumentParser:
    from specjax.eval.datasets import DEFAULT_MAX_NEW_TOKENS, EVAL_SEED

    p = argparse.ArgumentParser(prog="specjax-eval", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="target: a Hugging Face directory (Qwen3, Llama, Qwen2)"
                   " or a .gguf file (default: the embedded target)")
    p.add_argument("--drafter", required=True, action="append",
                   help="'ngram', a drafter directory, or an embedded drafter name; comma-separated or repeated")
    p.add_argument("--data", required=True, action="append", help="dataset JSONL files; comma-separated or repeated")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
    p.add_argument("--cap", default=None, help="N (every dataset) and/or name=N,... (default: the paper's caps)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=EVAL_SEED, help="sample i uses seed + i")
    p.add_argument("--gamma", type=int, default=None, help="proposal length (default: the drafter's)")
    p.add_argument("--bins", type=int, default=20, help="ECE bins")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")
    p.add_argument("--max-model-len", type=int, default=None, help="default: longest prompt + max new tokens")
    p.add_argument("--max-prefill", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--thinking", choices=("on", "off"), default="off")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from specjax.config import ConfigError
    from specjax.eval.datasets import parse_caps
    from specjax.eval.evaluate import EvalSettings, run_evaluation
    from specjax.eval.report import results_markdown

    try:
        cap, caps = parse_caps(args.cap)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        if args.gamma is not None and args.gamma < 1:
            raise ValueError(f"--gamma must be >= 1, got {args.gamma}")
        settings = EvalSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_new_tokens=args.max_new_tokens, seed=args.seed, bins=args.bins)
        results = run_evaluation(
            args.target, _list(args.drafter), _list(args.data), args.out, tokenizer_dir=args.tokenizer,
            settings=settings, cap=cap, caps=caps, gamma=args.gamma, max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len, max_prefill=args.max_prefill, dtype=args.dtype,
            progress=not args.quiet, enable_thinking=args.thinking == "on")
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(results_markdown(results), end="")
    print(f"wrote {', '.join(results['files'].values())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
