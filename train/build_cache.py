"""Build an offline target cache of a target's hidden taps and final hidden states.

Usage: `python -m train.build_cache --target DIR --data X.jsonl --out DIR [--layers=1,9,17]`.

Tokenises the JSONL records (chat `conversations`/`messages` with the target's chat template, or
`prompt`+`completion`, or pre-tokenised `input_ids`+`loss_mask`), runs the frozen target and
stores its hidden taps at `--layers` plus its final-normed hidden state per token (see
`specjax.training.features`). `--estimate` prints the bytes the cache will take and exits without
writing anything. An interrupted build continues where it stopped when rerun.

Multi-host: run the same command on every host with `--coordinator-address HOST:PORT
--num-processes N --process-id I` (or on a TPU pod slice / SLURM with their own settings, see
`specjax.distributed`). Process I caches its contiguous share of the samples in
`<out>/part-I-of-N` (each part resumable on its own); training reads `<out>` with all N parts in
order as one cache (`specjax.training.cache_parts`).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from specjax import distributed as dist
from specjax.config import ConfigError


def _layers(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers must be comma-separated ints, got {text!r}")
    if not ids:
        raise argparse.ArgumentTypeError("--layers must name at least one layer")
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.build_cache",
                                description=__doc__.split("\n")[0],
                                epilog="negative layer ids need the --layers=-1,3 form")
    p.add_argument("--target", required=True, help="target: a Hugging Face directory (Qwen3, Llama, Qwen2)"
                   " or a .gguf file")
    p.add_argument("--data", required=True, action="append", help="JSONL file (repeatable)")
    p.add_argument("--out", required=True, help="cache directory")
    p.add_argument("--layers", type=_layers, default=None,
                   help="target layer ids, e.g. 1,9,17,25,33 (default: evenly spaced 5)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--min-loss-tokens", type=int, default=14)
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-batch-tokens", type=int, default=65536)
    p.add_argument("--dtype", default="bfloat16", help="target dtype (default bfloat16)")
    p.add_argument("--chunk-tokens", type=int, default=64, help="rows per read chunk")
    p.add_argument("--shard-mb", type=int, default=32, help="approximate shard file size (MiB)")
    p.add_argument("--estimate", action="store_true",
                   help="print the bytes the cache needs and exit without writing")
    p.add_argument("--quiet", action="store_true")
    dist.add_distributed_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specjax import checkpoints
    from specjax.drafters.common import default_target_layer_ids
    from specjax.training import features as feat

    try:
        dist.initialize_from_args(args)
        tcfg = checkpoints.read_target_config(args.target)
        layers = args.layers or default_target_layer_ids(tcfg.num_hidden_layers)
        for lid in layers:
            if not -1 <= lid < tcfg.num_hidden_layers:
                raise ConfigError(f"--layers: layer {lid} out of range [-1, "
                                  f"{tcfg.num_hidden_layers}) for {args.target}")
        tok_dir = args.tokenizer or args.target
        tokenizer = checkpoints.load_tokenizer(tok_dir)
        samples = feat.read_jsonl_samples(args.data, tokenizer, max_length=args.max_length,
                                          min_loss_tokens=args.min_loss_tokens,
                                          system_prompt=args.system_prompt)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not samples:
        print("error: no sample left after filtering", file=sys.stderr)
        return 2
    print(json.dumps(_estimate(args, tcfg, layers, samples)), flush=True)
    if args.estimate:
        return 0
    return _cache_part(args, layers, samples, str(tok_dir) if tokenizer is not None else "")


def _estimate(args: argparse.Namespace, tcfg: Any, layers: tuple[int, ...],
              samples: list[tuple[Any, Any]]) -> dict[str, Any]:
    """The sizes the cache of `samples` will take."""
    from specjax.training import features as feat

    n_tok = sum(len(s[0]) for s in samples)
    h, nl = tcfg.hidden_size, len(layers)
    return {
        "num_samples": len(samples), "num_tokens": n_tok, "hidden_size": h,
        "target_layer_ids": list(layers), "bytes_per_token": feat.bytes_per_token(h, nl),
        "data_bytes": feat.estimate_bytes(n_tok, h, nl, len(samples)),
        "stored_bytes": feat.stored_bytes(n_tok, h, nl, len(samples),
                                          chunk_tokens=args.chunk_tokens,
                                          shard_bytes=args.shard_mb * 2**20),
    }


def _cache_part(args: argparse.Namespace, layers: tuple[int, ...],
                samples: list[tuple[Any, Any]], tokenizer_name: str) -> int:
    """Cache this process's contiguous share of `samples` in its part directory."""
    from specjax import checkpoints
    from specjax.training import cache_build
    from specjax.training import features as feat
    from specjax.training.cache_parts import part_dir, part_range

    index, count = dist.process_shard()
    lo, hi = part_range(len(samples), index, count)
    out_dir = part_dir(args.out, index, count)
    if lo == hi:
        print(f"error: {len(samples)} samples leave process {index} of {count} nothing to "
              "cache; run fewer processes", file=sys.stderr)
        return 2
    target, tcfg = checkpoints.load_target(args.target, dtype=args.dtype)
    part = {} if count == 1 else {"part": [index, count], "sample_range": [lo, hi]}
    report = cache_build.build_cache(
        out_dir, target, samples[lo:hi], tap_layers=layers,
        identity=feat.target_identity(args.target, tcfg), tokenizer_name=tokenizer_name,
        batch_size=args.batch_size,
        max_batch_tokens=args.max_batch_tokens, chunk_tokens=args.chunk_tokens,
        shard_bytes=args.shard_mb * 2**20,
        extra_manifest={"source_jsonl_paths": list(args.data), "max_length": args.max_length,
                        "min_loss_tokens": args.min_loss_tokens, **part},
        progress=not args.quiet)
    print(json.dumps({"out": report.path, "complete": report.complete,
                      "samples_written": report.samples_written,
                      "tensor_bytes": feat.stored_tensor_bytes(report.path)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
