"""OpenAI's predicted outputs (`prediction`; an engine with EngineConfig.prediction_tokens): a row whose
output follows its predicted tokens drafts the next ones (q one-hot), so verification keeps the output
exactly the target's. `prediction.advance` equals a Python reference of the alignment (follow,
realign on the output's last two tokens at or after the floor, or leave) over random sequences;
greedy outputs with a prediction equal plain decoding's while predicted drafts are verified and
accepted (a prediction equal to the answer is accepted whole); sampled outputs follow the target's
law. Negative controls: a verifier that accepts every draft turns the output into the prediction; a
q that is the drafter's instead of one-hot on the predicted token fails the law; an alignment that
ignores the floor differs from the reference."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding import prediction as pr
from specjax.decoding import row_state
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.decoding.verify import verify_chain
from specjax.drafters.base import DraftBlock

from engine_fixtures import (BigramDrafter, chi_square_pvalue, exact_continuations, refused_field, sampled_with_rules,
                             small_engine, tiny_target)
from test_engine import greedy_reference

V, GAMMA, N = 64, 3, 24
PROMPT = [5, 17, 42, 8, 33, 5]


def align_reference(pred: list[int], outputs: list[int], state=None, *, floor_rule: bool = True
                    ) -> tuple[int, int, int]:
    """(at, floor, last) after `outputs`, from `state` (default: a newly admitted row); `floor_rule`
    False realigns anywhere (the negative control)."""
    at, floor, last = state or (0 if pred else -1, 0, -1)
    for x in outputs:
        if 0 <= at < len(pred) and pred[at] == x:
            at = floor = at + 1
        else:
            lo = max(floor, 1) if floor_rule else 1
            hits = [i for i in range(lo, len(pred)) if last >= 0 and pred[i - 1] == last and pred[i] == x]
            at = hits[0] + 1 if hits else -1
            floor = at if hits else floor
        last = x
    return at, floor, last


def _advance(preds: list[list[int]], states: list[tuple[int, int, int]], outs: list[list[int]], width: int = 16):
    b, t = len(preds), max(map(len, outs))
    pred_bl = np.full((b, width), -1, np.int32)
    toks = np.zeros((b, max(t, 1)), np.int32)
    for i, (p, o) in enumerate(zip(preds, outs)):
        pred_bl[i, :len(p)], toks[i, :len(o)] = p, o
    ints = np.zeros((4, b), np.int32)
    ints[0], ints[1] = [s[0] for s in states], [s[1] for s in states]
    new, last = pr.advance(jnp.asarray(pred_bl), jnp.asarray(ints), jnp.asarray([s[2] for s in states], jnp.int32),
                           jnp.asarray(toks), jnp.asarray([len(o) for o in outs], jnp.int32))
    new, last = np.asarray(new), np.asarray(last)
    return [(int(new[0, i]), int(new[1, i]), int(last[i])) for i in range(b)]


def _random_rounds(floor_rule: bool) -> tuple[int, int]:
    """Six rounds of random outputs (following the prediction or not) of 64 rows through `advance`,
    each compared with the reference: (rows that differed in some round, row-rounds that ended aligned
    past the start, row-rounds that realigned: unaligned before, aligned after)."""
    rng = np.random.default_rng(0)
    preds = [[int(t) for t in rng.integers(0, 4, rng.integers(0, 13))] for _ in range(64)]
    states = [(0 if p else -1, 0, -1) for p in preds]
    ref, differed, aligned, realigned = list(states), set(), 0, 0
    for _ in range(6):  # rounds of up to 4 tokens, each row its own count: the state carries across calls
        outs = [[int(t) for t in rng.integers(0, 4, rng.integers(0, 5))] if rng.random() < 0.5 else
                p[max(s[0], 0):max(s[0], 0) + 3] + [int(rng.integers(0, 4))]  # follow, then maybe leave
                for p, s in zip(preds, states)]
        before, states = states, _advance(preds, states, outs)
        realigned += sum(a[0] == -1 and b[0] > 0 for a, b in zip(before, states))
        ref = [align_reference(p, o, r, floor_rule=floor_rule) for p, o, r in zip(preds, outs, ref)]
        differed |= {i for i, (a, b) in enumerate(zip(states, ref)) if a != b}
        aligned += sum(s[0] > 0 for s in states)
        ref = list(states)  # each round from the device's state
    return len(differed), aligned, realigned


def test_alignment_equals_the_reference_on_random_sequences():
    differed, aligned, realigned = _random_rounds(floor_rule=True)
    assert differed == 0 and aligned >= 40 and realigned >= 10  # rows followed, and rows rejoined


def test_alignment_cases():
    pred = [10, 11, 12, 13, 14, 15, 16, 17]
    cases = {  # output -> (at, floor)
        (10, 11, 12): (3, 3),  # follows
        (10, 11, 99, 13, 14): (5, 5),  # substitution of 12: rejoins once (13, 14) is seen
        (10, 11, 12, 13, 14, 15, 16, 17, 18): (-1, 8),  # past the end: left, floor kept
        (10, 11, 14, 15): (6, 6),  # deletion of 12 13: rejoins once (14, 15) is seen
        (10, 11, 98, 99, 12, 13): (4, 4),  # insertion: rejoins at (12, 13)
        (99,): (-1, 0),
    }
    got = _advance([pred] * len(cases), [(0, 0, -1)] * len(cases), [list(o) for o in cases])
    assert [g[:2] for g in got] == list(cases.values())
    assert got == [align_reference(pred, list(o)) for o in cases]
    # the floor: once past 13, an earlier (11, 12) does not pull the output back
    assert _advance([pred + [11, 12, 20]], [(6, 6, 15)], [[11, 12, 20]])[0][:2] == (11, 11)
    assert _advance([[11, 12, 13, 14, 11, 12, 20]], [(5, 5, 11)], [[12, 20]])[0][:2] == (7, 7)


def test_negative_control_a_reference_without_the_floor_differs():
    assert _random_rounds(floor_rule=False)[0] > 0
    state, pred = (-1, 5, 99), [11, 12, 13, 14, 15, 11, 12, 20]
    assert _advance([pred], [state], [[11, 12]])[0] == align_reference(pred, [11, 12], state) == (7, 7, 12)
    assert align_reference(pred, [11, 12], state, floor_rule=False) == (2, 2, 12)


def test_drafts_and_tally():
    pred = jnp.asarray([[1, 2, 3, 4, -1, -1], [5, 6, -1, -1, -1, -1], [7, 8, 9, -1, -1, -1]], jnp.int32)
    ints = jnp.asarray([[1, 1, -1], [1, 1, 0], [0, 2, 0], [0, 0, 0]], jnp.int32)
    assert np.asarray(pr.drafts(pred, ints[0], 3)).tolist() == [[2, 3, 4], [6, -1, -1], [-1, -1, -1]]
    draft = jnp.asarray([[2, 3, 9], [6, 0, 0], [7, 8, 9]], jnp.int32)
    new, accepted, drafted = pr.tally(pred, ints, draft, jnp.asarray([3, 3, 3]), jnp.asarray([1, 3, 3]))
    assert np.asarray(drafted).tolist() == [2, 1, 0] and np.asarray(accepted).tolist() == [1, 1, 0]
    assert np.asarray(new[2:]).tolist() == [[2, 3, 0], [1, 1, 0]]  # verified: up to the first rejected
    short = pr.tally(pred, ints, draft, jnp.asarray([1, 3, 3]), jnp.asarray([1, 3, 3]))[2]
    assert np.asarray(short).tolist() == [1, 1, 0]  # only the verified ell count
    assert np.asarray(pr.confidence(new)).tolist() == pytest.approx([10 / 12, 10 / 13, 0.9])


def _block(b: int, g: int, v: int) -> DraftBlock:
    q = jax.nn.softmax(jax.random.normal(jax.random.key(0), (b, g, v)), -1)
    return DraftBlock(jnp.zeros((b, g), jnp.int32), q, jnp.full((b, g), 0.5, jnp.float32))


def test_predicted_drafts_replace_the_drafters_up_to_the_prediction_end():
    rows = row_state.RowState.init(3, prediction_tokens=5)
    rows = rows._replace(pred_sl=jnp.asarray([[3, 4, 5, 6, 7], [3, 4, -1, -1, -1], [1, 2, 3, 4, 5]], jnp.int32),
                         pred_ints_4s=jnp.asarray([[1, 0, -1], [0, 0, 0], [4, 0, 0], [2, 0, 0]], jnp.int32))
    out = row_state.predict_drafts(rows, _block(3, 4, 8), None)
    assert np.asarray(out.tokens).tolist() == [[4, 5, 6, 7], [3, 4, 0, 0], [0, 0, 0, 0]]
    q = np.asarray(out.q)
    assert np.allclose(q[0], np.eye(8)[[4, 5, 6, 7]]) and np.allclose(q[1, :2], np.eye(8)[[3, 4]])
    assert np.allclose(q[1, 2:], np.asarray(_block(3, 4, 8).q)[1, 2:]) and np.allclose(q[2], _block(3, 4, 8).q[2])
    conf = np.asarray(out.confidence)
    assert conf[0] == pytest.approx([11 / 14] * 4) and conf[1] == pytest.approx([0.9, 0.9, pr.PAST_CONFIDENCE,
                                                                                 pr.PAST_CONFIDENCE])
    assert conf[2] == pytest.approx([0.5] * 4)  # an unaligned row keeps the drafter's
    # a draft vocabulary without token 5: row 0 drafts 4 only, then the drafter's
    ids = jnp.asarray([0, 1, 2, 3, 4, 6, 7], jnp.int32)
    blk = _block(3, 4, 8)._replace(q_draft=jnp.zeros((3, 4, 7), jnp.float32))
    out = row_state.predict_drafts(rows, blk, ids)
    assert np.asarray(out.tokens)[0].tolist() == [4, 0, 0, 0]
    assert np.asarray(out.q_draft)[0, 0].tolist() == [0, 0, 0, 0, 1, 0, 0]
    # a greedy round carries no q: every predicted token is a draft
    assert np.asarray(row_state.predict_drafts(rows, blk, ids, greedy=True).tokens)[0].tolist() == [4, 5, 6, 7]


@pytest.fixture(scope="module")
def model():
    return tiny_target(V, seed=0)


@pytest.fixture(scope="module")
def plain(model):
    return greedy_reference(model, PROMPT, N)  # plain greedy decoding, by full forwards


def _accept_every_draft(key_b, p, q, d, ell, stop_ids, q_ids, greedy=False):
    g = d.shape[1]
    p_fake = jnp.concatenate([jax.nn.one_hot(d, p.shape[-1], dtype=p.dtype), p[:, g:]], axis=1)
    return verify_chain(key_b, p_fake, q, d, ell, stop_ids, q_ids, greedy=greedy)


def _predicted(model, predictions: dict[str, list[int]], **kw) -> dict[str, EngineRequest]:
    eng = small_engine(model, BigramDrafter(V, GAMMA), slots=4, max_len=64, prefill=8, gamma=GAMMA,
                       tokens_buckets=(GAMMA + 1,), variants=("greedy",), config=dict(prediction_tokens=32), **kw)
    reqs = {name: EngineRequest(name, PROMPT, max_tokens=N, temperature=0.0, prediction_ids=tuple(p))
            for name, p in predictions.items()}
    eng.run(list(reqs.values()), progress=False)
    return reqs


def test_greedy_output_with_predictions_equals_plain(model, plain):
    edited = plain[:6] + [1, 2] + plain[8:]
    reqs = _predicted(model, {"exact": plain, "edited": edited, "unrelated": [3] * 20, "none": []})
    assert all(r.output_ids == plain for r in reqs.values())
    m = {name: r.metrics for name, r in reqs.items()}
    # a prediction equal to the answer: every round verifies GAMMA predicted drafts and accepts them all
    # (each round emits one token of its own: the bonus)
    assert m["exact"].num_rounds == -(-(N - 1) // (GAMMA + 1)) and m["exact"].rejected_prediction_tokens == 0
    assert m["exact"].accepted_prediction_tokens == m["exact"].num_accepted_tokens == N - 1 - m["exact"].num_rounds
    assert m["edited"].accepted_prediction_tokens >= 8 and m["edited"].rejected_prediction_tokens >= 1
    assert m["unrelated"].accepted_prediction_tokens == 0 and m["none"].rejected_prediction_tokens == 0
    assert m["none"].num_rounds > m["edited"].num_rounds > m["exact"].num_rounds


def test_negative_control_accepting_every_draft_outputs_the_prediction(model, plain):
    edited = plain[:6] + [1, 2] + plain[8:]
    out = _predicted(model, {"edited": edited}, verifier=_accept_every_draft)["edited"].output_ids
    assert out != plain and out[:8] == edited[:8]


@pytest.fixture(scope="module")
def small():
    return tiny_target(8, seed=3, init_scale=3.0)


def _sampled(model, n: int, seed0: int) -> tuple[list[tuple[int, ...]], int]:
    # every pair of tokens once (a de Bruijn sequence): an output realigns after any two tokens
    pairs = [(a, b) for a in range(8) for b in range(8)]
    seq, seen = [0], set()
    while len(seen) < len(pairs):
        nxt = next(b for b in range(7, -1, -1) if (seq[-1], b) not in seen)
        seen.add((seq[-1], nxt))
        seq.append(nxt)
    reqs = sampled_with_rules(model, n, seed0, dict(prediction_ids=tuple(seq)), dict(prediction_tokens=len(seq)))
    return [tuple(r.output_ids[:3]) for r in reqs], sum(r.metrics.accepted_prediction_tokens for r in reqs)


def _outside_vocabulary_run(small) -> EngineRequest:
    """A greedy request whose prediction is its answer, drafted by a drafter whose draft vocabulary
    lacks the answer's tokens."""
    from test_draft_vocab import make
    draft_ids = np.array([0, 1, 2, 3])
    plain_eng = small_engine(small, None, slots=2, max_len=32, prefill=4, variants=("greedy",))
    ref = EngineRequest("p", [1, 5, 2], max_tokens=13, temperature=0.0)
    plain_eng.run([ref], progress=False)
    assert set(ref.output_ids) - set(draft_ids.tolist())  # the answer has tokens outside the draft vocabulary
    eng = small_engine(small, make("dspark", small, draft_ids), slots=2, max_len=32, prefill=4, gamma=3,
                       tokens_buckets=(4,), variants=("greedy",), config=dict(prediction_tokens=16))
    req = EngineRequest("q", [1, 5, 2], max_tokens=13, temperature=0.0, prediction_ids=tuple(ref.output_ids))
    eng.run([req], progress=False)
    assert req.output_ids == ref.output_ids
    return req


