"""Benchmark what a draft vocabulary buys: the drafter's vocabulary-sized work at V vs N tokens.

    python -m bench.draft_vocab [--sizes 0 32000 16384 8192] [--batches 1 16] [--gamma 7]
        [--counts-from references.jsonl --tokenizer TOKENIZER [--max-rows 2000]] [--out-dir bench/results]

Shapes are SmolLM2-135M-Instruct's (hidden 576, vocab 49152, 9/3 heads of 64, MLP 1536); weights
are random (latency does not depend on them). For each draft vocabulary size N (0 = the full V),
timed round-robin so that every size shares the background load:

* `lm_head`: one jitted [B*gamma, 576] x [576, N] matmul (the block drafter's U = lm_head(h) for
  a whole block), in the tied-embedding layout the frozen copy uses ([H, N] kernel);
* `propose`: one jitted `propose` of a one-layer DSpark drafter (Markov head of rank 256,
  confidence head) over a committed context of `--context` tokens: the whole proposal including
  the N-wide Markov head, left-to-right sampling over N and the scatter of q back to V.

With `--counts-from` (a JSONL of {"conversations": [...]} rows, e.g. the `references.jsonl` of
`train.prepare_sharegpt`), the assistant tokens of the first `--max-rows` rows are tokenized with
`--tokenizer`; the N most frequent ids of the first 80% of those rows form the subset, and its
coverage (share of tokens inside it) is reported on the other 20%, rows it was not built from.

Writes draft_vocab.json, draft_vocab.md and draft_vocab.png to the output directory.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable

import numpy as np

from bench.common import (command_line, log, machine_info, md_table, pyplot, save_figure, time_interleaved,
                          write_results)

H, V, HEADS, KV_HEADS, HEAD_DIM, MLP = 576, 49152, 9, 3, 64, 1536


def lm_head_call(n: int, rows: int) -> Callable[[], Any]:
    import jax
    import jax.numpy as jnp

    k = jax.random.key(n + rows)
    h = jax.random.normal(k, (rows, H), jnp.float32)
    w = 0.02 * jax.random.normal(jax.random.fold_in(k, 1), (H, n), jnp.float32)
    f = jax.jit(lambda h, w: jnp.dot(h, w))
    return lambda: f(h, w)


def propose_call(n: int, batch: int, gamma: int, context: int) -> Callable[[], Any]:
    """One jitted DSpark proposal over a random committed context (draft vocabulary of n; 0 = V)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from specjax.sampling import SamplingArrays
    from specjax.drafters.base import ContextUpdate
    from specjax.drafters.dspark import BlockDrafterConfig
    from specjax.drafters.dspark import DSparkDrafter

    cfg = BlockDrafterConfig(vocab_size=V, hidden_size=H, intermediate_size=MLP,
                             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                             head_dim=HEAD_DIM, target_layer_ids=(1, 14, 27), mask_token_id=V - 1,
                             num_draft_layers=1, block_size=gamma, markov_rank=256,
                             confidence_head=True, draft_vocab_size=n, rope_theta=1e5)
    d = DSparkDrafter(cfg, rngs=nnx.Rngs(0))
    if n:
        d.draft_vocab.set_ids(np.sort(np.random.default_rng(n).choice(V, n, replace=False)))
    rng = np.random.default_rng(1)
    upd = ContextUpdate(tokens=jnp.asarray(rng.integers(0, V, (batch, context)), jnp.int32),
                        positions=jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (batch, context)),
                        taps=jnp.asarray(rng.normal(size=(batch, context, 3 * H)), jnp.float32),
                        hidden=None, n_valid=jnp.full((batch,), context, jnp.int32))
    graph, params = nnx.split(d)
    state = jax.jit(lambda p, s, u: nnx.merge(graph, p).commit(s, u))(
        params, d.init_state(batch, context + gamma + 1), upd)
    sa = SamplingArrays.broadcast(batch, temperature=1.0)
    keys = jax.random.split(jax.random.key(7), batch)
    anchor = jnp.asarray(rng.integers(0, V, (batch,)), jnp.int32)
    pos = jnp.full((batch,), context, jnp.int32)

    @jax.jit
    def run(p, s, anchor, pos, sa, keys):
        blk = nnx.merge(graph, p).propose(s, anchor, pos, sa, keys)
        return blk.tokens, blk.q, blk.confidence

    return lambda: run(params, state, anchor, pos, sa, keys)


