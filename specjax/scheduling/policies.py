"""Prefix scheduling policies: choose each request's verification length ell_r in 0..gamma.

Inputs are per-position confidences `c[r, k]` ~ P(draft position k+1 of request r is accepted |
all earlier positions accepted), already calibrated. The prefix survival of position j (1-based) is
`a[r, j] = prod_{i <= j} c[r, i]`. A verify step in which request r checks ell_r draft tokens
executes the bucket (slots >= R, tokens per slot >= 1 + max_r ell_r) of the cost table, and its
expected accepted tokens per second is

    Theta(ell) = (R + sum_r sum_{j <= ell_r} a[r, j]) / seconds(bucket(R, 1 + max_r ell_r))

(every row always gets one bonus/corrected token). Policies:

* `plain` (0), `fixed` (gamma), `mtp1` (min(1, gamma)), `threshold` (leading c >= theta): rules that
  ignore cost.
* `confidence`: the paper's Algorithm 1 — admit candidates (r, j) in order of decreasing a (ties
  toward earlier j, then lower r) while Theta strictly improves, and stop at the first
  non-improvement. The early stop makes admission non-anticipating: whether (r, k) is verified
  depends only on values ordered before it, never on c[r, k+1:], which depend on the token sampled
  at position k; so verification stays lossless.
* `confidence_async`: the capacity K and a per-row cap come from confidences two rounds old (global
  argmax of Theta over the sorted prefix sets, no early stop); the K slots are filled by a top-K over
  the current a. K and the cap never depend on current draft tokens, and a top-K with ties toward
  earlier positions ranks (r, k) before every later position of the same row, so this is lossless
  too, and the executed bucket is known before the round starts. `async_plan` is the engine's whole
  host plan for such a round (K, cap and the Theta of the schedule on the old confidences) in one pass.
* `anticipating_global_search_LOSSY`: the global argmax on the *current* confidences. It is biased
  (it looks at c[r, k+1], which depends on the token at k) and exists to demonstrate that bias.

Cost-aware policies never admit a position whose row would need a tokens-per-slot bucket beyond the
table's largest; rule-based policies raise ValueError if their lengths cannot execute. numpy only.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from specjax.scheduling.cost_table import CostTable
from specjax.scheduling.names import COST_AWARE_POLICIES, FIXED_POLICIES, LOSSY_POLICY, POLICIES

LENGTH_DTYPE = np.int32


# ---- validation ---------------------------------------------------------------------------------


def _validate_confidences(x: Any, name: str, gamma: int | None = None) -> np.ndarray:
    """float64 [R, gamma] view of `x`, checked 2-D, finite and within [0, 1]."""
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a numeric array [R, gamma]") from None
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [R, gamma], got shape {arr.shape}")
    if gamma is not None:
        if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)):
            raise ValueError(f"gamma must be an integer, got {gamma!r}")
        if not 0 <= gamma <= arr.shape[1]:
            raise ValueError(
                f"gamma={gamma} must be within 0..{arr.shape[1]} (the number of columns of {name})"
            )
        arr = arr[:, :gamma]
    if arr.size:
        lo, hi = arr.min(), arr.max()  # NaN propagates and fails both tests below
        if not (lo >= 0.0 and hi <= 1.0):
            if not np.isfinite(arr).all():
                raise ValueError(f"{name} must be finite (found NaN or inf)")
            raise ValueError(f"{name} must lie in [0, 1], found values in [{lo}, {hi}]")
    return arr


def _require_table(cost_table: Any, policy: str) -> CostTable:
    if not isinstance(cost_table, CostTable):
        raise ValueError(
            f"policy {policy!r} needs a CostTable, got {type(cost_table).__name__}"
        )
    return cost_table


def _check_executable(lengths: np.ndarray, cost_table: CostTable | None, policy: str) -> None:
    """Rule-based policies: the executed bucket must exist in the table (when one is given)."""
    if cost_table is None or lengths.size == 0:
        return
    try:
        cost_table.bucket_for(lengths.size, 1 + int(lengths.max()))
    except ValueError as e:
        raise ValueError(f"policy {policy!r}: {e}") from None


# ---- shared kernels (inputs already validated) --------------------------------------------------
#
# Candidates (r, j) are ranked by prefix survival a[r, j] descending, ties toward earlier j, then
# lower r (position-major order). Since a[r, j + 1] <= a[r, j], the first n ranked candidates always
# form a prefix of every row. The kernels never materialise that ranking (a stable argsort costs more
# than everything else together); they use the sorted survival values, which the ranking shares, and
# resolve ties through counts over the position-major layout.


_SMALL_R = 32  # below this many requests, np.multiply.accumulate beats a loop over positions


def _usable_positions(gamma: int, cost_table: CostTable) -> int:
    """Largest ell a row may get: gamma, limited by the largest tokens-per-slot bucket."""
    return min(gamma, cost_table.max_tokens_per_slot - 1)


def _survival_gr(c_rg: np.ndarray) -> np.ndarray:
    """Prefix survivals, position-major float64 [gamma, R] (row j-1 holds a[:, j]).

    Both branches multiply left to right, as np.cumprod(c_rg, axis=1) does, so the bits agree."""
    a_gr = np.array(c_rg.T, dtype=np.float64, order="C")
    if a_gr.shape[1] <= _SMALL_R:
        return np.multiply.accumulate(a_gr, axis=0, out=a_gr)
    for j in range(1, a_gr.shape[0]):  # wide rows: one vector multiply per position is faster
        a_gr[j] *= a_gr[j - 1]
    return a_gr


def _first_ranks(a_gr: np.ndarray, neg_sorted: np.ndarray) -> np.ndarray:
    """Rank (0-based) of each position's first candidate in the ranking, int [gamma].

    Position j first appears with its largest survival m_j; candidates ranked before it are those
    with a larger survival plus those tied with m_j at earlier positions. Strictly increasing in j.
    `neg_sorted` is the ascending sort of -a (the sorted survivals, negated)."""
    neg_m = -a_gr.max(axis=1)
    ranks = neg_sorted.searchsorted(neg_m, side="left")
    ties = neg_sorted.searchsorted(neg_m, side="right") - ranks
    for j in np.flatnonzero(ties > 1):  # rare: a tied value may sit at earlier positions
        ranks[j] += int(np.count_nonzero(a_gr[:j] == -neg_m[j]))
    return ranks


def _running_sums(R: int, neg_sorted: np.ndarray) -> np.ndarray:
    """R + the sum of the n largest survivals, for n = 0..N: float64 [N + 1].

    A running sum in ranked order, one survival at a time (tied survivals are equal, so any order
    among them gives the same bits)."""
    num = np.empty(neg_sorted.size + 1)
    num[0] = R
    np.negative(neg_sorted, out=num[1:])
    return np.cumsum(num, out=num)


def _admitted_gr(a_gr: np.ndarray, n: int, v: float, n_above: int) -> np.ndarray:
    """Mask bool [gamma, R] of the first n >= 1 ranked candidates, given v = the n-th largest
    survival and n_above = how many survivals exceed v: all of those, then the first n - n_above
    candidates equal to v in position-major order."""
    flat = a_gr.ravel()
    admitted = flat > v
    if n > n_above:
        admitted[np.flatnonzero(flat == v)[: n - n_above]] = True
    return admitted.reshape(a_gr.shape)


def _lengths(admitted_gr: np.ndarray) -> np.ndarray:
    """ell_r from a prefix-closed admitted mask [gamma, R]: int32 [R]."""
    return admitted_gr.sum(axis=0, dtype=LENGTH_DTYPE)


class _Ranked:
    """Sorted survivals of a confidence block and Theta over its ranking.

    Theta after admitting the first n ranked candidates is num[n] / stair[1 + (largest position
    among them)]; the denominator steps up where a position first appears, so positions 1..k are
    present exactly for n in (ranks[k-1], ranks[k]] (segment k; segment 0 is n = 0, and the last
    segment ends at N)."""

    __slots__ = ("a_gr", "neg_sorted", "ranks", "num", "stair_t")

    def __init__(self, c_rg: np.ndarray, cost_table: CostTable) -> None:
        R = c_rg.shape[0]
        self.a_gr = _survival_gr(c_rg)
        self.neg_sorted = np.negative(self.a_gr.ravel())
        self.neg_sorted.sort()
        self.ranks = _first_ranks(self.a_gr, self.neg_sorted)
        self.num = _running_sums(R, self.neg_sorted)
        self.stair_t = cost_table.staircase(R)

    def _segment_ends(self) -> np.ndarray:
        """Last n of each segment 0..g: int [g + 1]."""
        g = self.ranks.size
        ends = np.empty(g + 1, dtype=np.intp)
        ends[0], ends[1:g], ends[g] = 0, self.ranks[1:], self.num.size - 1
        return ends

    def objective(self) -> np.ndarray:
        """Theta for n = 0..N: float64 [N + 1]."""
        ends = self._segment_ends()
        counts = np.diff(ends, prepend=-1)
        return self.num / np.repeat(self.stair_t[1 : ends.size + 1], counts)

    def best_prefix(self) -> int:
        """The smallest n maximising Theta, i.e. argmax(objective()), from the segment ends: Theta
        never decreases within a segment (same denominator, growing sum), so the maximum sits at
        the end of the first segment reaching it, and only that segment is divided out."""
        ends = self._segment_ends()
        at_end = self.num[ends] / self.stair_t[1 : ends.size + 1]
        k = int(at_end.argmax())
        if k == 0:
            return 0
        lo = int(self.ranks[k - 1]) + 1
        theta = self.num[lo : ends[k] + 1] / self.stair_t[1 + k]
        return lo + int((theta == at_end[k]).argmax())

    def max_position(self, n: int) -> int:
        """Largest position among the first n ranked candidates."""
        return int(self.ranks.searchsorted(n, side="left"))

    def admitted(self, n: int) -> np.ndarray:
        """Mask bool [gamma, R] of the first n ranked candidates."""
        if n == 0:
            return np.zeros(self.a_gr.shape, dtype=bool)
        v = -self.neg_sorted[n - 1]
        return _admitted_gr(self.a_gr, n, v, int(self.neg_sorted.searchsorted(-v, side="left")))


def _top_k_lengths(c_rg: np.ndarray, k: int) -> np.ndarray:
    """ell_r of the first k ranked candidates of c_rg (1 <= k <= R * gamma), int32 [R]; a partial
    sort instead of a full one."""
    a_gr = _survival_gr(c_rg)
    flat = a_gr.ravel()
    v = np.partition(flat, flat.size - k)[flat.size - k]  # the k-th largest survival
    return _lengths(_admitted_gr(a_gr, k, v, int(np.count_nonzero(flat > v))))


def _confidence(c_rg: np.ndarray, cost_table: CostTable) -> np.ndarray:
    R, G = c_rg.shape
    g = _usable_positions(G, cost_table)
    if R == 0 or g == 0:
        return np.zeros(R, dtype=LENGTH_DTYPE)
    ranked = _Ranked(c_rg[:, :g], cost_table)
    obj = ranked.objective()
    stop = obj[1:] <= obj[:-1]  # non-improvement when admitting candidate n
    n = int(stop.argmax())
    if not stop[n]:
        n = obj.size - 1  # every admission improved
    return _lengths(ranked.admitted(n))


def _global_argmax(c_rg: np.ndarray, cost_table: CostTable) -> tuple[_Ranked | None, int, int, int]:
    """Best prefix of the ranked candidates under Theta, no early stop (first maximum on ties).

    Returns (ranking, n_best, max ell of that solution, usable positions g)."""
    R, G = c_rg.shape
    g = _usable_positions(G, cost_table)
    if R == 0 or g == 0:
        return None, 0, 0, g
    ranked = _Ranked(c_rg[:, :g], cost_table)
    n = ranked.best_prefix()
    return ranked, n, ranked.max_position(n), g


def _anticipating(c_rg: np.ndarray, cost_table: CostTable) -> np.ndarray:
    ranked, n, _, _ = _global_argmax(c_rg, cost_table)
    if ranked is None:
        return np.zeros(c_rg.shape[0], dtype=LENGTH_DTYPE)
    return _lengths(ranked.admitted(n))


def _async_capacity(old_rg: np.ndarray, cost_table: CostTable) -> tuple[int, int]:
    R, G = old_rg.shape
    if R == 0:
        return 0, 0
    _, n, max_ell, g = _global_argmax(old_rg, cost_table)
    _, tb = cost_table.bucket_for(R, 1 + max_ell)
    return n, min(g, tb - 1)


def _confidence_async(c_rg: np.ndarray, old_rg: np.ndarray, cost_table: CostTable) -> np.ndarray:
    R, G = c_rg.shape
    k, cap = _async_capacity(old_rg, cost_table)
    if R == 0 or cap == 0 or k == 0:
        return np.zeros(R, dtype=LENGTH_DTYPE)
    return _top_k_lengths(c_rg[:, :cap], min(k, R * cap))


# ---- public policies ----------------------------------------------------------------------------


def prefix_survival(confidences: Any) -> np.ndarray:
    """a[r, j] = prod_{i <= j} c[r, i]: float64 [R, gamma]."""
    return np.cumprod(_validate_confidences(confidences, "confidences"), axis=1)


def fixed_length(policy: str, gamma: int) -> int:
    """Every row's ell under a fixed policy: plain 0, mtp1 min(1, gamma), fixed gamma."""
    return {"plain": 0, "mtp1": min(1, gamma), "fixed": gamma}[policy]


