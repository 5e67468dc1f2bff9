"""Run an experiment: a named variant of a shipped drafter config, against the shipped drafter.

    python -m experiments.run --list
    python -m experiments.run NAME [--stages build compare] [--cap 8] [--max-tokens 64]
                              [--temperatures 0 1] [--replicates 4000] [--out-dir experiments/records]

A variant (`VARIANTS[NAME]`) is a shipped config of configs/embedded (`base`) and a list of
`section.field=value` overrides, read exactly as `train.train_draft --set` reads them
(`specjax.training.config.apply_overrides`). Stages:

* `build`: writes the base config with the overrides applied to runs/experiments/configs/NAME.yaml
  and trains it with `train.build_embedded` on the shipped build's work dir (runs/embedded: its
  prompts, regenerated answers, feature cache and draft vocabulary are reused, the stages already
  done are skipped); the drafter is exported to runs/embedded/exports/NAME.
* `compare`: evaluates the shipped `base` drafter and the variant together, one Table-1 evaluation
  per temperature (`bench.embedded.table1`: the same prompts, per-prompt seeds, fixed verification
  at each drafter's block size), and gives 95% intervals of each τ and of their ratio from a paired
  bootstrap over prompts (`specjax.eval.metrics.paired_tau_bootstrap`). Evaluations are kept in
  runs/experiments/NAME/eval_T* and reused when rerun with the same settings.

Writes NAME.json, .md and .png to `--out-dir`; docs/EXPERIMENTS.md holds the write-ups.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from typing import Any, Sequence

CONFIG_DIR = os.path.join("configs", "embedded")
WORK_DIR = os.path.join("runs", "embedded")
RUNS_DIR = os.path.join("runs", "experiments")
RECORDS_DIR = os.path.join("experiments", "records")
STAGES = ("build", "compare")


@dataclasses.dataclass(frozen=True)
class Variant:
    """`base`: the shipped drafter (configs/embedded/<base>.yaml) it changes and is compared with;
    `sets`: its `section.field=value` overrides; `question`: what the experiment asks."""

    base: str
    sets: tuple[str, ...]
    question: str


_G15 = ("model.block_size=15", "model.num_anchors=32", "model.loss_decay=7.0")
VARIANTS: dict[str, Variant] = {
    "dspark-long": Variant("dspark", ("schedule.total_steps=1440",),
                           "Do three times the optimizer steps on the same answers raise τ?"),
    "dspark-lr3": Variant("dspark", ("optimizer.learning_rate=0.003",),
                          "Does three times the peak learning rate buy the gain of more steps at the shipped budget?"),
    "dspark-decay1": Variant("dspark", ("model.loss_decay=1.0",),
                             "Does weighting the loss toward the first draft slots raise τ?"),
    "dspark-norm": Variant("dspark", ("model.init_norm_from_target=true",),
                           "Does starting the drafter's final norm at the target's raise τ?"),
    "dspark-layer": Variant("dspark", ("model.init_layer_from_target=28", "model.init_norm_from_target=true"),
                            "Does starting the draft layer from target layer 28 raise τ?"),
    "dspark-r256": Variant("dspark", ("model.markov_rank=256",),
                           "Does the reference's Markov rank (256 instead of 32) raise τ?"),
    "dspark-g15": Variant("dspark", _G15, "What τ does DSpark reach at block 15 on the shipped budget?"),
    "dflash-g15": Variant("dflash", _G15, "What τ does DFlash reach at block 15 on the shipped budget?"),
}


def variant_config(name: str, config_dir: str = CONFIG_DIR) -> dict[str, Any]:
    """The training config of variant `name`: its base config with its overrides applied."""
    from specjax.config import read_yaml_mapping
    from specjax.training.config import apply_overrides

    v = VARIANTS[name]
    data = apply_overrides(read_yaml_mapping(os.path.join(config_dir, f"{v.base}.yaml")), v.sets)
    data["name"] = f"experiment_{name}"
    return data


def write_config(name: str, out_dir: str, config_dir: str = CONFIG_DIR) -> str:
    """Write `variant_config(name)` to `out_dir`/<name>.yaml (the build reads configs by name)."""
    import yaml

    v = VARIANTS[name]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# Experiment {name}: configs/embedded/{v.base}.yaml with "
                f"{', '.join(v.sets)} (written by python -m experiments.run {name}).\n")
        yaml.safe_dump(variant_config(name, config_dir), f, sort_keys=False)
    return path


def build_command(name: str, config_dir: str) -> list[str]:
    """The `train.build_embedded` command that trains variant `name` on the shipped build's data."""
    return [sys.executable, "-m", "train.build_embedded", "--stages", "prepare", "regenerate", "cache", "vocab",
            "train", "--drafters", name, "--config-dir", config_dir, "--work-dir", WORK_DIR,
            "--out-dir", os.path.join(RUNS_DIR, name)]


