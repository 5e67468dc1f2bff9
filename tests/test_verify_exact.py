"""Losslessness of chain verification: exact enumeration, Monte-Carlo chi-square, greedy, stops.

Also the sampling transform (`probs_from_logits`), `sample`, per-request keys and
`validate_sampling`.
"""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.sampling import (SamplingArrays, keys_for_batch, probs_from_logits,
                                       request_key, round_key, sample, validate_sampling)
from specjax.decoding.verify import VerifyResult, chain_round_probs, verify_chain

EMPTY_STOPS = jnp.zeros((0,), jnp.int32)


# ----------------------------------------------------------------------------------------------
# Sampling transform
# ----------------------------------------------------------------------------------------------

def _ref_transform(logits_v: np.ndarray, t: float, k: int, p: float, m: float = 0.0) -> np.ndarray:
    """Independent float64 reference of the documented rule (inputs without ties)."""
    v = logits_v.shape[-1]
    if t == 0:
        out = np.zeros(v)
        out[int(np.argmax(logits_v))] = 1.0
        return out
    z = logits_v.astype(np.float64) / t
    full = np.exp(z - z.max())
    keep = full / full.sum() >= m * (full / full.sum()).max()  # min-p on the temperature-scaled law
    if 0 < k < v:
        top = np.zeros(v, bool)
        top[np.argsort(-z)[:k]] = True
        keep &= top
    e = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    probs = e / e.sum()
    if p < 1:
        order = np.argsort(-probs)
        mass, chosen = 0.0, []
        for i in order:
            chosen.append(i)
            mass += probs[i]
            if mass >= p:
                break
        mask = np.zeros(v, bool)
        mask[chosen] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize("t,k,p,m", [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0),
                                     (1.3, 0, 0.6, 0.0), (0.8, 5, 0.75, 0.0), (0.5, 1, 0.3, 0.0), (1.0, 0, 1.0, 0.1),
                                     (0.7, 0, 1.0, 0.3), (1.2, 6, 0.9, 0.15), (0.0, 0, 1.0, 0.5), (1.0, 0, 1.0, 1.0)])
def test_probs_from_logits_matches_reference(t: float, k: int, p: float, m: float) -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 3, 11)).astype(np.float32) * 2
    got = np.asarray(probs_from_logits(jnp.asarray(logits), SamplingArrays.broadcast(4, t, k, p, m)))
    assert got.shape == logits.shape and got.dtype == np.float32
    dropped = 0  # tokens min-p removed from what the other filters keep
    for idx in np.ndindex(4, 3):
        want = _ref_transform(logits[idx], t, k, p, m)
        np.testing.assert_allclose(got[idx], want, atol=2e-6)
        dropped += int(np.sum(_ref_transform(logits[idx], t, k, p) > 0) - np.sum(want > 0))
    assert (dropped > 0) == (m > 0 and t > 0)  # a min-p case that filters nothing would test nothing


def test_probs_from_logits_per_row_params_and_edge_cases() -> None:
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.0, -jnp.inf],
                          [1.0, 3.0, 3.0, 0.0, -jnp.inf],
                          [1.0, 3.0, 3.0, 0.0, -jnp.inf],
                          [2.0, 1.0, 0.0, -1.0, -2.0]])
    sa = SamplingArrays.from_values([0.0, 1.0, 1.0, 1.0], [0, 1, 0, 0], [1.0, 1.0, 0.5, 0.1])
    probs = np.asarray(probs_from_logits(logits, sa))
    np.testing.assert_array_equal(probs[0], [0, 1, 0, 0, 0])  # greedy: lowest index on ties
    np.testing.assert_allclose(probs[1], [0, 0.5, 0.5, 0, 0], atol=1e-7)  # top-k keeps ties
    np.testing.assert_allclose(probs[2], [0, 0.5, 0.5, 0, 0], atol=1e-7)  # top-p keeps ties
    np.testing.assert_allclose(probs[3], [1, 0, 0, 0, 0], atol=1e-7)  # top-p keeps top token
    # Middle axes broadcast the per-row parameters.
    probs3 = np.asarray(probs_from_logits(jnp.stack([logits, logits], axis=1), sa))
    np.testing.assert_array_equal(probs3[:, 0], probs)
    np.testing.assert_array_equal(probs3[:, 1], probs)
    # top_p = 1 is off exactly: a tail token of tiny mass survives.
    tail = jnp.asarray([[30.0, 0.0, 0.0]])
    assert float(probs_from_logits(tail, SamplingArrays.broadcast(1))[0, 2]) > 0
    # Degenerate rows stay NaN-free.
    bad = jnp.asarray([[-jnp.inf] * 4, [jnp.nan, 1.0, jnp.inf, 2.0]])
    out = np.asarray(probs_from_logits(bad, SamplingArrays.broadcast(2, 0.7, 2, 0.9)))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out.sum(-1), 1.0, atol=1e-6)
    assert out[1, 2] == 1.0


