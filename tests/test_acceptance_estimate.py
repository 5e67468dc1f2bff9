"""The online acceptance estimate (`decoding.acceptance`): draft confidences for the confidence policies
from what verification accepted, for a drafter without a confidence head (or every drafter with
EngineConfig.confidence_source "online"). The update equals its definition on a hand-made round; under
confidence_async, one request at a time, a drafter whose drafts are never accepted soon stops being
verified while one whose drafts are always accepted is verified whole, outputs equal plain's (control:
the constant confidences of before, ones, verify the rejected drafts every round); sampled outputs
under the estimate follow the target's law."""
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding import acceptance as ac
from specjax.decoding import row_state
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.scheduling import CostTable

from engine_fixtures import (BigramDrafter, chain_drafter, chi_square_pvalue, exact_continuations,
                             sample_continuations, tiny_target)
from test_engine import greedy_reference

V, GAMMA, N = 64, 3, 24
PROMPT = [5, 17, 42, 8, 33, 5]


def test_observe_follows_its_definition():
    rows = jnp.full((3, 3), 0.8, jnp.float32)
    engine = jnp.full((3,), 0.8, jnp.float32)
    # row 0 verified 3, accepted 1: positions 0 (hit) and 1 (miss) seen; row 1 verified 2, accepted 2:
    # both hits; row 2 not counted
    new_rows, new_engine = ac.observe(rows, engine, jnp.asarray([3, 2, 3]), jnp.asarray([1, 2, 0]),
                                      jnp.asarray([True, True, False]))
    a, e = ac.ROW_ALPHA, ac.ENGINE_ALPHA
    assert np.allclose(new_rows, [[a * 0.8 + 1 - a, a * 0.8, 0.8], [a * 0.8 + 1 - a, a * 0.8 + 1 - a, 0.8], [0.8] * 3])
    assert np.allclose(new_engine, [e * e * 0.8 + 1 - e * e, e * e * 0.8 + (1 - e * e) / 2, 0.8])


@pytest.fixture(scope="module")
def model():
    return tiny_target(V, seed=0)


@pytest.fixture(scope="module")
def plain(model):
    return greedy_reference(model, PROMPT, N)  # plain greedy decoding, by full forwards


def _decoy(plain: list[int]) -> BigramDrafter:
    """A drafter whose every draft is a token the greedy answer never holds."""
    drafter = BigramDrafter(V, GAMMA)
    never = next(t for t in range(3, V) if t not in plain)
    table = np.zeros((V, V), np.float32)
    table[:, never] = 30.0
    drafter.table[...] = table
    return drafter


def _one_at_a_time(model, drafter, **config) -> tuple[EngineRequest, list[int]]:
    """A greedy request alone in a 1-slot confidence_async engine under a cost table where verifying
    three drafts pays when they survive with probability >= ~0.5 each: (the request, its rounds' ell)."""
    cfg = EngineConfig(max_slots=1, max_len=64, policy="confidence_async", gamma=GAMMA, slots_buckets=(1,),
                       prefill_buckets=(8,), max_prefill=8, prefill_batch_buckets=(1,),
                       sampling_variants=("greedy",), **config)
    eng = Engine(model, drafter, cfg, progress=False)
    eng.cost_table = CostTable.from_seconds({(1, 1): 1.0, (1, 2): 1.5, (1, 4): 1.9}, meta=eng.cost_table_meta())
    eng.warmup()
    eng.plain_seconds = {1: 1.0}  # the table's scale, not this machine's
    assert eng.runner.row_state.estimated
    ell: list[int] = []
    eng.on_round = lambda info: ell.extend(info["ell"])
    req = EngineRequest("r", PROMPT, max_tokens=N, temperature=0.0)
    eng.run([req], progress=False)
    return req, ell


def test_rejected_drafts_stop_being_verified(model, plain):
    req, ell = _one_at_a_time(model, _decoy(plain))
    assert req.output_ids == plain and req.metrics.num_accepted_tokens == 0
    assert 0 < sum(e > 0 for e in ell) <= 6 and len(ell) >= N - 2, str(ell)  # a few rounds, then plain ones