def test_greedy_rounds_draft_predicted_tokens_outside_a_draft_vocabulary(small):
    m = _outside_vocabulary_run(small).metrics
    assert m.num_rounds == 3 and (m.accepted_prediction_tokens, m.rejected_prediction_tokens) == (12 - 3, 0)


def test_negative_control_holding_greedy_drafts_to_the_draft_vocabulary(small, monkeypatch):
    honest = row_state.predict_drafts
    monkeypatch.setattr(row_state, "predict_drafts", lambda rows, block, q_ids, greedy=False: honest(
        rows, block, q_ids, False))
    assert _outside_vocabulary_run(small).metrics.accepted_prediction_tokens < 12 - 3


def test_sampled_outputs_with_predictions_follow_the_target_law(small):
    firsts, accepted = _sampled(small, 4000, 0)
    assert accepted > 300  # predicted drafts were verified and accepted
    p = chi_square_pvalue(firsts, exact_continuations(small, [1, 5, 2], 3))
    assert p > 1e-3, f"output with predictions differs from the target's law (chi-square p={p:.2e})"


def test_negative_control_predicted_drafts_with_the_drafters_q_fail_the_law(small, monkeypatch):
    honest = row_state.predict_drafts
    monkeypatch.setattr(row_state, "predict_drafts", lambda rows, block, q_ids, greedy=False: honest(
        rows, block, q_ids, greedy)._replace(q=block.q, q_draft=block.q_draft))
    firsts, _ = _sampled(small, 1000, 10**6)
    assert chi_square_pvalue(firsts, exact_continuations(small, [1, 5, 2], 3)) < 1e-3


