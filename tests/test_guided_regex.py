"""vLLM's guided_regex / guided_json (an engine with EngineConfig.guided_regex): each request follows a
token automaton in the engine's shared table; every sampled position allows only the tokens its
automaton allows from the state after the output so far (its committed output, then the drafts
before that position), or eos in an accepting state, so the answer is a full match, exactly under
speculation. `logit_rules.automaton_path` / `guide_automaton` / `advance_automaton` equal a reference
position by position; greedy outputs equal the guided greedy reference with accepted and rejected
drafts, beside an unguided request; sampled outputs follow the enumerated guided law (chi-square);
a request whose automaton does not fit the table waits for room. Negative controls: states that
forget the drafts before each position leave the reference (greedy) and fail the law."""
import dataclasses
import json
import re

import numpy as np
import pytest

from specjax.decoding import logit_rules
from specjax.decoding.automata import AutomatonTable, TokenAutomaton, pack_allowed
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest

from engine_fixtures import chain_drafter, chi_square_pvalue, exact_continuations, refused_field, ruled_greedy, \
    sampled_with_rules, tiny_target
from test_engine import greedy_reference

V, GAMMA, N, EOS = 64, 3, 12, 2
PROMPT = [5, 17, 42, 8, 33, 5]


def automaton(edges: dict[int, dict[int, int]], finals: set[int], vocab: int, key: str) -> TokenAutomaton:
    """A TokenAutomaton from {state: {token: next}} (state 0 initial)."""
    n = 1 + max([*edges, *finals, *(d for out in edges.values() for d in out.values())])
    nxt = np.full((n, vocab), -1, np.int16)
    for s, out in edges.items():
        for t, d in out.items():
            nxt[s, t] = d
    return TokenAutomaton(nxt, np.array([s in finals for s in range(n)]), key)


def automaton_logits(logits_v: np.ndarray, output, a: TokenAutomaton, eos) -> np.ndarray:
    """Reference: -inf but at the tokens `a` allows after `output` (eos where that state accepts);
    unchanged where `output` leaves `a` (such a position is never sampled)."""
    s = a.walk(list(output))
    if s < 0:
        return logits_v
    keep = list(a.allowed(s)) + (list(eos) if a.final_n[s] else [])
    masked = np.full_like(logits_v, -np.inf)
    masked[keep] = logits_v[keep]
    return masked


def _rule(a: TokenAutomaton, eos=(EOS,)):
    return lambda logits, out: automaton_logits(logits, out, a, eos)


# six tokens from 3..30 (a different set at every other step), then eos or one of 50..60, then eos
SIX = automaton({**{s: {t: s + 1 for t in (range(3, 31) if s % 2 else range(3, 31, 3))} for s in range(6)},
                 6: {t: 7 for t in range(50, 61)}}, {6, 7}, V, "six")


