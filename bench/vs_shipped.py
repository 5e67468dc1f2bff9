"""A variant of the shipped DSpark against the shipped one: paired Table-1 evaluation and report.

The experiments `bench.norm_init`, `bench.layer_init`, `bench.steps_gain`, `bench.lr_gain` and
`bench.decay_gain` each train one change of configs/embedded/dspark.yaml on the shipped build's data
(`Variant.build`) and compare it here with the shipped DSpark: both drafters evaluated at each
temperature in one `run_evaluation` on the same prompts (Table 1's protocol, `bench.embedded.table1`),
and a paired bootstrap over prompts gives 95% intervals of each τ and of their ratio. `Variant` holds what differs between them (names, texts, default paths);
`Variant.main` is a whole experiment program.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from typing import Any, Callable, Sequence

from bench.common import command_line, load_average, log, machine_info, md_table, write_results
from bench.embedded import EVAL_SETS
from bench.gamma_gain import add_comparison_arguments, evaluate_kept, fmt_ci, plot_intervals, tau_parts

SHIPPED = "dspark"


def comparison(results: dict[str, Any], new: str, *, replicates: int = 4000) -> dict[str, Any]:
    """Paired-bootstrap intervals over prompts of the shipped DSpark's τ, `new`'s τ and their
    ratio (new / shipped) from one evaluation holding both, plus each first-token acceptance and
    Table 1's macro τ."""
    from specjax.eval.metrics import paired_tau_bootstrap

    names = (SHIPPED, new)
    parts = {n: tau_parts(results, n) for n in names}

    def boot(stat):
        return paired_tau_bootstrap(parts, stat, replicates=replicates)

    return {"tau": {n: boot(lambda t, n=n: t[n]) for n in names},
            "ratio": boot(lambda t: t[new] / t[SHIPPED]),
            "first_token_accept": {n: results["drafters"][n]["overall"]["accept_rate"][0] for n in names},
            "macro": {n: results["drafters"][n]["macro"] for n in names}}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One experiment against the shipped DSpark. `name`: the bench module and results name
    (`python -m bench.<name>`); `drafter`: the variant's config name (configs/embedded/<drafter>.yaml)
    and its default export directory; `change`: what its config changes (for messages);
    `drafter_text` follows the build command in the section; the labels head the τ columns."""

    name: str
    drafter: str
    change: str
    title: str
    drafter_text: str
    shipped_label: str
    new_label: str
    plot_title: str

    @property
    def build(self) -> str:
        """The command that trains the variant (configs/embedded/<drafter>.yaml) on the shipped build's data."""
        return ("python -m train.build_embedded --stages prepare regenerate cache vocab train "
                f"--drafters {self.drafter} --out-dir runs/embedded/out")

    def report(self, stats: dict[str, dict[str, Any]], new: str, args: argparse.Namespace,
               argv: Sequence[str] | None, extra: list[str] | None = None) -> str:
        """This experiment's Markdown section: per temperature both τ, the ratio with its interval,
        and whether the interval shows the variant better (its lower end above 1), not (it holds 1)
        or worse (its upper end below 1); `extra` lines follow the table."""
        rows = [[t, fmt_ci(s["tau"][SHIPPED]), fmt_ci(s["tau"][new]), fmt_ci(s["ratio"]),
                 f"{s['first_token_accept'][SHIPPED]:.3f} / {s['first_token_accept'][new]:.3f}",
                 f"{s['macro'][SHIPPED]:.3f} / {s['macro'][new]:.3f}",
                 "yes" if s["ratio"]["lo"] > 1 else "no" if s["ratio"]["hi"] >= 1 else "worse"]
                for t, s in stats.items()]
        n = next(iter(stats.values()))["ratio"]["requests"]
        return "\n".join([
            f"# {self.title}",
            "",
            f"Command: `{command_line(f'bench.{self.name}', argv)}`",
            "",
            f"Drafter: `{self.build}`. {self.drafter_text} Table 1's protocol ({args.cap} prompts from each of "
            f"{', '.join(EVAL_SETS)}: {n} prompts, {args.max_tokens} new tokens, fixed verification at gamma 7, "
            "per-prompt seeds), both drafters in one evaluation per temperature. τ pooled over the prompts, value "
            f"[95% interval] from a paired bootstrap over prompts ({args.replicates} replicates); macro: Table 1's "
            "mean of per-set τ.",
            "",
            md_table(["T", f"τ shipped ({self.shipped_label})", f"τ {new} ({self.new_label})", "ratio",
                      "P(first token accepted)", "macro τ", "better shown"], rows, "r" * 6 + "l"),
            *(extra or [""]),
            f"Evaluations kept in `{args.eval_dir}/eval_T*` (git-ignored). Machine: {machine_info()['cpu_count']} "
            f"CPUs; load {load_average()[0]:.1f} when written.",
        ])

    def compare(self, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
        """Check `args.drafter` (it must exist, and its name must differ from the shipped one) and
        compare it with the shipped DSpark at each temperature. Returns (its name, {temperature:
        `comparison`})."""
        new = os.path.basename(os.path.normpath(args.drafter))
        if not os.path.isfile(os.path.join(args.drafter, "config.json")):
            raise SystemExit(f"--drafter: no drafter at {args.drafter}; build it (configs/embedded/"
                             f"{self.drafter}.yaml, {self.change}) with `{self.build}`)")
        if new == SHIPPED:
            raise SystemExit(f"--drafter: its directory name must differ from {SHIPPED!r} (results are keyed by it)")
        stats: dict[str, Any] = {}
        for temp in args.temperatures:
            res = evaluate_kept([SHIPPED, args.drafter], temp, args.cap, args.max_tokens,
                                os.path.join(args.eval_dir, f"eval_T{temp:g}"))
            stats[f"{temp:g}"] = comparison(res, new, replicates=args.replicates)
            log(f"T={temp:g}: ratio {fmt_ci(stats[f'{temp:g}']['ratio'])}")
        return new, stats

    def plot(self, path: str, stats: dict[str, Any], new: str) -> None:
        """Both drafters' τ intervals, one cluster per temperature."""
        groups = {f"T = {t}": {n: s["tau"][n] for n in (SHIPPED, new)} for t, s in stats.items()}
        plot_intervals(path, groups, ylabel="τ (95% interval over prompts)", title=self.plot_title)

    def main(self, argv: Sequence[str] | None = None, *, doc: str = "",
             add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
             measure: Callable[[argparse.Namespace, str], tuple[dict[str, Any], list[str]]] | None = None) -> None:
        """Parse `argv`, compare the variant with the shipped DSpark and write <name>.json, .md and
        .png. `add_arguments` adds an experiment's own flags; `measure(args, new)` returns its own
        result fields and the lines it adds to the section."""
        ap = argparse.ArgumentParser(description=doc.split("\n\n")[0] or self.title)
        ap.add_argument("--drafter", default=os.path.join("runs", "embedded", "exports", self.drafter),
                        help=f"the DSpark trained with {self.change} (a directory or a link to one)")
        if add_arguments is not None:
            add_arguments(ap)
        add_comparison_arguments(ap, os.path.join("runs", self.name))
        args = ap.parse_args(argv)
        new, stats = self.compare(args)
        fields, lines = measure(args, new) if measure is not None else ({}, None)
        md = self.report(stats, new, args, argv, lines)
        result = {"command": command_line(f"bench.{self.name}", argv), "drafter": args.drafter, "cap": args.cap,
                  "max_tokens": args.max_tokens, "statistics": stats, **fields, "machine": machine_info()}
        plot = functools.partial(self.plot, stats=stats, new=new)
        for p in write_results(self.name, result, md, out_dir=args.out_dir, plot=plot):
            log(f"wrote {p}")


__all__ = ["SHIPPED", "Variant", "comparison"]
