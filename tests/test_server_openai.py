"""The server as real clients use it: the official `openai` package (chat, completions, streaming, `n`,
content parts, errors as the SDK's exception types), the OpenAPI schema and docs, and the lifecycle
(/health 503 with a reason until warm-up is done, /v1/models, rejected requests counted by reason).

A tiny random target with a word-level chat tokenizer ("w5 w6 ..."); the chat template joins the
message contents and adds "w9", so a conversation's prompt is known token by token."""
from __future__ import annotations

import json
import re
import threading

import pytest

openai = pytest.importorskip("openai")

try:
    from tests.serving_fixtures import http_json, http_request, shared_tiny_llm, tiny_chat_tokenizer
except ImportError:  # tests/ itself on sys.path
    from serving_fixtures import http_json, http_request, shared_tiny_llm, tiny_chat_tokenizer

from specjax.cli import serve as serve_cli
from specjax.serving.http_server import ServedApp, ServerThread
from specjax.serving.limits import ServerLimits
from specjax.serving.openai_api import OpenAIApp


@pytest.fixture(scope="module")
def served():
    llm = shared_tiny_llm()
    api = OpenAIApp.from_llm(llm, model_name="tiny", tokenizer=tiny_chat_tokenizer(),
                             limits=ServerLimits(max_tokens=16, max_body_bytes=1 << 14))
    server = ServerThread(api)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    try:
        yield {"url": server.url, "api": api, "client": client}
    finally:
        server.stop()
        api.engine.drain(60)
        api.engine.shutdown()


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_completions_and_chat_through_the_openai_client(served):
    c = served["client"]
    r = c.completions.create(model="tiny", prompt=[5, 6, 7, 9], max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny" and len(r.choices) == 1
    ids = _ids(r.choices[0])
    assert 1 <= len(ids) <= 6 and r.usage.prompt_tokens == 4 and r.usage.completion_tokens == len(ids)
    assert r.choices[0].text == served["api"].tokenizer.decode(ids, skip_special_tokens=True)
    batch = c.completions.create(model="tiny", prompt=[[5, 6, 7, 9], [8, 3]], max_tokens=6, temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1] and _ids(batch.choices[0]) == ids  # the SDK's batched prompts
    assert batch.usage.prompt_tokens == 6
    # the same prompt as a conversation: "w5" + "w6" + "w7" (text parts) + generation prompt "w9"
    chat = c.chat.completions.create(model="tiny", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "w5"},
        {"role": "user", "content": [{"type": "text", "text": "w6"}, {"type": "text", "text": "w7"}]}])
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == 4 and _ids(chat.choices[0]) == ids  # greedy: the same tokens
    assert chat.choices[0].message.content == r.choices[0].text
    # max_completion_tokens is max_tokens' alias; stop as a string or a list
    short = c.chat.completions.create(model="tiny", max_completion_tokens=2, temperature=0,
                                      messages=[{"role": "user", "content": "w5 w6 w7"}])
    assert _ids(short.choices[0]) == ids[:2] and short.choices[0].finish_reason == "length"
    words = r.choices[0].text.split()
    if len(words) >= 2 and words[1] != words[0]:
        for stop in (words[1], [words[1], "w63 w63 w63"]):
            cut = c.completions.create(model="tiny", prompt=[5, 6, 7, 9], max_tokens=6, temperature=0, stop=stop)
            assert cut.choices[0].text.split() == words[:1] and cut.choices[0].finish_reason == "stop"


