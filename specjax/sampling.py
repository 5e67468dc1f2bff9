"""The sampling transform, categorical sampling and per-request PRNG streams.

`probs_from_logits` is the ONE transform (temperature, then min-p, top-k and top-p) that turns logits
into the distribution a token is drawn from. Speculative decoding is exact only if target and draft
logits go through this same function with the same per-row parameters, so every drafter and the
verifier call it. All device functions are jittable with static shapes (no data-dependent shapes)
and never produce NaN for finite (or -inf) logits. The transform has three static variants
(`SamplingArrays.variant`: greedy, plain, filtered) so that a round whose rows need no filter has no
branch and no loop. The filtered variant finds the top-k and top-p thresholds among the
`top_k_cap` largest logits (`lax.top_k`, no sort of the vocabulary); when a row's kept set may
reach past them it takes the exact bisection over the float32 bit patterns instead (32 masked
reductions over the vocabulary), so the result never depends on the cap.

Rules, per row:

* temperature 0 is greedy: a one-hot at the argmax of the raw logits (lowest index on ties); top-k
  and top-p are then irrelevant.
* min-p (0 < m <= 1, vLLM's): keep every token whose temperature-scaled probability is >= m times
  the largest one, i.e. scaled logit >= max + log(m) (the top token always stays). m = 0 is off.
* top-k (k > 0 and k < V): keep every token whose scaled logit is >= the k-th largest scaled logit.
  Tokens tied with the k-th largest are all kept, so the kept set may exceed k; the rule does not
  depend on vocabulary order. k = 0 or k >= V is off.
* top-p (p < 1): on the temperature-scaled, min-p and top-k filtered distribution, sort probabilities in
  descending order and take the shortest prefix whose mass is >= p (this always contains the top
  token); then keep every token whose probability is >= the smallest probability in that prefix
  (ties at the boundary are all kept). p = 1 is off exactly (no rounding can drop tail tokens).
* the kept probabilities are renormalised to sum to one.

Logits that are NaN count as -inf (never drawn); a row whose logits are all -inf yields the one-hot
at index 0 rather than NaN.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

_F32_MAX = float(np.finfo(np.float32).max)


def validate_sampling(temperature: Any, top_k: Any, top_p: Any, min_p: Any = 0.0) -> None:
    """Check host-side sampling parameters (scalars or per-request sequences).

    Raises ValueError naming the field: `temperature` must be finite and >= 0, `top_k` an integer
    >= 0 (0 = off), `top_p` finite in (0, 1] (1 = off), `min_p` finite in [0, 1] (0 = off).
    """
    t = _as_float_array(temperature, "temperature")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature!r}")
    k = _as_float_array(top_k, "top_k")
    if not np.all(np.isfinite(k)) or np.any(k != np.round(k)):
        raise ValueError(f"top_k must be an integer (0 = off), got {top_k!r}")
    if np.any(k < 0):
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k!r}")
    if np.any(k > np.iinfo(np.int32).max):
        raise ValueError(f"top_k must fit in int32, got {top_k!r}")
    p = _as_float_array(top_p, "top_p")
    if not np.all(np.isfinite(p)) or np.any(p <= 0) or np.any(p > 1):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    m = _as_float_array(min_p, "min_p")
    if not np.all(np.isfinite(m)) or np.any(m < 0) or np.any(m > 1):
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p!r}")


def _as_float_array(value: Any, field: str) -> np.ndarray:
    if isinstance(value, (bool, np.bool_)) or (
            isinstance(value, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in value)):
        raise ValueError(f"{field} must be a number, got {value!r}")
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field} must be a number or a sequence of numbers, got {value!r}") from e
    if arr.ndim > 1:
        raise ValueError(f"{field} must be a scalar or a 1-D sequence, got shape {arr.shape}")
    return arr


VARIANTS = ("greedy", "plain", "filtered")  # narrowest first: each covers the rows the previous ones do
DEFAULT_TOP_K_CAP = 64


def sampling_variant(temperature: Any, top_k: Any, top_p: Any, min_p: Any = 0.0) -> str:
    """The narrowest variant (VARIANTS) exact for these rows' (validated) parameters: "greedy" when
    every row has temperature 0 and none sets a filter (min-p, top-k, top-p), "plain" when no row sets
    a filter, else "filtered". A row's filter counts even at temperature 0 (log-probabilities read a
    greedy row at temperature 1 with its filters)."""
    t = np.asarray(temperature, np.float64).reshape(-1)
    k = np.asarray(top_k, np.float64).reshape(-1)
    p = np.asarray(top_p, np.float64).reshape(-1)
    if np.any(k > 0) or np.any(p < 1) or np.any(np.asarray(min_p, np.float64) > 0):
        return "filtered"
    return "greedy" if np.all(t <= 0) else "plain"


def covering_variant(temperature: Any, top_k: Any, top_p: Any, compiled: Sequence[str], where: str,
                     min_p: Any = 0.0) -> str:
    """The narrowest variant in `compiled` exact for these rows; a ValueError naming the parameters
    and `where` (the setting that lists the compiled variants) when none is."""
    need = VARIANTS.index(sampling_variant(temperature, top_k, top_p, min_p))
    for v in VARIANTS[need:]:
        if v in compiled:
            return v
    raise ValueError(f"temperature={temperature!r}, top_k={top_k!r}, top_p={top_p!r}, min_p={min_p!r} need the "
                     f"{VARIANTS[need]!r} sampling variant, which is not compiled ({where} = {tuple(compiled)})")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["temperature", "top_k", "top_p", "min_p"],
                   meta_fields=["variant", "top_k_cap"])
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters as device arrays (a pytree; pass it straight into jit).

    `variant` and `top_k_cap` are static (in the treedef: each variant is its own trace). `variant`
    picks the transform `probs_from_logits` traces, with no branch on the data: "greedy" (every row
    is read as temperature 0), "plain" (min-p, top-k and top-p are not applied) or "filtered" (the full
    rule). The host picks it from every row's parameters (`sampling_variant`); a narrower variant
    than the rows need gives a wrong distribution. `top_k_cap` bounds the `lax.top_k` the filtered
    transform works in (see `probs_from_logits`)."""

    temperature: Array  # [B] float32; 0 = greedy
    top_k: Array  # [B] int32; 0 = off
    top_p: Array  # [B] float32; 1.0 = off
    min_p: Array  # [B] float32; 0.0 = off
    variant: str = "filtered"
    top_k_cap: int = DEFAULT_TOP_K_CAP

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"sampling variant must be one of {VARIANTS}, got {self.variant!r}")
        if isinstance(self.top_k_cap, bool) or not isinstance(self.top_k_cap, int) or self.top_k_cap < 1:
            raise ValueError(f"top_k_cap must be a positive int, got {self.top_k_cap!r}")

    @property
    def greedy(self) -> bool:
        """Static: every row's distribution is a one-hot (the "greedy" variant), so draws need no
        random bits (`sample(..., greedy=True)`)."""
        return self.variant == "greedy"

    @classmethod
    def broadcast(cls, b: int, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, min_p: float = 0.0) -> "SamplingArrays":
        """The same (validated) parameters for all `b` rows, in the narrowest exact variant."""
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 0:
            raise ValueError(f"batch size b must be a non-negative int, got {b!r}")
        validate_sampling(temperature, top_k, top_p, min_p)
        return cls(temperature=jnp.full((b,), temperature, jnp.float32),
                   top_k=jnp.full((b,), int(top_k), jnp.int32),
                   top_p=jnp.full((b,), top_p, jnp.float32), min_p=jnp.full((b,), min_p, jnp.float32),
                   variant=sampling_variant(temperature, top_k, top_p, min_p))

    @classmethod
    def from_values(cls, temperature: Sequence[float], top_k: Sequence[int],
                    top_p: Sequence[float], min_p: Sequence[float] | None = None) -> "SamplingArrays":
        """Per-row (validated) parameters in the narrowest exact variant; the sequences must have
        the same length (`min_p` None: off for every row)."""
        t = np.asarray(temperature, np.float32).reshape(-1)
        m = np.zeros_like(t) if min_p is None else np.asarray(min_p, np.float32).reshape(-1)
        validate_sampling(temperature, top_k, top_p, m)
        k = np.asarray(top_k, np.float64).reshape(-1).astype(np.int32)
        p = np.asarray(top_p, np.float32).reshape(-1)
        if not (t.shape == k.shape == p.shape == m.shape):
            raise ValueError(f"temperature, top_k, top_p and min_p must have the same length, got "
                             f"{t.shape[0]}, {k.shape[0]}, {p.shape[0]}, {m.shape[0]}")
        return cls(temperature=jnp.asarray(t), top_k=jnp.asarray(k), top_p=jnp.asarray(p), min_p=jnp.asarray(m),
                   variant=sampling_variant(t, k, p, m))