def test_sample_respects_support_and_row_keys() -> None:
    probs = jnp.asarray([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 1.0]])
    keys = keys_for_batch([3, 4])
    many = sample(jax.random.key(0), jnp.broadcast_to(probs, (5000, 2, 4)))
    assert set(np.unique(np.asarray(many[:, 0]))) == {1, 3}
    assert np.all(np.asarray(many[:, 1]) == 3)
    # Per-row keys: a row's draws do not depend on the other rows.
    probs_g = jnp.full((2, 64, 4), 0.25)
    a = np.asarray(sample(keys, probs_g))
    b = np.asarray(sample(keys[:1], probs_g[:1]))
    np.testing.assert_array_equal(a[0], b[0])
    assert a.shape == (2, 64) and not np.array_equal(a[0], a[1])
    with pytest.raises(ValueError, match="key batch shape"):
        sample(keys, jnp.full((3, 4), 0.25))


def test_request_and_round_keys() -> None:
    assert not np.array_equal(jax.random.key_data(request_key(0)),
                              jax.random.key_data(request_key(2 ** 32)))
    np.testing.assert_array_equal(jax.random.key_data(request_key(7)),
                                  jax.random.key_data(jax.random.key(7)))
    base = keys_for_batch([11, 12, 13])
    r = round_key(base, jnp.asarray([0, 5, 9]))
    single = round_key(base[1:2], jnp.asarray([5]))
    np.testing.assert_array_equal(jax.random.key_data(r[1]), jax.random.key_data(single[0]))
    with pytest.raises(ValueError, match="seed"):
        request_key(-1)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1, top_k=0, top_p=1.0), "temperature"),
    (dict(temperature=float("nan"), top_k=0, top_p=1.0), "temperature"),
    (dict(temperature=1.0, top_k=-1, top_p=1.0), "top_k"),
    (dict(temperature=1.0, top_k=2.5, top_p=1.0), "top_k"),
    (dict(temperature=1.0, top_k=0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_k=0, top_p=1.5), "top_p"),
    (dict(temperature=[1.0, -2.0], top_k=[0, 0], top_p=[1.0, 1.0]), "temperature"),
    (dict(temperature=[1.0, 1.0], top_k=[0, 0], top_p=[1.0, -0.5]), "top_p"),
    (dict(temperature=1.0, top_k=0, top_p=1.0, min_p=-0.1), "min_p"),
    (dict(temperature=1.0, top_k=0, top_p=1.0, min_p=1.5), "min_p"),
    (dict(temperature=[1.0, 1.0], top_k=[0, 0], top_p=[1.0, 1.0], min_p=[0.0, float("nan")]), "min_p"),
])
def test_validate_sampling_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        validate_sampling(**kwargs)
    with pytest.raises(ValueError, match=field):
        if isinstance(kwargs["temperature"], list):
            SamplingArrays.from_values(**kwargs)
        else:
            SamplingArrays.broadcast(2, **kwargs)


def test_validate_sampling_accepts_good_values() -> None:
    validate_sampling(0.0, 0, 1.0)
    validate_sampling([0.0, 2.0], [0, 40], [1.0, 0.01])
    with pytest.raises(ValueError, match="same length"):
        SamplingArrays.from_values([1.0, 1.0], [0], [1.0, 1.0])


# ----------------------------------------------------------------------------------------------
# Exact enumeration of one verification round
# ----------------------------------------------------------------------------------------------

V_ENUM = 5
CTX0, ANCHOR = 2, 4  # fixed context: the token before the anchor, and the anchor
MAX_SEQS = V_ENUM ** 3