def tau_parts(results: dict[str, Any], drafter: str) -> dict[str, tuple[int, int]]:
    """One drafter's per-prompt (rounds, committed tokens) over every set of an evaluation."""
    merged: dict[str, tuple[int, int]] = {}
    for entry in results["drafters"][drafter]["datasets"].values():
        merged.update({k: (int(v[0]), int(v[1])) for k, v in entry["requests"].items()})
    return merged


def comparison(results: dict[str, Any], base: str, new: str, *, replicates: int = 4000) -> dict[str, Any]:
    """Paired-bootstrap intervals over prompts of `base`'s τ, `new`'s τ and their ratio (new / base)
    from one evaluation holding both, plus each first-token acceptance and Table 1's macro τ."""
    from specjax.eval.metrics import paired_tau_bootstrap

    names = (base, new)
    parts = {n: tau_parts(results, n) for n in names}

    def boot(stat):
        return paired_tau_bootstrap(parts, stat, replicates=replicates)

    return {"tau": {n: boot(lambda t, n=n: t[n]) for n in names},
            "ratio": boot(lambda t: t[new] / t[base]),
            "first_token_accept": {n: results["drafters"][n]["overall"]["accept_rate"][0] for n in names},
            "macro": {n: results["drafters"][n]["macro"] for n in names}}


