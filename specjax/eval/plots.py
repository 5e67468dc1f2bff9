"""Evaluation pictures (matplotlib, Agg backend: no display needed).

* `plot_acceptance_by_position`: unconditional (P(n >= k)) and conditional (P(n >= k | n >= k-1))
  acceptance per draft position, one line per series.
* `plot_reliability`: reliability diagrams of predicted prefix survival a_k against the observed
  rate, one panel per draft position, before and after calibration, with the ECE in the legend.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from specjax.scheduling.calibration_metrics import ece


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def reliability_bins(pred: Any, label: Any, bins: int = 20) -> dict[str, np.ndarray]:
    """Equal-width bins on [0, 1] (bin floor(bins * p), clamped): per bin `count`, `mean_pred`,
    `mean_obs` (NaN for empty bins)."""
    p = np.clip(np.asarray(pred, np.float64).ravel(), 0.0, 1.0)
    y = np.asarray(label, np.float64).ravel()
    if p.shape != y.shape:
        raise ValueError(f"pred ({p.size}) and label ({y.size}) differ in size")
    b = np.minimum((p * bins).astype(np.int64), bins - 1)
    count = np.bincount(b, minlength=bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.bincount(b, weights=p, minlength=bins) / count
        mean_obs = np.bincount(b, weights=y, minlength=bins) / count
    return {"count": count.astype(np.int64), "mean_pred": mean_pred, "mean_obs": mean_obs}


def plot_acceptance_by_position(series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                                path: str | os.PathLike, *, title: str = "Acceptance by draft position") -> str:
    """series: label -> (unconditional [gamma], conditional [gamma]); NaN points are skipped.
    Writes a PNG and returns its path."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for label, (uncond, cond) in series.items():
        for ax, vals in zip(axes, (uncond, cond)):
            v = np.asarray([np.nan if x is None else x for x in vals], np.float64)
            k = np.arange(1, v.size + 1)
            ok = ~np.isnan(v)
            ax.plot(k[ok], v[ok], marker="o", ms=3, lw=1.2, label=label)
    for ax, name in zip(axes, ("unconditional  P(n ≥ k)", "conditional  P(n ≥ k | n ≥ k−1)")):
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("draft position k")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("acceptance")
    if series:
        axes[1].legend(fontsize=7, loc="best", ncol=1 if len(series) <= 8 else 2)
    fig.suptitle(title)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reliability(data: Mapping[str, Sequence[tuple[Any, Any]]], path: str | os.PathLike, *,
                     bins: int = 20, title: str = "Reliability of predicted prefix survival",
                     max_panels: int = 8) -> str:
    """data: variant ("before", "after") -> per position k a (pred, label) pair of arrays.
    One panel per position (positions without rounds skipped; at most `max_panels`, evenly
    chosen). Writes a PNG and returns its path."""
    plt = _pyplot()
    first = next(iter(data.values()), [])
    positions = [k for k in range(len(first)) if any(len(v[k][0]) for v in data.values())]
    if len(positions) > max_panels:
        idx = np.unique(np.linspace(0, len(positions) - 1, max_panels).round().astype(int))
        positions = [positions[i] for i in idx]
    n = max(len(positions), 1)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    styles = {"before": dict(color="tab:red", marker="o"), "after": dict(color="tab:blue", marker="s")}
    for ax in axes.ravel()[len(positions):]:
        ax.axis("off")
    for ax, k in zip(axes.ravel(), positions):
        ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=0.8)
        for variant, per_pos in data.items():
            pred, label = per_pos[k]
            if len(pred) == 0:
                continue
            rb = reliability_bins(pred, label, bins)
            ok = rb["count"] > 0
            e = ece(pred, label, bins)
            ax.plot(rb["mean_pred"][ok], rb["mean_obs"][ok], lw=1.2, ms=3,
                    label=f"{variant} (ECE {100 * e:.1f}%)", **styles.get(variant, {}))
        ax.set_title(f"position {k + 1}  (n={len(data[next(iter(data))][k][0])})", fontsize=9)
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.04)
        ax.set_xlabel("predicted", fontsize=8)
        ax.set_ylabel("observed", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["plot_acceptance_by_position", "plot_reliability", "reliability_bins"]
