"""The shipped drafters' build record (specjax/assets/smollm2/BUILD.json, written by
`make embedded` = `python -m train.build_embedded`) as a benchmark section: wall time per stage, the
data it made, what it shipped and how large, and DSpark's learning curve when its training recorded
one (tau per step on training, held-out and evaluation prompts). Measures nothing itself.

    python -m bench.embedded_build
    python -m bench.embedded_build --curve <work>/train/dspark/logs/learning_curve.jsonl
"""
from __future__ import annotations

import argparse
import json
import os

from bench.common import command_line, md_table, pyplot, write_results


def curve_section(points: list[dict], source: str, command: str, out_dir: str) -> list[str]:
    """The learning-curve subsection (`embedded_build_curve`): tau at T=0 per set and step, the fit
    gap (train - heldout), and a PNG of the curves."""
    if not points:
        raise SystemExit(f"{source}: no learning-curve point")
    names = list(points[0]["sets"])
    gap = "train" in names and "heldout" in names
    rows = [[p["step"], *(f"{p['sets'][n]['tau']:.3f}" for n in names),
             *([f"{p['sets']['train']['tau'] - p['sets']['heldout']['tau']:+.3f}"] if gap else [])] for p in points]
    md = ("# Embedded build: DSpark's learning curve\n\n"
          f"Command: `{command}` (reads `{source}`, written by the build's training of DSpark: "
          "`curve.every` in its config, set by `train.build_embedded --curve-every`)\n\n"
          "tau at T=0 under fixed verification on the target's greedy answers to the first prompts of "
          "each set (`train`: training prompts, `heldout`: held-out ShareGPT prompts, `table1`: Table 1's "
          "evaluation sets), replayed from the drafter's training forward at each step "
          "(`specjax.eval.curve`; equal to the engine's tau: tests/test_train_infer_consistency.py). "
          "Rounds per set: " + ", ".join(f"{n} {points[-1]['sets'][n]['rounds']}" for n in names) + ".\n\n"
          + md_table(["step", *(f"tau {n}" for n in names), *(["fit gap (train - heldout)"] if gap else [])],
                     rows, "r" * (1 + len(names) + gap)))

    def plot(p):
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for n in names:
            ax.plot([q["step"] for q in points], [q["sets"][n]["tau"] for q in points], marker="o", label=n)
        ax.set_xlabel("training step")
        ax.set_ylabel("tau at T=0")
        ax.set_title("DSpark learning curve")
        ax.legend()
        fig.tight_layout()
        fig.savefig(p, dpi=100)
        plt.close(fig)

    return write_results("embedded_build_curve", {"source": source, "points": points}, md, out_dir=out_dir,
                         plot=plot)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", default=None, help="BUILD.json (default: the shipped one)")
    ap.add_argument("--curve", default=None, metavar="JSONL",
                    help="only the learning-curve subsection, from this learning_curve.jsonl (default: the "
                         "shipped DSpark's training.json, when it holds one)")
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    from specjax import default_target
    if args.curve:
        from specjax.io import read_jsonl
        curve_section(read_jsonl(args.curve, objects=True), os.path.relpath(args.curve),
                      command_line("bench.embedded_build", argv), args.out_dir)
        return
    path = args.record or os.path.join(default_target.asset_dir(), "BUILD.json")
    if not os.path.isfile(path):
        raise SystemExit(f"no build record {path}: run `make embedded` first")
    with open(path, encoding="utf-8") as f:
        rec = json.load(f)
    stages = rec["stages"]
    rows = [[name, f"{st['wall_s'] / 60:.1f}", str(st["runs"]), "yes" if st.get("complete") else "no"]
            for name, st in stages.items()]
    total = sum(st["wall_s"] for st in stages.values())
    data = rec.get("data", {})
    read = data.get("sharegpt", {}).get("read", {})
    prompts = data.get("sharegpt", {}).get("prompts", {})
    sizes = rec.get("drafter_bytes", {})
    md = (f"# Embedded build: the shipped drafters of SmolLM2-135M-Instruct\n\n"
          f"Command: `{command_line('bench.embedded_build', argv)}` (reads `{os.path.relpath(path)}`, "
          f"written by `make embedded` = `python -m train.build_embedded`)\n\n"
          f"Machine: {rec.get('machine', {})}. Every stage resumes where it stopped; wall time sums "
          f"its runs.\n\n"
          + md_table(["stage", "wall time (min)", "runs", "complete"], rows, "lrrl")
          + f"\nTotal: {total / 3600:.2f} h (goal: <= 5 h for the whole build).\n\n"
          f"Data: ShareGPT read {read.get('complete', '?')} complete conversations and stopped at "
          f"char {read.get('stop_offset', '?')} ({read.get('stop_reason', '')[:80]}); "
          f"{prompts.get('train', '?')} training and {prompts.get('heldout', '?')} held-out prompts; "
          f"{data.get('regenerated_rows', '?')} answers regenerated by the target "
          f"(errors: {data.get('regen_errors', '?')}); feature cache {data.get('cache_bytes', 0) / 2**20:.0f} MiB; "
          f"draft vocabulary coverage of the training answers {data.get('draft_vocab_coverage', {})}"
          + (f"; the standalone LM also read {data['text_rows']} original ShareGPT replies as text"
             if data.get("text_rows") else "") + ".\n\n"
          + md_table(["drafter", "shipped MiB"], [[k, f"{v / 2**20:.2f}"] for k, v in sizes.items()]
                     + [["all", f"{sum(sizes.values()) / 2**20:.2f}"]], "lr")
          + f"\nBudget: {rec.get('settings', {}).get('budget_mb', 64):g} MiB in all.\n")

    def plot(p):
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = list(stages)
        ax.barh(names, [stages[n]["wall_s"] / 60 for n in names], color="tab:blue")
        ax.invert_yaxis()
        ax.set_xlabel("wall time (min)")
        ax.set_title(f"make embedded: {total / 3600:.2f} h on {rec.get('machine', {}).get('cpu_count', '?')} cores")
        fig.tight_layout()
        fig.savefig(p, dpi=100)
        plt.close(fig)

    write_results("embedded_build", {"record": os.path.relpath(path), "stages": stages, "total_s": total,
                                     "data": data, "drafter_bytes": sizes}, md, out_dir=args.out_dir, plot=plot)
    shipped = os.path.join(os.path.dirname(path), "drafters", "dspark", "training.json")
    if os.path.isfile(shipped):
        with open(shipped, encoding="utf-8") as f:
            points = json.load(f).get("learning_curve")
        if points:
            curve_section(points, os.path.relpath(shipped), command_line("bench.embedded_build", argv), args.out_dir)


if __name__ == "__main__":
    main()
