"""End-to-end exactness of the engine: Monte-Carlo chi-square against the enumerated target."""
import jax.numpy as jnp
import pytest

from specjax.decoding.verify import VerifyResult, verify_chain

from engine_fixtures import (BigramDrafter, chi_square_pvalue, exact_continuations, sample_continuations,
                             small_engine, tiny_target)

V, GAMMA, PROMPT = 8, 3, [1, 5, 2]



def _accept_all(key_b, p, q, d, ell, stop_ids) -> VerifyResult:
    # make the target look exactly like the draft at every drafted position: min(1, p/q) == 1
    g = q.shape[1]
    p_fake = jnp.concatenate([q, p[:, g:]], axis=1)
    return verify_chain(key_b, p_fake, q, d, ell, stop_ids)


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
    samples = sample_continuations(eng, PROMPT, 20000, 3, caps=[0, 1, 2, 3])
    assert any(min(r) == 0 and max(r) == GAMMA for r in rounds), "no round mixed ell = 0 and ell = gamma"
    p = chi_square_pvalue(samples, exact)
    assert p > 1e-3, f"engine output differs from the target distribution (chi-square p={p:.2e})"
    assert eng.stats["rounds"] > 0


def test_biased_verifier_is_caught(model, exact):
    eng = small_engine(model, BigramDrafter(V, GAMMA), slots=256, max_len=12, prefill=4, gamma=GAMMA,
                       tokens_buckets=(1, 2, 4), prefill_batch=256,
                       verifier=_accept_all)
    samples = sample_continuations(eng, PROMPT, 6000, 3, caps=[0, 1, 2, 3], seed0=10**6)
    p = chi_square_pvalue(samples, exact)
    assert p < 1e-3, f"a biased verifier passed the chi-square test (p={p:.2e}): the test has no teeth"