def coverage_table(path: str, tokenizer_path: str, max_rows: int, sizes: list[int]) -> dict[str, Any]:
    """Held-out coverage of the N most frequent assistant tokens (module docstring)."""
    from specjax import checkpoints
    from specjax.drafters import vocab as dv

    tok = checkpoints.load_tokenizer(tokenizer_path)
    if tok is None:
        raise FileNotFoundError(f"--tokenizer: no tokenizer at {tokenizer_path}")
    per_row: list[list[np.ndarray]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(per_row) >= max_rows:
                break
            if not line.strip():
                continue
            per_row.append([np.asarray(tok.encode(m["content"], add_special_tokens=False))
                            for m in json.loads(line).get("conversations", [])
                            if m.get("role") == "assistant" and m.get("content")])
    cut = int(0.8 * len(per_row))
    build = dv.token_counts((s for r in per_row[:cut] for s in r), V)
    held = dv.token_counts((s for r in per_row[cut:] for s in r), V)
    cov = {str(n): dv.coverage(held, dv.build_draft_vocab(build, n).draft_ids) for n in sizes if n}
    return {"file": os.path.basename(path), "rows": len(per_row), "build_rows": cut,
            "build_tokens": int(build.sum()), "heldout_tokens": int(held.sum()),
            "distinct": int(np.count_nonzero(build)), "coverage": cov}


def markdown(res: dict[str, Any], command: str) -> str:
    m, a = res["machine"], res["settings"]
    label = {0: f"{V} (full)"}
    out = ["# Draft vocabulary: the drafter's vocabulary-sized work at V vs N\n",
           f"Command: `{command}`\n",
           f"- Shapes of SmolLM2-135M-Instruct (hidden {H}, vocab {V}); random weights. `lm_head`: one "
           f"jitted [B x gamma, {H}] x [{H}, N] matmul; `propose`: one jitted proposal of a one-layer DSpark "
           f"drafter (Markov rank 256, confidence head, gamma {a['gamma']}, context {a['context']}) including "
           f"sampling over N and the scatter of q back to V. Median of {a['repeats']} round-robin repeats.",
           f"- Machine: {m['cpu_count']} CPUs, jax {m['versions'].get('jax')}; load average "
           f"{m['load_average'][0]} at the end (shared machine: ratios are steadier than absolute times).\n"]
    cov = res.get("coverage")
    head = ["batch", "N", "lm_head ms", "vs full", "propose ms", "vs full"]
    if cov:
        head.append("coverage")
    rows = []
    for r in res["rows"]:
        row = [r["batch"], label.get(r["n"], r["n"]), f"{r['lm_head_ms']:.3f}",
               f"{r['lm_head_speedup']:.2f}x", f"{r['propose_ms']:.2f}", f"{r['propose_speedup']:.2f}x"]
        if cov:
            row.append("100%" if r["n"] == 0 else f"{cov['coverage'][str(r['n'])]:.2%}")
        rows.append(row)
    out.append(md_table(head, rows, align="rlrrrr" + ("r" if cov else "")))
    if cov:
        out.append(f"\nCoverage: the N most frequent ids of the assistant turns of the first "
                   f"{cov['build_rows']} rows of `{cov['file']}` ({cov['build_tokens']:,} tokens, "
                   f"{cov['distinct']:,} distinct ids) form the subset; the column is the share of the "
                   f"{cov['heldout_tokens']:,} assistant tokens of the next {cov['rows'] - cov['build_rows']} "
                   f"rows that fall inside it (original ShareGPT replies, written by `python -m "
                   f"train.prepare_sharegpt --references`; many are not in English, so the target's own "
                   f"regenerated answers, which the drafters train on, are likely more concentrated).")
    out.append("\nThe q handed to verification is zero outside the draft vocabulary, so verification "
               "stays exact (tests/test_draft_vocab.py: engine chi-square at T=1 with a subset, and a "
               "negative control whose q leaks outside the subset).")
    return "\n".join(out) + "\n"


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for b in sorted({r["batch"] for r in res["rows"]}):
        rr = [r for r in res["rows"] if r["batch"] == b]
        ns = [r["n"] or V for r in rr]
        axes[0].plot(ns, [r["lm_head_ms"] for r in rr], "o-", label=f"batch {b}")
        axes[1].plot(ns, [r["propose_ms"] for r in rr], "o-", label=f"batch {b}")
    for ax, t in zip(axes, ("lm_head matmul", "whole DSpark proposal")):
        ax.set_xlabel("draft vocabulary N")
        ax.set_ylabel("ms (median)")
        ax.set_title(t)
        ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[0, 32000, 16384, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--counts-from", default=None, help="JSONL of conversations to measure coverage on")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or .gguf (with --counts-from)")
    p.add_argument("--max-rows", type=int, default=2000)
    p.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = p.parse_args(argv)
    if any(not 0 <= n < V for n in args.sizes):
        p.error(f"--sizes must lie in [0, {V}) (0 = full vocabulary)")
    if args.counts_from and not args.tokenizer:
        p.error("--counts-from needs --tokenizer")
    import jax

    sizes = sorted(set(args.sizes), key=lambda n: n or V, reverse=True)
    rows = []
    for b in args.batches:
        log(f"batch {b}: compiling lm_head and propose for N in {sizes}")
        fns = {}
        for n in sizes:
            fns[("lm_head", n)] = lm_head_call(n or V, b * args.gamma)
            fns[("propose", n)] = propose_call(n, b, args.gamma, args.context)
        named = {f"{k}:{n}": f for (k, n), f in fns.items()}
        t = time_interleaved(named, warmup=2, repeats=args.repeats, inner=3,
                             sync=jax.block_until_ready)
        full_h, full_p = t[f"lm_head:{sizes[0]}"].median, t[f"propose:{sizes[0]}"].median
        for n in sizes:
            lh, pr = t[f"lm_head:{n}"].median, t[f"propose:{n}"].median
            rows.append({"batch": b, "n": n, "lm_head_ms": lh * 1e3, "propose_ms": pr * 1e3,
                         "lm_head_speedup": full_h / lh, "propose_speedup": full_p / pr,
                         "lm_head": t[f"lm_head:{n}"].as_dict(), "propose": t[f"propose:{n}"].as_dict()})
            log(f"batch {b}, N {n or V}: lm_head {lh * 1e3:.3f} ms, propose {pr * 1e3:.2f} ms")
    res = {"rows": rows, "machine": machine_info(),
           "settings": {"sizes": sizes, "batches": args.batches, "gamma": args.gamma,
                        "context": args.context, "repeats": args.repeats}}
    if args.counts_from:
        res["coverage"] = coverage_table(args.counts_from, args.tokenizer, args.max_rows, sizes)
    cmd = command_line("bench.draft_vocab", argv)
    write_results("draft_vocab", res, markdown(res, cmd), out_dir=args.out_dir,
                  plot=lambda path: plot(res, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
