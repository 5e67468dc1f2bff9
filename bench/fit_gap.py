"""Where the shipped drafters' acceptance is lost: prompts they trained on, held-out ShareGPT, Table 1's sets.

    python -m bench.fit_gap [--work-dir runs/embedded] [--drafters dspark mtp1] [--own 40] [--cap 8]
                            [--max-tokens 64] [--temperature 0] [--eval-dir runs/fit_gap] [--out-dir bench/results]

A drafter whose τ is high on the prompts whose regenerated answers it was trained on but low on
held-out ones has overfit its data (more answers would help); one that is as low on its own
training prompts as elsewhere has not fit them yet (more training compute would help); a drop from
held-out ShareGPT to Table 1's sets is a shift of domain. One evaluation (Table 1's protocol: fixed
verification, per-prompt seeds) runs each drafter on `--own` prompts of the build's training rows
(`<work-dir>/regen.jsonl`, the answers the feature cache holds), `--own` of its held-out split
(`<work-dir>/sharegpt/heldout.jsonl`) and `--cap` of each Table-1 set. Per set: τ with a 95%
bootstrap interval over its prompts, and the first draft token's acceptance.

Needs the build's work dir (`make embedded`, or its data stages: `python -m train.build_embedded
--stages prepare regenerate cache vocab --out-dir runs/embedded/out`). Not part of `make bench`;
`python -m bench.run_all --section fit_gap` adds its section. Writes fit_gap.json, .md and .png.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from bench.common import DEFAULT_OUT_DIR, command_line, load_average, log, machine_info, md_table, write_results
from bench.embedded import EVAL_SETS, _eval_paths
from bench.gamma_gain import fmt_ci, plot_intervals

OWN, HELDOUT = "trained", "heldout"
DATA_BUILD = "python -m train.build_embedded --stages prepare regenerate cache vocab --out-dir runs/embedded/out"


def write_own_sets(work_dir: str, out_dir: str) -> tuple[str, str]:
    """`{"turns": [prompt]}` files of the build's trained prompts (in regen.jsonl order, rows with
    a user turn) and of its held-out split, under `out_dir`; returns their paths."""
    regen = os.path.join(work_dir, "regen.jsonl")
    heldout = os.path.join(work_dir, "sharegpt", "heldout.jsonl")
    for p in (regen, heldout):
        if not os.path.isfile(p):
            raise SystemExit(f"--work-dir: {p} not found; build the data with `{DATA_BUILD}`")
    os.makedirs(out_dir, exist_ok=True)
    own = os.path.join(out_dir, f"{OWN}.jsonl")
    with open(regen, encoding="utf-8") as f, open(own + ".tmp", "w", encoding="utf-8") as g:
        for line in f:
            if not line.strip():
                continue
            conv = json.loads(line).get("conversations") or []
            user = next((t["content"] for t in conv if t.get("role") == "user"), None)
            if user:
                g.write(json.dumps({"turns": [user]}) + "\n")
    os.replace(own + ".tmp", own)
    held = os.path.join(out_dir, f"{HELDOUT}.jsonl")
    with open(heldout, encoding="utf-8") as f, open(held + ".tmp", "w", encoding="utf-8") as g:
        for line in f:
            if line.strip():
                g.write(json.dumps({"turns": json.loads(line)["turns"]}) + "\n")
    os.replace(held + ".tmp", held)
    return own, held


def set_statistics(results: dict[str, Any], drafter: str, *, replicates: int = 4000) -> dict[str, Any]:
    """Per evaluated set: τ with its bootstrap interval over that set's prompts, and the first
    draft token's acceptance."""
    from specjax.eval.metrics import paired_tau_bootstrap

    out = {}
    for name, entry in results["drafters"][drafter]["datasets"].items():
        parts = {drafter: {k: (int(v[0]), int(v[1])) for k, v in entry["requests"].items()}}
        out[name] = {"tau": paired_tau_bootstrap(parts, lambda t: t[drafter], replicates=replicates),
                     "first_token_accept": entry["accept_rate"][0]}
    return out


def verdict(s: dict[str, Any]) -> str:
    """'overfit' when the trained prompts' τ interval lies above the held-out one's, 'domain shift'
    when held-out ShareGPT lies above every Table-1 set, else 'not fit yet' (its own prompts no
    better than new ones)."""
    own, held = s[OWN]["tau"], s[HELDOUT]["tau"]
    table = [s[n]["tau"] for n in EVAL_SETS if n in s]
    if own["lo"] > held["hi"]:
        return "overfit"
    if table and all(held["lo"] > t["hi"] for t in table):
        return "domain shift"
    return "not fit yet"


