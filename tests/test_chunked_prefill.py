"""vLLM's chunked prefill (`EngineConfig.chunked_prefill`, on by default): a prompt longer than one
prefill call takes its first call at admission and one call per engine step after it, between
decoding rounds, so requests already running keep decoding while it is prefilled; the row it fills
stays inactive on the device until its last chunk. For plain decoding and drafters with per-slot
state (DSpark's context K/V, Eagle3's pair cache) the long request then decodes the same greedy
tokens, accepts the same drafts round by round, leaves the same target cache rows and proposes the
same next block as with the whole prompt prefilled at admission (chunked prefill off: the control,
in which the running request does not advance while the prompt is prefilled). Negative control: a
row left active between its chunks breaks Eagle3's pair cache."""
import pytest

from specjax.decoding.engine import EngineRequest

from engine_fixtures import tiny_target
from test_drafters_lossless import V
from test_engine import greedy_reference
from test_prefix_cache import _differences, _engine

LONG = [(3 * k + k // 5) % 7 + 1 for k in range(37)]  # 5 chunks of at most 8 tokens
SHORT = [1, 2, 3]


@pytest.fixture(scope="module")
def target():
    return tiny_target(V, seed=3)


def _run(target, kind, on: bool):
    """A short request decoding, then LONG added: (engine, short, long, steps in which the short one
    gained tokens while LONG was still being prefilled)."""
    engine = _engine(target, kind, slots=2, chunked_prefill=on, prefix_caching=False)
    short = EngineRequest("short", SHORT, max_tokens=40, temperature=0.0)
    long = EngineRequest("long", LONG, max_tokens=8, temperature=0.0)
    engine.add_request(short)
    engine.step()
    engine.step()
    engine.add_request(long)
    interleaved = 0
    while engine.has_work():
        mid = any(e[0] is long for e in engine._prefilling)
        before = len(short.output_ids)
        engine.step()
        interleaved += mid and len(short.output_ids) > before
    return engine, short, long, interleaved


@pytest.mark.parametrize("kind", [None, "dspark", "eagle3"])
def test_running_requests_decode_between_a_long_prompts_chunks_and_outputs_are_unchanged(target, kind):
    on, short_on, long_on, interleaved_on = _run(target, kind, True)
    off, short_off, long_off, interleaved_off = _run(target, kind, False)
    assert interleaved_on >= 3 and interleaved_off == 0  # 4 chunk calls after the first: rounds between them
    for r in (short_on, long_on):
        assert r.output_ids == greedy_reference(target, r.prompt_ids, r.max_tokens)
    assert short_on.output_ids == short_off.output_ids
    assert _differences(on, long_on, long_off, other=off) == []
    if kind is not None:  # drafts were verified on the long request's prefilled drafter state
        assert long_on.metrics.num_draft_tokens > 0


def test_negative_control_a_row_left_active_between_its_chunks_breaks_the_pair_cache(target, monkeypatch):
    """The rounds between the chunks would advance a row the prefill left active: Eagle3's pair cache
    (its pending feature) then differs from a whole prefill's."""
    from specjax.decoding import engine as engine_module
    real = engine_module.prefill_inputs

    def all_active(chunks, *a, **kw):
        out = real(chunks, *a, **kw)
        for row, (r, *_) in enumerate(chunks):
            out["limits_4b"][0, row] = r.max_tokens
        return out
    monkeypatch.setattr(engine_module, "prefill_inputs", all_active)
    on, _, long_on, interleaved = _run(target, "eagle3", True)
    monkeypatch.setattr(engine_module, "prefill_inputs", real)
    off, _, long_off, _ = _run(target, "eagle3", False)
    assert interleaved >= 3 and _differences(on, long_on, long_off, other=off) != []