@pytest.mark.parametrize("config, request_fields, message", [
    ({}, dict(prediction_ids=(3,)), "prediction needs an engine with predicted outputs"),
    (dict(prediction_tokens=4), dict(prediction_ids=(3,) * 5), "5 tokens, more than a slot holds"),
    (dict(prediction_tokens=4), dict(prediction_ids=(3, 64)), r"token id 64 outside the vocabulary \[0, 64\)"),
])
def test_bad_predictions_are_refused_naming_the_field(model, config, request_fields, message):
    from engine_fixtures import BigramDrafter as Drafter
    eng = Engine(model, Drafter(V, GAMMA), EngineConfig(max_slots=2, max_len=32, **config), eos_token_ids=(2,),
                 progress=False)
    with pytest.raises(ValueError, match=message) as e:
        eng.add_request(EngineRequest("a", PROMPT, max_tokens=4, **request_fields))
    assert e.value.field == "prediction"
    assert refused_field(model, {}, PROMPT, request_fields, "needs an engine with predicted outputs") == "prediction"


def test_engine_settings_are_checked(model):
    with pytest.raises(ValueError, match="prediction_tokens needs a drafter"):
        Engine(model, None, EngineConfig(max_slots=2, max_len=32, prediction_tokens=8), progress=False)
    with pytest.raises(ValueError, match="prediction_tokens must be an int >= 0"):
        EngineConfig(prediction_tokens=-1)
    from specjax.api import SamplingParams
    with pytest.raises(ValueError, match=r"prediction\[1\]"):
        SamplingParams(prediction=[3, -1])
    assert dataclasses.replace(SamplingParams(), prediction=[3, 4]).prediction == (3, 4)


