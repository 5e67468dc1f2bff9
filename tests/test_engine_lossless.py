"""End-to-end exactness of the engine: Monte-Carlo chi-square against the enumerated target."""
import dataclasses

import jax.numpy as jnp
import pytest

from specjax.decoding import programs
from specjax.decoding.engine import EngineRequest
from specjax.sampling import VARIANTS, SamplingArrays, probs_from_logits
from specjax.decoding.verify import VerifyResult, verify_chain

from engine_fixtures import (BigramDrafter, chi_square_pvalue, exact_continuations, sample_continuations,
                             small_engine, tiny_target)

V, GAMMA, PROMPT = 8, 3, [1, 5, 2]
# (temperature, top_k, top_p, min_p) per row group, all served in the same batches
FILTERS = ((0.7, 3, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 5, 0.9, 0.6))  # the tiny target is flat: min_p 0.6 bites


def _accept_all(key_b, p, q, d, ell, stop_ids, q_ids, greedy=False) -> VerifyResult:
    # make the target look exactly like the draft at every drafted position: min(1, p/q) == 1
    assert q_ids is None  # the bigram drafter's q is over the whole vocabulary
    g = q.shape[1]
    p_fake = jnp.concatenate([q, p[:, g:]], axis=1)
    return verify_chain(key_b, p_fake, q, d, ell, stop_ids, greedy=greedy)


@pytest.fixture(scope="module")
def model():
    return tiny_target(V, seed=3, init_scale=3.0)


@pytest.fixture(scope="module")
def exact(model):
    return exact_continuations(model, PROMPT, 3)


def test_engine_sampling_is_exact_with_mixed_ell(model, exact):
    eng = small_engine(model, BigramDrafter(V, GAMMA), slots=256, max_len=12, prefill=4, gamma=GAMMA,
                       tokens_buckets=(1, 2, 4), prefill_batch=256)
    # rows verify 0..GAMMA draft tokens within the same batch (cap cycles per request)
    rounds = []
    eng.on_round = lambda info: rounds.append(info["ell"])
    samples = sample_continuations(eng, PROMPT, 10000, 3, caps=[0, 1, 2, 3])
    assert any(min(r) == 0 and max(r) == GAMMA for r in rounds), "no round mixed ell = 0 and ell = gamma"
    p = chi_square_pvalue(samples, exact)
    assert p > 1e-3, f"engine output differs from the target distribution (chi-square p={p:.2e})"
    assert eng.stats["rounds"] > 0


def test_biased_verifier_is_caught(model, exact):
    eng = small_engine(model, BigramDrafter(V, GAMMA), slots=256, max_len=12, prefill=4, gamma=GAMMA,
                       tokens_buckets=(1, 2, 4), prefill_batch=256,
                       verifier=_accept_all)
    samples = sample_continuations(eng, PROMPT, 2000, 3, caps=[0, 1, 2, 3], seed0=10**6)
    p = chi_square_pvalue(samples, exact)
    assert p < 1e-3, f"a biased verifier passed the chi-square test (p={p:.2e}): the test has no teeth"


def sample_filtered_groups(eng, n_per_group: int, seed0: int = 0) -> list[list[tuple[int, ...]]]:
    """Requests cycle through FILTERS (and draft caps 0..GAMMA), so every batch mixes all of them;
    returns each group's first three tokens."""
    reqs = [EngineRequest(str(i), list(PROMPT), max_tokens=6, temperature=FILTERS[i % 3][0], top_k=FILTERS[i % 3][1],
                          top_p=FILTERS[i % 3][2], min_p=FILTERS[i % 3][3], seed=seed0 + i,
                          max_draft_tokens=i % (GAMMA + 1))
            for i in range(3 * n_per_group)]
    assert len(eng.run(reqs, progress=False)) == len(reqs)
    return [[tuple(r.output_ids[:3]) for r in reqs[g::3]] for g in range(3)]


@pytest.fixture(scope="module")
def exact_filtered(model):
    return [exact_continuations(model, PROMPT, 3, temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in FILTERS]


def filter_engine(model):
    return small_engine(model, BigramDrafter(V, GAMMA), slots=256, max_len=12, prefill=4, gamma=GAMMA,
                        tokens_buckets=(1, 2, 4), prefill_batch=256, variants=VARIANTS)


def test_engine_is_exact_with_per_row_top_k_top_p_min_p_and_temperature(model, exact_filtered):
    t, k, top_p, _ = FILTERS[2]  # min_p bites: without it that group's law differs
    without = exact_continuations(model, PROMPT, 3, temperature=t, top_k=k, top_p=top_p)
    assert sum(abs(without[s] - exact_filtered[2].get(s, 0.0)) for s in without) > 0.05
    eng = filter_engine(model)
    ells = []
    eng.on_round = lambda info: ells.extend(info["ell"])
    groups = sample_filtered_groups(eng, 5000, seed0=2 * 10**6)
    assert sum(e == GAMMA for e in ells) > 1000  # full blocks were verified under every filter
    for (t, k, top_p, min_p), samples, exact in zip(FILTERS, groups, exact_filtered):
        p = chi_square_pvalue(samples, exact)
        assert p > 1e-3, f"T={t} top_k={k} top_p={top_p} min_p={min_p}: output differs from the filtered target (p={p:.2e})"


def test_filtering_only_the_draft_is_caught(model, exact_filtered, monkeypatch):
    """Negative control: the drafter filters q with each row's top-k/top-p/min-p, but the target's p at
    the verified positions gets the row's temperature only. The output then follows the unfiltered target."""
    def temperature_only(logits, sa: SamplingArrays):
        if logits.ndim == 3:  # the verify pass [slots, tokens, V]; prefill's first token stays filtered
            sa = dataclasses.replace(sa, top_k=jnp.zeros_like(sa.top_k), top_p=jnp.ones_like(sa.top_p),
                                     min_p=jnp.zeros_like(sa.min_p))
        return probs_from_logits(logits, sa)
    monkeypatch.setattr(programs, "probs_from_logits", temperature_only)
    groups = sample_filtered_groups(filter_engine(model), 2000, seed0=3 * 10**6)
    pvals = [chi_square_pvalue(s, e) for s, e in zip(groups, exact_filtered)]
    assert max(pvals) < 1e-3, f"p filtered differently from q passed (p={pvals}): the test has no teeth"