def _per_row(a_b: Array, ndim: int, dtype: Any) -> Array:
    """[B] -> [B, 1, ..., 1] with `ndim` axes in all."""
    a_b = jnp.asarray(a_b, dtype)
    return a_b.reshape(a_b.shape + (1,) * (ndim - a_b.ndim))


@jax.jit
def _ordered_bits(x: Array) -> Array:
    """float32 -> uint32 whose unsigned order is the float order (-0.0 just below +0.0)."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(i >> 31 == 1, ~i, i | jnp.uint32(0x80000000))


def _from_ordered_bits(u: Array) -> Array:
    i = jnp.where(u >> 31 == 1, u & jnp.uint32(0x7FFFFFFF), ~u)
    return jax.lax.bitcast_convert_type(i, jnp.float32)


def _largest_passing(pred: Any, shape: tuple[int, ...]) -> Array:
    """Per row, the largest uint32 u with pred(u) true, for a pred that is monotone (true up to
    some u*, false above) and true at 0: 32 bisection steps, exact."""
    lo = jnp.zeros(shape, jnp.uint32)
    hi = jnp.full(shape, 0xFFFFFFFF, jnp.uint32)

    def step(_, lo_hi):
        lo, hi = lo_hi
        gap = hi - lo
        mid = lo + (gap >> 1) + (gap & 1)  # upper middle: no overflow, progress when gap = 1
        ok = pred(mid) & (gap > 0)
        return jnp.where(ok, mid, lo), jnp.where(ok | (gap == 0), hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return lo


def _kth_largest(z: Array, k: Array) -> Array:
    """The k-th largest value of z along the last axis (k [..., 1] int32 in [1, V]), [..., 1]."""
    u = _ordered_bits(z)
    kth = _largest_passing(lambda t: jnp.sum(u >= t, axis=-1, keepdims=True) >= k,
                           z.shape[:-1] + (1,))
    return _from_ordered_bits(kth)


def _mass_cutoff(probs: Array, p: Array) -> Array:
    """The largest probability c with sum(probs >= c) >= p ([..., 1]); probs >= 0. -inf (keep
    everything) when rounding leaves the whole row's mass below p."""
    u = _ordered_bits(probs)
    c = _largest_passing(
        lambda t: jnp.sum(jnp.where(u >= t, probs, 0.0), axis=-1, keepdims=True) >= p,
        probs.shape[:-1] + (1,))
    return jnp.where(c == 0, -jnp.inf, _from_ordered_bits(c))


