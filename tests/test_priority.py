"""vLLM's priority scheduling: with EngineConfig.scheduling_policy "priority" waiting requests start
lower priority first (arrival order among equals); a waiting request that outranks a running one takes
its slot (preemption by recompute: the running one waits, then continues from its prompt and output,
its tokens still the target's); "fcfs" (the default) refuses a non-zero priority, naming the field and
the option."""
from __future__ import annotations

import pytest

from specjax.decoding import preemption
from specjax.decoding.engine import Engine, EngineRequest
from specjax.decoding.requests import RequestFieldError
from specjax.drafters.ngram import NGramDrafter

from engine_fixtures import chi_square_pvalue, exact_continuations, small_engine, tiny_target

V = 16


@pytest.fixture(scope="module")
def model():
    return tiny_target(V, seed=1)


def _req(name: str, priority: int = 0) -> EngineRequest:
    return EngineRequest(name, [1, 2, 3], max_tokens=3, temperature=0.0, priority=priority)


def _finish_order(eng, reqs, late=None):
    """Request ids in the order one slot served them; `late` is added after the first step."""
    for r in reqs:
        eng.add_request(r)
    done = [r.request_id for r in eng.step()]
    for r in late or ():
        eng.add_request(r)
    while eng.has_work():
        done += [r.request_id for r in eng.step()]
    return done


def test_one_slot_serves_waiting_requests_lowest_priority_first(model):
    eng = small_engine(model, slots=1, config={"scheduling_policy": "priority", "prefix_caching": False},
                       variants=("greedy",))
    order = _finish_order(eng, [_req("a", 3), _req("b"), _req("c", -2), _req("d")], late=[_req("e", -1)])
    # c starts first; e arrives after the first step, while c runs, and goes before b and d (not c)
    assert order == ["c", "e", "b", "d", "a"], order
    # control: equal priorities keep arrival order
    assert _finish_order(eng, [_req("p"), _req("q"), _req("r")], late=[_req("s")]) == ["p", "q", "r", "s"]


def test_fcfs_refuses_a_priority_naming_the_option(model):
    eng = small_engine(model, slots=1, variants=("greedy",))
    with pytest.raises(RequestFieldError, match="priority needs an engine with priority scheduling "
                                                r"\(EngineConfig.scheduling_policy=priority; the server's "
                                                "--scheduling-policy priority\\)") as e:
        eng.add_request(_req("x", 1))
    assert e.value.field == "priority"
    eng.add_request(_req("y", 0))  # 0 is every request's priority under fcfs
    assert [r.request_id for r in eng.run([])] == ["y"]
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        small_engine(model, slots=1, config={"scheduling_policy": "lifo"})


def test_victims_are_the_lowest_priority_latest_arrivals_that_waiting_requests_outrank():
    running = [(0, 2, 1.0), (1, 5, 2.0), (2, 5, 3.0), (3, -1, 4.0)]  # (slot, priority, arrival)
    assert preemption.victims([0, 1], running, free=0) == [2, 1]  # priority 5 first, the later arrival first
    assert preemption.victims([0, 1, 4], running, free=1) == [2, 1]  # the free slot goes to the first
    assert preemption.victims([2, 0], running, free=0) == [2, 1]  # 5 > 2: still outranked
    assert preemption.victims([5, 0], running, free=0) == []  # the head outranks none: the search stops
    assert preemption.victims([-3], [(0, -3, 0.0)], free=0) == []  # equals keep their slots
    assert preemption.preemptible(EngineRequest("a", [1], 4, logit_bias={3: 1.0}, repetition_penalty=1.2))
    for field in ({"presence_penalty": 0.5}, {"frequency_penalty": -0.5}, {"bad_words": ((3, 4),)},
                  {"guided_choice": ((3,),)}, {"prediction_ids": (3, 4)}):
        assert not preemption.preemptible(EngineRequest("a", [1], 4, **field)), field


LOW_PROMPT, HIGH_PROMPT = [3, 5, 7, 5, 3], [9, 2, 4]


@pytest.mark.parametrize("drafter, caching, steps", [(None, True, 3), ("ngram", True, 3), ("ngram", False, 14)])
def test_a_waiting_request_that_outranks_a_running_one_takes_its_slot(model, drafter, caching, steps):
    """One slot: a long low-priority request runs, a high-priority one arrives after `steps` steps and
    finishes first; the low one, preempted once, continues to its greedy output (drafts verified with the
    n-gram drafter; with prefix caching from its old rows, without it a whole prefill: after 14 steps its
    prompt and output outgrow one 16-token prefill call, so chunked). Control: equal priorities wait."""
    make = (lambda: None) if drafter is None else (lambda: NGramDrafter(V, gamma=3, max_ngram=2))
    cfg = {"scheduling_policy": "priority", "prefix_caching": caching}
    ref = small_engine(model, make(), slots=1, variants=("greedy",), config=cfg)
    want = {p[0]: r.output_ids for p, r in ((p, ref.run([EngineRequest("r", p, max_tokens=24, temperature=0.0)])[0])
                                         for p in (LOW_PROMPT, HIGH_PROMPT))}
    eng = small_engine(model, make(), slots=1, variants=("greedy",), config=cfg)
    for high_priority, preempted in ((-1, True), (5, False)):
        low = EngineRequest("low", list(LOW_PROMPT), max_tokens=24, temperature=0.0, priority=5)
        high = EngineRequest("high", list(HIGH_PROMPT), max_tokens=24, temperature=0.0, priority=high_priority)
        order = _finish_order_after(eng, [low], late=[high], steps=steps)
        assert order == (["high", "low"] if preempted else ["low", "high"]), (high_priority, order)
        assert (low.preemptions, high.preemptions) == (int(preempted), 0)
        assert low.output_ids == want[LOW_PROMPT[0]] and high.output_ids == want[HIGH_PROMPT[0]]
        assert steps <= low.resume_at < 24 if preempted else low.resume_at == 0
        if preempted and steps > 3:
            assert len(low.context_ids()) > 16  # readmitted in two prefill calls
        if drafter is not None:
            assert low.metrics.num_drafts > 0 and low.metrics.num_accepted_tokens > 0
    assert eng.stats["preemptions"] == 1


