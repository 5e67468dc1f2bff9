"""vLLM's `min_tokens`: until a request has emitted min_tokens tokens, its stop ids (the engine's eos
ids unless it ignores them, and its own stop_token_ids) have probability zero wherever the device
samples it (the first token in prefill, every verified position of a round), and a stop string
cannot end it before then. Greedy outputs equal a reference that holds those ids back, with and
without verified drafts, while a request of the same batch without min_tokens still stops at eos;
sampled outputs follow the enumerated held-back law (chi-square); negative control: a device that
holds nothing back stops early and fails the law. (Stop strings: test_detokenize.)"""
import pytest

from specjax.api import SamplingParams
from specjax.decoding import logit_rules, row_state
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.serving.schema import FieldError, parse_sampling

from engine_fixtures import (BigramDrafter, chain_drafter, chi_square_pvalue, exact_continuations, hold_logits,
                             ruled_greedy, small_engine, tiny_target)
from test_engine import greedy_reference

V, GAMMA, N, M = 64, 3, 14, 6
PROMPT = [5, 17, 42, 8, 33]


def until_stop(tokens: list[int], stops: set[int], m: int) -> list[int]:
    """`tokens` cut after the first stop id at index >= m (all of them if none)."""
    for i, t in enumerate(tokens):
        if i >= m and t in stops:
            return tokens[:i + 1]
    return tokens


@pytest.fixture(scope="module")
def case():
    """(model, eos, own stop id, the held-back greedy continuation): eos is the plain greedy
    continuation's token at index 2; the own stop id is a token the continuation without eos would
    emit before index M (holding it back changes the output too) and that the held-back continuation
    emits at an index >= M (so the hold must end there)."""
    model = tiny_target(V, seed=5, init_scale=2.0)
    ref = greedy_reference(model, PROMPT, N)
    eos = ref[2]
    assert eos not in ref[:2], ref
    no_eos = ruled_greedy(model, PROMPT, N, hold_logits({eos}, M))
    for own in dict.fromkeys(no_eos[:M]):
        held = ruled_greedy(model, PROMPT, N, hold_logits({eos, own}, M))
        if own != eos and own in held[M:]:
            return model, eos, own, held
    raise AssertionError("no own stop id fits: pick another prompt")


def _oracle(chain_tokens: list[int]) -> BigramDrafter:
    """A bigram drafter whose greedy draws follow `chain_tokens` after PROMPT."""
    return chain_drafter(V, GAMMA, [PROMPT[-1]] + chain_tokens)


def _engine(model, drafter, eos: int) -> Engine:
    cfg = EngineConfig(max_slots=2, max_len=32, policy="plain" if drafter is None else "fixed", gamma=GAMMA,
                       slots_buckets=(2,), tokens_buckets=(1, GAMMA + 1), prefill_buckets=(8,), max_prefill=8,
                       prefill_batch_buckets=(2,), sampling_variants=("greedy",))
    eng = Engine(model, drafter, cfg, eos_token_ids=(eos,), progress=False)
    eng.warmup()
    return eng


@pytest.mark.parametrize("drafting", [False, True])
def test_min_tokens_holds_back_eos_and_own_stop_ids(case, drafting):
    model, eos, own, held = case
    eng = _engine(model, _oracle(held) if drafting else None, eos)
    free = EngineRequest("free", PROMPT, max_tokens=N, temperature=0.0)
    min_keeps = []  # what a stop string's check is told
    hold = EngineRequest("hold", PROMPT, max_tokens=N, temperature=0.0, min_tokens=M, stop_token_ids=(own,),
                         stop_check=lambda ids, min_keep: min_keeps.append(min_keep))
    eng.run([free, hold], progress=False)
    assert min_keeps and set(min_keeps) == {M}
    assert free.finish_reason == "stop" and free.output_ids[-1] == eos and len(free.output_ids) <= 3
    want = until_stop(held, {eos, own}, M)
    assert len(want) < N and want[-1] in (eos, own)  # a stop id ends it once the hold is over
    assert (hold.output_ids, hold.finish_reason) == (want, "stop"), held
    if drafting:  # drafts were verified across the held positions and accepted
        m = hold.metrics.as_dict()
        assert m["num_draft_tokens"] >= GAMMA and m["num_accepted_tokens"] >= GAMMA


