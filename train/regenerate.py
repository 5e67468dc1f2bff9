"""Regenerate the assistant turns of a prompts file with the target itself (reference §7.2).

Usage: `python -m train.regenerate --target DIR --prompts prompts.jsonl --out train.jsonl
[--drafter ngram|DIR] [--thinking off|on] [--temperature 0.7 --top-p 0.8 --top-k 20 --max-tokens 4096]`.

Rows: {"turns": [...]}, {"conversations": [{"role", "content"}, ...]} or {"prompt": "..."}; see
`specjax.training.regenerate`. ShareGPT prompts (deduplicated, length-filtered, evaluation
prompts removed, held-out split recorded) come from `python -m train.prepare_sharegpt`. Output rows
are written in input order; failing rows go to `<out stem>.errors.jsonl` with their line and the
reason. Rerun the same command after an interruption (even kill -9) to continue: no row is
duplicated or lost.

Multi-host: run the same command on every host with `--coordinator-address HOST:PORT
--num-processes N --process-id I` (or on a TPU pod slice / SLURM with their own settings, see
`specjax.distributed`): process I regenerates rows I, I+N, ... into `<out stem>.shard-I-of-N.jsonl`
(train on all the shards: `data.train_jsonl` takes a list). `--shard I/N --distributed off`
finishes one shard on any machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from specjax import distributed as dist


def _on_off(text: str) -> bool:
    t = text.strip().lower()
    if t in ("on", "true", "1", "yes"):
        return True
    if t in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def main(argv: Sequence[str] | None = None) -> int:
    from specjax.training.regenerate import QWEN3_DEFAULTS as D

    p = argparse.ArgumentParser(prog="python -m train.regenerate", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target: a Hugging Face directory (Qwen3, Llama, Qwen2)"
                   " or a .gguf file")
    p.add_argument("--prompts", required=True, help="prompts JSONL")
    p.add_argument("--out", required=True, help="output JSONL (appended to when resuming)")
    p.add_argument("--errors", default=None, help="errors JSONL (default <out stem>.errors.jsonl)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
    p.add_argument("--drafter", default=None, help="speculative decoding: 'ngram' or a drafter directory "
                                                    "(default: plain decoding; the output distribution is the same)")
    p.add_argument("--thinking", type=_on_off, default=False, help="chat template enable_thinking (default off)")
    p.add_argument("--temperature", type=float, default=D.temperature)
    p.add_argument("--top-p", type=float, default=D.top_p)
    p.add_argument("--top-k", type=int, default=D.top_k)
    p.add_argument("--max-tokens", type=int, default=D.max_tokens, help="per reply (capped by the context)")
    p.add_argument("--seed", type=int, default=0, help="request seeds derive from it, the row and the turn")
    p.add_argument("--max-num-seqs", type=int, default=8, help="cache slots (requests decoded together)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length per slot (default: the longest request the prompts can make, "
                        "rounded up to 128, at most min(8192, max_position_embeddings))")
    p.add_argument("--max-prefill", type=int, default=512, help="largest prefill chunk")
    p.add_argument("--window", type=int, default=None, help="rows in flight + reorder buffer (default 4 x slots)")
    p.add_argument("--limit", type=int, default=None, help="process at most this many rows in this run")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds for this run from its start (loading and compiling included): "
                        "past them it stops, keeping every row written (rerun to resume)")
    p.add_argument("--dtype", default=None,
                   help="target dtype, float32 or bfloat16 (default: bfloat16 on an accelerator, float32 on CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--shard", default=None, help="i/n: take rows with index %% n == i "
                                                 "(default: jax.process_index()/process_count())")
    dist.add_distributed_args(p)
    args = p.parse_args(argv)
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s

    from specjax import checkpoints
    from specjax.api import LLM, SamplingParams
    from specjax.sampling import sampling_variant
    from specjax.config import ConfigError
    from specjax.jobs import Shard
    from specjax.training.regenerate import data_max_len, default_dtype, regenerate

    try:
        dist.initialize_from_args(args)
        shard = Shard.parse(args.shard) if args.shard else None
        sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens)
        tcfg = checkpoints.read_target_config(args.target)
        max_len = args.max_model_len or data_max_len(
            checkpoints.load_tokenizer(args.tokenizer or args.target), args.prompts, args.max_tokens,
            enable_thinking=args.thinking, limit=min(8192, tcfg.max_position_embeddings))
        if max_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {max_len}")
        if args.budget_s is not None and args.budget_s <= 0:
            raise ValueError(f"--budget-s must be > 0, got {args.budget_s:g}")
        if args.limit is not None and args.limit < 0:
            raise ValueError(f"--limit must be >= 0, got {args.limit}")
        llm = LLM(target=args.target, drafter=args.drafter, tokenizer=args.tokenizer,
                  max_num_seqs=args.max_num_seqs, max_model_len=max_len,
                  max_prefill=min(args.max_prefill, max_len), dtype=args.dtype or default_dtype(), seed=args.seed,
                  progress=not args.quiet,
                  sampling_variants=(sampling_variant(sp.temperature, sp.top_k, sp.top_p),))
        summary = regenerate(llm, args.prompts, args.out, errors_path=args.errors, sampling=sp,
                             enable_thinking=args.thinking, seed=args.seed, window=args.window,
                             limit=args.limit, shard=shard, progress=not args.quiet,
                             deadline=deadline)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