def _finish_order_after(eng, reqs, late, steps):
    for r in reqs:
        eng.add_request(r)
    done = []
    for _ in range(steps):
        done += [r.request_id for r in eng.step()]
    for r in late:
        eng.add_request(r)
    while eng.has_work():
        done += [r.request_id for r in eng.step()]
    return done


def _preempted_samples(eng, n_samples: int, per_run: int) -> list[tuple[int, ...]]:
    """Tokens 1 and 3 of `n_samples` seeded sampled low-priority requests, each preempted after its
    second token (the round in flight when the high-priority requests of one token arrive is read first)
    and resuming with its third (`per_run` lows and highs at a time)."""
    out = []
    for start in range(0, n_samples, per_run):
        lows = [EngineRequest(f"l{start + i}", list(LOW_PROMPT), max_tokens=5, temperature=1.0, seed=start + i,
                              priority=1) for i in range(per_run)]
        for r in lows:
            eng.add_request(r)
        eng.step()  # admitted: first tokens sampled, not read
        for i in range(per_run):
            eng.add_request(EngineRequest(f"h{i}", list(HIGH_PROMPT), max_tokens=1, temperature=1.0, priority=0))
        while eng.has_work():
            eng.step()
        assert all(r.preemptions == 1 and r.resume_at == 2 and len(r.output_ids) == 5 for r in lows)
        out += [(r.output_ids[0], r.output_ids[2]) for r in lows]
    return out


def test_preempted_sampled_requests_keep_the_targets_distribution(model, monkeypatch):
    """2,560 seeded sampled requests preempted after two tokens: their first and third tokens (one before,
    one after) follow the target's enumerated distribution (chi-square). Negative control: resuming
    with the request's own key (its counters restart, so the tokens after the preemption reuse the
    randomness of those before) is detected."""
    exact: dict[tuple[int, ...], float] = {}
    for (a, _, c), p in exact_continuations(model, LOW_PROMPT, 3, temperature=1.0).items():
        exact[(a, c)] = exact.get((a, c), 0.0) + p
    eng = small_engine(model, slots=64, max_len=16, prefill=8, variants=("plain",),
                       config={"scheduling_policy": "priority", "prefix_caching": False})
    assert chi_square_pvalue(_preempted_samples(eng, 2560, 64), exact) > 1e-3
    own_key = Engine._seed_key
    monkeypatch.setattr(Engine, "_seed_key", lambda self, r: own_key(self, EngineRequest(
        r.request_id, r.prompt_ids, r.max_tokens, seed=r.seed)))  # resume_at ignored: the seed's own key
    assert chi_square_pvalue(_preempted_samples(eng, 2560, 64), exact) < 1e-6


def test_a_preempted_stream_continues_where_it_was_and_the_server_counts_it(model):
    """Through the server's engine thread: a streamed low-priority request gives its slot to a
    high-priority one mid-answer; its deltas, joined, are its greedy output (nothing repeated or
    lost across the preemption), and vLLM's vllm:num_preemptions_total counts one."""
    import time

    from specjax.serving.async_engine import AsyncEngine
    from specjax.serving.metrics import ServingMetrics
    cfg = {"scheduling_policy": "priority"}
    ref = small_engine(model, slots=1, variants=("greedy",), config=cfg)
    want = ref.run([EngineRequest("r", list(LOW_PROMPT), max_tokens=40, temperature=0.0)])[0].output_ids
    metrics = ServingMetrics(model_name="tiny")
    eng = small_engine(model, slots=1, variants=("greedy",), config=cfg)
    eng.on_round = lambda info: time.sleep(0.02)  # rounds slow enough for the high one to arrive mid-answer
    engine = AsyncEngine(eng, metrics=metrics).start()
    try:
        low = engine.submit(EngineRequest("low", list(LOW_PROMPT), max_tokens=40, temperature=0.0, priority=1))
        got = list(low.get(timeout=60).token_ids)  # the low one is decoding
        high = engine.submit(EngineRequest("high", list(HIGH_PROMPT), max_tokens=4, temperature=0.0))
        for ev in low:
            got += ev.token_ids
        assert high.result(60).metrics.finish_time < low.request.metrics.finish_time
        assert got == want and low.request.preemptions == 1
        deadline = time.monotonic() + 10
        while metrics.snapshot()["requests"]["preempted"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # the gauges are updated after the step that delivered the end
        assert b'vllm:num_preemptions_total{model_name="tiny"} 1.0' in metrics.exposition()
    finally:
        engine.drain(60)
        engine.shutdown()
