"""`make demo`: speculative vs plain decoding on held-out prompts, with a report in demo_output/."""
from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--drafter", default="dspark", help="shipped drafter name (dspark, dflash, eagle3, ...) or ngram")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default="demo_output")
    args = ap.parse_args(argv)
    from specjax.demo import run_demo
    run_demo(args.out, drafter=args.drafter, num_prompts=args.prompts, max_tokens=args.max_tokens,
             temperature=args.temperature)


if __name__ == "__main__":
    main()