def test_automaton_rules_equal_the_reference_at_every_position():
    import jax.numpy as jnp
    rng = np.random.default_rng(4)
    b, t, v, eos = 4, 5, 12, (0, 11)
    a1 = automaton({0: {3: 1, 4: 2}, 1: {5: 1, 6: 2}, 2: {7: 3}, 3: {}}, {2, 3}, v, "a1")
    a2 = automaton({0: {1: 1, 2: 1}, 1: {1: 0, 9: 2}}, {2}, v, "a2")
    table = AutomatonTable(8, v)
    starts = [table.acquire(a1), table.acquire(a2)]
    assert starts == [0, 4]  # a2 sits after a1's four states
    rows = [(a1, [3]), (a2, []), (a1, [4, 7]), (None, [])]  # (automaton, committed output)
    state = np.array([-1 if a is None else starts[a is a2] + a.walk(o) for a, o in rows], np.int32)
    drafts = np.array([[5, 5, 6, 7], [2, 9, 1, 1], [1, 2, 3, 4], [3, 3, 3, 3]], np.int32)
    logits = rng.normal(size=(b, t, v))
    nxt, fin = jnp.asarray(table.next_nv), jnp.asarray(table.final_n)
    path = logit_rules.automaton_path(nxt, jnp.asarray(state), jnp.asarray(drafts))
    allowed = jnp.asarray(table.allowed_nw)
    got = np.asarray(logit_rules.guide_automaton(jnp.asarray(logits, jnp.float32), allowed, fin, path,
                                                 jnp.tile(jnp.asarray(eos, jnp.int32), (b, 1))))
    masked = 0
    for i, (a, out) in enumerate(rows):
        for j in range(t):
            want = logits[i, j] if a is None else automaton_logits(logits[i, j], out + list(drafts[i, :j]), a, eos)
            np.testing.assert_allclose(got[i, j], want, rtol=1e-6, err_msg=f"row {i} position {j}")
            masked += int(np.isinf(want).any())
    assert masked >= 9  # inside, at accepting states (eos kept), and not past a draft the automaton refuses
    emitted = np.array([3, 2, 1, 4], np.int32)
    new = np.asarray(logit_rules.advance_automaton(nxt, jnp.asarray(state), jnp.asarray(drafts), jnp.asarray(emitted)))
    for i, (a, out) in enumerate(rows):
        s = -1 if a is None else a.walk(out + list(drafts[i, :emitted[i]]))
        assert new[i] == (-1 if s < 0 else starts[a is a2] + s), i


def test_the_table_shares_evicts_and_makes_a_request_wait():
    a, b, c = (automaton({0: {1: 1}, 1: {2: 2}, 2: {3: 3}}, {3}, 8, k) for k in "abc")
    table = AutomatonTable(9, 8)
    assert (table.acquire(a), table.acquire(b), table.acquire(a)) == (0, 4, 0)  # a's second request shares
    assert table.acquire(c) is None  # no room beside a and b in use: the request waits
    table.release(b)
    assert table.acquire(c) == 4 and "b" not in table.users()  # b was unused: evicted for c
    np.testing.assert_array_equal(table.next_nv[4:8, 1:4], [[5, -1, -1], [-1, 6, -1], [-1, -1, 7], [-1, -1, -1]])
    np.testing.assert_array_equal(table.allowed_nw[4:8, 0], [2, 4, 8, 0])  # token t is bit t of word 0
    big = np.full((3, 70), -1, np.int16)
    big[1, [0, 31, 32, 69]] = 0  # the packed bits across words: 70 tokens in 3 words
    np.testing.assert_array_equal(pack_allowed(big), [[0, 0, 0], [1 | 1 << 31, 1, 1 << 5], [0, 0, 0]])
    with pytest.raises(ValueError, match="does not fit the engine's table of 9 states"):
        table.acquire(automaton({s: {1: s + 1} for s in range(9)}, {9}, 8, "big"))


def guided_case():
    """(a tiny target, its plain greedy answer to PROMPT, its greedy answer under SIX then eos)."""
    model = tiny_target(V, seed=5, init_scale=2.0)
    plain = greedy_reference(model, PROMPT, N)
    guided = ruled_greedy(model, PROMPT, N, _rule(SIX))
    guided = guided[:guided.index(EOS) + 1] if EOS in guided else guided
    assert SIX.walk(guided[:-1]) >= 0 and guided[-1] == EOS and guided[:3] != plain[:3], (guided, plain)
    return model, plain, guided


@pytest.fixture(scope="module")
def case():
    return guided_case()


def _engine(model, drafter, states: int = 12, **config) -> Engine:
    config = EngineConfig(max_slots=2, max_len=32, policy="plain" if drafter is None else "fixed", gamma=GAMMA,
                          slots_buckets=(2,), tokens_buckets=(1, GAMMA + 1), prefill_buckets=(8,), max_prefill=8,
                          prefill_batch_buckets=(2,), sampling_variants=("greedy",), guided_regex=True,
                          automaton_states=states, **config)
    eng = Engine(model, drafter, config, eos_token_ids=(EOS,), progress=False)
    eng.warmup()
    return eng