def _shifted_exp(z: Array, top: Array) -> Array:
    """exp(z - top) for the rows' max `top` [..., 1] (a row of -inf: exp(z) = 0, no NaN)."""
    return jnp.exp(z - jnp.where(jnp.isfinite(top), top, 0.0))


def _softmax(z: Array) -> Array:
    e = _shifted_exp(z, jnp.max(z, axis=-1, keepdims=True))
    s = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(s > 0, s, 1.0)


def _stats_three_reductions(z: Array) -> tuple[Array, Array, Array]:
    top, top_id = _max_argmax_two_reductions(z)
    return top, top_id, jnp.sum(_shifted_exp(z, top), axis=-1, keepdims=True)


def _stats_one_reduction(z: Array) -> tuple[Array, Array, Array]:
    # a running (max, first argmax, sum of exp(z - max)) per row, merged pairwise; an element's own
    # sum is 1 (0 at -inf), and a part with sum 0 adds nothing (its max may be -inf)
    ids = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)

    def merge(a: tuple[Array, Array, Array], b: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        (m1, i1, s1), (m2, i2, s2) = a, b
        m = jnp.maximum(m1, m2)
        first = jnp.where(m1 > m2, i1, jnp.where(m2 > m1, i2, jnp.minimum(i1, i2)))
        return m, first, sum(jnp.where(sk > 0, sk * jnp.exp(mk - m), 0.0) for mk, sk in ((m1, s1), (m2, s2)))
    inits = (jnp.float32(-jnp.inf), jnp.int32(z.shape[-1]), jnp.float32(0.0))
    top, top_id, s = jax.lax.reduce((z, ids, jnp.where(z > -jnp.inf, 1.0, 0.0)), inits, merge, (z.ndim - 1,))
    return top[..., None], top_id, s[..., None]


def softmax_stats(z: Array) -> tuple[Array, Array, Array]:
    """The rows' max [..., 1] of NaN-free z, its int32 index (the lowest on ties) and the softmax's
    sum of exp(z - max) [..., 1]. On CPU three plain reductions (XLA:CPU vectorises them, not a
    variadic reduction); elsewhere one variadic reduction with a running max (one pass over the row
    on a GPU). The sums agree to rounding."""
    return jax.lax.platform_dependent(z, cpu=_stats_three_reductions, default=_stats_one_reduction)


def _min_p_masked(z: Array, m: Array) -> Array:
    """Scaled logits z with the tokens min-p `m` [..., 1] drops set to -inf: those below the row's max
    + log(m) (m = 0: log 0 = -inf drops none; the max itself always stays)."""
    top = jnp.max(z, axis=-1, keepdims=True)
    floor = jnp.where(m > 0, top + jnp.log(jnp.where(m > 0, m, 1.0)), -jnp.inf)
    return jnp.where(z < floor, -jnp.inf, z)


def _filtered_by_bisection(z: Array, k: Array, p: Array, k_on: Array, p_on: Array) -> Array:
    """The filtered probabilities of every row, thresholds found by bisection over the vocabulary."""
    v = z.shape[-1]
    kth = _kth_largest(z, jnp.clip(k, 1, v))
    probs = _softmax(jnp.where(k_on & (z < kth), -jnp.inf, z))
    # top-p: the shortest descending prefix with mass >= p; its smallest probability is the
    # largest c with mass(probs >= c) >= p.
    return jnp.where(p_on & (probs < _mass_cutoff(probs, p)), 0.0, probs)


def _outside_cap(k_far: Array, mass_in_cap: Array, p: Array, p_on: Array) -> Array:
    """Rows whose kept set the top-`cap` candidates may not hold: top-k above the cap, or a top-p
    nucleus with more mass than the cap's candidates carry ([..., 1] bool)."""
    return k_far | (p_on & (mass_in_cap < p))


def _filtered(z: Array, k: Array, p: Array, k_on: Array, p_on: Array, active: Array, cap: int) -> Array:
    """Top-k then top-p within the `cap` largest scaled logits (one `lax.top_k`): exact for rows
    whose kept set lies in those candidates. When any `active` row's may not (`_outside_cap`), all
    rows take the exact bisection path instead, so the result never depends on the cap."""
    v = z.shape[-1]
    cap = min(cap, v)
    vals, idx = jax.lax.top_k(z, cap)  # [..., cap] descending
    kth = jnp.take_along_axis(vals, jnp.clip(k, 1, cap) - 1, axis=-1)
    probs = _softmax(jnp.where(k_on & (z < kth), -jnp.inf, z))
    desc = jnp.take_along_axis(probs, idx, axis=-1)  # the filtered probabilities, still descending
    cum = jnp.cumsum(desc, axis=-1)
    # top-p: the prefix ends at the first position whose inclusive mass reaches p; ties with its
    # probability (inside or beyond the cap) are all kept by thresholding the full row.
    count = jnp.minimum(jnp.sum(cum - desc < p, axis=-1, keepdims=True), cap)
    cutoff = jnp.take_along_axis(desc, jnp.maximum(count, 1) - 1, axis=-1)
    capped = jnp.where(p_on & (probs < cutoff), 0.0, probs)
    far = _outside_cap(k_on & (k > cap), cum[..., -1:], p, p_on) & active
    return jax.lax.cond(jnp.any(far), _filtered_by_bisection, lambda *_: capped, z, k, p, k_on, p_on)


def probs_from_logits(logits: Array, sa: SamplingArrays) -> Array:
    """Apply temperature, min-p, top-k and top-p (module docstring) to logits [B, ..., V].

    Parameters in `sa` are per row ([B]) and broadcast over the middle axes; `sa.variant` (static)
    picks the program: "greedy" is the argmax one-hot of every row, "plain" the temperature softmax
    (greedy rows one-hot), "filtered" the full rule. The filtered transform works in the
    `sa.top_k_cap` largest logits of each row and falls back to an exact bisection over the
    vocabulary (a `lax.cond`, the only branch) when a row's kept set may reach past them.
    Returns float32 probabilities of the same shape, each row summing to one.
    """
    x = _finite_logits(logits)
    v = x.shape[-1]
    vocab_ids = jnp.arange(v, dtype=jnp.int32)
    if sa.greedy:
        return (vocab_ids == first_argmax(x)[..., None]).astype(jnp.float32)
    t = _per_row(sa.temperature, x.ndim, jnp.float32)
    greedy = t <= 0.0
    z = jnp.clip(x / jnp.where(greedy, 1.0, t), -jnp.inf, _F32_MAX)  # a greedy row's z is its x
    if sa.variant == "plain":  # one pass for the row's max, argmax and softmax sum; they normalise
        top, top_id, s = softmax_stats(z)
        onehot = (vocab_ids == top_id[..., None]).astype(jnp.float32)
        return jnp.where(greedy | (s <= 0), onehot, _shifted_exp(z, top) / jnp.where(s > 0, s, 1.0))
    onehot = (vocab_ids == first_argmax(x)[..., None]).astype(jnp.float32)
    k = _per_row(sa.top_k, x.ndim, jnp.int32)
    p = _per_row(sa.top_p, x.ndim, jnp.float32)
    k_on, p_on = (k > 0) & (k < v), p < 1.0
    probs = _filtered(_min_p_masked(z, _per_row(sa.min_p, x.ndim, jnp.float32)), k, p, k_on, p_on, ~greedy,
                      sa.top_k_cap)
    s = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(s > 0, s, 1.0)
    return jnp.where(greedy | (s <= 0), onehot, probs)


def _is_typed_key(key: Array) -> bool:
    return jnp.issubdtype(key.dtype, jax.dtypes.prng_key)


def _as_typed_key(key: Array) -> Array:
    if _is_typed_key(key):
        return key
    key = jnp.asarray(key)
    if key.dtype == jnp.uint32 and key.ndim >= 1 and key.shape[-1] == 2:
        return jax.random.wrap_key_data(key)
    raise ValueError(f"key must be a typed PRNG key (jax.random.key) or raw uint32 [..., 2] key "
                     f"data, got dtype {key.dtype} shape {key.shape}")


def _max_argmax_two_reductions(x: Array) -> tuple[Array, Array]:
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    top = jnp.max(x, axis=-1, keepdims=True)
    return top, jnp.min(jnp.where(x == top, ids, x.shape[-1]), axis=-1)


def _finite_logits(logits: Array) -> Array:
    """Logits [B, ..., V] as float32, NaN read as -inf and +inf as the largest float (exp() stays
    finite)."""
    x = jnp.asarray(logits, jnp.float32)
    if x.ndim < 2:
        raise ValueError(f"logits must be [B, ..., V], got shape {x.shape}")
    return jnp.minimum(jnp.where(jnp.isnan(x), -jnp.inf, x), _F32_MAX)


def first_argmax(x: Array) -> Array:
    """int32 index of the largest entry along the last axis (the lowest on ties), for NaN-free x, as
    `jnp.argmax`. On CPU from two plain reductions (a max, then a min over the indices holding it),
    which XLA:CPU vectorises where its variadic argmax reduction is not (2-4x faster over a
    vocabulary); elsewhere the variadic one (one pass over the row on a GPU)."""
    return jax.lax.platform_dependent(x, cpu=lambda x: _max_argmax_two_reductions(x)[1],
                                      default=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))