def plain(confidences: Any) -> np.ndarray:
    """No speculation: ell_r = 0 for every request. int32 [R]."""
    c = _validate_confidences(confidences, "confidences")
    return np.zeros(c.shape[0], dtype=LENGTH_DTYPE)


def fixed(confidences: Any, gamma: int | None = None) -> np.ndarray:
    """Verify the whole block: ell_r = gamma (default: number of columns). int32 [R]."""
    c = _validate_confidences(confidences, "confidences", gamma)
    return np.full(c.shape[0], c.shape[1], dtype=LENGTH_DTYPE)


def mtp1(confidences: Any, gamma: int | None = None) -> np.ndarray:
    """One draft token per request (MTP-1 style): ell_r = min(1, gamma). int32 [R]."""
    c = _validate_confidences(confidences, "confidences", gamma)
    return np.full(c.shape[0], min(1, c.shape[1]), dtype=LENGTH_DTYPE)


def _validate_threshold(theta: Any) -> float:
    if theta is None or isinstance(theta, bool):
        raise ValueError(f"policy 'threshold' needs threshold= in [0, 1], got {theta!r}")
    try:
        t = float(theta)
    except (TypeError, ValueError):
        raise ValueError(f"threshold must be a number in [0, 1], got {theta!r}") from None
    if not (math.isfinite(t) and 0.0 <= t <= 1.0):
        raise ValueError(f"threshold must be a number in [0, 1], got {theta!r}")
    return t