def _greedy(eng: Engine, extra: dict | None = None) -> tuple[EngineRequest, EngineRequest]:
    guided = EngineRequest("g", PROMPT, max_tokens=N, temperature=0.0, automaton=SIX)
    other = EngineRequest("f", PROMPT, max_tokens=N, temperature=0.0, **(extra or {}))
    eng.run([guided, other], progress=False)
    return guided, other


def _drafter(guided_ref):
    """Drafts that follow the guided answer but for its third token (the plain answer's there)."""
    chain = [PROMPT[-1]] + guided_ref[:2] + [61] + guided_ref[3:]
    return chain_drafter(V, GAMMA, chain)


@pytest.mark.parametrize("drafting", [False, True])
def test_greedy_guided_output_is_the_reference(case, drafting):
    model, plain, guided_ref = case
    guided, free = _greedy(_engine(model, _drafter(guided_ref) if drafting else None))
    assert (guided.output_ids, guided.finish_reason) == (guided_ref, "stop") and free.output_ids == plain
    if drafting:
        m = guided.metrics.as_dict()
        assert m["num_draft_tokens"] >= 2 * GAMMA and 2 <= m["num_accepted_tokens"] < m["num_draft_tokens"], m


def test_a_request_waits_until_its_automaton_fits(case):
    """A table of 12 states holds one copy of the 8-state automaton: the second request, with the
    same automaton under another key, is admitted after the first ends, and answers the same."""
    model, _, guided_ref = case
    eng = _engine(model, None)
    other = dataclasses.replace(SIX, key="six-again")
    guided, second = _greedy(eng, dict(automaton=other))
    assert guided.output_ids == second.output_ids == guided_ref
    assert second.metrics.first_token_time > guided.metrics.finish_time
    assert eng.automata.users() == {"six-again": 0}


_PATH = logit_rules.automaton_path


def _forget_drafts(nxt, state_b, drafts_bk):
    import jax.numpy as jnp
    return jnp.repeat(state_b[:, None], drafts_bk.shape[1] + 1, axis=1)


def test_negative_control_states_that_forget_the_drafts(case, monkeypatch):
    model, _, guided_ref = case
    monkeypatch.setattr(logit_rules, "automaton_path", _forget_drafts)
    guided, _ = _greedy(_engine(model, _drafter(guided_ref)))
    assert guided.output_ids != guided_ref


def small_target():
    return tiny_target(8, seed=3, init_scale=3.0)


@pytest.fixture(scope="module")
def small():
    return small_target()


# over 8 tokens, eos 0: three tokens, then eos or one of 1 2 (then eos)
LAW = automaton({0: {1: 1, 3: 2, 4: 2}, 1: {5: 3, 6: 3, 2: 2}, 2: {7: 3, 2: 3}, 3: {1: 4, 2: 4}}, {3, 4}, 8, "law")


def _sampled(model, n: int, seed0: int) -> list[list[int]]:
    reqs = sampled_with_rules(model, n, seed0, dict(automaton=LAW), dict(guided_regex=True, automaton_states=8),
                              gamma=GAMMA, full_share=50, eos_token_ids=(0,))
    return [r.output_ids for r in reqs]


def _law(model):
    return exact_continuations(model, [1, 5, 2], 3, rule=_rule(LAW, (0,)))


def test_sampled_outputs_follow_the_guided_law(small):
    outputs = _sampled(small, 3000, 0)
    assert all(LAW.walk(o[:-1]) >= 0 and o[-1] == 0 for o in outputs)  # a full match, then eos
    p = chi_square_pvalue([tuple(o[:3]) for o in outputs], _law(small))
    assert p > 1e-3, f"guided output differs from the guided law (chi-square p={p:.2e})"