@jax.jit
def _round_probs_batched(p_sgv: jax.Array, q_sgv: jax.Array, d_sg: jax.Array, ell: jax.Array):
    return jax.vmap(chain_round_probs, in_axes=(0, 0, 0, None))(p_sgv, q_sgv, d_sg, ell)


class _TableModel:
    """Target p(. | prev2, prev1) and draft q_k(. | prev1), after the sampling transform."""

    def __init__(self, seed: int, sa_kwargs: dict, g_max: int = 3) -> None:
        rng = np.random.default_rng(seed)
        v = V_ENUM
        target_logits = rng.normal(size=(v * v, v)).astype(np.float32) * 1.5
        draft_logits = rng.normal(size=(g_max * v, v)).astype(np.float32) * 1.5
        self.p = np.asarray(probs_from_logits(
            jnp.asarray(target_logits), SamplingArrays.broadcast(v * v, **sa_kwargs)),
            np.float64).reshape(v, v, v)
        self.q = np.asarray(probs_from_logits(
            jnp.asarray(draft_logits), SamplingArrays.broadcast(g_max * v, **sa_kwargs)),
            np.float64).reshape(g_max, v, v)
        self._joint_cache: dict = {}

    def target_joint(self, ctx: tuple[int, int], length: int) -> np.ndarray:
        """Exact target law of the next `length` tokens after context ending (prev2, prev1)."""
        key = (ctx, length)
        if key not in self._joint_cache:
            if length == 0:
                out = np.array(1.0)
            else:
                out = np.stack([self.p[ctx][y] * self.target_joint((ctx[1], y), length - 1)
                                for y in range(V_ENUM)])
            self._joint_cache[key] = out
        return self._joint_cache[key]

    def round_output_joint(self, g: int, ell: int, round_fn=None) -> np.ndarray:
        """Law of the first ell+1 tokens: one verified round, then exact target sampling."""
        v = V_ENUM
        seqs = list(itertools.product(range(v), repeat=ell))
        p_sgv = np.full((MAX_SEQS, g + 1, v), np.nan, np.float32)  # padding is NaN garbage
        q_sgv = np.full((MAX_SEQS, g, v), np.nan, np.float32)
        d_sg = np.full((MAX_SEQS, g), -1, np.int32)
        weights = np.zeros(len(seqs))
        for s, x in enumerate(seqs):
            hist = (CTX0, ANCHOR) + x
            weights[s] = 1.0
            for k in range(ell + 1):
                p_sgv[s, k] = self.p[hist[k], hist[k + 1]]
            for k in range(ell):
                q_sgv[s, k] = self.q[k, hist[k + 1]]
                weights[s] *= self.q[k, hist[k + 1], x[k]]
            d_sg[s, :ell] = x
        round_fn = round_fn or _round_probs_batched
        acc, nxt = round_fn(jnp.asarray(p_sgv), jnp.asarray(q_sgv),
                                        jnp.asarray(d_sg), jnp.asarray(ell, jnp.int32))
        acc = np.asarray(acc, np.float64)[:len(seqs)]  # rows past len(seqs) are unused padding
        nxt = np.asarray(nxt, np.float64)[:len(seqs)]
        assert np.all(np.isfinite(acc)) and np.all(np.isfinite(nxt))
        joint = np.zeros((v,) * (ell + 1))
        for s, x in enumerate(seqs):
            if weights[s] == 0:
                continue
            survive = weights[s]
            for n in range(ell + 1):
                path = survive * ((1.0 - acc[s, n]) if n < ell else 1.0)
                if n < ell:
                    survive *= acc[s, n]
                if path == 0:
                    continue
                for y in range(v):
                    mass = path * nxt[s, n, y]
                    if mass == 0:
                        continue
                    emitted = x[:n] + (y,)
                    hist = (CTX0, ANCHOR) + emitted
                    joint[emitted] += mass * self.target_joint(hist[-2:], ell - n)
        return joint


