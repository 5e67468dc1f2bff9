"""The host one round behind (#36 items 3 and 6): for the plain, fixed and confidence_async policies
the engine dispatches round t+1 before reading round t, and admission leaves the first token on the
device. Outputs, finish reasons, log-probabilities and metrics equal the synchronous engine's
(`EngineConfig.pipeline=False`); a request that ended in round t runs one more round, whose tokens
are dropped. Negative controls: keeping the extra round's tokens, or not resetting a reused slot's
row state, makes the comparison fail."""
import dataclasses

import numpy as np
import pytest

from specjax.decoding import programs, runner
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.scheduling import CostTable

from engine_fixtures import BigramDrafter, tiny_target
from test_engine import greedy_reference

V, GAMMA, SLOTS = 64, 3, 3


@pytest.fixture(scope="module")
def model():
    return tiny_target(V, seed=5, init_scale=2.0)


def _prompts():
    rng = np.random.default_rng(4)
    return [list(map(int, rng.integers(0, V, size=n))) for n in (3, 7, 12, 5, 9, 4, 6, 11)]


@pytest.fixture(scope="module")
def stops(model):
    """(engine eos id, per prompt a stop id): tokens the greedy continuations of prompts 0 and 1 reach
    after a few steps, so those requests end on a device-known stop (eos) and on a host-only one."""
    ps = _prompts()
    return greedy_reference(model, ps[0], 4)[3], greedy_reference(model, ps[1], 5)[4]


def _engine(model, policy: str, pipeline: bool, eos: int) -> Engine:
    drafter = None if policy == "plain" else BigramDrafter(V, GAMMA, confidence=policy == "confidence_async")
    cfg = EngineConfig(max_slots=SLOTS, max_len=40, policy=policy, gamma=GAMMA, slots_buckets=(SLOTS,),
                       tokens_buckets=(1, GAMMA + 1), prefill_buckets=(8,), max_prefill=8,
                       prefill_batch_buckets=(2,), max_logprobs=2, pipeline=pipeline)
    eng = Engine(model, drafter, cfg, eos_token_ids=(eos,), progress=False)
    if policy == "confidence_async":
        eng.cost_table = CostTable.from_seconds({(SLOTS, 1): 1.0, (SLOTS, GAMMA + 1): 1.2},
                                                meta=eng.cost_table_meta())
    eng.warmup()
    return eng


def _stop_after_five(ids, min_keep=0):
    """A stop string's rule: ends the request once it holds 5 tokens, keeping 4 (host-only)."""
    return (4, "", "five") if len(ids) >= 5 else None


def _requests(stop_id: int, sampled: bool = True) -> list[EngineRequest]:
    """Eight requests for three slots (slots are reused): greedy and seeded sampling, stop ids, a
    stop-string rule, max_tokens that end mid-round, log-probabilities, a chunked prompt (12 > 8)."""
    ps = _prompts()
    t = (lambda x: x) if sampled else (lambda x: 0.0)
    specs = [dict(max_tokens=12, temperature=0.0, logprobs=2), dict(max_tokens=12, temperature=0.0,
                                                                     stop_token_ids=(stop_id,)),
             dict(max_tokens=9, temperature=t(1.0), seed=11, logprobs=1), dict(max_tokens=10, temperature=t(0.8),
                                                                                top_k=5, seed=12),
             dict(max_tokens=14, temperature=t(1.0), top_p=0.9, seed=13, stop_check=_stop_after_five),
             dict(max_tokens=7, temperature=0.0, stop_check=_stop_after_five), dict(max_tokens=1, temperature=t(1.0),
                                                                                    seed=14),
             dict(max_tokens=11, temperature=t(0.7), seed=15, logprobs=0)]
    return [EngineRequest(str(i), p, **kw) for i, (p, kw) in enumerate(zip(ps, specs))]


def _outcome(reqs):
    return [(r.output_ids, r.finish_reason, r.output_logprobs, r.metrics.as_dict(), r.rounds) for r in reqs]


def _run(eng: Engine, reqs):
    done = eng.run(reqs, progress=False)
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in reqs)
    assert not eng.has_work() and all(r is None for r in eng.slot_req)
    return _outcome(reqs)