def _threshold(c_rg: np.ndarray, theta: float) -> np.ndarray:
    return np.logical_and.accumulate(c_rg >= theta, axis=1).sum(axis=1, dtype=LENGTH_DTYPE)


def threshold(confidences: Any, theta: float, gamma: int | None = None) -> np.ndarray:
    """Static per-step threshold: ell_r = number of leading positions with c[r, k] >= theta."""
    c = _validate_confidences(confidences, "confidences", gamma)
    return _threshold(c, _validate_threshold(theta))


def confidence(confidences: Any, cost_table: CostTable, gamma: int | None = None) -> np.ndarray:
    """Paper Algorithm 1 (greedy admission by prefix survival, stop at first non-improvement)."""
    c = _validate_confidences(confidences, "confidences", gamma)
    table = _require_table(cost_table, "confidence")
    table.staircase(max(c.shape[0], 1))  # R beyond the largest slots bucket -> ValueError
    return _confidence(c, table)


def async_capacity(
    old_confidences: Any, cost_table: CostTable, gamma: int | None = None
) -> tuple[int, int]:
    """Capacity and per-row cap of `confidence_async`, from confidences two rounds old.

    K = size of the best prefix of the sorted candidates under Theta (global argmax, no early
    stop, the smallest K on ties). cap = (tokens-per-slot bucket of that solution) - 1, limited to
    gamma: every row may use the padding that bucket executes anyway, and no row can push the step
    into a larger bucket — so the executed bucket is at most bucket(R, 1 + cap), known from old
    information before the round starts. Returns (K, cap).
    """
    old = _validate_confidences(old_confidences, "old_confidences", gamma)
    table = _require_table(cost_table, "confidence_async")
    table.staircase(max(old.shape[0], 1))
    return _async_capacity(old, table)