ENUM_CONFIGS = {
    "t1": dict(temperature=1.0),
    "t0.7": dict(temperature=0.7),
    "topk": dict(temperature=1.0, top_k=3),
    "topp": dict(temperature=0.9, top_p=0.7),
    "t0.7_topk_topp": dict(temperature=0.7, top_k=4, top_p=0.8),
    "minp": dict(temperature=1.0, min_p=0.3),
    "minp_topp": dict(temperature=0.8, top_p=0.9, min_p=0.1),
    "greedy": dict(temperature=0.0),
}


@pytest.mark.parametrize("name", list(ENUM_CONFIGS))
def test_round_is_lossless_by_enumeration(name: str) -> None:
    model = _TableModel(seed=len(name), sa_kwargs=ENUM_CONFIGS[name])
    for g in (1, 2, 3):
        for ell in range(g + 1):
            joint = model.round_output_joint(g, ell)
            target = model.target_joint((CTX0, ANCHOR), ell + 1)
            np.testing.assert_allclose(joint.sum(), 1.0, atol=1e-6)
            # First emitted token: exactly p_0.
            np.testing.assert_allclose(joint.reshape(V_ENUM, -1).sum(-1), model.p[CTX0, ANCHOR],
                                       atol=1e-6, err_msg=f"{name} g={g} ell={ell}")
            # Whole emitted block (completed by the target): the target's joint chain law.
            np.testing.assert_allclose(joint, target, atol=1e-6, err_msg=f"{name} g={g} ell={ell}")


def test_enumeration_detects_a_wrong_residual() -> None:
    """Teeth: using p_n instead of the residual after a rejection breaks the joint law."""
    model = _TableModel(seed=1, sa_kwargs=dict(temperature=1.0))
    good = model.round_output_joint(2, 2)
    def wrong(p_gv, q_gv, draft_g, ell):
        acc, _ = chain_round_probs(p_gv, q_gv, draft_g, ell)
        return acc, jnp.where((jnp.arange(p_gv.shape[0]) <= ell)[:, None], p_gv, 0.0)

    bad = model.round_output_joint(2, 2, jax.jit(jax.vmap(wrong, in_axes=(0, 0, 0, None))))
    target = model.target_joint((CTX0, ANCHOR), 3)
    np.testing.assert_allclose(good, target, atol=1e-6)
    assert np.abs(bad - target).max() > 1e-3


# ----------------------------------------------------------------------------------------------
# Monte-Carlo: repeated jitted verify_chain rounds
# ----------------------------------------------------------------------------------------------

V_MC, G_MC, MC_ANCHOR = 6, 3, 1


@functools.partial(jax.jit, static_argnames=("rounds", "q_seen"))
def _generate(base_keys_b: jax.Array, tp_vv: jax.Array, dq_gvv: jax.Array, ell_offset_b: jax.Array,
              q_scale: jax.Array, stop_e: jax.Array, rounds: int = 3, q_ids_n: jax.Array | None = None,
              verify_ids_n: jax.Array | None = None, q_seen=None):
    """Rows generate with chain drafts; tp_vv[prev] = target probs, dq_gvv[k, prev] = draft probs.
    The verifier gets q * q_scale, through `q_seen` (a transform the drafts were not sampled from),
    in the columns `q_ids_n` (None: all), told that they are `verify_ids_n`.

    Returns (tokens [B, rounds*(G+1)], lengths [B], (num_accepted [rounds, B], ell [rounds, B])).
    """
    b = base_keys_b.shape[0]
    g = dq_gvv.shape[0]

    def one_round(carry, r):
        buf, length, last = carry
        kr = round_key(base_keys_b, r)
        kd, kv = round_key(kr, 1), round_key(kr, 0)
        prev, xs, qs = last, [], []
        for k in range(g):
            q_k = dq_gvv[k][prev]
            prev = sample(round_key(kd, k), q_k)
            xs.append(prev)
            qs.append(q_k)
        draft = jnp.stack(xs, 1)
        p = jnp.stack([tp_vv[last]] + [tp_vv[x] for x in xs], 1)
        ell = (ell_offset_b + r) % (g + 1)
        q = jnp.stack(qs, 1) * q_scale
        q = q if q_seen is None else q_seen(q)
        res = verify_chain(kv, p, q if q_ids_n is None else q[..., q_ids_n], draft, ell, stop_e, verify_ids_n)
        buf = jax.vmap(lambda row, t, o: jax.lax.dynamic_update_slice(row, t, (o,)))(
            buf, res.tokens, length)
        last = jnp.take_along_axis(res.tokens, (res.num_emitted - 1)[:, None], axis=1)[:, 0]
        return (buf, length + res.num_emitted, last), (res.num_accepted, ell)

    init = (jnp.full((b, rounds * (g + 1)), -1, jnp.int32), jnp.zeros((b,), jnp.int32),
            jnp.full((b,), MC_ANCHOR, jnp.int32))
    (buf, length, _), accepted = jax.lax.scan(one_round, init, jnp.arange(rounds))
    return buf, length, accepted