def draft_probs(logits: Array, sa: SamplingArrays, dtype: Any) -> Array:
    """A drafter's q: `probs_from_logits` rounded to `dtype`, the drafter's compute dtype (bfloat16
    halves what travels from draft to verify). Draws come from the rounded q (`sample` needs no
    normalised row) and the verifier renormalises it, so verification stays exact."""
    return probs_from_logits(logits, sa).astype(dtype)


def draft_draw(key: Array, logits_bn: Array, sa: SamplingArrays, dtype: Any) -> tuple[Array, Array | None]:
    """A drafter's draw from its logits [B, N]: (index [B] int32, q [B, N]), q the rounded
    probabilities it was drawn from (`draft_probs`). In a greedy round (`sa.greedy`) q is None: it is
    the one-hot of the index (`one_hot_q`), which the greedy verifier does not read, so a drafting
    loop need not carry it."""
    if sa.greedy:
        return first_argmax(_finite_logits(logits_bn)), None
    q = draft_probs(logits_bn, sa, dtype)
    return sample(key, q), q


def one_hot_q(index: Array, n: int, dtype: Any) -> Array:
    """The q of greedy draws `index` [...] over n columns: one-hot [..., n] in `dtype`, equal to
    `draft_probs` of a greedy round."""
    return (jnp.arange(n, dtype=jnp.int32) == index[..., None]).astype(dtype)