def confidence_async(
    confidences: Any,
    old_confidences: Any,
    cost_table: CostTable,
    gamma: int | None = None,
) -> np.ndarray:
    """Asynchronous top-K: (K, cap) = `async_capacity(old_confidences)`; then admit the K candidates
    with the largest *current* prefix survival among positions j <= cap (ties toward earlier j,
    then lower r). Rows of `old_confidences` must correspond to rows of `confidences` (the caller
    fills rows without history, e.g. with a prior)."""
    c = _validate_confidences(confidences, "confidences", gamma)
    old = _validate_confidences(old_confidences, "old_confidences", gamma)
    if old.shape != c.shape:
        raise ValueError(
            f"old_confidences shape {old.shape} must equal confidences shape {c.shape}"
        )
    table = _require_table(cost_table, "confidence_async")
    table.staircase(max(c.shape[0], 1))
    return _confidence_async(c, old, table)


def anticipating_global_search_LOSSY(
    confidences: Any, cost_table: CostTable, gamma: int | None = None
) -> np.ndarray:
    """LOSSY, for tests only: global argmax of Theta over all prefix sizes on the current
    confidences, without the early stop. Its decision to verify position k can depend on
    c[r, k+1], which depends on the token sampled at k, so the output distribution is biased."""
    c = _validate_confidences(confidences, "confidences", gamma)
    table = _require_table(cost_table, LOSSY_POLICY)
    table.staircase(max(c.shape[0], 1))
    return _anticipating(c, table)


