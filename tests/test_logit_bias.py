"""vLLM's logit_bias, allowed_token_ids and bad_words (an engine with EngineConfig.logit_bias): every
sampled position's logits get the row's bias (-inf outside allowed_token_ids and at one-token bad
words) and a multi-token bad word's last token is banned where the output before that position
(its committed output, then the drafts before it) ends with the word's other tokens.
`logit_rules.ban_bad_words` and `push_tail` equal a float64 reference position by position; greedy
outputs equal the ruled greedy reference with and without verified drafts, beside a request without
rules; sampled outputs follow the enumerated ruled law (chi-square). Negative controls: bad words
that forget the drafts before each position, or a tail never updated, fail the references."""
import numpy as np
import pytest

from specjax.decoding import logit_rules
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.decoding.logit_rules import BAD_WORD_TOKENS, ROW_BAD_WORDS

from engine_fixtures import (bias_logits, chain_drafter, chi_square_pvalue, exact_continuations, greedy_beside_free,
                             ruled_greedy, sampled_with_rules, tiny_target)
from test_engine import greedy_reference

V, GAMMA, N = 64, 3, 14
PROMPT = [5, 17, 42, 8, 33, 5]


def test_bad_words_and_tails_equal_the_reference_at_every_position():
    import jax.numpy as jnp
    rng = np.random.default_rng(1)
    b, t, v = 3, 5, 10
    logits = rng.normal(size=(b, t, v))
    outputs = [[4, 1], [], [2, 3, 2, 3, 9, 2, 3]]  # committed output, the anchor last
    drafts = np.array([[3, 5, 3, 5], [2, 3, 2, 3], [5, 2, 3, 5]])
    words = [[(1, 3), (3, 5, 7), (4, 1, 3, 0)], [(2, 3, 8), (9, 9)], [(2, 3, 5), (3, 2, 3, 5, 2, 3, 6), (5, 2)]]
    tails, words_bwl = np.full((b, BAD_WORD_TOKENS - 1), -1), np.full((b, ROW_BAD_WORDS, BAD_WORD_TOKENS), -1)
    for i, o in enumerate(outputs):
        tails[i, BAD_WORD_TOKENS - 1 - len(o[-(BAD_WORD_TOKENS - 1):]):] = o[-(BAD_WORD_TOKENS - 1):]
        for k, w in enumerate(words[i]):
            words_bwl[i, k, BAD_WORD_TOKENS - len(w):] = w
    got = np.asarray(logit_rules.ban_bad_words(jnp.asarray(logits, jnp.float32), jnp.asarray(words_bwl, jnp.int32),
                                               jnp.asarray(tails, jnp.int32), jnp.asarray(drafts, jnp.int32)))
    banned = 0
    for i in range(b):
        for j in range(t):
            want = bias_logits(logits[i, j], outputs[i] + list(drafts[i, :j]), bad_words=words[i])
            np.testing.assert_allclose(got[i, j], want, rtol=1e-6, err_msg=f"row {i} position {j}")
            banned += int(np.isinf(want).sum())
    assert banned >= 6  # words hit in the committed output, across it and the drafts, and in the drafts
    emitted = np.array([2, 0, 4])
    pushed = np.asarray(logit_rules.push_tail(jnp.asarray(tails, jnp.int32), jnp.asarray(drafts, jnp.int32),
                                              jnp.asarray(emitted, jnp.int32)))
    for i in range(b):
        full = ([-1] * BAD_WORD_TOKENS + outputs[i] + list(drafts[i, :emitted[i]]))[-(BAD_WORD_TOKENS - 1):]
        assert pushed[i].tolist() == full, i


RULES = {"words": dict(bad_words=((62, 46), (34,)), logit_bias={19: -0.3}),
         "allowed": dict(allowed_token_ids=(1, 2, 30, 46, 62), logit_bias={62: -1.5})}


def _rule(kw: dict):
    allowed = kw.get("allowed_token_ids")
    return lambda logits, out: bias_logits(logits, out, logit_bias=kw.get("logit_bias"), allowed=allowed,
                                           bad_words=kw.get("bad_words", ()))


@pytest.fixture(scope="module")
def case():
    model = tiny_target(V, seed=5, init_scale=2.0)
    plain = greedy_reference(model, PROMPT, N)
    refs = {name: ruled_greedy(model, PROMPT, N, _rule(kw)) for name, kw in RULES.items()}
    assert all(ref != plain for ref in refs.values()), "the rules change nothing here: pick others"
    return model, plain, refs