@pytest.mark.parametrize("policy", ["plain", "fixed"])
def test_one_round_behind_equals_synchronous(model, stops, policy):
    eos, stop_id = stops
    sync = _engine(model, policy, False, eos)
    behind = _engine(model, policy, True, eos)
    a, b = _run(sync, _requests(stop_id)), _run(behind, _requests(stop_id))
    assert a == b
    reasons = {r for _, r, _, _, _ in a}
    assert reasons == {"stop", "length"}
    assert a[0][0][-1] == eos and a[1][0][-1] == stop_id and len(a[4][0]) == 4  # each stop rule ran
    assert sync.stats["rounds_ahead"] == 0 and behind.stats["rounds_ahead"] > 0.8 * behind.stats["rounds"]
    if policy == "fixed":
        assert sum(m["num_draft_tokens"] for _, _, _, m, _ in a) > 0
    # greedy requests also equal the engine-independent reference up to their stop
    ref = greedy_reference(model, _prompts()[5], 7)
    assert b[5][0] == ref[:4]


def test_confidence_async_one_round_behind_equals_synchronous_greedy(model, stops):
    """Greedy outputs do not depend on the verified lengths; the async policy's lengths depend on
    which rows share a round, which the host learns one round later when it runs behind."""
    eos, stop_id = stops
    sync = _engine(model, "confidence_async", False, eos)
    behind = _engine(model, "confidence_async", True, eos)
    a, b = _run(sync, _requests(stop_id, sampled=False)), _run(behind, _requests(stop_id, sampled=False))
    assert [x[:3] for x in a] == [x[:3] for x in b]
    assert behind.stats["rounds_ahead"] > 0
    assert sum(m["num_draft_tokens"] for _, _, _, m, _ in b) > 0


def test_first_token_reaches_the_host_with_the_next_round(model, stops):
    eos, stop_id = stops
    eng = _engine(model, "fixed", True, eos)
    reqs = _requests(stop_id)[:SLOTS]
    for r in reqs:
        eng.add_request(r)
    assert eng.step() == []
    assert all(r.output_ids == [] for r in reqs)  # admitted, round 1 dispatched, nothing read yet
    eng.step()
    (long,) = [r for r in reqs if len(r.prompt_ids) > 8]  # two prefill chunks: the second in step 2
    assert all(len(r.output_ids) >= 2 for r in reqs if r.max_tokens > 1 and r is not long)  # first token + round 1
    assert eng.stats["rounds_ahead"] == 1 and long.output_ids == []
    eng.step()
    assert len(long.output_ids) >= 2  # its first token and its first round, one step later


def test_negative_control_keeping_the_extra_rounds_tokens(model, stops, monkeypatch):
    eos, stop_id = stops
    ref = _run(_engine(model, "fixed", False, eos), _requests(stop_id))
    eng = _engine(model, "fixed", True, eos)
    monkeypatch.setattr(eng, "_served", lambda launched: [i for i, r in enumerate(launched.reqs) if r is not None])
    reqs = _requests(stop_id)
    eng.run(reqs, progress=False)
    assert _outcome(reqs) != ref


def test_negative_control_reused_slot_keeps_its_round_counter(model, stops, monkeypatch):
    """A prefill that does not reset the slot's round counter: the extra round of a request ended by a
    stop-string rule shifts the next occupant's random stream, so outputs differ from synchronous
    (with the reset they are equal: the first test)."""
    def prefill_keeping_counters(ctx, t_params, d_params, cache, dstate, anchors, rows, *args, attn):
        *state, new_rows, outs = programs.prefill(ctx, t_params, d_params, cache, dstate, anchors, rows, *args,
                                                  attn=attn)
        slot_p = args[1][1]
        counts = new_rows.ints_7s[1].at[slot_p].set(rows.ints_7s[1][slot_p], mode="drop")
        return (*state, new_rows._replace(ints_7s=new_rows.ints_7s.at[1].set(counts)), outs)
    eos, _ = stops
    monkeypatch.setitem(runner.FAMILIES, "prefill",
                        dataclasses.replace(runner.FAMILIES["prefill"], fn=prefill_keeping_counters))
    outs = []
    for pipeline in (False, True):
        reqs = [EngineRequest(str(i), [3, 4, 5], max_tokens=12, temperature=1.0, seed=i,
                              stop_check=_stop_after_five) for i in range(2 * SLOTS)]
        outs.append(_run(_engine(model, "plain", pipeline, eos), reqs))
    assert outs[0] != outs[1]
