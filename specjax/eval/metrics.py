"""Acceptance metrics (numpy only).

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

Calibration metrics (`ece`, `auroc`, `brier`, `confidence_metrics`) live in
`specjax.scheduling.calibration_metrics`, beside the calibration they judge.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

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