def test_accepted_drafts_are_verified_whole(model, plain):
    req, ell = _one_at_a_time(model, chain_drafter(V, GAMMA, [PROMPT[-1]] + plain))
    assert req.output_ids == plain and ell.count(GAMMA) >= 4 and req.metrics.num_accepted_tokens >= 4 * GAMMA, ell


def test_negative_control_constant_confidences_verify_rejected_drafts_every_round(model, plain, monkeypatch):
    monkeypatch.setattr(row_state, "estimate_confidence", lambda rows, block: block._replace(
        confidence=jnp.ones(block.tokens.shape, jnp.float32)))
    req, ell = _one_at_a_time(model, _decoy(plain))
    assert req.output_ids == plain and sum(e > 0 for e in ell) > 10, ell


def test_which_engines_keep_an_estimate(model):
    def estimated(drafter, **config) -> bool:
        cfg = EngineConfig(max_slots=2, max_len=32, gamma=GAMMA, **config)
        return Engine(model, drafter, cfg, progress=False).runner.row_state.estimated
    with_head, without = BigramDrafter(V, GAMMA, confidence=True), BigramDrafter(V, GAMMA)
    assert not estimated(without, policy="fixed") and estimated(without, policy="confidence_async")
    assert estimated(without, policy="threshold", threshold=0.5)
    assert not estimated(with_head, policy="confidence") and estimated(with_head, policy="confidence",
                                                                       confidence_source="online")
    with pytest.raises(ValueError, match="confidence_source must be one of"):
        EngineConfig(confidence_source="head")


def test_online_source_replaces_a_head_s_confidences(model):
    """The first drafting round of an engine with confidence_source "online" reports the starting
    estimate, not the drafter head's confidences."""
    cfg = EngineConfig(max_slots=1, max_len=64, policy="confidence", gamma=GAMMA, slots_buckets=(1,),
                       prefill_buckets=(8,), max_prefill=8, prefill_batch_buckets=(1,),
                       sampling_variants=("greedy",), confidence_source="online")
    eng = Engine(model, BigramDrafter(V, GAMMA, confidence=True, seed=7), cfg, progress=False)
    eng.cost_table = CostTable.from_seconds({(1, 1): 1.0, (1, 2): 1.1, (1, 4): 1.2}, meta=eng.cost_table_meta())
    eng.warmup()
    confs = []
    eng.on_round = lambda info: confs.extend(info.get("confidence", []))
    eng.run([EngineRequest("r", PROMPT, max_tokens=8, temperature=0.0)], progress=False)
    assert confs[0] == pytest.approx([ac.START] * GAMMA)


@pytest.fixture(scope="module")
def small():
    return tiny_target(8, seed=3, init_scale=3.0)


def test_sampled_outputs_under_the_estimate_follow_the_target_law(small):
    cfg = EngineConfig(max_slots=256, max_len=12, policy="confidence_async", gamma=GAMMA, slots_buckets=(256,),
                       tokens_buckets=(1, 2, 4), prefill_buckets=(4,), max_prefill=4, prefill_batch_buckets=(256,),
                       sampling_variants=("greedy", "plain"))
    eng = Engine(small, BigramDrafter(8, GAMMA), cfg, progress=False)
    eng.cost_table = CostTable.from_seconds({(256, 1): 1.0, (256, 2): 1.2, (256, 4): 1.5},
                                            meta=eng.cost_table_meta())
    eng.warmup()
    eng.plain_seconds = {256: 1.0}
    lengths: list[int] = []
    eng.on_round = lambda info: lengths.extend(info["ell"])
    samples = sample_continuations(eng, [1, 5, 2], 4000, 3, seed0=5 * 10**6)
    assert 0 < np.mean(lengths) < GAMMA  # it drafted, and not everything
    assert chi_square_pvalue(samples, exact_continuations(small, [1, 5, 2], 3)) > 1e-3