def evaluate_kept(drafters: list[str], temperature: float, cap: int, max_tokens: int, out: str) -> dict[str, Any]:
    """One Table-1 evaluation of `drafters` at `temperature`, or the one already in `out` with the
    same drafters and settings."""
    from bench.embedded import table1

    path = os.path.join(out, "results.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            done = json.load(f)
        p = done["protocol"]
        if (sorted(done["drafters"]) == sorted(os.path.basename(d) for d in drafters)
                and p["temperature"] == temperature and p["max_new_tokens"] == max_tokens
                and all(d["evaluated"] == min(cap, d["rows"]) for d in done["datasets"].values())):
            return done
    table1(drafters, cap, max_tokens, temperature, out)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def fmt_ci(s: dict[str, float], digits: int = 3) -> str:
    """`value [lo, hi]` of a bootstrap result."""
    return f"{s['value']:.{digits}f} [{s['lo']:.{digits}f}, {s['hi']:.{digits}f}]"


def verdict(ratio: dict[str, float]) -> str:
    """'better' when the ratio's interval lies above 1, 'worse' below 1, else 'no difference shown'."""
    return "better" if ratio["lo"] > 1 else "worse" if ratio["hi"] < 1 else "no difference shown"


def report(name: str, stats: dict[str, dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    """The record's Markdown: per temperature both τ, their ratio with its interval and the verdict."""
    from bench.common import md_table
    from bench.embedded import EVAL_SETS

    v = VARIANTS[name]
    rows = [[t, fmt_ci(s["tau"][v.base]), fmt_ci(s["tau"][name]), fmt_ci(s["ratio"]),
             f"{s['first_token_accept'][v.base]:.3f} / {s['first_token_accept'][name]:.3f}",
             f"{s['macro'][v.base]:.3f} / {s['macro'][name]:.3f}", verdict(s["ratio"])]
            for t, s in stats.items()]
    n = next(iter(stats.values()))["ratio"]["requests"]
    return "\n".join([
        f"# Experiment {name}: {v.question}",
        "",
        f"Command: `{command}`",
        "",
        f"Variant: configs/embedded/{v.base}.yaml with {', '.join(f'`{s}`' for s in v.sets)}, trained on the "
        f"shipped build's data. Table 1's protocol ({args.cap} prompts from each of {', '.join(EVAL_SETS)}: {n} "
        f"prompts, {args.max_tokens} new tokens, fixed verification, per-prompt seeds), both drafters in one "
        "evaluation per temperature. τ pooled over the prompts, value [95% interval] from a paired bootstrap "
        f"over prompts ({args.replicates} replicates); macro: Table 1's mean of per-set τ.",
        "",
        md_table(["T", f"τ {v.base}", f"τ {name}", "ratio", "P(first token accepted)", "macro τ", "verdict"],
                 rows, "r" * 6 + "l"),
    ])


def compare(name: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{temperature: `comparison`} of variant `name` against its shipped base drafter."""
    from bench.common import log

    drafter = os.path.join(WORK_DIR, "exports", name)
    if not os.path.isfile(os.path.join(drafter, "config.json")):
        raise SystemExit(f"{name}: no drafter at {drafter}; build it with `python -m experiments.run {name} "
                         "--stages build`")
    base = VARIANTS[name].base
    stats: dict[str, dict[str, Any]] = {}
    for temp in args.temperatures:
        res = evaluate_kept([base, drafter], temp, args.cap, args.max_tokens,
                            os.path.join(RUNS_DIR, name, f"eval_T{temp:g}"))
        stats[f"{temp:g}"] = comparison(res, base, name, replicates=args.replicates)
        log(f"T={temp:g}: ratio {fmt_ci(stats[f'{temp:g}']['ratio'])}")
    return stats


def plot(path: str, name: str, stats: dict[str, dict[str, Any]]) -> None:
    """Both drafters' τ with their intervals, one cluster per temperature."""
    from bench.common import pyplot

    plt = pyplot()
    base = VARIANTS[name].base
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, (t, s) in enumerate(stats.items()):
        for j, n in enumerate((base, name)):
            r = s["tau"][n]
            ax.errorbar([i * 3 + j], [r["value"]], yerr=[[r["value"] - r["lo"]], [r["hi"] - r["value"]]],
                        fmt="o", capsize=4, color=f"C{j}", label=n if i == 0 else None)
    ax.set_xticks([i * 3 + 0.5 for i in range(len(stats))], [f"T = {t}" for t in stats])
    ax.set_ylabel("τ (95% interval over prompts)")
    ax.set_title(f"{base} (shipped) vs {name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", choices=sorted(VARIANTS), help="the variant to run")
    ap.add_argument("--list", action="store_true", help="list the variants and their overrides")
    ap.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    ap.add_argument("--cap", type=int, default=8, help="prompts per evaluation set (Table 1: 8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--replicates", type=int, default=4000)
    ap.add_argument("--out-dir", default=RECORDS_DIR)
    args = ap.parse_args(argv)
    if args.list or args.name is None:
        for n, v in VARIANTS.items():
            print(f"{n:<14} {v.base:<7} {' '.join(v.sets)}")
        return 0
    name = args.name
    if "build" in args.stages:
        config_dir = os.path.join(RUNS_DIR, "configs")
        write_config(name, config_dir)
        rc = subprocess.run(build_command(name, config_dir)).returncode
        if rc:
            return rc
    if "compare" in args.stages:
        from bench.common import command_line, machine_info, write_results

        stats = compare(name, args)
        command = command_line("experiments.run", argv)
        result = {"command": command, "variant": dataclasses.asdict(VARIANTS[name]), "cap": args.cap,
                  "max_tokens": args.max_tokens, "statistics": stats, "machine": machine_info()}
        for p in write_results(name, result, report(name, stats, args, command), out_dir=args.out_dir,
                               plot=lambda path: plot(path, name, stats)):
            print(f"wrote {p}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
