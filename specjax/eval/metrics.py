"""Acceptance and calibration metrics (numpy only).

Acceptance (per verification round: n accepted draft tokens out of m proposed, plus one bonus or
corrected token unless an accepted stop token ended the round), positions k are 1-indexed (k-th
draft token):

* `tau` (DeepSpec `accept_len`, the paper's Table 1) = mean over rounds of n + bonus.
* `accept_rate@k` (unconditional prefix survival, DeepSpec/vLLM style) =
  #rounds with n >= k / #rounds with m >= k.
* `cond_accept@k` (the paper's Fig. 2) = #rounds with n >= k / #rounds with n >= k-1 and m >= k;
  with fixed-length proposals this equals accept_rate@k / accept_rate@(k-1).
* `verify_rate` = sum(n + bonus) / (sum(m) + #rounds): committed tokens per verified token.
* vLLM names: `num_drafts` (rounds with m >= 1), `num_draft_tokens` = sum m,
  `num_accepted_tokens` = sum n, `num_accepted_tokens_per_pos[i]` = #rounds with n > i,
  `mean_acceptance_length` = 1 + num_accepted_tokens / num_drafts (bonus included, drafted rounds
  only), `draft_acceptance_rate` = num_accepted_tokens / num_draft_tokens,
  `acceptance_rate_per_pos[i]` = num_accepted_tokens_per_pos[i] / num_drafts.

Uncertainty over prompts: `per_request_tau_parts` sums each request's rounds and committed tokens
(n + bonus), and `paired_tau_bootstrap` resamples requests with replacement (the same draw for every
drafter, so drafters evaluated on the same prompts are compared pairwise) and recomputes
tau = sum tokens / sum rounds: a percentile interval of any statistic of the drafters' taus (one
tau, a ratio of two, a difference of ratios). Rounds of one request are not independent, so the
request, not the round, is the unit resampled.

Calibration of predicted prefix survival against realised outcomes (reference §8.6): `ece` (equal-
width bins, predictions clamped to [1e-8, 1 - 1e-8]), `auroc` (exact rank statistic, ties count 1/2),
`brier`, and `confidence_metrics` per position.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

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


def _rounds(accepted: Any, proposed: Any, gamma: int, bonus: Any | None,
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = np.asarray(accepted, np.int64).ravel()
    m = np.asarray(proposed, np.int64).ravel()
    if n.shape != m.shape:
        raise ValueError(f"accepted_per_round ({n.size}) and proposed_per_round ({m.size}) differ in length")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if (n < 0).any() or (n > m).any():
        raise ValueError("accepted_per_round must lie in [0, proposed_per_round]")
    if (m < 0).any() or (m > gamma).any():
        raise ValueError(f"proposed_per_round must lie in [0, gamma={gamma}]")
    if bonus is None:
        bo = np.ones_like(n)
    else:
        bo = np.asarray(bonus, np.int64).ravel()
        if bo.shape != n.shape or not np.isin(bo, (0, 1)).all():
            raise ValueError("bonus_per_round must be 0/1 with one entry per round")
    return n, m, bo


def _ratio(num: Any, den: Any) -> Any:
    num = np.asarray(num, np.float64)
    den = np.asarray(den, np.float64)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def acceptance_metrics(accepted_per_round: Any, proposed_per_round: Any, gamma: int,
                       bonus_per_round: Any | None = None) -> dict[str, Any]:
    """Acceptance statistics over verification rounds (definitions in the module docstring).

    Args:
      accepted_per_round: [N] accepted draft tokens n per round.
      proposed_per_round: [N] verified proposal length m per round (0 <= n <= m <= gamma).
      gamma: largest proposal length (number of per-position entries).
      bonus_per_round: [N] 1 when the round also committed a bonus/corrected token (default all 1;
        0 when an accepted stop token ended the round).
    """
    n, m, bo = _rounds(accepted_per_round, proposed_per_round, gamma, bonus_per_round)
    rounds = n.size
    ks = np.arange(1, gamma + 1)
    surv = (n[:, None] >= ks[None, :]).sum(axis=0)  # rounds with n >= k
    offered = (m[:, None] >= ks[None, :]).sum(axis=0)  # rounds with m >= k
    reached = ((n[:, None] >= ks[None, :] - 1) & (m[:, None] >= ks[None, :])).sum(axis=0)
    accept_rate = _ratio(surv, offered)
    cond = _ratio(surv, reached)
    length = n + bo
    num_drafts = int((m > 0).sum())
    out: dict[str, Any] = {
        "num_rounds": rounds,
        "tau": float(length.mean()) if rounds else float("nan"),
        "mean_proposal": float(m.mean()) if rounds else float("nan"),
        "verify_rate": float(_ratio(length.sum(), m.sum() + rounds)),
        "accept_rate": accept_rate,
        "cond_accept": cond,
        "acceptance_histogram": np.bincount(n, minlength=gamma + 1)[:gamma + 1],
        "num_drafts": num_drafts,
        "num_draft_tokens": int(m.sum()),
        "num_accepted_tokens": int(n.sum()),
        "num_accepted_tokens_per_pos": surv.astype(np.int64),
        "mean_acceptance_length": float(1.0 + _ratio(n[m > 0].sum(), num_drafts)),
        "draft_acceptance_rate": float(_ratio(n.sum(), m.sum())),
        "acceptance_rate_per_pos": _ratio(surv, num_drafts),
    }
    for k in ks:
        out[f"accept_rate@{k}"] = float(accept_rate[k - 1])
        out[f"cond_accept@{k}"] = float(cond[k - 1])
    return out


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


def per_request_tau_parts(request_ids: Sequence[str], accepted: Any, bonus: Any,
                          ) -> dict[str, tuple[int, int]]:
    """request id -> (drafting rounds, committed tokens sum(n + bonus)) over the rounds given
    (one entry per request per round, e.g. `RoundLog.arrays()`)."""
    n = np.asarray(accepted, np.int64).ravel()
    b = np.asarray(bonus, np.int64).ravel()
    if not (len(request_ids) == n.size == b.size):
        raise ValueError(f"request_ids ({len(request_ids)}), accepted ({n.size}) and bonus ({b.size}) "
                         "must have one entry per round")
    out: dict[str, tuple[int, int]] = {}
    for rid, k in zip(request_ids, (n + b).tolist()):
        rounds, tokens = out.get(rid, (0, 0))
        out[rid] = (rounds + 1, tokens + k)
    return out


def paired_tau_bootstrap(parts: Mapping[str, Mapping[str, tuple[int, int]]],
                         statistic: Callable[[dict[str, float]], float], *, replicates: int = 4000,
                         level: float = 0.95, seed: int = 0) -> dict[str, float]:
    """Percentile bootstrap of `statistic({drafter: tau})` over requests.

    Args:
      parts: drafter -> `per_request_tau_parts` of its run; every drafter must have the same
        request ids (the same prompts), which are resampled together.
      statistic: maps the drafters' taus to one number, e.g. `lambda t: t["a"] / t["b"]`.
    Returns `value` (on all requests), `lo`, `hi` (the central `level` interval), `requests`,
    `replicates`, and `p_le_0`: the fraction of replicates with statistic <= 0 (a one-sided
    bootstrap p-value for "statistic > 0").
    """
    names = list(parts)
    if not names:
        raise ValueError("no drafter to bootstrap")
    ids = sorted(parts[names[0]])
    for name in names[1:]:
        if sorted(parts[name]) != ids:
            raise ValueError(f"drafters {names[0]!r} and {name!r} were not run on the same requests")
    if not ids:
        raise ValueError("no request to resample")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rounds = np.array([[parts[d][r][0] for r in ids] for d in names], np.float64)  # [D, R]
    tokens = np.array([[parts[d][r][1] for r in ids] for d in names], np.float64)

    def stat(idx: Any) -> float:
        taus = tokens[:, idx].sum(axis=1) / np.maximum(rounds[:, idx].sum(axis=1), 1.0)
        return float(statistic(dict(zip(names, taus.tolist()))))

    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(ids), size=(replicates, len(ids)))
    values = np.array([stat(d) for d in draws])
    tail = (1.0 - level) / 2.0
    return {"value": stat(np.arange(len(ids))), "lo": float(np.quantile(values, tail)),
            "hi": float(np.quantile(values, 1.0 - tail)), "p_le_0": float((values <= 0).mean()),
            "requests": len(ids), "replicates": replicates}
