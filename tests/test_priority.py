"""vLLM's priority scheduling: with EngineConfig.scheduling_policy "priority" waiting requests start
lower priority first (arrival order among equals, a running request keeps its slot); "fcfs" (the
default) refuses a non-zero priority, naming the field and the option."""
from __future__ import annotations

import pytest

from specjax.decoding.engine import EngineRequest
from specjax.decoding.requests import RequestFieldError

from engine_fixtures import small_engine, tiny_target

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
