"""Evaluation results as files: the Table-1 style table (results.md), results.json, the plots."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable

import numpy as np

from specjax.eval.datasets import DOMAIN_ORDER, TABLE_ORDER
from specjax.io import write_atomic


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# ---------------------------------------------------------------------------------------------
# tables and files
# ---------------------------------------------------------------------------------------------

def ordered_datasets(names: Iterable[str]) -> list[str]:
    """Datasets in the paper's Table-1 order, then the others in the given order."""
    names = list(names)
    known = [n for n in TABLE_ORDER if n in names]
    return known + [n for n in names if n not in TABLE_ORDER]


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per drafter: tau per dataset, per domain, and the macro average."""
    rows = []
    for name, r in results["drafters"].items():
        row = {"drafter": name}
        for ds in ordered_datasets(r["datasets"]):
            row[ds] = r["datasets"][ds]["tau"]
        for dom in _domains(results):
            row[f"domain:{dom}"] = r["domains"].get(dom, float("nan"))
        row["macro"] = r["macro"]
        rows.append(row)
    return rows


def _domains(results: dict[str, Any]) -> list[str]:
    present = {d["domain"] for d in results["datasets"].values()}
    return [d for d in DOMAIN_ORDER if d in present] + sorted(present - set(DOMAIN_ORDER))


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "–"
    x = float(x)
    return "–" if math.isnan(x) else f"{x:.{digits}f}"


def results_markdown(results: dict[str, Any]) -> str:
    """Table 1 (tau per dataset, domain means, macro) plus per-position acceptance and calibration."""
    dsets = ordered_datasets(results["datasets"])
    doms = _domains(results)
    p = results["protocol"]
    lines = ["# Evaluation (DSpark Table-1 protocol)", "",
             f"Target `{os.path.basename(os.path.normpath(results['target']))}`; temperature {p['temperature']}, "
             f"max new tokens {p['max_new_tokens']}, seed {p['seed']} + sample index, first turn only, thinking off, "
             f"fixed verification of gamma draft tokens (scheduler off). τ = accepted draft tokens + bonus per "
             f"drafting round.", "",
             "## τ (Table 1)", "",
             "| Drafter | " + " | ".join(dsets + doms + ["macro"]) + " |",
             "|---|" + "---|" * (len(dsets) + len(doms) + 1)]
    for row in results["table"]:
        cells = [_fmt(row[d]) for d in dsets] + [_fmt(row[f"domain:{d}"]) for d in doms] + [_fmt(row["macro"])]
        lines.append(f"| {row['drafter']} | " + " | ".join(cells) + " |")
    lines += ["", "Samples per dataset: " + ", ".join(
        f"{d} {results['datasets'][d]['evaluated']}/{results['datasets'][d]['rows']}" for d in dsets), ""]
    for name, r in results["drafters"].items():
        g = r["gamma"]
        ks = list(range(1, g + 1))
        ov = r["overall"]
        lines += [f"## {name} (gamma {g})", ""]
        if ov.get("tau_ci95"):
            lo, hi = ov["tau_ci95"]
            lines += [f"τ over every prompt: {_fmt(ov['tau'], 3)} (95% interval {_fmt(lo, 3)}–{_fmt(hi, 3)}, "
                      "bootstrap over prompts).", ""]
        lines += ["Per-position acceptance (all datasets pooled): "
                  "unconditional = P(n ≥ k); conditional = P(n ≥ k | n ≥ k−1).", "",
                  "| | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * g]
        lines.append("| unconditional | " + " | ".join(_fmt(x, 3) for x in ov["accept_rate"]) + " |")
        lines.append("| conditional | " + " | ".join(_fmt(x, 3) for x in ov["cond_accept"]) + " |")
        conf = r.get("confidence")
        if conf:
            lines += ["", "Confidence calibration of the predicted prefix survival (pooled):", "",
                      "| | " + " | ".join(f"k={k}" for k in ks) + " | weighted |", "|---|" + "---|" * (g + 1)]
            for when in ("before", "after"):
                if when not in conf:
                    continue
                c = conf[when]
                for key, label in (("ece", "ECE"), ("auroc", "AUROC"), ("brier", "Brier")):
                    lines.append(f"| {label} {when} | " + " | ".join(_fmt(x, 3) for x in c[key]) +
                                 f" | {_fmt(c[key + '_weighted'], 3)} |")
            if "after" not in conf:
                lines.append("")
                lines.append("(no STS calibration on this drafter: run `python -m train.calibrate`)")
        lines.append("")
    return "\n".join(lines) + "\n"


def jsonable(x: Any) -> Any:
    """numpy arrays/scalars -> lists/numbers; NaN/inf -> None; tuples -> lists (recursively)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    return x


def write_results(results: dict[str, Any], out_dir: str) -> None:
    """results.json (NaN -> null) and results.md, each written atomically."""
    for name, text in (("results.json", json.dumps(jsonable(results), indent=2) + "\n"),
                       ("results.md", results_markdown(results))):
        write_atomic(os.path.join(out_dir, name), text)


def write_plots(series: dict[str, Any], reliability: dict[str, Any], out_dir: str) -> dict[str, str]:
    """acceptance_by_position.png over `series` and reliability_<drafter>.png per drafter with
    reliability data; returns {file name: path}."""
    from specjax.eval import plots

    png = os.path.join(out_dir, "acceptance_by_position.png")
    plots.plot_acceptance_by_position(series, png)
    files = {"acceptance_by_position.png": png}
    for name, rel in reliability.items():
        p = os.path.join(out_dir, f"reliability_{safe_name(name)}.png")
        plots.plot_reliability(rel, p, title=f"{name}: predicted vs observed prefix survival")
        files[f"reliability_{safe_name(name)}.png"] = p
    return files
