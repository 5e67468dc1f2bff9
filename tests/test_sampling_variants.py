"""The static sampling variants (greedy / plain / filtered) and the top-k cap of the filtered one.

Each variant equals the full rule on the rows it is picked for; the cap changes nothing (its exact
fallback covers rows whose kept set reaches past it), and without that fallback a chi-square test
catches the truncation. The engine picks the narrowest compiled variant per round, refuses what no
compiled variant covers, and the greedy and plain rounds compile with no branch and no loop.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax import sampling
from specjax.sampling import SamplingArrays, keys_for_batch, probs_from_logits, sample, sampling_variant
from tests.engine_fixtures import DEFAULT_CPU_EMITTERS, BigramDrafter, tiny_target


def _ref(logits_v: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
    """float64 sort-based reference of the documented rule (inputs without ties)."""
    if t == 0:
        out = np.zeros_like(logits_v, np.float64)
        out[np.argmax(logits_v)] = 1.0
        return out
    z = logits_v.astype(np.float64) / t
    if 0 < k < z.size:
        z = np.where(z >= np.sort(z)[-k], z, -np.inf)
    e = np.exp(z - z.max())
    probs = e / e.sum()
    if p < 1:
        order = np.argsort(-probs)
        n = int(np.searchsorted(np.cumsum(probs[order]), p) + 1)
        probs = np.where(np.isin(np.arange(z.size), order[:n]), probs, 0.0)
        probs /= probs.sum()
    return probs


def _sa(t, k, p, variant: str, cap: int = sampling.DEFAULT_TOP_K_CAP) -> SamplingArrays:
    t = jnp.asarray(t, jnp.float32)
    return SamplingArrays(t, jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32), jnp.zeros_like(t), variant, cap)


def test_the_host_picks_the_narrowest_exact_variant():
    assert sampling_variant([0.0, 0.0], [0, 0], [1.0, 1.0]) == "greedy"
    assert sampling_variant([0.0, 0.7], [0, 0], [1.0, 1.0]) == "plain"
    assert sampling_variant([0.7, 0.7], [0, 5], [1.0, 1.0]) == "filtered"
    assert sampling_variant([0.0], [0], [0.9]) == "filtered"  # log-probabilities read its filter
    assert sampling_variant([0.7, 0.0], [0, 0], [1.0, 1.0], [0.0, 0.1]) == "filtered"  # min-p is a filter
    assert sampling_variant([0.7], [0], [1.0], [0.0]) == "plain"
    assert SamplingArrays.broadcast(2, 0.0).variant == "greedy"
    assert SamplingArrays.from_values([1.0, 0.0], [0, 0], [1.0, 0.5]).variant == "filtered"
    with pytest.raises(ValueError, match="variant"):
        _sa([1.0], [0], [1.0], "fast")
    leaves, tree = jax.tree.flatten(_sa([1.0], [0], [1.0], "plain", 8))
    assert len(leaves) == 4 and jax.tree.unflatten(tree, leaves).variant == "plain"  # static: in the treedef


def test_each_variant_equals_the_full_rule_on_the_rows_it_is_picked_for():
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(4, 3, 50)) * 2).astype(np.float32)
    x = jnp.asarray(logits)
    full = lambda t, k, p: np.asarray(probs_from_logits(x, _sa(t, k, p, "filtered")))  # noqa: E731
    t0 = [0.0] * 4
    np.testing.assert_array_equal(np.asarray(probs_from_logits(x, _sa(t0, [0] * 4, [1.0] * 4, "greedy"))),
                                  full(t0, [0] * 4, [1.0] * 4))
    t = [0.0, 0.5, 1.0, 1.7]
    np.testing.assert_allclose(np.asarray(probs_from_logits(x, _sa(t, [0] * 4, [1.0] * 4, "plain"))),
                               full(t, [0] * 4, [1.0] * 4), atol=1e-7)
    k, p = [0, 3, 0, 7], [0.8, 1.0, 0.5, 0.9]
    got = np.asarray(probs_from_logits(x, _sa(t, k, p, "filtered", cap=8)))
    for b, m in np.ndindex(4, 3):
        np.testing.assert_allclose(got[b, m], _ref(logits[b, m], t[b], k[b], p[b]), atol=2e-6)


@pytest.mark.parametrize("k,p", [(3, 1.0), (0, 0.5), (12, 0.9), (0, 0.99), (40, 1.0)])
def test_the_cap_changes_nothing(k, p):
    """Kept sets inside and past a cap of 4 candidates: the same as the sort-based rule."""
    rng = np.random.default_rng(k + int(100 * p))
    logits = (rng.normal(size=(5, 64)) * 1.5).astype(np.float32)
    got = np.asarray(probs_from_logits(jnp.asarray(logits), _sa([1.0] * 5, [k] * 5, [p] * 5, "filtered", cap=4)))
    for b in range(5):
        np.testing.assert_allclose(got[b], _ref(logits[b], 1.0, k, p), atol=2e-6)


def _chi2_of_draws(monkeypatch_truncate: bool, monkeypatch) -> float:
    """Draw 20k tokens from a top-p 0.9 nucleus of ~6 of 8 tokens with a cap of 2 candidates."""
    if monkeypatch_truncate:  # the negative control: no exact fallback, the cap truncates the nucleus
        monkeypatch.setattr(sampling, "_outside_cap", lambda k_far, mass, p, p_on: jnp.zeros_like(p_on))
    logits = np.linspace(0.0, -1.0, 8).astype(np.float32)
    n = 20_000
    probs = probs_from_logits(jnp.broadcast_to(jnp.asarray(logits), (n, 8)),
                              _sa([1.0] * n, [0] * n, [0.9] * n, "filtered", cap=2))
    tokens = np.asarray(sample(keys_for_batch(range(n)), probs))
    want = _ref(logits, 1.0, 0, 0.9)
    observed = np.bincount(tokens, minlength=8)
    assert observed[want == 0].sum() == 0 or monkeypatch_truncate
    keep = want > 0
    return float(stats.chisquare(observed[keep], want[keep] * n).pvalue)


def test_chi_square_passes_with_the_exact_fallback_and_fails_on_a_truncated_cap(monkeypatch):
    assert _chi2_of_draws(False, monkeypatch) > 1e-3
    assert _chi2_of_draws(True, monkeypatch) < 1e-3


@pytest.fixture(scope="module")
def model():
    return tiny_target(16, seed=2)


def test_engine_refuses_what_no_compiled_variant_covers(model):
    from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
    with pytest.raises(ValueError, match="sampling_variants"):
        EngineConfig(sampling_variants=("fast",))
    eng = Engine(model, None, EngineConfig(max_slots=2, max_len=32, sampling_variants=("plain",), top_k_cap=4),
                 progress=False)
    with pytest.raises(ValueError, match="top_p.*'filtered' sampling variant.*sampling_variants"):
        eng.add_request(EngineRequest("a", [1, 2], max_tokens=2, top_p=0.9))
    with pytest.raises(ValueError, match="top_k 5 exceeds the engine's top_k_cap 4"):
        eng.add_request(EngineRequest("b", [1, 2], max_tokens=2, top_k=5))
    assert eng.round_variant([0.0], [0], [1.0]) == "plain"  # greedy rows: the narrowest compiled cover
    assert {k[-1] for f, k in eng.warm_keys() if f not in ("prefill", "release", "copy")} == {"plain"}


def _engine(model, variants):
    from specjax.decoding.engine import Engine, EngineConfig
    cfg = EngineConfig(max_slots=2, max_len=40, gamma=3, policy="fixed", slots_buckets=(2,), tokens_buckets=(1, 4),
                       prefill_buckets=(8,), max_prefill=8, prefill_batch_buckets=(2,), sampling_variants=variants)
    eng = Engine(model, BigramDrafter(16, 3), cfg, progress=False)
    eng.warmup()
    return eng


def test_rounds_run_the_narrowest_variant_and_decode_as_the_filtered_one(model):
    from specjax.decoding.engine import EngineRequest
    every, only_filtered = _engine(model, ("greedy", "plain", "filtered")), _engine(model, ("filtered",))
    used: list[str] = []
    warmed = every.compile_counts()
    run = every.runner.run
    every.runner.run = lambda family, key, **kw: (used.append(key[-1]) if family != "prefill" else None,
                                                  run(family, key, **kw))[1]

    def requests(kinds):
        reqs = {"greedy": EngineRequest("g", [1, 2, 3], max_tokens=8, temperature=0.0),
                "plain": EngineRequest("t", [4, 5], max_tokens=8, temperature=1.0, seed=3),
                "filtered": EngineRequest("f", [6, 7], max_tokens=8, temperature=0.8, top_p=0.7, seed=4)}
        return [reqs[k] for k in kinds]
    for kinds in (["greedy"], ["greedy", "plain"], ["plain", "filtered"]):
        used.clear()
        a = {r.request_id: r.output_ids for r in every.run(requests(kinds))}
        b = {r.request_id: r.output_ids for r in only_filtered.run(requests(kinds))}
        assert a == b, kinds
        # rows together run the widest of their variants; once it finishes, the rest run narrower
        assert used and used[0] == kinds[-1] and set(used) <= set(kinds), (kinds, used)
    assert every.compile_counts() == warmed  # every variant a round ran was compiled at warm-up


@pytest.mark.parametrize("variant,conds", [("greedy", 0), ("plain", 0), ("filtered", 1)])
def test_greedy_and_unfiltered_rounds_compile_without_branches_or_loops(variant, conds):
    """No conditional and no loop in a greedy or plain round; a greedy round draws no random bits at
    all (no threefry loop, counted apart on CPU), where a plain one does (the count has teeth)."""
    from bench import round_ops
    runner = round_ops.abstract_runner(round_ops.presets()["tiny"], 2, 32)
    for family in ("lite", "verify", "fused"):
        lowered = runner.lower(family, round_ops.bucket_key(runner, family, 2, variant))
        rep = round_ops.compiled_report(lowered, DEFAULT_CPU_EMITTERS)
        assert rep["conditionals"] == (conds if family != "fused" else 2 * conds), (family, rep)
        if variant != "filtered" and family != "fused":  # fused drafts in a scan: one loop
            assert rep["whiles"] == 0, (family, rep)  # the threefry PRNG's CPU loops are counted apart
        if variant == "greedy":
            assert rep["prng_whiles"] == 0, (family, rep)
        else:
            assert rep["prng_whiles"] > 0, (family, rep)


def test_greedy_draws_need_no_random_bits():
    """On one-hot rows `sample(greedy=True)` is the draw (the argmax), and `verify_chain(greedy=True)`
    decides as the random test does (accepted prefixes, residual tokens, stop tokens); on rows that
    are not one-hot it is not a sampler (negative control: it always returns the mode)."""
    from specjax.decoding.verify import verify_chain
    rng = np.random.default_rng(0)
    b, g, v = 256, 4, 12
    keys = jax.random.split(jax.random.key(3), b)
    target = rng.integers(0, v, (b, g + 1))
    draft = np.where(rng.random((b, g)) < 0.7, target[:, :g], rng.integers(0, v, (b, g)))
    p = jax.nn.one_hot(target, v, dtype=jnp.float32)
    q = jax.nn.one_hot(draft, v, dtype=jnp.float32)
    ell = jnp.asarray(rng.integers(0, g + 1, b), jnp.int32)
    stop = jnp.array([3, -1], jnp.int32)
    args = (keys, p, q, jnp.asarray(draft, jnp.int32), ell, stop)
    want, got = verify_chain(*args), verify_chain(*args, greedy=True)
    for field in ("num_accepted", "next_token", "tokens", "num_emitted", "stopped_on_draft"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    assert 0 < int((want.num_accepted < ell).sum()) < b  # rows rejected and rows fully accepted
    np.testing.assert_array_equal(sample(keys, p[:, 0], greedy=True), sample(keys, p[:, 0]))
    soft = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, v)), jnp.float32))
    assert np.all(np.asarray(sample(keys, soft, greedy=True)) == np.argmax(np.asarray(soft), -1))
    assert not np.array_equal(sample(keys, soft), sample(keys, soft, greedy=True))


def test_greedy_verifier_reads_no_q_and_greedy_drafts_keep_none():
    """A greedy round's q is the one-hot of its draws: `draft_draw` returns none (the index is the
    greedy draw of `draft_probs`, also on NaN and +inf logits, and `one_hot_q` equals its q) and
    `verify_chain(greedy=True)` decides the same with q replaced by NaN. Control: the sampling
    verifier does read q (NaN changes its decisions)."""
    from specjax.decoding.verify import verify_chain
    rng = np.random.default_rng(7)
    b, g, v = 64, 4, 40
    z = rng.normal(size=(b, v)).astype(np.float32)
    z[0, 3], z[1, :] = np.inf, np.nan
    z[2, 5] = np.nan
    keys = jax.random.split(jax.random.key(0), b)
    greedy = _sa(np.zeros(b), np.zeros(b, int), np.ones(b), "greedy")
    d, q = sampling.draft_draw(keys, jnp.asarray(z), greedy, jnp.bfloat16)
    want_q = sampling.draft_probs(jnp.asarray(z), greedy, jnp.bfloat16)
    assert q is None
    np.testing.assert_array_equal(d, sample(keys, want_q, greedy=True))
    np.testing.assert_array_equal(sampling.one_hot_q(d, v, jnp.bfloat16), want_q)
    plain = _sa(np.ones(b), np.zeros(b, int), np.ones(b), "plain")
    d_plain, q_plain = sampling.draft_draw(keys, jnp.asarray(z), plain, jnp.bfloat16)
    np.testing.assert_array_equal(q_plain, sampling.draft_probs(jnp.asarray(z), plain, jnp.bfloat16))
    np.testing.assert_array_equal(d_plain, sample(keys, q_plain))

    target = rng.integers(0, v, (b, g + 1))
    draft = np.where(rng.random((b, g)) < 0.7, target[:, :g], rng.integers(0, v, (b, g)))
    p = jax.nn.one_hot(target, v, dtype=jnp.float32)
    q_one = jax.nn.one_hot(draft, v, dtype=jnp.float32)
    q_nan = jnp.full((b, g, v), jnp.nan, jnp.float32)
    rest = (jnp.asarray(draft, jnp.int32), jnp.asarray(rng.integers(0, g + 1, b), jnp.int32),
            jnp.array([-1], jnp.int32))
    one, nan = verify_chain(keys, p, q_one, *rest, greedy=True), verify_chain(keys, p, q_nan, *rest, greedy=True)
    for field in ("num_accepted", "next_token", "tokens"):
        np.testing.assert_array_equal(getattr(nan, field), getattr(one, field), err_msg=field)
    assert int(one.num_accepted.sum()) > 0
    sampled = verify_chain(keys, p, q_nan, *rest)
    assert not np.array_equal(sampled.num_accepted, one.num_accepted)
    none = verify_chain(keys, p, jnp.zeros((b, g, 0), jnp.bfloat16), *rest, greedy=True)  # q without columns
    np.testing.assert_array_equal(none.tokens, one.tokens)
    with pytest.raises(ValueError, match=r"q_bgn must be \[B, G, N\]"):
        verify_chain(keys, p, jnp.zeros((b, g, 0), jnp.bfloat16), *rest)  # a sampling verifier needs q


@pytest.mark.parametrize("variant", ["greedy", "plain"])
def test_greedy_rounds_carry_q_without_columns(variant):
    """The split draft program returns q [slots, gamma, 0] in a greedy round (nothing vocabulary-wide
    travels to verify, and the one-hot is never built) and [slots, gamma, V] in a sampling round."""
    from bench import round_ops
    shape = round_ops.presets()["tiny"]
    runner = round_ops.abstract_runner(shape, 2, 32)
    draft = runner.lower("draft", round_ops.bucket_key(runner, "draft", 2, variant))
    _, q, _ = draft.out_info
    assert q.shape == (2, shape.gamma, 0 if variant == "greedy" else shape.target["vocab_size"])


@pytest.mark.parametrize("variant", ["greedy", "plain"])
def test_greedy_drafting_loop_carries_no_vocabulary_buffer(variant):
    """The fused round's drafting loop keeps q ([slots, gamma, V]) only when it samples: a greedy
    round's loop carries nothing vocabulary-wide but the drafter's per-step inputs (the block's
    logits and the Markov head's tables), a plain round's one more such buffer (control)."""
    from bench import round_ops
    shape = round_ops.presets()["tiny"]
    runner = round_ops.abstract_runner(shape, 2, 32)
    text = runner.lower("fused", round_ops.bucket_key(runner, "fused", 2, variant)).compile().as_text()
    loops = [line for line in text.splitlines() if " while(" in line and 'op_name="jit(fused)/while"' in line]
    assert len(loops) == 1, loops  # the drafting loop (on CPU the PRNG's loops are apart)
    carried = loops[0].split(" while(")[0]
    per_row = f"[2,{shape.gamma},{shape.target['vocab_size']}]"
    assert carried.count(per_row) == (1 if variant == "greedy" else 2), carried


def test_first_argmax_is_argmax_with_ties_and_infinities():
    """The argmax returns jnp.argmax's index (the lowest on ties) on rows with ties,
    -inf entries, an all -inf row and +inf; a row's last maximum instead would fail (control)."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 4, (64, 33)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2, 7] = np.inf
    x[3, ::2] = -np.inf
    got, want = np.asarray(sampling.first_argmax(jnp.asarray(x))), np.asarray(jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32
    # the softmax statistics both ways, of x with +inf clamped (as probs_from_logits does): max and
    # argmax exact, sums to rounding (0 on the all -inf row)
    xc = np.minimum(x, np.finfo(np.float32).max)
    finite_max = np.where(np.isfinite(xc.max(-1)), xc.max(-1), 0.0)[:, None]
    want_sum = np.exp(xc - finite_max).sum(-1)
    for way in (sampling._stats_three_reductions, sampling._stats_one_reduction):
        top, idx, total = jax.jit(way)(jnp.asarray(xc))
        np.testing.assert_array_equal(np.asarray(idx), want)
        np.testing.assert_array_equal(np.asarray(top)[:, 0], xc.max(axis=-1))
        np.testing.assert_allclose(np.asarray(total)[:, 0], want_sum, rtol=1e-5)
    last = x.shape[-1] - 1 - np.argmax(x[:, ::-1], axis=-1)
    assert not np.array_equal(got, last)
