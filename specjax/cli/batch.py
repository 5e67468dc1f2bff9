"""Offline batch job: JSONL prompts in, JSONL results out (resumable, shardable).

    specjax-batch prompts.jsonl -o results.jsonl --target DIR --drafter ngram --max-tokens 128

See `specjax.serving.batch_job` for the row formats and the resume/shard rules. Prints a JSON
summary on stdout when done.

Multi-host: run the same command on every host with `--coordinator-address HOST:PORT
--num-processes N --process-id I` (or on a TPU pod slice / SLURM with their own settings, see
`specjax.distributed`): process I takes input lines I, I+N, ... and writes
`<output stem>.shard-I-of-N.jsonl`. After a crash, rerun the same command on every host: each
process finishes its own shard. `--shard I/N --distributed off` finishes one shard on any machine.
"""
from __future__ import annotations

import argparse
import json
import sys

from specjax import distributed as dist
from specjax.serving.cli import add_llm_args, add_parser_flags, build_llm


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specjax-batch", description=__doc__.splitlines()[0])
    p.add_argument("input", help="input JSONL (rows: id, prompt or messages, optional sampling fields; or OpenAI "
                   "batch lines: custom_id, url, body)")
    p.add_argument("-o", "--output", required=True, help="output JSONL (a shard suffix is added when sharded)")
    p.add_argument("--errors", default=None, help="errors JSONL (default: <output stem>.errors.jsonl)")
    p.add_argument("--shard", default=None, help="i/n: take input lines with index %% n == i "
                                                 "(default: jax.process_index()/process_count())")
    p.add_argument("--window", type=int, default=None, help="requests in flight (default 2 x max-num-seqs)")
    g = p.add_argument_group("default sampling (a row's own fields win)")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="generate max-tokens past eos (a row's ignore_eos wins)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="each row's usage carries prompt_tokens_details.cached_tokens (prefix caching)")
    add_parser_flags(p)
    add_llm_args(p)
    dist.add_distributed_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specjax.api import SamplingParams
    from specjax.serving.batch_job import Shard, run_batch_job

    try:
        dist.initialize_from_args(args)
        shard = Shard.parse(args.shard) if args.shard else None
        defaults = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  min_p=args.min_p, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = build_llm(args, progress=not args.no_progress)
    summary = run_batch_job(llm, args.input, args.output, errors_path=args.errors, shard=shard, defaults=defaults,
                            window=args.window, progress=not args.no_progress, tool_parser=args.tool_call_parser,
                            prompt_tokens_details=args.enable_prompt_tokens_details,
                            reasoning_parser=args.reasoning_parser)
    print(json.dumps(summary.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