def report(stats: dict[str, dict[str, Any]], args: argparse.Namespace, argv: list[str] | None) -> str:
    sets = [OWN, HELDOUT, *[n for n in EVAL_SETS if n in next(iter(stats.values()))]]
    rows = [[d, *(f"{fmt_ci(s[n]['tau'], 2)} ({s[n]['first_token_accept']:.2f})" for n in sets), verdict(s)]
            for d, s in stats.items()]
    return "\n".join([
        "# Where acceptance is lost: trained prompts, held-out ShareGPT, Table 1's sets",
        "",
        f"Command: `{command_line('bench.fit_gap', argv)}`",
        "",
        f"One evaluation at T={args.temperature:g} (Table 1's protocol: fixed verification at each drafter's "
        f"gamma, {args.max_tokens} new tokens, per-prompt seeds) on {args.own} prompts whose regenerated "
        f"answers the drafters were trained on (`{args.work_dir}/regen.jsonl`; the answers were "
        f"sampled at T=0.2, so greedy continuations may differ from them), {args.own} prompts of the "
        f"build's held-out ShareGPT split and {args.cap} of each Table-1 set. Each cell: τ [95% interval, "
        f"bootstrap over that set's prompts] (first draft token's acceptance). Verdict: 'overfit' when "
        "the trained prompts' interval lies above the held-out one's, 'domain shift' when held-out "
        "ShareGPT lies above every Table-1 set, else 'not fit yet'.",
        "",
        md_table(["drafter", *sets, "verdict"], rows, "l" + "r" * len(sets) + "l"),
        "",
        f"Evaluation kept in `{args.eval_dir}` (git-ignored). Machine: {machine_info()['cpu_count']} CPUs; "
        f"load {load_average()[0]:.1f} when written.",
    ])


def kept_evaluation(args: argparse.Namespace) -> dict[str, Any] | None:
    """The evaluation already in `--eval-dir` when it holds the same drafters, temperature, token
    count and prompt counts, else None."""
    path = os.path.join(args.eval_dir, "results.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        done = json.load(f)
    p, sets = done["protocol"], done["datasets"]
    want = {OWN: args.own, HELDOUT: args.own, **{n: args.cap for n in EVAL_SETS}}
    if (sorted(done["drafters"]) == sorted(os.path.basename(os.path.normpath(d)) for d in args.drafters) and p["temperature"] == args.temperature
            and p["max_new_tokens"] == args.max_tokens and set(sets) == set(want)
            and all(sets[n]["evaluated"] == min(want[n], sets[n]["rows"]) for n in want)):
        log(f"reusing {path}")
        return done
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", default=os.path.join("runs", "embedded"), help="the embedded build's work dir")
    ap.add_argument("--drafters", nargs="+", default=["dspark", "mtp1"], help="shipped drafter names or drafter directories")
    ap.add_argument("--own", type=int, default=40, help="trained and held-out prompts evaluated")
    ap.add_argument("--cap", type=int, default=8, help="prompts per Table-1 set")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--replicates", type=int, default=4000)
    ap.add_argument("--eval-dir", default=os.path.join("runs", "fit_gap"))
    ap.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    args = ap.parse_args(argv)
    from specjax.eval.evaluate import EvalSettings, run_evaluation

    own, held = write_own_sets(args.work_dir, os.path.join(args.eval_dir, "prompts"))
    res = kept_evaluation(args)
    if res is None:
        log(f"evaluating {', '.join(args.drafters)} (load {load_average()[0]:.1f})")
        res = run_evaluation(None, args.drafters, [own, held, *_eval_paths()], args.eval_dir, cap=args.cap,
                             caps={OWN: args.own, HELDOUT: args.own}, max_num_seqs=8, progress=False,
                             settings=EvalSettings(temperature=args.temperature, max_new_tokens=args.max_tokens))
    names = [os.path.basename(os.path.normpath(d)) for d in args.drafters]
    stats = {d: set_statistics(res, d, replicates=args.replicates) for d in names}
    for d, s in stats.items():
        log(f"{d}: " + ", ".join(f"{n} {v['tau']['value']:.3f}" for n, v in s.items()) + f" -> {verdict(s)}")
    md = report(stats, args, argv)

    def plot(path: str) -> None:
        sets = list(next(iter(stats.values())))
        groups = {n: {d: s[n]["tau"] for d, s in stats.items()} for n in sets}
        plot_intervals(path, groups, ylabel="τ (95% interval over prompts)",
                       title=f"Shipped drafters by prompt set (T={args.temperature:g})")

    result = {"command": command_line("bench.fit_gap", argv), "statistics": stats, "temperature": args.temperature,
              "own": args.own, "cap": args.cap, "max_tokens": args.max_tokens, "machine": machine_info()}
    for p in write_results("fit_gap", result, md, out_dir=args.out_dir, plot=plot):
        log(f"wrote {p}")


if __name__ == "__main__":
    main()