def _mc_tables(sa_kwargs: dict, seed: int = 5) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    tl = rng.normal(size=(V_MC, V_MC)).astype(np.float32) * 1.5
    dl = rng.normal(size=(G_MC * V_MC, V_MC)).astype(np.float32) * 1.5
    tp = probs_from_logits(jnp.asarray(tl), SamplingArrays.broadcast(V_MC, **sa_kwargs))
    dq = probs_from_logits(jnp.asarray(dl), SamplingArrays.broadcast(G_MC * V_MC, **sa_kwargs))
    return tp, dq.reshape(G_MC, V_MC, V_MC)


def _chi2_pvalue(tokens_b3: np.ndarray, tp: np.ndarray) -> float:
    tp = np.asarray(tp, np.float64)
    expected = (tp[MC_ANCHOR][:, None, None] * tp[:, :, None] * tp[None, :, :]).reshape(-1)
    idx = np.ravel_multi_index(tokens_b3.T, (V_MC,) * 3)
    observed = np.bincount(idx, minlength=V_MC ** 3).astype(np.float64)
    n = observed.sum()
    assert observed[expected == 0].sum() == 0, "a token outside the target's support was emitted"
    expected = expected * n
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def test_monte_carlo_chi_square_and_biased_verifier_fails() -> None:
    b = 20_000
    tp, dq = _mc_tables(dict(temperature=0.8, top_k=5))
    keys = keys_for_batch(range(b))
    ell_offset = jnp.arange(b, dtype=jnp.int32) % (G_MC + 1)  # rows differ; includes ell = 0

    buf, length, accepted = _generate(keys, tp, dq, ell_offset, jnp.float32(1.0), EMPTY_STOPS)
    assert int(jnp.min(length)) >= 3
    n0, ell0 = accepted[0][0], accepted[1][0]  # first round
    assert set(np.unique(np.asarray(ell0))) == {0, 1, 2, 3}
    assert np.all(np.asarray(n0) <= np.asarray(ell0))
    assert np.asarray(n0)[np.asarray(ell0) == 0].max() == 0
    p_good = _chi2_pvalue(np.asarray(buf[:, :3]), tp)
    assert p_good > 1e-3, p_good

    # Accept with min(1, 2p/q) (the verifier is handed q/2): must be detected.
    buf_bad, _, _ = _generate(keys, tp, dq, ell_offset, jnp.float32(0.5), EMPTY_STOPS)
    p_bad = _chi2_pvalue(np.asarray(buf_bad[:, :3]), tp)
    assert p_bad < 1e-3, p_bad


DRAFT_IDS_MC = jnp.asarray([0, 2, 3, 5], jnp.int32)  # a draft vocabulary of 4 of the 6 tokens


def _power_of_two(q: jax.Array) -> jax.Array:
    """q rounded down to a power of two: a rounded q the drafts were not sampled from."""
    return jnp.where(q > 0, jnp.exp2(jnp.floor(jnp.log2(jnp.where(q > 0, q, 1.0)))), 0.0)


