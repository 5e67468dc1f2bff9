"""Confidence-scheduled verification in the engine: exact (non-anticipating) and measurably biased."""
import collections
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.decoding.programs import topk_prefix_fill
from specjax.scheduling import CostTable, RoundPlanner, prefix_schedule

from engine_fixtures import (BigramDrafter, chi_square_pvalue, exact_continuations, sample_continuations,
                             tiny_target)

V, GAMMA, PROMPT = 8, 3, [1, 5, 2]
NO_FILTER = ("greedy", "plain")  # the sampling variants compiled: no test here filters top-k / top-p
# Appendix A of the paper for one request: steps/s SPS(1)=1.0, SPS(2)=0.5, SPS(3)=0.45
ONE_REQUEST = CostTable.from_seconds({(1, 1): 1.0, (1, 2): 2.0, (1, 3): 1 / 0.45, (1, 4): 2.5})
# One request whose verify cost grows slowly enough that Algorithm 1 drafts: with the test drafter's
# confidences (0.24..0.79) it verifies 0, 1, 2 and 3 tokens in hundreds of rounds each or more (measured), and
# the anticipating search on the same table drafts differently (its bias is caught below).
DRAFTING_ROW = CostTable.from_seconds({(1, 1): 1.0, (1, 2): 1.6, (1, 3): 1.9, (1, 4): 2.0})
MIN_ROUNDS_PER_LENGTH = 500  # each verified length 1..GAMMA occurs at least this often in a chi-square run


def per_row(policy, table=DRAFTING_ROW):
    """A host policy that schedules every row as if alone under a one-request cost table (a row's
    schedule depends on its confidences only: each distinct row is scheduled once)."""
    seen: dict[bytes, np.ndarray] = {}

    def one(row_1g: np.ndarray) -> np.ndarray:
        key = row_1g.tobytes()
        if key not in seen:
            seen[key] = prefix_schedule(row_1g, table, policy, gamma=GAMMA)
        return seen[key]

    def fn(conf_rg):
        conf_rg = np.asarray(conf_rg)
        return np.concatenate([one(conf_rg[r:r + 1]) for r in range(conf_rg.shape[0])])
    return fn


def count_lengths(eng) -> np.ndarray:
    """Start counting the verified lengths of the engine's rounds; returns counts[ell] (updated live)."""
    counts = np.zeros(GAMMA + 1, np.int64)

    def on_round(info):
        np.add.at(counts, np.asarray(info["ell"], np.int64), 1)
    eng.on_round = on_round
    return counts


def assert_drafted_at_lengths(counts: np.ndarray, lengths=range(1, GAMMA + 1)) -> None:
    assert all(counts[e] >= MIN_ROUNDS_PER_LENGTH for e in lengths), f"verified-length counts {counts.tolist()}"


@pytest.fixture(scope="module")
def model():
    return tiny_target(V, seed=3, init_scale=3.0)


@pytest.fixture(scope="module")
def exact(model):
    return exact_continuations(model, PROMPT, 3)


def make_engine(model, policy, *, schedule_fn=None, cost_table=None, plain_seconds=None, tokens_buckets=(1, 2, 4),
                threshold=None):
    cfg = EngineConfig(max_slots=256, max_len=12, policy=policy, gamma=GAMMA, slots_buckets=(256,),
                       tokens_buckets=tokens_buckets, prefill_buckets=(4,), max_prefill=4,
                       prefill_batch_buckets=(256,), threshold=threshold,
                       sampling_variants=("plain",))  # every engine of this builder samples at T = 1
    eng = Engine(model, BigramDrafter(V, GAMMA, confidence=True, seed=7), cfg, progress=False,
                 schedule_fn=schedule_fn)
    if cost_table is not None:
        eng.cost_table = cost_table(eng.cost_table_meta())
    eng.warmup()
    if plain_seconds is not None:  # the synthetic cost table's scale, not this machine's
        eng.plain_seconds = plain_seconds
    return eng


def test_appendix_a_single_request_verifies_nothing():
    assert prefix_schedule(np.array([[0.8, 0.9, 0.9]]), ONE_REQUEST, "confidence").tolist() == [0]


def test_drafting_row_table_drafts_where_appendix_a_does_not():
    c = np.array([[0.79, 0.77, 0.77]])
    assert prefix_schedule(c, ONE_REQUEST, "confidence").tolist() == [0]
    assert prefix_schedule(c, DRAFTING_ROW, "confidence").tolist() == [3]