def test_streaming_through_the_openai_client_with_usage(served):
    c = served["client"]
    plain = c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=8, temperature=0)
    chunks = list(c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain.choices[0].text
    assert [t for ch in chunks if ch.choices for t in _ids(ch.choices[0])] == _ids(plain.choices[0])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    chat = list(c.chat.completions.create(model="tiny", max_tokens=5, temperature=0, stream=True,
                                          messages=[{"role": "user", "content": "w5 w6"}]))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("stop", "length")


def test_n_choices_each_with_its_own_seed_stream(served):
    """n parallel samples of one prompt: choice i is the request with seed + i, streamed or not."""
    c = served["client"]
    kw = dict(model="tiny", prompt=[5, 6, 7], max_tokens=10, temperature=1.0, seed=11)
    r = c.completions.create(n=3, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    singles = [_ids(c.completions.create(**{**kw, "seed": 11 + i}).choices[0]) for i in range(3)]
    assert [_ids(ch) for ch in r.choices] == singles
    assert len({tuple(s) for s in singles}) > 1  # different streams, not copies
    assert r.usage.completion_tokens == sum(len(s) for s in singles) and r.usage.prompt_tokens == 3
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    usage = None
    for ch in c.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw):
        for choice in ch.choices:
            streamed[choice.index] += _ids(choice)
        usage = ch.usage or usage
    assert [streamed[i] for i in range(3)] == singles and usage.completion_tokens == r.usage.completion_tokens


@pytest.mark.parametrize("kwargs, param, fragment", [
    (dict(messages=[{"role": "wizard", "content": "w5"}]), "messages[0].role", "'tool'"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0].type", "'image_url'"),
    (dict(messages=[{"role": "user", "content": "w5"}], n=9), "n", "[1, 4]"),
    (dict(messages=[{"role": "user", "content": "w5"}], max_completion_tokens=0), "max_completion_tokens",
     "max_completion_tokens"),
    (dict(messages=[{"role": "user", "content": "w5"}], temperature=-1), "temperature", "temperature"),
    (dict(messages=[{"role": "user", "content": "w5"}], logprobs=True, top_logprobs=21), "top_logprobs", "[0, 20]"),
    (dict(messages=[{"role": "user", "content": "w5"}], top_logprobs=2), "top_logprobs", "needs 'logprobs'"),
    (dict(messages=[], max_tokens=2), "messages", "messages"),
])
def test_refusals_are_the_sdks_exceptions_naming_the_field(served, kwargs, param, fragment):
    with pytest.raises(openai.BadRequestError) as ei:
        served["client"].chat.completions.create(model="tiny", **kwargs)
    e = ei.value
    assert e.status_code == 400 and e.param == param and fragment in e.body["message"], e.body


def test_logprobs_in_chat_and_completions_streamed_or_not(served):
    """Chat `logprobs` + `top_logprobs` and completions `logprobs` report the same values for the same
    tokens; greedy: the chosen token is the top alternative; streamed chunks carry their tokens' entries."""
    c, tok = served["client"], served["api"].tokenizer
    chat = c.chat.completions.create(model="tiny", max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                     messages=[{"role": "user", "content": "w5 w6 w7"}])
    ids = _ids(chat.choices[0])
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in ids]
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the argmax
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob) and e.logprob <= 0
        assert e.bytes == list(e.token.encode())
    comp = c.completions.create(model="tiny", prompt=[5, 6, 7, 9], max_tokens=6, temperature=0, logprobs=3)
    lp = comp.choices[0].logprobs
    assert _ids(comp.choices[0]) == ids and lp.tokens == [e.token for e in content]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in content], abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(d) <= 3 for d in lp.top_logprobs)
    # sampled, n = 2, streamed: each choice's chunks carry exactly its tokens' entries
    kw = dict(model="tiny", prompt=[5, 6, 7], max_tokens=8, temperature=0.9, top_k=10, seed=5, n=2, logprobs=2)
    kw = {k: v for k, v in kw.items() if k != "top_k"} | {"extra_body": {"top_k": 10}}
    whole = c.completions.create(**kw)
    got: dict[int, list[float]] = {0: [], 1: []}
    for ch in c.completions.create(stream=True, **kw):
        for choice in ch.choices:
            assert len(choice.logprobs.token_logprobs) == len(_ids(choice))
            got[choice.index] += choice.logprobs.token_logprobs
    for choice in whole.choices:
        assert got[choice.index] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-6)
        assert all(-9999.0 <= x <= 0 for x in choice.logprobs.token_logprobs)


def test_echo_scoring_through_the_openai_client(served):
    """lm-eval-harness' log-likelihood request: the prompt echoed with its logprobs, nothing generated."""
    c, tok = served["client"], served["api"].tokenizer
    r = c.completions.create(model="tiny", prompt="w5 w6 w7 w9", echo=True, logprobs=2, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == "w5 w6 w7 w9" and _ids(choice) == [] and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == ["w5", "w6", "w7", "w9"] and lp.text_offset == [0, 2, 4, 6]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(d) == 2 for d in lp.top_logprobs[1:])
    echoed = c.completions.create(model="tiny", prompt=[5, 6, 7, 9], echo=True, max_tokens=3, temperature=0)
    plain = c.completions.create(model="tiny", prompt=[5, 6, 7, 9], max_tokens=3, temperature=0)
    assert echoed.choices[0].text == tok.decode([5, 6, 7, 9]) + plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=[5, 6], max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_unknown_model_is_the_sdks_not_found_error(served):
    with pytest.raises(openai.NotFoundError) as ei:
        served["client"].completions.create(model="gpt-9", prompt=[5], max_tokens=1)
    assert ei.value.param == "model" and ei.value.code == "model_not_found"


def test_models_lists_the_served_name_and_context_length(served):
    models = served["client"].models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == served["api"].max_model_len == 128