def test_the_api_server_and_batch_lines_serve_predictions(model, plain, tmp_path):
    """SamplingParams.prediction (text) through LLM(prediction_tokens=...): the plain answer, predicted
    drafts accepted; the OpenAI server over it answers OpenAI's `prediction` (a string or text parts)
    with usage.completion_tokens_details, and names the field of a bad one; OpenAI batch lines the same."""
    from specjax.api import LLM, SamplingParams
    from specjax.jobs import default_errors_path
    from specjax.serving.batch_job import Shard, run_batch_job
    from specjax.serving.http_server import ServerThread
    from specjax.serving.openai_api import OpenAIApp
    from serving_fixtures import http_json, http_request, read_jsonl, sse_events, tiny_chat_tokenizer, write_jsonl
    assert min(plain) >= 3  # words of the tiny tokenizer
    tok, text = tiny_chat_tokenizer(), " ".join(f"w{t}" for t in plain)
    llm = LLM(target=(model, model.config), drafter=BigramDrafter(V, GAMMA), max_num_seqs=2, max_model_len=64,
              max_prefill=8, prediction_tokens=32, sampling_variants=("greedy",))
    llm.tokenizer = tok
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=N, prediction=text))[0]
    accepted = N - 1 - out.metrics["num_rounds"]
    assert out.token_ids == plain and out.metrics["accepted_prediction_tokens"] == accepted > 0
    details = {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": 0}
    api = OpenAIApp.from_llm(llm, model_name="tiny", tokenizer=tok)
    server = ServerThread(api)
    try:
        for prediction in ({"type": "content", "content": text},
                           {"type": "content", "content": [{"type": "text", "text": text[:9]},
                                                           {"type": "text", "text": text[9:]}]}):
            status, r = http_json(server.url + "/v1/completions", "POST", {
                "prompt": PROMPT, "max_tokens": N, "temperature": 0, "prediction": prediction})
            assert status == 200 and r["choices"][0]["token_ids"] == plain, r
            assert r["usage"]["completion_tokens_details"] == details, r["usage"]
        status, _, data = http_request(server.url + "/v1/completions", "POST", {
            "prompt": PROMPT, "max_tokens": N, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "prediction": {"type": "content", "content": text}})
        events = [e for e in sse_events(data) if e != "[DONE]"]
        assert status == 200 and [t for e in events for c in e["choices"] for t in c.get("token_ids") or []] == plain
        assert events[-1]["usage"]["completion_tokens_details"] == details  # the streamed answer's usage
        status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": PROMPT, "max_tokens": 4,
                                                                        "temperature": 0})
        assert status == 200 and "completion_tokens_details" not in r["usage"]
        for bad, fragment in [({"type": "text", "content": text}, '"type": "content"'),
                              ({"type": "content", "content": [{"type": "image"}]}, "prediction.content[0]"),
                              ({"type": "content", "content": " ".join(["w5"] * 33)}, "more than a slot holds")]:
            status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": PROMPT, "temperature": 0,
                                                                            "prediction": bad})
            assert status == 400 and r["error"]["param"] == "prediction" and fragment in r["error"]["message"], r
    finally:
        server.stop()
        api.engine.drain(60)
        api.engine.shutdown()
    lines = [{"custom_id": "p", "url": "/v1/completions", "body": {
                 "prompt": PROMPT, "max_tokens": N, "temperature": 0, "prediction": {"type": "content", "content": text}}},
             {"custom_id": "bad", "url": "/v1/completions", "body": {"prompt": PROMPT, "temperature": 0,
                                                                      "prediction": "w5"}},
             {"id": "native", "prompt": PROMPT, "max_tokens": N, "temperature": 0,
              "prediction": {"type": "content", "content": text}}]
    inp, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    s = run_batch_job(llm, str(inp), str(dst), shard=Shard(0, 1), progress=False)
    rows = {r.get("custom_id", r.get("id")): r for r in read_jsonl(dst)}
    body = rows["p"]["response"]["body"]
    assert s.completed == 2 and body["choices"][0]["token_ids"] == plain == rows["native"]["token_ids"]
    assert body["usage"]["completion_tokens_details"] == details == rows["native"]["completion_tokens_details"]
    assert [e["field"] for e in read_jsonl(default_errors_path(str(dst)))] == ["body.prediction"]


