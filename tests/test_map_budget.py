"""XLA:CPU's memory-mapping limit (`specjax.decoding.map_budget`): a warm-up that would pass
vm.max_map_count stops with an error naming it before XLA crashes, and an engine whose default
buckets would not fit compiles coarser defaults (warned) and still decodes exactly. The process's
limit and mappings are replaced here by chosen numbers, so the tests do not depend on the machine."""
from __future__ import annotations

import dataclasses

import pytest

from specjax.decoding import map_budget
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.decoding.runner import Runner
from specjax.sampling import VARIANTS

from engine_fixtures import tiny_target

V = 32
MAPS = 100.0  # mappings each program is taken to need


def _machine(monkeypatch, limit: int, held: int = 0) -> None:
    monkeypatch.setattr(map_budget, "map_limit", lambda: limit)
    monkeypatch.setattr(map_budget, "mapped_regions", lambda: held)


def test_guard_stops_a_warmup_projected_past_the_limit_and_names_it(monkeypatch):
    _machine(monkeypatch, limit=10_000, held=1_000)
    map_budget.WarmupGuard(80, "cpu", expected_maps=8_000)  # 9,000 <= 0.93 x 10,000: goes on
    with pytest.raises(map_budget.ProgramBudgetError, match=r"90 programs.*9,500 memory mappings.*"
                                                            r"vm\.max_map_count = 10,000.*sysctl"):
        map_budget.WarmupGuard(90, "cpu", expected_maps=8_500)
    map_budget.WarmupGuard(90, "gpu", expected_maps=8_500)  # accelerators: no such limit


def test_guard_stops_when_the_mappings_held_pass_the_line_while_compiling(monkeypatch):
    _machine(monkeypatch, limit=10_000, held=1_000)
    guard = map_budget.WarmupGuard(50, "cpu")
    guard.installed()
    _machine(monkeypatch, limit=10_000, held=9_400)
    with pytest.raises(map_budget.ProgramBudgetError, match="9,400 memory mappings"):
        guard.installed()


def test_coarsening_stops_at_the_first_step_that_fits_and_warns(monkeypatch):
    _machine(monkeypatch, limit=1_000)
    n = {"programs": 12}
    steps = [(f"step {i}", "a", "b", lambda k=k: n.update(programs=k)) for i, k in enumerate((10, 8, 2))]
    with pytest.warns(UserWarning, match="12 compiled programs would take about 1,200"):
        done = map_budget.coarsen_to_fit(lambda: [MAPS] * n["programs"], steps)
    assert len(done) == 2 and n["programs"] == 8  # 1,000 > 900 (10 programs), 800 fits: step 2 never applied


def _engine(model, **cfg) -> Engine:
    base = dict(max_slots=2, max_len=1024, policy="plain", slots_buckets=(2,), prefill_buckets=(16,),
                max_prefill=16, prefill_batch_buckets=(1,))
    return Engine(model, None, EngineConfig(**{**base, **cfg}), progress=False)


def _greedy(eng: Engine) -> list[list[int]]:
    reqs = [EngineRequest(str(i), p, max_tokens=8, temperature=0.0) for i, p in enumerate([[1, 2, 3], [4, 5]])]
    eng.run(reqs, progress=False)
    return [r.output_ids for r in reqs]


def test_an_engine_over_the_budget_compiles_coarser_defaults_and_decodes_the_same(monkeypatch):
    model = tiny_target(V, seed=3, init_scale=2.0)
    probe = _engine(model)
    assert probe.buckets.attention == (512, 1024) and probe.cfg.sampling_variants == VARIANTS
    n_default = len(probe.warm_keys())
    probe.buckets = dataclasses.replace(probe.buckets, attention=(1024,))
    n_one = len(probe.warm_keys())
    assert n_one < n_default
    limit = int(n_one * MAPS / map_budget.HEADROOM) + 1  # one attention bucket fits, two do not
    _machine(monkeypatch, limit=limit)
    monkeypatch.setattr(Runner, "maps_by_family", lambda self, keys: {f: MAPS for f, _ in keys})

    eng = _engine(model)
    with pytest.warns(UserWarning, match=r"attention buckets \(1024,\) instead of the default \(512, 1024\)"):
        eng.warmup()
    assert len(eng.coarsened) == 1 and eng.buckets.attention == (1024,)
    assert eng.cfg.sampling_variants == VARIANTS  # the first step sufficed
    assert sum(eng.compile_counts().values()) == n_one  # only the coarser set was compiled
    reference = _engine(model, attention_buckets=(1024,))  # a user's explicit choice: never coarsened
    reference.warmup()
    assert reference.coarsened == []
    out = _greedy(eng)
    assert out == _greedy(reference) and all(len(o) == 8 for o in out)

    # control: what the user set is not changed; the warm-up stops with the limit named, before tracing
    explicit = _engine(model, attention_buckets=(512, 1024), sampling_variants=("greedy", "filtered"))
    monkeypatch.setattr(Runner, "lower", lambda *a: pytest.fail("traced a warm-up that cannot fit"))
    with pytest.raises(map_budget.ProgramBudgetError, match="vm.max_map_count"):
        explicit.warmup()
    assert explicit.coarsened == [] and explicit.buckets.attention == (512, 1024)
    assert sum(explicit.compile_counts().values()) == 0


def test_the_runner_measures_each_familys_mappings_on_this_machine():
    """Unpatched: on Linux (CI's machine too) one program per family compiles and its mappings count."""
    if map_budget.map_limit() is None:
        pytest.skip("no vm.max_map_count on this system")
    eng = _engine(tiny_target(V, seed=3))
    keys = eng.warm_keys()
    by_family = eng.runner.maps_by_family(keys)
    assert set(by_family) == {f for f, _ in keys} == {"prefill", "release", "copy", "lite"}
    assert by_family["lite"] >= 3  # each kernel: code, read-only data and data
    assert sum(eng.compile_counts().values()) == 4  # those programs stay compiled; warm-up skips them
    eng.warmup()
    assert sum(eng.compile_counts().values()) == len(keys) and eng.coarsened == []


def test_an_engine_that_fits_at_the_bound_measures_nothing(monkeypatch):
    """Engines whose programs fit even at MAPS_BOUND each skip the serial measurement (their warm-up
    compiles every program in parallel); the test above shows the measurement runs when they might not."""
    _machine(monkeypatch, limit=10 ** 6)

    def refuse(self, keys):
        raise AssertionError("measured an engine that fits anyway")
    monkeypatch.setattr(Runner, "maps_by_family", refuse)
    eng = _engine(tiny_target(V, seed=3))
    eng.warmup()
    assert eng.coarsened == [] and sum(eng.compile_counts().values()) == len(eng.warm_keys())


def test_the_serving_programs_set_what_the_budget_would_coarsen(monkeypatch):
    """--attention-buckets and --sampling-variants reach the engine (set, they are never coarsened);
    a variant name outside sampling.VARIANTS is refused at parsing, naming the choices."""
    from specjax import api
    from specjax.cli.serve import build_parser
    from specjax.serving.cli import build_llm
    seen = {}
    monkeypatch.setattr(api, "LLM", lambda **kw: seen.update(kw))
    build_llm(build_parser().parse_args(["--attention-buckets", "1024", "--sampling-variants", "greedy,filtered"]))
    cfg = seen["engine_config"]
    assert cfg.attention_buckets == (1024,) and cfg.sampling_variants == ("greedy", "filtered")
    build_llm(build_parser().parse_args([]))
    assert seen["engine_config"] is None  # nothing set: the engine's defaults
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--sampling-variants", "greedy,nucleus"])