def _theta(a_rg: np.ndarray, admitted_rg: np.ndarray, max_ell: int, cost_table: CostTable) -> float:
    """Theta from survivals a_rg [R, G] and the admitted mask [R, G] (any memory layout: the
    admitted survivals are summed in row-major order, so every caller gets the same bits)."""
    R = a_rg.shape[0]
    return float((R + a_rg[admitted_rg].sum()) / cost_table.seconds(R, 1 + max_ell))


def expected_tokens_per_second(confidences: Any, lengths: Any, cost_table: CostTable) -> float:
    """Theta(lengths) = (R + sum_r sum_{j <= ell_r} a[r, j]) / seconds(bucket(R, 1 + max ell))."""
    c = _validate_confidences(confidences, "confidences")
    table = _require_table(cost_table, "expected_tokens_per_second")
    R, G = c.shape
    ell = np.asarray(lengths)
    if ell.shape != (R,) or not np.issubdtype(ell.dtype, np.integer):
        raise ValueError(f"lengths must be an integer array of shape ({R},), got {ell.dtype} {ell.shape}")
    if R == 0:
        raise ValueError("expected_tokens_per_second needs at least one request")
    if ell.min() < 0 or ell.max() > G:
        raise ValueError(f"lengths must lie in 0..{G}, found [{ell.min()}, {ell.max()}]")
    admitted = np.arange(G)[None, :] < ell[:, None]
    return _theta(np.cumprod(c, axis=1), admitted, int(ell.max()), table)