def _engine(model, drafter, slots=4, **cfg) -> Engine:
    config = EngineConfig(max_slots=slots, max_len=32, policy="plain" if drafter is None else "fixed", gamma=GAMMA,
                          slots_buckets=(slots,), tokens_buckets=(1, GAMMA + 1), prefill_buckets=(8,), max_prefill=8,
                          prefill_batch_buckets=(slots,), sampling_variants=("greedy",), logit_bias=True, **cfg)
    eng = Engine(model, drafter, config, progress=False)
    eng.warmup()
    return eng


def _greedy_run(eng: Engine) -> dict[str, EngineRequest]:
    return greedy_beside_free(eng, PROMPT, N, RULES)


@pytest.mark.parametrize("drafting", [False, True])
def test_greedy_ruled_outputs_equal_the_reference(case, drafting):
    model, plain, refs = case
    drafter = chain_drafter(V, GAMMA, [PROMPT[-1]] + refs["words"]) if drafting else None
    reqs = _greedy_run(_engine(model, drafter))
    assert {n: r.output_ids for n, r in reqs.items()} == {**refs, "free": plain}
    assert set(refs["allowed"]) <= set(RULES["allowed"]["allowed_token_ids"])
    if drafting:  # whole blocks of drafts were verified, across the bad word's first token
        assert reqs["words"].metrics.as_dict()["num_accepted_tokens"] >= 2 * GAMMA


_BAN = logit_rules.ban_bad_words


def test_negative_control_bad_words_that_forget_the_drafts(case, monkeypatch):
    model, _, refs = case
    monkeypatch.setattr(logit_rules, "ban_bad_words", lambda lg, w, tail, d: _BAN(lg, w, tail, d * 0 - 1))
    reqs = _greedy_run(_engine(model, chain_drafter(V, GAMMA, [PROMPT[-1]] + refs["words"])))
    assert reqs["words"].output_ids != refs["words"]


def test_negative_control_a_tail_never_updated(case, monkeypatch):
    model, _, refs = case
    monkeypatch.setattr(logit_rules, "push_tail", lambda tail, tokens, emitted: tail)
    assert _greedy_run(_engine(model, None))["words"].output_ids != refs["words"]


@pytest.fixture(scope="module")
def small():
    return tiny_target(8, seed=3, init_scale=3.0)


# (2, 6): the prompt ends with 2, but bad words read the output only, so 6 stays allowed first
SMALL = dict(logit_bias={4: 1.5, 0: -1.0}, bad_words=((6, 7), (2, 6), (5,)))


def _law(model):
    return exact_continuations(model, [1, 5, 2], 3, rule=_rule(SMALL))


def _sampled(model, n: int, seed0: int) -> list[tuple[int, ...]]:
    reqs = sampled_with_rules(model, n, seed0, SMALL, dict(logit_bias=True), gamma=GAMMA)
    return [tuple(r.output_ids[:3]) for r in reqs]


def test_sampled_outputs_follow_the_ruled_law(small):
    law, free = _law(small), exact_continuations(small, [1, 5, 2], 3)
    assert sum(abs(law[k] - free[k]) for k in law) > 0.3  # the rules change the law
    assert sum(p for k, p in law.items() if k[0] == 6) > 0.02  # (2, 6) does not read the prompt
    samples = _sampled(small, 4000, 0)
    assert not any(5 in s or (6, 7) in (s[:2], s[1:]) for s in samples)
    p = chi_square_pvalue(samples, law)
    assert p > 1e-3, f"ruled output differs from the ruled law (chi-square p={p:.2e})"


def test_negative_control_forgetting_the_drafts_fails_the_law(small, monkeypatch):
    monkeypatch.setattr(logit_rules, "ban_bad_words", lambda lg, w, tail, d: _BAN(lg, w, tail, d * 0 - 1))
    assert chi_square_pvalue(_sampled(small, 2000, 10**6), _law(small)) < 1e-3


@pytest.mark.parametrize("kw, message", [
    (dict(logit_bias={64: 1.0}), "logit_bias token id 64 outside the vocabulary"),
    (dict(logit_bias={3: 150.0}), r"logit_bias values must be in \[-100, 100\]"),
    (dict(allowed_token_ids=()), "allowed_token_ids is empty"),
    (dict(allowed_token_ids=(3, 70)), "allowed_token_ids has an id outside the vocabulary"),
    (dict(bad_words=((1,) * (BAD_WORD_TOKENS + 1),)), rf"bad_words\[0\] is 9 tokens; at most {BAD_WORD_TOKENS}"),
    (dict(bad_words=tuple((1, t) for t in range(ROW_BAD_WORDS + 1))), f"at most {ROW_BAD_WORDS}"),
    (dict(bad_words=((),)), r"bad_words\[0\] must be token ids"),
    (dict(allowed_token_ids=(3, 4), bad_words=((3,), (4,))), "allowed_token_ids are all bad_words"),
    (dict(allowed_token_ids=(9,), min_tokens=2, stop_token_ids=(9,)), "allowed_token_ids are all stop ids"),
])
def test_bad_rules_are_refused_naming_the_field(case, kw, message):
    eng = Engine(case[0], None, EngineConfig(max_slots=2, max_len=32, policy="plain", logit_bias=True), progress=False)
    with pytest.raises(ValueError, match=message):
        eng.add_request(EngineRequest("a", PROMPT, max_tokens=4, **kw))


