"""Sequential Temperature Scaling (STS) of confidence-head logits (numpy only; never imports jax).

The confidence head predicts c_k = P(draft k accepted | drafts < k accepted); the scheduler uses the
prefix survival a_k = prod_{i<=k} c_i. STS (paper §3.2.1) fits one temperature per position on
held-out verification rounds, in order k = 1..gamma, each by a 1-D grid search that minimises the
ECE of a_k = prod_{i<=k} sigmoid(z_i / T_i) against y_k = 1{accepted >= k} over the rounds that
proposed at least k tokens, with T_1..T_{k-1} already fixed. Choices the paper leaves open (§8.6 of
the reference): the temperature divides the logit before the sigmoid (order preserving per
position); the default grid is 200 geometric points in [0.05, 20] plus 1.0; ECE uses 20 equal-width
bins; ties go to the temperature closest to 1.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from specjax.config import ConfigError
from specjax.scheduling.calibration_metrics import ece, prefix_survival_labels
from specjax.io import write_json_atomic

STS_FORMAT = "specjax-sts"
STS_VERSION = 1
_MAX_GRID_ELEMS = 1 << 22  # grid rows x rounds evaluated at once


def default_grid() -> np.ndarray:
    """200 geometric temperatures in [0.05, 20] plus 1.0 (identity), ascending."""
    return np.unique(np.concatenate([np.geomspace(0.05, 20.0, 200), [1.0]]))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def fit_sts(conf_logits: Any, accepted_prefix_len: Any, proposal_len: Any, grid: Any = None, *,
            bins: int = 20) -> np.ndarray:
    """Fit per-position temperatures, float64 [gamma].

    Args:
      conf_logits: [N, gamma] raw confidence logits of N held-out verification rounds.
      accepted_prefix_len: [N] number of accepted draft tokens of each round.
      proposal_len: [N] number of draft tokens verified in each round (positions beyond it are
        unobserved and excluded).
      grid: candidate temperatures (> 0); default `default_grid()`.
      bins: ECE bins.
    Positions with no observed round keep T = 1.
    """
    z = np.asarray(conf_logits, np.float64)
    if z.ndim != 2:
        raise ValueError(f"conf_logits must be [N, gamma], got shape {z.shape}")
    if not np.isfinite(z).all():
        raise ValueError("conf_logits must be finite")
    n_rounds, gamma = z.shape
    y, valid = prefix_survival_labels(accepted_prefix_len, proposal_len, gamma)
    if y.shape[0] != n_rounds:
        raise ValueError(f"conf_logits has {n_rounds} rounds, accepted_prefix_len has {y.shape[0]}")
    g = default_grid() if grid is None else np.asarray(grid, np.float64).ravel()
    if g.size == 0 or not (g > 0).all() or not np.isfinite(g).all():
        raise ValueError("grid must be a non-empty list of finite temperatures > 0")
    temps = np.ones(gamma)
    prev = np.ones(n_rounds)  # prod_{i<k} sigmoid(z_i / T_i), already calibrated positions
    for k in range(gamma):
        sel = valid[:, k]
        if sel.any():
            zk, pk, yk = z[sel, k], prev[sel], y[sel, k].astype(np.float64)
            errs = np.empty(g.size)
            step = max(1, _MAX_GRID_ELEMS // zk.size)
            for s in range(0, g.size, step):
                t = g[s:s + step, None]
                errs[s:s + step] = ece(pk[None, :] * _sigmoid(zk[None, :] / t), yk, bins)
            best = np.flatnonzero(errs <= errs.min() + 1e-12)
            temps[k] = g[best[np.argmin(np.abs(np.log(g[best])))]]
        prev = prev * _sigmoid(z[:, k] / temps[k])
    return temps


def apply_sts(conf_logits: Any, temps: Any) -> np.ndarray:
    """Calibrated per-step probabilities sigmoid(z_k / T_k) for logits [..., g] (g <= len(temps))."""
    z = np.asarray(conf_logits, np.float64)
    t = np.asarray(temps, np.float64).ravel()
    if z.ndim == 0 or z.shape[-1] > t.size:
        raise ValueError(f"conf_logits last axis ({z.shape[-1:] or 'scalar'}) exceeds the "
                         f"{t.size} fitted temperatures")
    if not (t > 0).all():
        raise ValueError("temperatures must be > 0")
    return _sigmoid(z / t[:z.shape[-1]])


def save_sts(path: str | os.PathLike, temps: Any, meta: dict[str, Any] | None = None) -> None:
    """Write temperatures (+ JSON-able metadata, e.g. drafter, dataset, ECE before/after) as JSON."""
    t = np.asarray(temps, np.float64).ravel()
    if t.size == 0 or not (t > 0).all() or not np.isfinite(t).all():
        raise ValueError("temps must be a non-empty list of finite temperatures > 0")
    doc = {"format": STS_FORMAT, "version": STS_VERSION, "temperatures": [float(x) for x in t],
           "meta": dict(meta or {})}
    write_json_atomic(path, doc, indent=2, sort_keys=True)


def load_sts(path: str | os.PathLike) -> tuple[np.ndarray, dict[str, Any]]:
    """Read (temperatures float64 [gamma], meta) written by `save_sts`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"STS calibration file not found: {path}")
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != STS_FORMAT:
        raise ConfigError(f"{path}: field 'format' must be {STS_FORMAT!r}")
    if doc.get("version") != STS_VERSION:
        raise ConfigError(f"{path}: unsupported field 'version' {doc.get('version')!r}")
    temps = doc.get("temperatures")
    if not isinstance(temps, list) or not temps or \
            not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in temps):
        raise ConfigError(f"{path}: field 'temperatures' must be a non-empty list of numbers > 0")
    meta = doc.get("meta", {})
    if not isinstance(meta, dict):
        raise ConfigError(f"{path}: field 'meta' must be a mapping")
    return np.asarray(temps, np.float64), meta