def async_plan(
    old_confidences: Any, cost_table: CostTable, gamma: int | None = None
) -> tuple[int, int, float]:
    """The async policy's host plan in one pass over confidences two rounds old: (K, cap, Theta).

    (K, cap) = `async_capacity(old)`; Theta = `expected_tokens_per_second(old, ell)` for the lengths
    ell = `confidence_async(old, old)` would choose (the best prefix of the ranking, which already
    lies within cap). Equal bit for bit to those three calls, at the cost of one. Needs R >= 1."""
    old = _validate_confidences(old_confidences, "old_confidences", gamma)
    table = _require_table(cost_table, "async_plan")
    R = old.shape[0]
    if R == 0:
        raise ValueError("async_plan needs at least one request")
    table.staircase(R)
    ranked, n, max_ell, g = _global_argmax(old, table)
    cap = min(g, table.bucket_for(R, 1 + max_ell)[1] - 1)
    if ranked is None:  # no usable positions: nothing is drafted
        return 0, cap, _theta(np.zeros((R, 0)), np.zeros((R, 0), dtype=bool), 0, table)
    return n, cap, _theta(ranked.a_gr.T, ranked.admitted(n).T, max_ell, table)


# ---- entry point --------------------------------------------------------------------------------


def prefix_schedule(
    confidences: Any,
    cost_table: CostTable | None,
    policy: str = "confidence",
    *,
    gamma: int | None = None,
    threshold: float | None = None,
    old_confidences: Any = None,
) -> np.ndarray:
    """Verification lengths int32 [R] (0 <= ell_r <= gamma) for confidences [R, gamma_max].

    `gamma` (default: the number of columns) limits the block; `threshold` is required by the
    'threshold' policy; `old_confidences` [R, gamma_max] (two rounds old) by 'confidence_async'.
    `cost_table` may be None only for the rule-based policies (plain, fixed, mtp1, threshold); when
    given, R must fit its largest slots bucket.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown scheduling policy {policy!r}; valid policies: {', '.join(POLICIES)}")
    c = _validate_confidences(confidences, "confidences", gamma)
    R, G = c.shape
    if cost_table is not None:
        if not isinstance(cost_table, CostTable):
            raise ValueError(f"cost_table must be a CostTable or None, got {type(cost_table).__name__}")
        cost_table.staircase(max(R, 1))  # R beyond the largest slots bucket -> ValueError
    elif policy in COST_AWARE_POLICIES:
        raise ValueError(f"policy {policy!r} needs a cost_table")
    if policy == "threshold":
        theta = _validate_threshold(threshold)
    elif threshold is not None:
        raise ValueError(f"threshold= is only used by policy 'threshold', not {policy!r}")
    if policy == "confidence_async":
        if old_confidences is None:
            raise ValueError("policy 'confidence_async' needs old_confidences [R, gamma]")
        old = _validate_confidences(old_confidences, "old_confidences", gamma)
        if old.shape != c.shape:
            raise ValueError(
                f"old_confidences shape {old.shape} must equal confidences shape {c.shape}"
            )
    elif old_confidences is not None:
        raise ValueError(f"old_confidences= is only used by policy 'confidence_async', not {policy!r}")

    if policy == "confidence":
        return _confidence(c, cost_table)  # type: ignore[arg-type]
    if policy == "confidence_async":
        return _confidence_async(c, old, cost_table)  # type: ignore[arg-type]
    if policy == LOSSY_POLICY:
        return _anticipating(c, cost_table)  # type: ignore[arg-type]
    if policy in FIXED_POLICIES:
        out = np.full(R, fixed_length(policy, G), dtype=LENGTH_DTYPE)
    else:  # threshold
        out = _threshold(c, theta)
    _check_executable(out, cost_table, policy)
    return out