def test_algorithm1_per_row_is_exact(model, exact):
    eng = make_engine(model, "confidence", schedule_fn=per_row("confidence"))
    counts = count_lengths(eng)
    samples = sample_continuations(eng, PROMPT, 10000, 3)
    assert_drafted_at_lengths(counts)  # lossless while drafting, not plain decoding in disguise
    p = chi_square_pvalue(samples, exact)
    assert p > 1e-3, f"output differs from the target distribution (chi-square p={p:.2e})"


def test_anticipating_scheduler_is_caught(model, exact):
    """The same table and drafter, scheduled by a global search that looks at later confidences."""
    eng = make_engine(model, "confidence", schedule_fn=per_row("anticipating_global_search_LOSSY"))
    samples = sample_continuations(eng, PROMPT, 10000, 3, seed0=10**6)
    assert chi_square_pvalue(samples, exact) < 1e-3, "an anticipating scheduler passed: the test has no teeth"


def staircase(meta):
    return CostTable.from_seconds({(256, 1): 1.0, (256, 2): 1.2, (256, 4): 1.5}, meta=meta)


def shallow_staircase(meta):
    """A 256-row step whose cost barely grows up to 3 tokens per slot, so Algorithm 1 admits drafts over
    the batch; the step to 4 tokens never pays for a whole batch, so it stops there, with each row at 0, 1
    or 2 drafts by its own survivals (a batch-wide search stops only at such jumps: a cheap last step
    would admit every position, leaving only the requests' caps to vary the lengths)."""
    return CostTable.from_seconds({(256, 1): 1.0, (256, 2): 1.0001, (256, 3): 1.0002, (256, 4): 1.002},
                                  meta=meta)


def test_engine_confidence_policy_is_exact(model, exact):
    eng = make_engine(model, "confidence", cost_table=shallow_staircase, tokens_buckets=(1, 2, 3, 4))
    counts = count_lengths(eng)
    samples = sample_continuations(eng, PROMPT, 10000, 3, seed0=2 * 10**6)
    assert_drafted_at_lengths(counts, (1, 2))
    p = chi_square_pvalue(samples, exact)
    assert p > 1e-3, f"output differs from the target distribution (chi-square p={p:.2e})"


def test_engine_scheduler_peeking_at_the_next_confidence_is_caught(model, exact, monkeypatch):
    """Negative control for the engine's host policy path: Algorithm 1, then drop a row's last admitted
    draft when the next position's confidence (which depends on that draft's token) is low."""
    algorithm1 = RoundPlanner._host_lengths

    def peeking(self, conf_rg):
        ell = algorithm1(self, conf_rg)
        nxt = np.take_along_axis(np.pad(conf_rg, ((0, 0), (0, 1)), constant_values=1.0), ell[:, None], 1)[:, 0]
        return np.where((ell > 0) & (nxt < 0.5), ell - 1, ell)
    monkeypatch.setattr(RoundPlanner, "_host_lengths", peeking)
    eng = make_engine(model, "confidence", cost_table=shallow_staircase, tokens_buckets=(1, 2, 3, 4))
    samples = sample_continuations(eng, PROMPT, 10000, 3, seed0=2 * 10**6)
    p = chi_square_pvalue(samples, exact)
    assert p < 1e-3, f"a scheduler peeking at the next confidence passed (p={p:.2e}): the test has no teeth"


def test_engine_threshold_policy_is_exact(model, exact):
    # the test drafter's confidences: three tokens >= 0.7, five below, so leading runs of every length
    eng = make_engine(model, "threshold", threshold=0.7)
    counts = count_lengths(eng)
    samples = sample_continuations(eng, PROMPT, 10000, 3, seed0=5 * 10**6)
    assert_drafted_at_lengths(counts)
    p = chi_square_pvalue(samples, exact)
    assert p > 1e-3, f"output differs from the target distribution (chi-square p={p:.2e})"


def test_engine_confidence_async_policy_is_exact(model, exact):
    eng = make_engine(model, "confidence_async", cost_table=staircase, plain_seconds={256: 1.0})
    lengths = []
    eng.on_round = lambda info: lengths.extend(info["ell"])
    samples = sample_continuations(eng, PROMPT, 10000, 3, seed0=3 * 10**6)
    assert chi_square_pvalue(samples, exact) > 1e-3
    assert 0 < np.mean(lengths) < GAMMA  # it really chose lengths: neither nothing nor everything