def test_openapi_schema_and_docs_describe_the_routes(served):
    status, schema = http_json(served["url"] + "/openapi.json")
    assert status == 200
    paths = schema["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(paths)
    chat = paths["/v1/chat/completions"]["post"]
    assert set(chat["responses"]) == {"200", "400", "404", "413", "503", "504"}  # never FastAPI's 422
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    comps = schema["components"]["schemas"]
    req = comps["ChatCompletionRequest"]["properties"]
    assert {"messages", "n", "stop", "max_completion_tokens", "stream_options", "top_logprobs"} <= set(req)
    assert comps["ChatMessage"]["properties"]["role"]["enum"] == ["system", "user", "assistant", "tool"]
    assert {"minimum": 0, "maximum": 20}.items() <= req["top_logprobs"]["anyOf"][0].items()
    assert req["max_tokens"]["anyOf"][0]["minimum"] == 1  # completions: 0 too, with echo
    assert comps["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["minimum"] == 0
    assert set(comps["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}
    status, headers, page = http_request(served["url"] + "/docs")
    assert status == 200 and headers["content-type"].startswith("text/html") and b"openapi.json" in page


def _rejected(url: str, reason: str) -> float:
    text = http_request(url + "/metrics")[2].decode()
    m = re.search(rf'^specjax:request_rejected_total\{{model_name="tiny",reason="{reason}"\}} (\S+)$', text, re.M)
    assert m, f"no series for reason {reason}"
    return float(m.group(1))


def test_metrics_count_refusals_by_reason(served):
    url = served["url"]
    before = {r: _rejected(url, r) for r in ("invalid_request", "model_not_found", "request_too_large")}
    http_request(url + "/v1/completions", "POST", {"prompt": [5], "top_p": 2})
    http_request(url + "/v1/completions", "POST", {"prompt": [5], "model": "other"})
    try:  # refused by its Content-Length; the server may close before the client has sent it all
        http_request(url + "/v1/completions", "POST", raw=b"{" + b" " * 20000 + b"}")
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert {r: _rejected(url, r) - v for r, v in before.items()} == {
        "invalid_request": 1, "model_not_found": 1, "request_too_large": 1}


def test_health_is_503_with_a_reason_until_the_app_is_ready(served):
    pending = ServedApp(reason="warming up", limits=ServerLimits())
    server = ServerThread(pending)
    try:
        assert http_json(server.url + "/health") == (503, {"status": "starting", "reason": "warming up"})
        status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": [5], "max_tokens": 1})
        assert status == 503 and r["error"]["code"] == "not_ready" and "warming up" in r["error"]["message"]
        assert http_json(server.url + "/v1/models")[0] == 503
        pending.ready(served["api"])
        assert http_json(server.url + "/health") == (200, {"status": "ok"})
        status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": [5], "max_tokens": 1})
        assert status == 200, r
    finally:
        server.stop()


def test_serve_exits_1_when_the_model_cannot_be_loaded(monkeypatch, capsys):
    def broken(args, progress=False):
        raise ValueError("no such checkpoint")
    monkeypatch.setattr(serve_cli, "build_llm", broken)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("rc", serve_cli.main(["--port", "0"])), daemon=True)
    t.start()
    t.join(60)
    assert out.get("rc") == 1 and "stopped" in capsys.readouterr().out


def test_api_key_guards_the_model_routes_and_the_openai_client_sends_it(served, monkeypatch):
    """--api-key: the model's routes answer 401 (OpenAI's invalid_api_key, WWW-Authenticate) without the
    key or with another, before reading the body; /health and /metrics stay open; the openai client with
    the key gets the answer the open server gives (control: the open server needs no key)."""
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    status, open_answer = http_json(served["url"] + "/v1/completions", "POST", body)
    assert status == 200  # control: without --api-key no header is needed
    server = ServerThread(ServedApp(served["api"], api_key="s3cret"))
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for path, method, sent in (("/v1/completions", "POST", body), ("/v1/models", "GET", None),
                                       ("/tokenize", "POST", {"prompt": "w5"}),
                                       ("/reset_prefix_cache", "POST", None),
                                       ("/v1/completions", "POST", {"prompt": 5})):  # a bad body: 401 first
                status, hdrs, data = http_request(server.url + path, method, sent, headers=headers)
                err = json.loads(data)["error"]
                assert status == 401 and err["code"] == "invalid_api_key" and "Bearer" in err["message"], (path, data)
                assert hdrs["www-authenticate"] == "Bearer"
        for path in ("/health", "/metrics", "/version"):
            assert http_request(server.url + path)[0] == 200
        doc = http_json(server.url + "/openapi.json")[1]["paths"]
        assert "401" in doc["/v1/chat/completions"]["post"]["responses"] and "401" in doc["/tokenize"]["post"]["responses"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        r = client.completions.create(model="tiny", **body)
        assert _ids(r.choices[0]) == open_answer["choices"][0]["token_ids"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        server.stop()
    monkeypatch.setenv("SPECJAX_API_KEY", "from-env")
    assert serve_cli.build_parser().parse_args([]).api_key == "from-env"
    assert serve_cli.main(["--api-key", " "]) == 2
    with pytest.raises(ValueError, match="api_key must be a non-empty string"):
        ServedApp(api_key="")