def test_negative_control_forgetting_the_drafts_fails_the_law(small, monkeypatch):
    monkeypatch.setattr(logit_rules, "automaton_path", _forget_drafts)
    assert chi_square_pvalue([tuple(o[:3]) for o in _sampled(small, 1000, 10**6)], _law(small)) < 1e-3


@pytest.mark.parametrize("kw, field, message", [
    (dict(automaton=SIX, ignore_eos=True), "ignore_eos", "not with ignore_eos"),
    (dict(automaton=SIX, min_tokens=1), "min_tokens", "not served with guided_regex"),
    (dict(automaton=SIX, bad_words=((3, 4),)), "bad_words", "not served with guided_regex"),
    (dict(automaton=automaton({0: {1: 1}}, {1}, 8, "v8")), "guided_regex", "over 8 token ids"),
    (dict(automaton=automaton({s: {3: s + 1} for s in range(12)}, {12}, V, "big")), "guided_regex",
     "13 automaton states, more than the engine's table holds"),
])
def test_bad_automata_are_refused_naming_the_field(case, kw, field, message):
    config = dict(guided_regex=True, logit_bias=True, automaton_states=12)
    assert refused_field(case[0], config, PROMPT, kw, message, (EOS,)) == field
    assert refused_field(case[0], {}, PROMPT, dict(automaton=SIX),
                         "guided_regex needs an engine with guided regular expressions") == "guided_regex"


