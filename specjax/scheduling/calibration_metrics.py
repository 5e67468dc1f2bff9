"""Calibration of predicted prefix survival against realised outcomes (reference §8.6), numpy only.

`ece` (equal-width bins, predictions clamped to [1e-8, 1 - 1e-8]), `auroc` (exact rank statistic,
ties count 1/2), `brier`, `prefix_survival_labels` and `confidence_metrics` per position. The
scheduler's calibration (`calibration.py`) fits against these; evaluation reports them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

_CLAMP = 1e-8


def ece(pred: Any, label: Any, bins: int = 20) -> Any:
    """Expected calibration error sum_b (n_b / n) |mean(pred_b) - mean(label_b)| over equal-width bins.

    `pred` may carry leading batch axes ([..., n], labels [n] or the same shape): one ECE per row.
    Returns a float (1-D input) or an array of the leading shape; nan for an empty set.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    p = np.clip(np.asarray(pred, np.float64), _CLAMP, 1.0 - _CLAMP)
    y = np.broadcast_to(np.asarray(label, np.float64), p.shape)
    n = p.shape[-1]
    lead = p.shape[:-1]
    if n == 0:
        out = np.full(lead, np.nan)
        return float(out) if not lead else out
    p2 = p.reshape(-1, n)
    y2 = y.reshape(-1, n)
    rows = p2.shape[0]
    b = np.minimum((p2 * bins).astype(np.int64), bins - 1)
    flat = (b + bins * np.arange(rows)[:, None]).ravel()
    size = rows * bins
    sum_p = np.bincount(flat, weights=p2.ravel(), minlength=size).reshape(rows, bins)
    sum_y = np.bincount(flat, weights=y2.ravel(), minlength=size).reshape(rows, bins)
    out = (np.abs(sum_p - sum_y).sum(axis=1) / n).reshape(lead)
    return float(out) if not lead else out


def auroc(pred: Any, label: Any) -> float:
    """Area under the ROC curve = P(score of a positive > score of a negative), ties count 1/2.

    Exact (average ranks, Mann-Whitney U). nan when one class is absent.
    """
    p = np.asarray(pred, np.float64).ravel()
    y = np.asarray(label).ravel().astype(bool)
    if p.shape != y.shape:
        raise ValueError(f"pred and label must have the same size, got {p.size} and {y.size}")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(p, kind="mergesort")
    sp = p[order]
    ranks = np.empty(p.size, np.float64)
    # average rank (1-based) of each run of equal scores
    boundaries = np.flatnonzero(np.diff(sp)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [p.size]])
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def brier(pred: Any, label: Any) -> float:
    """Mean squared error between predicted probability and the 0/1 outcome (nan if empty)."""
    p = np.asarray(pred, np.float64).ravel()
    y = np.asarray(label, np.float64).ravel()
    if p.shape != y.shape:
        raise ValueError(f"pred and label must have the same size, got {p.size} and {y.size}")
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def prefix_survival_labels(accepted_prefix_len: Any, proposal_len: Any, gamma: int,
                           ) -> tuple[np.ndarray, np.ndarray]:
    """Labels y[r, k-1] = 1{accepted_r >= k} and validity 1{proposal_r >= k}, each [N, gamma]."""
    n = np.asarray(accepted_prefix_len, np.int64).ravel()
    m = np.asarray(proposal_len, np.int64).ravel()
    if n.shape != m.shape:
        raise ValueError(f"accepted_prefix_len ({n.size}) and proposal_len ({m.size}) differ in length")
    if (n < 0).any() or (n > m).any():
        raise ValueError("accepted_prefix_len must lie in [0, proposal_len]")
    ks = np.arange(1, gamma + 1)[None, :]
    return (n[:, None] >= ks), (m[:, None] >= ks)


def confidence_metrics(conf_probs: Any, accepted_prefix_len: Any, proposal_len: Any, *,
                       bins: int = 20) -> dict[str, Any]:
    """Calibration of predicted prefix survival a_k = prod_{i<=k} c_i per position k (§8.6).

    Args:
      conf_probs: [N, gamma] per-step confidences c_k in (0, 1) (raw sigmoid or STS-calibrated).
      accepted_prefix_len: [N] accepted draft tokens per round.
      proposal_len: [N] verified proposal length per round; position k counts rounds with m >= k.
    Returns per-position arrays (index k-1) `ece`, `auroc`, `brier`, `mean_pred`, `mean_obs`,
    `count`; the same values as scalars `ece@k`, `auroc@k`, ...; and count-weighted summaries
    `ece_weighted`, `brier_weighted`, `auroc_weighted` (over positions where AUROC is defined).
    """
    c = np.asarray(conf_probs, np.float64)
    if c.ndim != 2:
        raise ValueError(f"conf_probs must be [N, gamma], got shape {c.shape}")
    gamma = c.shape[1]
    y, valid = prefix_survival_labels(accepted_prefix_len, proposal_len, gamma)
    if y.shape[0] != c.shape[0]:
        raise ValueError(f"conf_probs has {c.shape[0]} rounds, accepted_prefix_len has {y.shape[0]}")
    a = np.cumprod(c, axis=1)
    per = {key: np.full(gamma, np.nan) for key in ("ece", "auroc", "brier", "mean_pred", "mean_obs")}
    count = valid.sum(axis=0)
    for k in range(gamma):
        sel = valid[:, k]
        if not sel.any():
            continue
        pk, yk = a[sel, k], y[sel, k]
        per["ece"][k] = ece(pk, yk, bins)
        per["auroc"][k] = auroc(pk, yk)
        per["brier"][k] = brier(pk, yk)
        per["mean_pred"][k] = pk.mean()
        per["mean_obs"][k] = yk.mean()
    out: dict[str, Any] = {**per, "count": count}
    for k in range(gamma):
        for key in ("ece", "auroc", "brier", "mean_pred", "mean_obs"):
            out[f"{key}@{k + 1}"] = float(per[key][k])
    tot = count.sum()
    out["ece_weighted"] = float((np.nan_to_num(per["ece"]) * count).sum() / tot) if tot else float("nan")
    out["brier_weighted"] = float((np.nan_to_num(per["brier"]) * count).sum() / tot) if tot else float("nan")
    ok = ~np.isnan(per["auroc"])
    w = count * ok
    out["auroc_weighted"] = float((np.where(ok, per["auroc"], 0) * w).sum() / w.sum()) if w.sum() else float("nan")
    return out