def test_topk_prefix_fill_admits_prefixes_by_survival():
    conf = jnp.array([[0.9, 0.5, 0.9], [0.6, 0.99, 0.99], [0.95, 0.95, 0.95]])
    active = jnp.array([True, True, False])
    # survivals: row0 .9 .45 .405, row1 .6 .594 .588; row 2 idle
    assert topk_prefix_fill(conf, jnp.int32(3), active, 3).tolist() == [1, 2, 0]
    assert topk_prefix_fill(conf, jnp.int32(0), active, 3).tolist() == [0, 0, 0]
    assert topk_prefix_fill(conf, jnp.int32(6), active, 2).tolist() == [2, 2, 0]
    ties = jnp.full((2, 3), 0.5)
    assert topk_prefix_fill(ties, jnp.int32(3), jnp.array([True, True]), 3).tolist() == [2, 1]


def test_cost_table_for_another_engine_is_refused(model):
    cfg = EngineConfig(max_slots=4, max_len=16, policy="confidence", gamma=GAMMA, slots_buckets=(4,),
                       tokens_buckets=(1, 4), prefill_buckets=(8,), max_prefill=8)
    eng = Engine(model, BigramDrafter(V, GAMMA, confidence=True), cfg, progress=False)
    meta = eng.cost_table_meta()
    import dataclasses
    other = dataclasses.replace(meta, target="some-other-model")
    table = CostTable.from_seconds({(4, 1): 1.0, (4, 4): 2.0}, meta=other)
    with pytest.raises(ValueError, match="target"):
        eng.use_cost_table(table)


def test_engine_profiles_its_own_cost_table(model, tmp_path):
    cfg = EngineConfig(max_slots=2, max_len=16, policy="confidence", gamma=GAMMA, slots_buckets=(1, 2),
                       tokens_buckets=(1, 4), prefill_buckets=(8,), max_prefill=8, sampling_variants=NO_FILTER)
    eng = Engine(model, BigramDrafter(V, GAMMA, confidence=True), cfg, progress=False)
    eng.warmup()
    table = eng.cost_table
    assert set(table.as_dict()) == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(s > 0 for s in table.as_dict().values())
    table.check_matches(eng.cost_table_meta())
    path = tmp_path / "cost.json"
    table.to_json(path)
    eng.use_cost_table(CostTable.from_json(path))  # a saved table for this engine is accepted
    reqs = sample_continuations(eng, PROMPT, 4, 5)
    assert all(len(r) == 5 for r in reqs)


def test_async_policy_skips_drafting_when_plain_rounds_pay_more(model, exact):
    eng = make_engine(model, "confidence_async", cost_table=staircase, plain_seconds={256: 0.2})
    rounds = []
    eng.on_round = lambda info: rounds.append((info["kind"], max(info["ell"])))
    samples = sample_continuations(eng, PROMPT, 3000, 3, seed0=4 * 10**6)
    # exact although most rounds are lite (no drafter upkeep) and the rows they leave behind never draft
    assert chi_square_pvalue(samples, exact) > 1e-3
    kinds = [k for k, _ in rounds]
    # a plain step (0.2 s) beats every drafted round of the staircase (>= 1 s): only probes draft, and
    # after LITE_AFTER upkeep rounds in a row the rounds stop maintaining the drafter (lite)
    planner = eng.planner
    assert kinds.count("draft") <= len(kinds) // (planner.PROBE_EVERY + 1) + 1
    assert kinds[1:1 + planner.LITE_AFTER] == ["upkeep"] * planner.LITE_AFTER
    assert kinds.count("lite") > len(kinds) // 2
    assert all(e == 0 for k, e in rounds if k != "draft")


def one_slot_async_engine(model, plain_seconds, drafter=None):
    cfg = EngineConfig(max_slots=1, max_len=12, policy="confidence_async", gamma=GAMMA, slots_buckets=(1,),
                       tokens_buckets=(1, 2, 4), prefill_buckets=(4,), max_prefill=4, prefill_batch_buckets=(1,),
                       sampling_variants=NO_FILTER)
    drafter = drafter if drafter is not None else BigramDrafter(V, GAMMA, confidence=True, seed=7)
    eng = Engine(model, drafter, cfg, progress=False)
    eng.cost_table = CostTable.from_seconds({(1, 1): 1.0, (1, 2): 1.2, (1, 4): 1.5}, meta=eng.cost_table_meta())
    eng.warmup()
    eng.plain_seconds = plain_seconds
    return eng