# ---------------------------------------------------------------------------- regular expressions over a tokenizer
def byte_level_tokenizer():
    """A byte-level BPE fast tokenizer: the 256 byte symbols, a few merges ("true", "false", '":'),
    and "<|end|>" (eos, special)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from specjax.grammars import _byte_level_alphabet
    symbols = sorted(_byte_level_alphabet(), key=_byte_level_alphabet().get)
    merges = [("t", "r"), ("tr", "u"), ("tru", "e"), ("f", "a"), ("fa", "l"), ("fal", "s"), ("fals", "e"),
              ('"', ":")]
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.add_special_tokens({"eos_token": "<|end|>"})
    return fast


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def test_token_bytes_of_byte_level_and_sentencepiece_tokenizers(tok):
    from tokenizers import Tokenizer, decoders, models
    from specjax.grammars import token_bytes
    pieces = token_bytes(tok)
    text = 'ok: {"a": true}\n héllo'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert b"".join(pieces[i] for i in ids) == text.encode() and tok.eos_token_id not in pieces
    assert pieces[tok.convert_tokens_to_ids("true")] == b"true"
    sp = Tokenizer(models.BPE({"<s>": 0, "\u2581hi": 1, "<0x0A>": 2, "x": 3}, []))
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp.add_special_tokens(["<s>"])
    assert token_bytes(sp) == {1: b" hi", 2: b"\n", 3: b"x"}


def test_regular_expressions_and_schemas_compile_to_their_matches(tok):
    from specjax.grammars import GrammarCompiler, GrammarError
    gc = GrammarCompiler(tok, len(tok) + 3)  # a target vocabulary wider than the tokenizer's
    a = gc.regex(r"(true|false|[0-9]{2})")
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for text, full in [("true", True), ("false", True), ("42", True), ("4", False), ("truex", None), ("7a", None)]:
        s = a.walk(enc(text))
        assert (None if s < 0 else bool(a.final_n[s])) is full, text
    assert set(a.allowed(0)) == {tok.convert_tokens_to_ids(x) for x in ["t", "tr", "tru", "true", "f", "fa", "fal", "fals",
                                                                   "false", *"0123456789"]}
    assert gc.regex(r"(true|false|[0-9]{2})") is a  # cached
    small = GrammarCompiler(tok, len(tok), cache_bytes=a.next_nv.nbytes)  # room for one such table
    first = small.regex("(true|false)")
    assert small.regex("(true|false)") is first and small.regex("[0-9]+") is not None
    assert small.regex("(true|false)") is not first  # dropped for the second, compiled again
    digits = {tok.convert_tokens_to_ids(x) for x in "0123456789"}
    assert set(gc.regex(r"\d").allowed(0)) == digits  # ASCII: not the first bytes of other scripts' digits
    assert set(gc.regex(r"[\d]").allowed(0)) == digits and len(gc.regex(r"\p{Nd}").allowed(0)) > len(digits)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22]}},
              "required": ["ok", "n"]}
    js = gc.json_schema(schema)
    for text in ['{"ok": true, "n": 22}', '{"ok":false,"n":1}', '{\n  "ok": true,\n  "n": 1\n}']:
        s = js.walk(enc(text))
        assert s >= 0 and js.final_n[s], text
    assert js.walk(enc('{"ok": 1')) < 0 and js.field == "guided_json"
    compact = gc.json_schema(schema, whitespace="")  # vLLM's guided_whitespace_pattern
    assert compact.walk(enc('{"ok":true,"n":22}')) >= 0 and compact.walk(enc('{"ok": true')) < 0
    bounded = gc.json_schema({"type": "integer", "minimum": 3, "exclusiveMaximum": 13})  # bounds as an enum
    assert [t for t in range(-2, 20) if bounded.walk(enc(str(t))) >= 0 and bounded.final_n[bounded.walk(enc(str(t)))]] \
        == list(range(3, 13))
    for schema, keyword in [({"type": "number", "maximum": 1}, "'maximum'"), ({"type": "integer", "minimum": 0},
                            "'minimum'"), ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                            "'uniqueItems'"), ({"properties": {"a": {"type": "integer", "multipleOf": 2}}},
                                               "'properties.a.multipleOf' is not enforced")]:
        with pytest.raises(GrammarError, match=keyword):
            gc.json_schema(schema)
    for bad, field in [((gc.regex, "(unclosed"), "guided_regex"), ((gc.json_schema, {"type": "nope"}), "guided_json")]:
        with pytest.raises(GrammarError) as e:
            bad[0](bad[1])
        assert e.value.field == field, bad


def test_request_fields_become_one_guide():
    from specjax.api import SamplingParams
    from specjax.serving.schema import FieldError, parse_sampling
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    for fields, want in [({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}, schema),
                         ({"response_format": {"type": "json_object"}}, {"type": "object"}),
                         ({"structured_outputs": {"json_object": True}}, {"type": "object"}),
                         ({"response_format": {"type": "text"}, "guided_json": schema}, schema)]:
        assert parse_sampling(fields, SamplingParams()).guided_json == want, fields
    assert parse_sampling({"structured_outputs": {"regex": "a+"}}, SamplingParams()).guided_regex == "a+"
    with pytest.raises(FieldError) as e:
        parse_sampling({"response_format": {"type": "json_object"}, "guided_regex": "a"}, SamplingParams())
    assert e.value.field == "response_format"


def test_states_that_reach_no_accepting_state_are_pruned():
    from specjax.grammars import _live_states
    successors = {0: {1, 2, 4}, 1: set(), 2: {3}, 3: {2}, 4: {5}, 5: set()}
    assert _live_states(successors, {3, 6}, 0) == {0, 2, 3}  # 1, 4, 5: dead ends; 6: unreachable


def test_the_python_api_and_the_server_serve_guided_regex_and_json(tok):
    """LLM(guided_regex=True) answers full matches of SamplingParams.guided_regex / guided_json; the
    OpenAI server over it answers guided_json, response_format json_schema / json_object and
    structured_outputs regex / json, and names the field of a bad value."""
    from specjax.api import LLM, SamplingParams
    from specjax.serving.http_server import ServerThread
    from specjax.serving.openai_api import OpenAIApp
    from serving_fixtures import http_json
    vocab = len(tok)
    model = tiny_target(vocab, seed=11, init_scale=2.0)
    config = dataclasses.replace(model.config, eos_token_ids=(tok.eos_token_id,))
    llm = LLM(target=(model, config), max_num_seqs=2, max_model_len=64, max_prefill=16, guided_regex=True,
              sampling_variants=("greedy", "plain"))
    llm.tokenizer = tok
    regex = r"(true|false) [0-9]{2}"
    out = llm.generate(["x"], SamplingParams(temperature=1.0, seed=3, max_tokens=20, guided_regex=regex))[0]
    assert re.fullmatch(regex, out.text) and out.finish_reason == "stop", out
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22]}},
              "required": ["ok", "n"]}
    api = OpenAIApp.from_llm(llm, model_name="tiny", tokenizer=tok)
    server = ServerThread(api)
    try:
        for extra in [{"guided_json": schema},
                      {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
                      {"structured_outputs": {"json": json.dumps(schema)}}]:
            status, r = http_json(server.url + "/v1/completions", "POST",
                                  {"prompt": "x", "max_tokens": 40, "temperature": 0, **extra})
            assert status == 200 and r["choices"][0]["finish_reason"] == "stop", r
            answer = json.loads(r["choices"][0]["text"])
            assert set(answer) == {"ok", "n"} and answer["n"] in (1, 22), r
        status, r = http_json(server.url + "/v1/completions", "POST",
                              {"prompt": "x", "max_tokens": 40, "temperature": 0, "guided_json": schema,
                               "guided_whitespace_pattern": ""})
        assert status == 200 and not re.search(r"\s", r["choices"][0]["text"]) and json.loads(r["choices"][0]["text"])
        status, r = http_json(server.url + "/v1/completions", "POST",
                              {"prompt": "x", "max_tokens": 8, "seed": 1, "structured_outputs": {"regex": regex}})
        assert status == 200 and re.fullmatch(regex, r["choices"][0]["text"]), r
        for bad, param, fragment in [
                ({"guided_json": {"type": "nope"}}, "guided_json", "not a JSON schema"),
                ({"response_format": {"type": "json_schema"}}, "response_format", "'schema' object"),
                ({"structured_outputs": {"grammar": "x"}}, "structured_outputs", "grammar not supported"),
                ({"guided_regex": "(a", "max_tokens": 4}, "guided_regex", "cannot compile"),
                ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "not several"),
                ({"guided_regex": "a{0,5000}"}, "guided_regex", "more than the engine's table holds"),
                ({"guided_json": schema, "guided_whitespace_pattern": "("}, "guided_whitespace_pattern",
                 "must be a regular expression"),
                ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "without guided_json")]:
            status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": "x", **bad})
            assert status == 400 and r["error"]["param"] == param and fragment in r["error"]["message"], (bad, r)
    finally:
        server.stop()
        api.engine.drain(60)
        api.engine.shutdown()


def test_tool_choice_is_answered_as_tool_calls(tok, tmp_path):
    """A named tool_choice answers that function's arguments (JSON of its parameters) as one tool call,
    "required" a list of calls; "none" answers text (the control: unguided, no valid arguments);
    "auto" (a server with --tool-call-parser hermes) the model's own text, and its calls where it writes them;
    a function not listed and tool_choice without tools are refused naming the field (the Responses API's
    function tools on the same server: test_responses_api.check_function_calls). A named call streams:
    its first delta names it, the next carry its arguments in pieces; "required" streams each call whole,
    "auto" its text."""
    from specjax.api import LLM
    from specjax.serving.http_server import ServerThread
    from specjax.serving.openai_api import OpenAIApp
    from serving_fixtures import http_json, http_request, sse_events
    from test_responses_api import check_function_calls
    chat_tok = byte_level_tokenizer()
    chat_tok.chat_template = ("{% for m in messages %}{{ m['content'] or '' }}\n{% endfor %}"
                              "{% if tools %}[{{ tools | length }} tools]{% endif %}")
    model = tiny_target(len(chat_tok), seed=11, init_scale=2.0)
    llm = LLM(target=(model, dataclasses.replace(model.config, eos_token_ids=(chat_tok.eos_token_id,))),
              max_num_seqs=2, max_model_len=192, max_prefill=64, guided_regex=True, sampling_variants=("greedy",),
              logit_bias=True)  # logit_bias: an answer that ends at once (eos), read as the model's calls
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_time", "arguments": "{\"utc\": true}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    api = OpenAIApp.from_llm(llm, model_name="tiny", tokenizer=chat_tok, tool_parser="hermes")
    server = ServerThread(api)

    def ask(**kw):
        return http_json(server.url + "/v1/chat/completions", "POST",
                         {"messages": history, "tools": [weather, clock], "temperature": 0, "max_tokens": 60, **kw})
    try:
        status, r = ask(tool_choice={"type": "function", "function": {"name": "get_weather"}})
        c = r["choices"][0]
        assert status == 200 and c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, r
        (call,) = c["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] in (
            "Paris", "Rome"), r
        status, _, data = http_request(server.url + "/v1/chat/completions", "POST", {
            "messages": history, "tools": [weather, clock], "temperature": 0, "max_tokens": 60, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
        chunks = [e["choices"][0] for e in sse_events(data) if e != "[DONE]" and e["choices"]]
        (first,) = chunks[0]["delta"]["tool_calls"]
        assert status == 200 and first["function"]["name"] == "get_weather" and first["id"].startswith("call_")
        pieces = [d["function"]["arguments"] for c in chunks for d in c["delta"].get("tool_calls", [])]
        assert "".join(pieces) == call["function"]["arguments"] and len(pieces) > 2, pieces  # streamed in pieces
        assert [c["finish_reason"] for c in chunks][-1] == "tool_calls" and "content" not in chunks[-1]["delta"]
        status, r = ask(tool_choice="required", max_tokens=120)
        calls = r["choices"][0]["message"]["tool_calls"]
        assert status == 200 and calls and all(x["function"]["name"] in ("get_weather", "get_time") for x in calls), r
        for x in calls:
            assert set(json.loads(x["function"]["arguments"])) == {"city" if x["function"]["name"] == "get_weather"
                                                                   else "utc"}, x
        status, r = ask(tool_choice="required", max_tokens=120, parallel_tool_calls=False)
        assert status == 200 and len(r["choices"][0]["message"]["tool_calls"]) == 1, r  # guided to one call
        status, _, data = http_request(server.url + "/v1/chat/completions", "POST", {
            "messages": history, "tools": [weather, clock], "temperature": 0, "max_tokens": 120, "stream": True,
            "tool_choice": "required"})
        chunks = [e["choices"][0] for e in sse_events(data) if e != "[DONE]" and e["choices"]]
        streamed = [d["function"] for c in chunks for d in c["delta"].get("tool_calls", [])]
        assert streamed == [x["function"] for x in calls] and chunks[-1]["finish_reason"] == "tool_calls", chunks
        status, r = ask(tool_choice="none", max_tokens=12)
        text = r["choices"][0]["message"]["content"]
        assert status == 200 and not r["choices"][0]["message"].get("tool_calls"), r
        with pytest.raises(ValueError):
            json.loads(text)  # unguided: not the arguments of a call
        status, r = ask(max_tokens=12)  # "auto": the model's own text; this one holds no call
        m = r["choices"][0]["message"]
        assert status == 200 and m["content"] and "tool_calls" not in m, r
        said = '<tool_call>\n{"name": "get_time", "arguments": {"utc": false}}\n</tool_call>'
        decode, api._decode = api._decode, lambda ids: "Checking. " + said  # as if the model wrote a hermes call
        try:
            status, r = ask(tool_choice="auto", max_tokens=12, logit_bias={str(chat_tok.eos_token_id): 100})
        finally:
            api._decode = decode
        m, reason = r["choices"][0]["message"], r["choices"][0]["finish_reason"]
        assert (m["content"], reason, m["tool_calls"][0]["function"]) == (
            "Checking.", "tool_calls", {"name": "get_time", "arguments": '{"utc": false}'}), r
        status, _, data = http_request(server.url + "/v1/chat/completions", "POST", {
            "messages": history, "tools": [weather, clock], "temperature": 0, "max_tokens": 12, "stream": True})
        chunks = [e["choices"][0] for e in sse_events(data) if e != "[DONE]" and e["choices"]]
        assert status == 200 and chunks[0]["delta"]["role"] == "assistant"  # "auto" streamed: text, no call
        assert not any("tool_calls" in c["delta"] for c in chunks) and chunks[-1]["finish_reason"] in ("stop", "length")
        for kw, param, fragment in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
                                     "one of ['get_time', 'get_weather']"),
                                    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]",
                                     "must be"),
                                    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs 'tools'")]:
            status, r = ask(**kw)
            assert status == 400 and r["error"]["param"] == param and fragment in r["error"]["message"], (kw, r)
        status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": "x", "tools": [weather],
                                                                        "tool_choice": "required"})
        assert status == 400 and r["error"]["param"] == "tools", r  # the chat route's and the Responses API's
        check_function_calls(server.url, [weather, clock], history, call)
    finally:
        server.stop()
        api.engine.drain(60)
        api.engine.shutdown()
    llm.tokenizer = chat_tok
    from specjax.api import SamplingParams
    from specjax.request_builder import encode_chat
    (out,) = llm.chat(history, SamplingParams(max_tokens=1, temperature=0), tools=[weather])  # the API renders tools
    assert out.prompt_token_ids == encode_chat(chat_tok, history, tools=[weather]) != encode_chat(chat_tok, history)
    _batch_lines_answer_tool_calls(llm, tmp_path, history, [weather, clock], call)


def _batch_lines_answer_tool_calls(llm, tmp_path, history, tools, server_call):
    """OpenAI batch lines on the chat url answer tool calls as the server does (the same greedy
    arguments); "auto" needs the job's --tool-call-parser, "required" and a named call its guide."""
    from specjax.serving.batch_job import Shard, run_batch_job
    from specjax.jobs import default_errors_path
    from serving_fixtures import read_jsonl, write_jsonl
    body = {"messages": history, "tools": tools, "temperature": 0, "max_tokens": 60}
    lines = [{"custom_id": "named", "url": "/v1/chat/completions",
              "body": {**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}},
             {"custom_id": "required", "url": "/v1/chat/completions", "body": {**body, "tool_choice": "required",
                                                                              "max_tokens": 120}},
             {"custom_id": "auto", "url": "/v1/chat/completions", "body": {**body, "max_tokens": 8}}]
    inp, out = tmp_path / "tools.jsonl", tmp_path / "tools.out.jsonl"
    write_jsonl(inp, lines)
    s = run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False, tool_parser="hermes")
    by_id = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in read_jsonl(out)}
    assert s.errors == 0 and by_id["named"]["finish_reason"] == "tool_calls", by_id
    assert by_id["named"]["message"]["tool_calls"][0]["function"] == server_call["function"]
    assert by_id["required"]["finish_reason"] == "tool_calls" and by_id["required"]["message"]["tool_calls"]
    assert by_id["auto"]["message"]["content"] and "tool_calls" not in by_id["auto"]["message"]
    out.unlink()
    s = run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False)  # no parser: "auto" is an error
    errors = read_jsonl(default_errors_path(str(out)))
    assert (s.completed, [e["field"] for e in errors if e["id"] == "auto"]) == (2, ["body.tool_choice"]), errors
