"""vLLM's `ignore_eos`: a request that sets it generates past the engine's eos ids, which the device
reads per row (an eos inside an accepted draft, or as the round's next token, ends only the rows
that honour it), while its own stop_token_ids still end it. Outputs equal the greedy reference
with and without a drafter; a request without the flag in the same batch still stops at eos.
Negative control: a prefill that marks every row as honouring eos ends the ignore_eos request at
eos on the device."""
import dataclasses
import inspect

import numpy as np
import pytest

from specjax.api import SamplingParams
from specjax.decoding import programs, runner
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.serving.schema import FieldError, parse_sampling

from engine_fixtures import BigramDrafter, tiny_target
from test_engine import greedy_reference

V, GAMMA, N = 64, 3, 14
PROMPT = [5, 17, 42, 8, 33]


@pytest.fixture(scope="module")
def case():
    """(model, greedy continuation of PROMPT, eos): eos is the token at index 2 of the continuation,
    its first occurrence, so a drafting round's second draft (and a plain round's token) is eos."""
    model = tiny_target(V, seed=5, init_scale=2.0)
    ref = greedy_reference(model, PROMPT, N)
    eos = ref[2]
    assert eos not in ref[:2], ref
    return model, ref, eos


def _oracle(ref: list[int]) -> BigramDrafter:
    """A bigram drafter whose greedy draws follow the reference continuation (each token's successor
    in it; the test needs that map to be a function)."""
    chain = [PROMPT[-1]] + ref
    succ = {}
    for a, b in zip(chain, chain[1:]):
        assert succ.setdefault(a, b) == b, "the reference is not a bigram chain: pick another prompt"
    drafter = BigramDrafter(V, GAMMA)
    table = np.zeros((V, V), np.float32)
    for a, b in succ.items():
        table[a, b] = 30.0
    drafter.table[...] = table
    return drafter


def _engine(model, drafter, eos: int) -> Engine:
    cfg = EngineConfig(max_slots=2, max_len=32, policy="plain" if drafter is None else "fixed", gamma=GAMMA,
                       slots_buckets=(2,), tokens_buckets=(1, GAMMA + 1), prefill_buckets=(8,), max_prefill=8,
                       prefill_batch_buckets=(2,))
    eng = Engine(model, drafter, cfg, eos_token_ids=(eos,), progress=False)
    eng.warmup()
    return eng


def _run(eng: Engine, stop_token_ids=()) -> tuple[EngineRequest, EngineRequest]:
    honour = EngineRequest("honour", PROMPT, max_tokens=N, temperature=0.0)
    ignore = EngineRequest("ignore", PROMPT, max_tokens=N, temperature=0.0, ignore_eos=True,
                           stop_token_ids=stop_token_ids)
    eng.run([honour, ignore], progress=False)
    return honour, ignore


@pytest.mark.parametrize("drafting", [False, True])
def test_ignore_eos_generates_past_eos_and_the_other_row_still_stops(case, drafting):
    model, ref, eos = case
    eng = _engine(model, _oracle(ref) if drafting else None, eos)
    honour, ignore = _run(eng)
    assert (honour.output_ids, honour.finish_reason) == (ref[:3], "stop")
    assert (ignore.output_ids, ignore.finish_reason) == (ref, "length")
    if drafting:  # eos was an accepted draft of the ignoring row (round 1 verifies ref[1:4])
        m = ignore.metrics.as_dict()
        assert m["num_accepted_tokens_per_pos"][1] >= 1 and m["num_accepted_tokens"] >= 2 * GAMMA


def test_ignore_eos_keeps_the_requests_own_stop_ids(case):
    model, ref, eos = case
    stop = next(t for t in ref[3:] if t != eos)
    _, ignore = _run(_engine(model, _oracle(ref), eos), stop_token_ids=(stop,))
    assert (ignore.output_ids, ignore.finish_reason) == (ref[:ref.index(stop) + 1], "stop")


def test_negative_control_a_device_that_ends_every_row_at_eos(case, monkeypatch):
    def prefill_honouring_eos(*args, attn):
        bound = inspect.signature(programs.prefill).bind(*args, attn=attn)
        bound.arguments["limits_4b"] = bound.arguments["limits_4b"].at[2].set(1)  # eos_stops = 1 for every row
        return programs.prefill(*bound.args, **bound.kwargs)
    monkeypatch.setitem(runner.FAMILIES, "prefill",
                        dataclasses.replace(runner.FAMILIES["prefill"], fn=prefill_honouring_eos))
    model, ref, eos = case
    _, ignore = _run(_engine(model, _oracle(ref), eos))
    assert ignore.output_ids != ref, ignore.finish_reason


def test_ignore_eos_is_a_checked_flag():
    assert SamplingParams(ignore_eos=True).ignore_eos
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=1)
    assert parse_sampling({"ignore_eos": True}, SamplingParams()).ignore_eos
    with pytest.raises(FieldError, match="ignore_eos") as e:
        parse_sampling({"ignore_eos": "yes"}, SamplingParams())
    assert e.value.field == "ignore_eos"