def test_the_benchmark_s_edit_tasks_come_from_humaneval():
    from bench.decode import eval_dir
    from bench.prediction import edit_tasks
    tasks = edit_tasks(f"{eval_dir()}/humaneval.jsonl", 3)
    assert len(tasks) == 3 and tasks[0][0].startswith("Rename the function `has_close_elements` to `solution`")
    assert all(code.startswith("```python\n") and code.endswith("\n```") and code in q for q, code in tasks)


def test_predicted_drafts_stop_where_the_row_s_automaton_disallows_them():
    """A row following an automaton drafts its predicted tokens up to the first one the automaton does
    not allow after the ones before (verification would reject it); a row without one drafts them all."""
    next_nv = np.full((2, 8), -1, np.int16)
    next_nv[0, [3, 4]], next_nv[1, 5] = 1, 0  # state 0: 3 or 4 -> state 1; state 1: 5 -> state 0
    rows = row_state.RowState.init(2, automaton_shape=(2, 8), prediction_tokens=4)
    rows = rows._replace(fsm_next_nv=jnp.asarray(next_nv), fsm_state_s=jnp.asarray([0, -1], jnp.int32),
                         pred_sl=jnp.asarray([[3, 5, 4, 6], [3, 5, 4, 6]], jnp.int32),
                         pred_ints_4s=jnp.asarray([[0, 0], [0, 0], [0, 0], [0, 0]], jnp.int32))
    out = row_state.predict_drafts(rows, _block(2, 4, 8), None)
    assert np.asarray(out.tokens).tolist() == [[3, 5, 4, 0], [3, 5, 4, 6]]


