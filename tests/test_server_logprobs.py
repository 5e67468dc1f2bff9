"""Log-probabilities: each output token's log-probability and its top alternatives come from the target's
distribution after the request's temperature / top-k / top-p (temperature 0 read as 1), so they equal a
cache-free teacher-forced reference within 1e-5, with or without speculation, greedy or sampled; and
the server answers them in OpenAI's chat and completions formats (streamed or not)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

try:
    from tests.engine_fixtures import tiny_target
    from tests.reference_decode import continuation_logits
    from tests.serving_fixtures import shared_tiny_llm, tiny_chat_tokenizer
except ImportError:  # tests/ itself on sys.path
    from engine_fixtures import tiny_target
    from reference_decode import continuation_logits
    from serving_fixtures import shared_tiny_llm, tiny_chat_tokenizer

from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.drafters.ngram import NGramDrafter
from specjax.sampling import SamplingArrays, probs_from_logits

VOCAB, K = 48, 5
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10], [3, 4, 5, 6, 7, 8, 3, 4]]
SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, top_k=20, top_p=0.9, seed=3), dict(temperature=1.3, seed=4)]


@pytest.fixture(scope="module")
def engines():
    model = tiny_target(VOCAB, init_scale=3.0)

    def make(drafter, policy, tokens):
        cfg = EngineConfig(max_slots=4, max_len=64, policy=policy, slots_buckets=(4,), tokens_buckets=tokens,
                           prefill_buckets=(16,), max_prefill=16, prefill_batch_buckets=(4,), max_logprobs=K)
        eng = Engine(model, drafter, cfg, progress=False)
        eng.warmup()
        return eng
    return model, {"plain": make(None, "plain", (1,)), "spec": make(NGramDrafter(VOCAB, gamma=3), "fixed", (1, 4))}


def _run(eng: Engine, logprobs: int = K) -> list[EngineRequest]:
    reqs = [EngineRequest(request_id=str(i), prompt_ids=p, max_tokens=12, logprobs=logprobs, **sp)
            for i, (p, sp) in enumerate((p, sp) for p in PROMPTS for sp in SAMPLING)]
    return eng.run(reqs)


def _reference(model, req: EngineRequest) -> np.ndarray:
    """log p(token | prefix) over the vocabulary for each output token: [n, V]."""
    logits = continuation_logits(model, [req.prompt_ids + req.output_ids], len(req.prompt_ids))[0]
    t = req.temperature if req.temperature > 0 else 1.0
    sa = SamplingArrays(jnp.full((1,), t, jnp.float32), jnp.full((1,), req.top_k, jnp.int32),
                        jnp.full((1,), req.top_p, jnp.float32))
    with np.errstate(divide="ignore"):  # outside the top-k / top-p set: -inf
        return np.log(np.asarray(probs_from_logits(jnp.asarray(logits, jnp.float32)[None], sa))[0])


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_logprobs_equal_the_teacher_forced_target_distribution(engines, kind):
    model, engs = engines
    reqs = _run(engs[kind])
    if kind == "spec":
        assert sum(r.metrics.num_accepted_tokens for r in reqs) > 0  # multi-token rounds were exercised
    for r in reqs:
        assert len(r.output_logprobs) == len(r.output_ids) > 0
        ref = _reference(model, r)
        got = np.array([lp for lp, _, _ in r.output_logprobs])
        want = ref[np.arange(len(r.output_ids)), r.output_ids]
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert np.all(np.isfinite(got))  # every emitted token is inside the request's top-k / top-p set
        for j, (_, ids, lps) in enumerate(r.output_logprobs):
            assert len(ids) == K and lps == sorted(lps, reverse=True)
            finite = np.isfinite(lps)
            np.testing.assert_allclose(np.array(lps)[finite], ref[j, ids][finite], atol=1e-5)
            np.testing.assert_allclose(np.array(lps)[finite], np.sort(ref[j])[::-1][:K][finite], atol=1e-5)


def test_greedy_logprobs_are_the_same_with_and_without_speculation(engines):
    _, engs = engines
    spec = {r.request_id: r for r in _run(engs["spec"])}
    for a in _run(engs["plain"]):
        b = spec[a.request_id]
        if a.temperature == 0:
            assert a.output_ids == b.output_ids
            np.testing.assert_allclose([x[0] for x in a.output_logprobs], [x[0] for x in b.output_logprobs],
                                       atol=1e-5)
            assert [x[1] for x in a.output_logprobs] == [x[1] for x in b.output_logprobs]


def test_logprobs_are_opt_in_and_bounded(engines):
    _, engs = engines
    reqs = _run(engs["spec"], logprobs=None)
    assert all(r.output_logprobs == [] for r in reqs)
    with pytest.raises(ValueError, match="logprobs must be in"):
        engs["spec"].add_request(EngineRequest(request_id="x", prompt_ids=[5], max_tokens=2, logprobs=K + 1))