@pytest.fixture(scope="module")
def small():
    """A vocabulary-8 target whose sampled continuations are enumerable; token 3 is the stop id."""
    return tiny_target(8, seed=3, init_scale=3.0)


def _sampled(eng: Engine, n: int, min_tokens: int, seed0: int) -> list[tuple[int, ...]]:
    reqs = [EngineRequest(str(i), [1, 5, 2], max_tokens=3 + GAMMA, temperature=1.0, seed=seed0 + i,
                          stop_token_ids=(3,), min_tokens=min_tokens, max_draft_tokens=i % (GAMMA + 1))
            for i in range(n)]
    eng.run(reqs, progress=False)
    return [tuple(r.output_ids[:3]) for r in reqs]


def _sampling_engine(model) -> Engine:
    return small_engine(model, BigramDrafter(8, GAMMA), slots=256, max_len=16, prefill=4, gamma=GAMMA,
                        tokens_buckets=(1, 2, 4), prefill_batch=256, variants=("plain",))


def test_sampled_outputs_follow_the_held_back_law(small):
    exact = exact_continuations(small, [1, 5, 2], 3, rule=hold_logits((3,), 2))
    free = exact_continuations(small, [1, 5, 2], 3)
    assert sum(v for k, v in free.items() if 3 in k[:2]) > 0.15  # holding token 3 back changes the law
    eng = _sampling_engine(small)
    ells = []
    eng.on_round = lambda info: ells.extend(info["ell"])
    samples = _sampled(eng, 4000, 2, seed0=0)
    assert sum(e == GAMMA for e in ells) > 500  # full blocks were verified
    assert all(len(s) == 3 and 3 not in s[:2] for s in samples)
    p = chi_square_pvalue(samples, exact)
    assert p > 1e-3, f"min_tokens output differs from the held-back law (chi-square p={p:.2e})"


def test_negative_control_a_device_that_holds_nothing_back(small, monkeypatch):
    monkeypatch.setattr(logit_rules, "hold_stops", lambda logits, stops, min_left: logits)
    samples = _sampled(_sampling_engine(small), 1000, 2, seed0=10**6)
    exact = exact_continuations(small, [1, 5, 2], 3, rule=hold_logits((3,), 2))
    assert chi_square_pvalue(samples, exact) < 1e-3


def test_min_tokens_is_checked_and_named():
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    assert parse_sampling({"min_tokens": 20, "max_tokens": 32}, SamplingParams(max_tokens=16)).min_tokens == 20
    for body in ({"min_tokens": 20}, {"min_tokens": 1.5}, {"min_tokens": 3, "max_tokens": 2}):
        with pytest.raises(FieldError, match="min_tokens") as e:
            parse_sampling(body, SamplingParams(max_tokens=16))
        assert e.value.field == "min_tokens"


def test_engine_refuses_more_held_stop_ids_than_a_row_holds(case):
    model, eos, _, _ = case
    eng = Engine(model, None, EngineConfig(max_slots=2, max_len=32, policy="plain"), progress=False)
    many = tuple(range(row_state.ROW_STOP_IDS + 1))
    with pytest.raises(ValueError, match=f"at most {row_state.ROW_STOP_IDS} stop_token_ids"):
        eng.add_request(EngineRequest("a", PROMPT, max_tokens=4, min_tokens=2, stop_token_ids=many))
    eng.add_request(EngineRequest("b", PROMPT, max_tokens=4, stop_token_ids=many))  # without min_tokens: host-side
    with pytest.raises(ValueError, match="min_tokens must be in"):
        eng.add_request(EngineRequest("c", PROMPT, max_tokens=4, min_tokens=5))