@pytest.mark.parametrize("policy", ["confidence", "confidence_async"])
def test_the_confidence_schedulers_verify_more_of_a_row_s_predicted_drafts(model, plain, policy):
    """One request at a time under a cost table where drafting pays only for confident drafts: a
    request whose prediction is its answer (predicted drafts' confidence from its record, >= 0.9)
    verifies whole blocks (after the async policy's first two rounds, which have no confidences yet),
    one without a prediction (the test drafter's confidences, 0.05-0.95) fewer drafts; both outputs
    are plain's."""
    from specjax.scheduling import CostTable
    cfg = EngineConfig(max_slots=1, max_len=64, policy=policy, gamma=GAMMA, slots_buckets=(1,),
                       prefill_buckets=(8,), max_prefill=8, prefill_batch_buckets=(1,),
                       sampling_variants=("greedy",), prediction_tokens=32)
    eng = Engine(model, BigramDrafter(V, GAMMA, confidence=True, seed=7), cfg, progress=False)
    eng.cost_table = CostTable.from_seconds({(1, 1): 1.0, (1, 2): 1.5, (1, 4): 1.9}, meta=eng.cost_table_meta())
    eng.warmup()
    eng.plain_seconds = {1: 1.0}  # the table's scale, not this machine's
    ell: dict[str, list[int]] = {"p": [], "n": []}
    eng.on_round = lambda info: [ell[r].append(e) for r, e in zip(info["request_ids"], info["ell"])]
    reqs = [EngineRequest("p", PROMPT, max_tokens=N, temperature=0.0, prediction_ids=tuple(plain)),
            EngineRequest("n", PROMPT, max_tokens=N, temperature=0.0)]
    eng.run(reqs, progress=False)
    assert all(r.output_ids == plain for r in reqs) and reqs[0].metrics.accepted_prediction_tokens >= N // 2
    assert ell["p"].count(GAMMA) >= 5 and np.mean(ell["p"]) > np.mean(ell["n"]) + 0.5, str(ell)