def test_q_over_a_draft_vocabulary_verifies_exactly_and_wrong_columns_or_rounding_fail() -> None:
    """q carried over the draft vocabulary's columns (what the engine moves from draft to verify)
    gives the same outcome as the scattered q and passes the chi-square test; q read at the wrong
    tokens (a column map off by one) and a rounded q the drafts were not drawn from both fail it."""
    b = 20_000
    tp, dq = _mc_tables(dict(temperature=0.8, top_k=5))
    inside = jnp.zeros((V_MC,), bool).at[DRAFT_IDS_MC].set(True)
    dq = jnp.where(inside, dq, 0.0)
    dq = dq / dq.sum(-1, keepdims=True)  # drafts only ever propose the draft vocabulary
    keys = keys_for_batch(range(b))
    ell_offset = jnp.arange(b, dtype=jnp.int32) % (G_MC + 1)
    one = jnp.float32(1.0)
    full = _generate(keys, tp, dq, ell_offset, one, EMPTY_STOPS)
    sub = _generate(keys, tp, dq, ell_offset, one, EMPTY_STOPS, q_ids_n=DRAFT_IDS_MC, verify_ids_n=DRAFT_IDS_MC)
    np.testing.assert_array_equal(np.asarray(sub[0]), np.asarray(full[0]))  # the same outcome, row by row
    assert _chi2_pvalue(np.asarray(sub[0][:, :3]), tp) > 1e-3
    wrong = _generate(keys, tp, dq, ell_offset, one, EMPTY_STOPS, q_ids_n=DRAFT_IDS_MC,
                      verify_ids_n=jnp.roll(DRAFT_IDS_MC, 1))
    assert _chi2_pvalue(np.asarray(wrong[0][:, :3]), tp) < 1e-3
    rounded = _generate(keys, tp, dq, ell_offset, one, EMPTY_STOPS, q_seen=_power_of_two)
    assert _chi2_pvalue(np.asarray(rounded[0][:, :3]), tp) < 1e-3


def test_rounded_q_the_drafts_were_drawn_from_verifies_exactly_in_bfloat16() -> None:
    """A drafter's q rounded to its compute dtype (`sampling.draft_probs`) no longer sums to one;
    drafts drawn from the rounded q and the verifier handed it in bfloat16 (renormalised there) pass
    the chi-square test. Negative control: the same q handed as float32 (taken as normalised) fails.
    Rounding down to powers of two (exact in bfloat16) makes the rows sum to ~0.7, a bias the test sees."""
    b = 20_000
    tp, dq = _mc_tables(dict(temperature=0.8, top_k=5))
    dq = _power_of_two(dq)  # the rounded q the drafts are drawn from
    sums = np.asarray(dq.sum(-1))
    assert sums.min() < 0.8 and sums.max() < 1.0
    keys = keys_for_batch(range(b))
    ell_offset = jnp.arange(b, dtype=jnp.int32) % (G_MC + 1)
    bf16 = _generate(keys, tp, dq, ell_offset, jnp.float32(1.0), EMPTY_STOPS, q_seen=lambda q: q.astype(jnp.bfloat16))
    assert int(np.asarray(bf16[2][0]).sum()) > 0  # drafts were accepted
    assert _chi2_pvalue(np.asarray(bf16[0][:, :3]), tp) > 1e-3
    as_f32 = _generate(keys, tp, dq, ell_offset, jnp.float32(1.0), EMPTY_STOPS)
    assert _chi2_pvalue(np.asarray(as_f32[0][:, :3]), tp) < 1e-3


def test_verify_chain_rejects_bad_column_ids() -> None:
    keys = keys_for_batch([0, 1])
    p = jnp.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match="q_ids_n"):
        verify_chain(keys, p, jnp.full((2, 2, 2), 0.5), jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32),
                     EMPTY_STOPS, jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="q_bgn"):
        verify_chain(keys, p, jnp.full((2, 2, 3), 0.5), jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32),
                     EMPTY_STOPS, jnp.asarray([0, 2], jnp.int32))


# ----------------------------------------------------------------------------------------------
# Greedy, oracle drafts, stop tokens, padding, batch independence
# ----------------------------------------------------------------------------------------------