def test_async_probes_back_off_and_stale_rows_never_draft(model):
    eng = one_slot_async_engine(model, {1: 0.2})
    # per planned round (the host plans each round before reading the previous one): its kind and
    # largest ell, and whether the slot's drafter context was complete before it
    rounds, fresh_at_round = [], []
    plan = eng.planner.plan

    def recording_plan(caps_b, active_b):
        fresh_at_round.append(bool(eng.planner.fresh[0]))
        p = plan(caps_b, active_b)
        rounds.append((p.kind, int(p.ell_b.max())))
        return p
    eng.planner.plan = recording_plan
    reqs = [EngineRequest(str(i), PROMPT, max_tokens=8, temperature=1.0, seed=i) for i in range(160)]
    eng.run(reqs, progress=False)
    drafts = [i for i, (k, _) in enumerate(rounds) if k == "draft"]
    assert all(fresh_at_round[i] for i in drafts)  # a row a lite round left behind never drafts again
    gaps = np.diff(drafts)
    # probes come after 32, 64, 128, ... rounds without drafting (each waits for a fresh row)
    want = [min(RoundPlanner.PROBE_EVERY * 2 ** k, RoundPlanner.PROBE_MAX) for k in range(len(gaps))]
    assert len(gaps) >= 3 and all(g > w for g, w in zip(gaps, want)), (gaps, want)
    assert all(e == 0 for k, e in rounds if k != "draft")


def test_async_round_admitting_no_draft_is_not_drafted(model):
    """Confidences of 0 admit no draft (after the first round, planned on the 0.5 prior), and the
    cost table's 1-token round (1.0 s) is below the measured plain round (1.1 s), as table noise can
    make it. A drafting round that verifies nothing still pays for a proposal, so the policy must go
    upkeep and lite, drafting only in its probes (the rule before drafted all 280 rounds here)."""
    drafter = BigramDrafter(V, GAMMA, confidence=True, seed=7)
    drafter.conf_table[...] = jnp.zeros((V,), jnp.float32)
    eng = one_slot_async_engine(model, {1: 1.1}, drafter)
    kinds = []
    eng.on_round = lambda info: kinds.append(info["kind"])
    eng.run([EngineRequest(str(i), PROMPT, max_tokens=8, temperature=1.0, seed=i) for i in range(40)],
            progress=False)
    assert kinds.count("lite") > len(kinds) // 2 and kinds.count("draft") <= 8, collections.Counter(kinds)


def test_async_drafts_again_when_drafting_pays(model):
    eng = one_slot_async_engine(model, {1: 5.0})  # a plain step slower than any drafted round
    kinds = []
    eng.on_round = lambda info: kinds.append(info["kind"])
    reqs = [EngineRequest(str(i), PROMPT, max_tokens=8, temperature=1.0, seed=i) for i in range(10)]
    eng.run(reqs, progress=False)
    assert set(kinds) == {"draft"}


def test_async_drafting_round_is_one_call_and_greedy_equals_plain(model):
    """The async policy drafts, fills its lengths from the fresh confidences and verifies in one
    executable call (fused_fill); greedy output is the plain engine's."""
    eng = one_slot_async_engine(model, {1: 5.0})  # drafting always pays: every round drafts
    # per planned round (the host plans a round before reading the previous one): its kind and the
    # round calls dispatched after the plan (prefill, release and copy calls are no round's)
    rounds: list[tuple[str, list[str]]] = []
    run, plan = eng.runner.run, eng.planner.plan

    def recording_run(family, key, **kw):
        if family not in ("prefill", "release", "copy"):
            rounds[-1][1].append(family)
        return run(family, key, **kw)

    def recording_plan(caps_b, active_b):
        p = plan(caps_b, active_b)
        rounds.append((p.kind, []))
        return p
    eng.runner.run, eng.planner.plan = recording_run, recording_plan
    reqs = [EngineRequest(str(i), p, max_tokens=8, temperature=0.0) for i, p in enumerate([PROMPT, [3, 4], [7]])]
    eng.run(reqs, progress=False)
    assert rounds and all(kind == "draft" and fams == ["fused_fill"] for kind, fams in rounds), rounds
    plain = Engine(model, None, EngineConfig(max_slots=1, max_len=12, policy="plain", slots_buckets=(1,),
                                             prefill_buckets=(4,), max_prefill=4, prefill_batch_buckets=(1,),
                                             sampling_variants=NO_FILTER),
                   progress=False)
    plain.warmup()
    ref = [EngineRequest(r.request_id, r.prompt_ids, max_tokens=8, temperature=0.0) for r in reqs]
    plain.run(ref, progress=False)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    exes = eng.runner.exes
    assert not exes["draft"].keys and not exes["verify"].keys and exes["fused_fill"].keys  # no two-call path