@functools.partial(jax.jit, static_argnames=("greedy",))
def sample(key: Array, probs: Array, greedy: bool = False) -> Array:
    """Draw int32 tokens from `probs` [..., V] (categorical; zero-probability tokens never drawn).

    `greedy` (static): every row of `probs` is one-hot (the "greedy" variant of `probs_from_logits`,
    or a verifier's residual of one-hot p and q), so the draw is its argmax with certainty and no
    random bits are drawn.

    `key` is either one key (shape ()), used for the whole array, or a batch of keys whose shape is
    a prefix of `probs.shape[:-1]`: e.g. key_b [B] with probs [B, V] gives one draw per row from its
    own key, and key_b [B] with probs [B, G, V] gives G draws per row, all from that row's key, so
    a row's draws do not depend on the other rows. Returns tokens of shape probs.shape[:-1].
    """
    key = _as_typed_key(key)
    probs = jnp.asarray(probs, jnp.float32)
    if key.shape != probs.shape[:key.ndim] or key.ndim >= probs.ndim:
        raise ValueError(f"key batch shape {key.shape} must prefix probs batch shape "
                         f"{probs.shape[:-1]}")

    if greedy:
        return first_argmax(probs)

    def draw(k: Array, pr: Array) -> Array:
        logp = jnp.where(pr > 0, jnp.log(jnp.where(pr > 0, pr, 1.0)), -jnp.inf)
        return jax.random.categorical(k, logp, axis=-1).astype(jnp.int32)

    fn = draw
    for _ in range(key.ndim):
        fn = jax.vmap(fn)
    return fn(key, probs)  # a one-hot row (greedy) draws its token with certainty: no branch