def test_greedy_emits_target_argmax_chain() -> None:
    b = 256
    tp, dq = _mc_tables(dict(temperature=0.0), seed=9)
    buf, length, _ = _generate(keys_for_batch(range(b)), tp, dq,
                               jnp.arange(b, dtype=jnp.int32) % (G_MC + 1), jnp.float32(1.0),
                               EMPTY_STOPS)
    tp_np = np.asarray(tp)
    chain, prev = [], MC_ANCHOR
    for _ in range(3):
        prev = int(np.argmax(tp_np[prev]))
        chain.append(prev)
    assert np.all(np.asarray(length) >= 3)
    np.testing.assert_array_equal(np.asarray(buf[:, :3]), np.tile(chain, (b, 1)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_oracle_draft_accepts_everything(temperature: float) -> None:
    b = 256
    tp, _ = _mc_tables(dict(temperature=temperature), seed=3)
    dq = jnp.broadcast_to(tp, (G_MC, V_MC, V_MC))  # q = p at every position
    _, _, accepted = _generate(keys_for_batch(range(b)), tp, dq,
                               jnp.arange(b, dtype=jnp.int32) % (G_MC + 1), jnp.float32(1.0),
                               EMPTY_STOPS)
    n, ell = accepted
    np.testing.assert_array_equal(np.asarray(n), np.asarray(ell))


def _fixed_round(stop_ids: jax.Array, ell: list[int], draft: list[list[int]]) -> VerifyResult:
    v, g = 5, 3
    p = np.full((len(ell), g + 1, v), 0.2, np.float32)
    q = np.full((len(ell), g, v), 0.2, np.float32)
    p[2, 1] = [0.5, 0.5, 0.0, 0.0, 0.0]  # row 2: target gives draft token 2 (position 2) zero mass
    return verify_chain(keys_for_batch(range(len(ell))), jnp.asarray(p), jnp.asarray(q),
                        jnp.asarray(draft, jnp.int32), jnp.asarray(ell, jnp.int32), stop_ids)


def test_stop_token_in_accepted_prefix_ends_row() -> None:
    draft = [[1, 4, 2], [1, 3, 4], [1, 2, 4], [0, 0, 2]]
    res = _fixed_round(jnp.asarray([4, -1, 0], jnp.int32), ell=[3, 2, 3, 3], draft=draft)
    # Row 0: q = p, so everything is accepted up to the stop token 4 at position 2.
    assert int(res.num_accepted[0]) == 2 and bool(res.stopped_on_draft[0])
    assert int(res.next_token[0]) == -1 and int(res.num_emitted[0]) == 2
    np.testing.assert_array_equal(np.asarray(res.tokens[0]), [1, 4, -1, -1])
    # Row 1: the stop token lies beyond ell (padding): ignored, bonus token sampled.
    assert int(res.num_accepted[1]) == 2 and not bool(res.stopped_on_draft[1])
    assert 0 <= int(res.next_token[1]) < 5 and int(res.num_emitted[1]) == 3
    np.testing.assert_array_equal(np.asarray(res.tokens[1, :2]), [1, 3])
    # Row 2: draft 2 is rejected (p = 0) before the stop token: no stop, residual token.
    assert int(res.num_accepted[2]) == 1 and not bool(res.stopped_on_draft[2])
    assert int(res.next_token[2]) in (0, 1) and int(res.num_emitted[2]) == 2
    # Row 3: the first accepted stop token ends the row.
    np.testing.assert_array_equal(np.asarray(res.tokens[3]), [0, -1, -1, -1])
    assert int(res.num_emitted[3]) == 1 and bool(res.stopped_on_draft[3])
    # Without stop ids (or only padding) row 0 runs through and gets a bonus token.
    for stops in (EMPTY_STOPS, jnp.asarray([-1, -1], jnp.int32)):
        free = _fixed_round(stops, ell=[3, 2, 3, 3], draft=draft)
        assert int(free.num_accepted[0]) == 3 and int(free.num_emitted[0]) == 4
        assert not bool(free.stopped_on_draft[0]) and int(free.next_token[0]) >= 0


def test_padding_is_ignored_and_rows_are_independent() -> None:
    rng = np.random.default_rng(0)
    b, g, v = 6, 5, 7
    p = rng.dirichlet(np.ones(v), size=(b, g + 1)).astype(np.float32)
    q = rng.dirichlet(np.ones(v), size=(b, g)).astype(np.float32)
    draft = rng.integers(0, v, size=(b, g)).astype(np.int32)
    ell = np.array([0, 1, 2, 3, 2, 1], np.int32)
    keys = keys_for_batch(range(100, 100 + b))
    res = verify_chain(keys, p, q, draft, ell, EMPTY_STOPS)
    # NaN / out-of-range garbage beyond ell changes nothing.
    p2, q2, d2 = p.copy(), q.copy(), draft.copy()
    for i, e in enumerate(ell):
        p2[i, e + 1:] = np.nan
        q2[i, e:] = np.nan
        d2[i, e:] = -7
    res2 = verify_chain(keys, p2, q2, d2, ell, EMPTY_STOPS)
    for a, c in zip(res, res2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    # A row alone, with a smaller padded block (G = 3), gives the same outcome.
    for i in range(b):
        solo = verify_chain(keys[i:i + 1], p[i:i + 1, :4], q[i:i + 1, :3], draft[i:i + 1, :3],
                            ell[i:i + 1], EMPTY_STOPS)
        assert int(solo.num_accepted[0]) == int(res.num_accepted[i])
        assert int(solo.next_token[0]) == int(res.next_token[i])
        np.testing.assert_array_equal(np.asarray(solo.tokens[0]), np.asarray(res.tokens[i, :4]))
    n = np.asarray(res.num_accepted)
    assert np.all(n <= ell) and np.all(np.asarray(res.num_emitted) == n + 1)
    assert np.all(np.asarray(res.tokens)[np.arange(b), n] == np.asarray(res.next_token))


def test_no_drafts_is_plain_sampling_from_p0() -> None:
    b, v = 4000, 4
    p = jnp.broadcast_to(jnp.asarray([0.1, 0.0, 0.6, 0.3]), (b, 1, v))
    res = verify_chain(keys_for_batch(range(b)), p, jnp.zeros((b, 0, v)),
                       jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32), EMPTY_STOPS)
    assert np.all(np.asarray(res.num_emitted) == 1) and np.all(np.asarray(res.num_accepted) == 0)
    freq = np.bincount(np.asarray(res.next_token), minlength=v) / b
    assert freq[1] == 0
    np.testing.assert_allclose(freq, [0.1, 0.0, 0.6, 0.3], atol=0.03)


def test_verify_chain_shape_errors() -> None:
    keys = keys_for_batch([0, 1])
    p = jnp.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match="q_bgn"):
        verify_chain(keys, p, jnp.full((2, 3, 4), 0.25), jnp.zeros((2, 2), jnp.int32),
                     jnp.zeros(2, jnp.int32), EMPTY_STOPS)
    with pytest.raises(ValueError, match="draft_bg"):
        verify_chain(keys, p, jnp.full((2, 2, 4), 0.25), jnp.zeros((2, 3), jnp.int32),
                     jnp.zeros(2, jnp.int32), EMPTY_STOPS)


def _sorted_thresholds(z: np.ndarray, k: int, p: float) -> tuple[np.ndarray, np.ndarray]:
    """The sort-based top-k / top-p kept sets (float32, as the rule reads) for comparison."""
    v = z.shape[-1]
    kth = np.sort(z, axis=-1)[..., v - k][..., None]
    zf = np.where(z < kth, -np.inf, z)
    e = np.exp(zf - zf.max(-1, keepdims=True)).astype(np.float32)
    probs = e / e.sum(-1, keepdims=True)
    desc = -np.sort(-probs, axis=-1)
    excl = np.concatenate([np.zeros_like(desc[..., :1]), np.cumsum(desc, -1)[..., :-1]], -1)
    count = np.maximum((excl < p).sum(-1, keepdims=True), 1)
    cutoff = np.take_along_axis(desc, count - 1, -1)
    return zf > -np.inf, probs >= cutoff


@pytest.mark.parametrize("k,p", [(50, 1.0), (0, 0.9), (2000, 0.95), (0, 0.3)])
def test_bisection_thresholds_keep_what_a_sort_keeps_on_a_real_vocabulary(k, p):
    """The sort-free thresholds select exactly the sort-based top-k / top-p sets on [B, K, V]
    logits of a 49k vocabulary, ties (rounded logits) included."""
    rng = np.random.default_rng(k + int(p * 100))
    z = (rng.standard_normal((3, 2, 49152)) * 3).astype(np.float32)
    z[0] = np.round(z[0], 1)  # many exact ties
    probs = np.asarray(probs_from_logits(jnp.asarray(z), SamplingArrays.broadcast(3, 1.0, k, p)))
    keep_k, keep_p = _sorted_thresholds(z, k if k else 49152, p)
    want = keep_k & (keep_p if p < 1 else True)
    np.testing.assert_array_equal(probs > 0, want)
    assert 0 < want.sum() < want.size