def test_rules_are_refused_without_the_engine_option(case):
    eng = Engine(case[0], None, EngineConfig(max_slots=2, max_len=32, policy="plain"), progress=False)
    for field, kw in [("logit_bias", dict(logit_bias={3: 1.0})), ("allowed_token_ids", dict(allowed_token_ids=(3,))),
                      ("bad_words", dict(bad_words=((3, 4),)))]:
        with pytest.raises(ValueError, match=f"{field} needs an engine with logit bias"):
            eng.add_request(EngineRequest("a", PROMPT, max_tokens=4, **kw))


def test_the_python_api_the_server_and_the_batch_job_serve_the_rules(case, tmp_path):
    """LLM(logit_bias=True) with SamplingParams' fields (bad words as text, through the tokenizer)
    gives the ruled greedy answer; the OpenAI server and a batch job over it answer the same to a
    body whose logit_bias keys are strings and name the field of a bad value."""
    from specjax.api import LLM, SamplingParams
    from specjax.request_builder import bad_word_ids
    from specjax.serving.http_server import ServerThread
    from specjax.serving.openai_api import OpenAIApp
    from specjax.jobs import Shard, default_errors_path
    from specjax.serving.batch_job import run_batch_job
    from serving_fixtures import http_json, read_jsonl, tiny_chat_tokenizer, write_jsonl
    model, _, refs = case
    tok = tiny_chat_tokenizer()
    assert bad_word_ids(tok, ["  w62 w46", "w34"]) == ((62, 46), (34,))
    llm = LLM(target=(model, model.config), max_num_seqs=2, max_model_len=32, max_prefill=8, logit_bias=True,
              sampling_variants=("greedy",))
    llm.tokenizer = tok
    sp = SamplingParams(temperature=0.0, max_tokens=N, bad_words=["w62 w46", "w34"], logit_bias={19: -0.3})
    assert llm.generate([PROMPT], sp)[0].token_ids == refs["words"]
    api = OpenAIApp.from_llm(llm, model_name="tiny", tokenizer=tok)
    server = ServerThread(api)
    try:
        body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "bad_words": ["w62 w46", "w34"],
                "logit_bias": {"19": -0.3}}
        status, r = http_json(server.url + "/v1/completions", "POST", body)
        assert status == 200 and r["choices"][0]["token_ids"] == refs["words"], r
        for bad, param, fragment in [({"allowed_token_ids": [3, 70]}, "allowed_token_ids", "outside the vocabulary"),
                                     ({"logit_bias": {"x": 1}}, "logit_bias", "string of digits"),
                                     ({"bad_words": "w5"}, "bad_words", "list of strings")]:
            status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": PROMPT, **bad})
            assert status == 400 and r["error"]["param"] == param and fragment in r["error"]["message"], r
        status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": PROMPT, "bad_words": [" ".join(
            ["w5"] * (BAD_WORD_TOKENS + 1))]})  # refused by the engine, which names the field
        assert status == 400 and "bad_words[0] is 9 tokens" in r["error"]["message"], r
        assert (r["error"]["param"], r["error"]["code"]) == ("bad_words", "rejected_by_engine"), r
    finally:
        server.stop()
        api.engine.drain(60)
        api.engine.shutdown()
    rows = [{"id": "words", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "bad_words": ["w62 w46", "w34"],
             "logit_bias": {"19": -0.3}},
            {"id": "long", "prompt": PROMPT, "bad_words": [" ".join(["w5"] * (BAD_WORD_TOKENS + 1))]}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    s = run_batch_job(llm, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), shard=Shard(0, 1), progress=False)
    assert (s.completed, s.errors) == (1, 1)
    assert read_jsonl(tmp_path / "out.jsonl")[0]["token_ids"] == refs["words"]
    err = read_jsonl(default_errors_path(str(tmp_path / "out.jsonl")))[0]
    assert err["field"] == "bad_words" and "9 tokens" in err["error"], err