def _check_seed(seed: Any) -> int:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, (bool, np.bool_)):
        raise ValueError(f"seed must be an int, got {seed!r}")
    seed = int(seed)
    if seed < 0 or seed >= 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def request_key(seed: int) -> Array:
    """The base PRNG key of a seeded request (any int in [0, 2**64)).

    Equal to `jax.random.key(seed)` for seeds below 2**32; larger seeds fold their high 32 bits in,
    so distinct 64-bit seeds give distinct streams even with 32-bit jax.
    """
    return keys_for_batch([seed])[0]


def keys_for_batch(seeds: Sequence[int]) -> Array:
    """[B] typed keys, `request_key(seeds[b])` for each row, built in one vectorised call."""
    checked = [_check_seed(s) for s in seeds]
    lo = jnp.asarray(np.asarray([s & 0xFFFFFFFF for s in checked], np.uint32).reshape(-1))
    hi = np.asarray([s >> 32 for s in checked], np.uint32).reshape(-1)
    keys = jax.vmap(jax.random.key)(lo)
    if np.any(hi):
        folded = jax.vmap(jax.random.fold_in)(keys, jnp.asarray(hi))
        data = jnp.where(jnp.asarray(hi != 0)[:, None], jax.random.key_data(folded),
                         jax.random.key_data(keys))
        keys = jax.random.wrap_key_data(data, impl=jax.random.key_impl(keys))
    return keys


def round_key(base_key_b: Array, counter_b: Array | int) -> Array:
    """Per-row key for one round: fold_in(base_key_b[b], counter_b[b]).

    `base_key_b` is [B] typed keys (one per request, from `request_key`), `counter_b` [B] (or a
    scalar) int: each request's own round counter, so its stream never depends on which other
    requests share the batch. Nest calls to derive purpose keys, e.g. round_key(k_b, 0) / (k_b, 1).
    """
    base_key_b = _as_typed_key(base_key_b)
    counter_b = jnp.broadcast_to(jnp.asarray(counter_b, jnp.uint32), base_key_b.shape)
    fold = jax.random.fold_in
    for _ in range(base_key_b.ndim):
        fold = jax.vmap(fold)
    return fold(base_key_b, counter_b)


__all__ = ["SamplingArrays", "VARIANTS", "sampling_variant", "covering_variant", "probs_from_logits", "draft_probs", "draft_draw",
           "one_hot_q", "sample",
           "first_argmax", "softmax_stats",
           "request_key", "round_key", "keys_for_batch", "validate_sampling"]
