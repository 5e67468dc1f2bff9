"""OpenAI-compatible HTTP server (FastAPI + uvicorn): completions (plain and streamed), chat, errors,
metrics, continuous batching, load, client disconnects and the waiting-queue limit.

The server is started through `specjax.cli.serve.main(["--port", "0", ...])` on a thread, with the model
builder swapped for the shared tiny LLM (no checkpoint needed)."""
from __future__ import annotations

import contextlib
import http.client
import io
import json
import re
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

try:
    from tests.serving_fixtures import (http_json, http_request, shared_tiny_llm, sse_events,
                                        tiny_chat_tokenizer)
except ImportError:  # tests/ itself on sys.path
    from serving_fixtures import http_json, http_request, shared_tiny_llm, sse_events, tiny_chat_tokenizer

import specjax
from specjax.cli import serve as serve_cli
from specjax.api import SamplingParams
from specjax.request_builder import build_engine_request
from specjax.decoding.engine import Engine
from specjax.serving import http_server
from specjax.serving.async_engine import AsyncEngine, QueueFullError, RequestError
from specjax.serving.http_server import ServerThread
from specjax.serving.limits import ServerLimits
from specjax.serving.openai_api import OpenAIApp
from specjax.serving.request_metrics import response_metrics

PROMPT = [5, 6, 7, 8, 5, 6, 7]


@pytest.fixture(scope="module")
def srv():
    llm = shared_tiny_llm()
    made: dict = {}
    real_make_server = http_server.make_server

    def make_server(served, **kw):
        made["served"] = served
        made["server"] = real_make_server(served, **kw)
        return made["server"]

    argv = ["--port", "0", "--served-model-name", "tiny", "--max-body-bytes", "4096", "--max-prompt-tokens", "64",
            "--max-tokens-limit", "32", "--per-request-spec-decode-metrics", "summary"]
    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve_cli, "build_llm", lambda args, progress=False: llm)
        mp.setattr(http_server, "make_server", make_server)
        thread = threading.Thread(target=serve_cli.main, args=(argv,), daemon=True)
        with contextlib.redirect_stdout(buf):
            thread.start()
            deadline = time.time() + 60
            while not (made.get("server") is not None and made["server"].started and made["served"].api is not None) \
                    and time.time() < deadline and thread.is_alive():
                time.sleep(0.01)
    m = re.search(r"http://([\d.]+):(\d+)", buf.getvalue())
    host, port = m.group(1), int(m.group(2))
    yield {"url": f"http://{host}:{port}", "host": host, "port": port, "printed": buf.getvalue(),
           "app": made["served"].api, "llm": llm}
    made["server"].should_exit = True
    thread.join(30)
    assert not thread.is_alive()
    assert not llm.engine.has_work()


@contextlib.contextmanager
def side_server(srv, **kw):
    """A second HTTP server over the fixture's engine (other tokenizer or limits)."""
    app = srv["app"]
    api = OpenAIApp(app.engine, model_name="tiny", max_model_len=app.max_model_len, vocab_size=64, **kw)
    server = ServerThread(api)
    try:
        yield server.url, api
    finally:
        server.stop()


def _complete(url, **body):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **body}
    return http_json(url + "/v1/completions", "POST", body)


def test_port_0_is_printed_and_bound_to_localhost_by_default(srv):
    assert srv["port"] > 0
    assert srv["host"] == "127.0.0.1" == serve_cli.build_parser().parse_args([]).host
    assert re.search(rf"http://127\.0\.0\.1:{srv['port']}\b", srv["printed"])
    assert http_json(srv["url"] + "/health") == (200, {"status": "ok"})
    assert http_json(srv["url"] + "/version") == (200, {"version": specjax.__version__})
    status, models = http_json(srv["url"] + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]


def test_completion_plain_and_streamed_agree(srv):
    # each request prefills whole: a repeat would draft from the slot's stale tail (other rounds, same tokens)
    srv["llm"].reset_prefix_cache()
    status, r = _complete(srv["url"])
    assert status == 200, r
    ch = r["choices"][0]
    assert r["object"] == "text_completion" and r["model"] == "tiny"
    assert ch["finish_reason"] in ("stop", "length") and 1 <= len(ch["token_ids"]) <= 12
    assert ch["stop_reason"] is None  # eos or max_tokens (vLLM's: null)
    assert r["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": len(ch["token_ids"]),
                          "total_tokens": len(PROMPT) + len(ch["token_ids"])}
    sm = r["spec_metrics"]
    assert set(sm) >= {"mean_acceptance_length", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                       "accepted_per_pos"}
    assert sm["num_drafts"] > 0 and sm["mean_acceptance_length"] == pytest.approx(
        1 + sm["num_accepted_tokens"] / sm["num_drafts"])

    srv["llm"].reset_prefix_cache()
    status, headers, data = http_request(srv["url"] + "/v1/completions", "POST",
                                         {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(data)
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == ch["token_ids"]  # greedy: the same tokens, delivered in deltas
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == ch["finish_reason"]
    assert last["usage"] == r["usage"] and last["spec_metrics"]["num_drafts"] == sm["num_drafts"]


def test_chat_without_tokenizer_is_a_clear_400(srv):
    status, r = http_json(srv["url"] + "/v1/chat/completions", "POST",
                          {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and r["error"]["param"] == "messages" and "tokenizer" in r["error"]["message"]


def test_chat_with_a_tokenizer_template(srv):
    with side_server(srv, tokenizer=tiny_chat_tokenizer()) as (url, chat_app):
        body = {"messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 6, "temperature": 0}
        status, r = http_json(url + "/v1/chat/completions", "POST", body)
        assert status == 200, r
        msg = r["choices"][0]["message"]
        assert r["object"] == "chat.completion" and msg["role"] == "assistant"
        assert r["usage"]["prompt_tokens"] == 4  # "w5 w6 w7 " + generation prompt "w9"
        ids = r["choices"][0]["token_ids"]
        assert msg["content"] == chat_app.tokenizer.decode(ids, skip_special_tokens=True)
        # the same prompt as token ids through /v1/completions gives the same greedy tokens
        status, c = http_json(url + "/v1/completions", "POST", {"prompt": [5, 6, 7, 9], "max_tokens": 6,
                                                                "temperature": 0})
        assert c["choices"][0]["token_ids"] == ids
        status, _, data = http_request(url + "/v1/chat/completions", "POST", {**body, "stream": True})
        events = sse_events(data)
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == msg["content"]
        # a stop string that begins inside a token (a word without its "w") ends the text exactly before
        # it, streamed or not (tokens held back until safe); the tokens run through the one completing it
        words, full = msg["content"].split(), msg["content"]
        cut = next(i for i in range(2, len(words)) if words[i][1:] not in " ".join(words[:i]))
        stop = words[cut][1:]
        body = {**body, "stop": [stop], "max_tokens": 6}
        status, r = http_json(url + "/v1/chat/completions", "POST", body)
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["choices"][0]["message"]["content"] == full[:full.index(stop)] and full[:full.index(stop)].endswith("w")
        assert r["choices"][0]["token_ids"] == ids[:cut + 1] and r["choices"][0]["stop_reason"] == stop
        status, _, data = http_request(url + "/v1/chat/completions", "POST", {**body, "stream": True})
        events = sse_events(data)
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == full[:full.index(stop)]
        assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == ids[:cut + 1]
        assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["choices"][0]["stop_reason"] == stop
        # vLLM's include_stop_str_in_output keeps it (each word is one token), streamed or not
        body = {**body, "include_stop_str_in_output": True}
        status, r = http_json(url + "/v1/chat/completions", "POST", body)
        assert r["choices"][0]["message"]["content"].split() == words[:cut + 1]
        assert r["choices"][0]["token_ids"] == ids[:cut + 1] and r["choices"][0]["finish_reason"] == "stop"
        status, _, data = http_request(url + "/v1/chat/completions", "POST", {**body, "stream": True})
        events = sse_events(data)
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]).split() == words[:cut + 1]


def test_a_list_of_prompts_answers_each_prompt_n_times_in_order(srv):
    """OpenAI's batched completion prompts: choice k * n + j is prompt k's; greedy choices equal the
    prompt's own completion; usage counts each prompt once; streamed choices equal non-streamed."""
    prompts = [[5, 6, 7], [9, 10, 11, 9], [3, 4]]
    alone = [_complete(srv["url"], prompt=p, max_tokens=6)[1]["choices"][0]["token_ids"] for p in prompts]
    status, r = _complete(srv["url"], prompt=prompts, n=2, max_tokens=6)
    assert status == 200, r
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert [c["token_ids"] for c in r["choices"]] == [a for a in alone for _ in range(2)]
    assert r["usage"]["prompt_tokens"] == 9 and r["usage"]["completion_tokens"] == sum(6 for _ in range(6))
    status, _, data = http_request(srv["url"] + "/v1/completions", "POST",
                                   {"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0, "stream": True,
                                    "stream_options": {"include_usage": True}})
    events = sse_events(data)
    got: dict[int, list[int]] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            got.setdefault(c["index"], []).extend(c["token_ids"])
    assert [got[i] for i in range(6)] == [c["token_ids"] for c in r["choices"]]
    finals = [e for e in events[:-2] if e["choices"][0].get("finish_reason")]
    assert sorted(e["usage"]["prompt_tokens"] for e in finals) == [2, 2, 3, 3, 4, 4]  # each its own prompt
    assert events[-2]["usage"] == r["usage"]
    with side_server(srv, tokenizer=tiny_chat_tokenizer()) as (url, _):  # echo: each choice after its prompt
        status, e = http_json(url + "/v1/completions", "POST", {"prompt": ["w5 w6", "w7"], "echo": True,
                                                                "max_tokens": 0, "logprobs": 1})
        assert status == 200 and [c["text"] for c in e["choices"]] == ["w5 w6", "w7"], e
        assert [c["logprobs"]["tokens"] for c in e["choices"]] == [["w5", "w6"], ["w7"]]
        assert [c["logprobs"]["token_logprobs"][0] for c in e["choices"]] == [None, None]
    status, r = _complete(srv["url"], prompt=[[5]] * 65)
    assert status == 400 and r["error"]["param"] == "prompt" and "limit is 64" in r["error"]["message"]
    status, r = _complete(srv["url"], prompt=[[5, 6], [5, 640]])
    assert status == 400 and "'prompt[1]'" in r["error"]["message"]


def test_chat_continues_the_final_message_and_drops_the_generation_prompt_when_asked(srv):
    """vLLM's `continue_final_message` and `add_generation_prompt`: the prompt ids are the template's with
    those options (the generation prompt "w9" gone), in /tokenize and in the completion the engine ran."""
    with side_server(srv, tokenizer=tiny_chat_tokenizer()) as (url, app):
        msgs = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7 w8"}]
        want = app.tokenizer.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True,
                                                 tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert want == [5, 6, 7, 8]
        for opts, ids in (({}, [5, 6, 7, 8, 9]), ({"continue_final_message": True}, want),
                          ({"add_generation_prompt": False}, [5, 6, 7, 8])):
            assert http_json(url + "/tokenize", "POST", {"messages": msgs, **opts})[1]["tokens"] == ids, opts
            status, r = http_json(url + "/v1/chat/completions", "POST",
                                  {"messages": msgs, "max_tokens": 4, "temperature": 0, **opts})
            _, c = _complete(url, prompt=ids, max_tokens=4)
            assert status == 200 and r["usage"]["prompt_tokens"] == len(ids), r
            assert r["choices"][0]["token_ids"] == c["choices"][0]["token_ids"]  # that prompt was decoded
        for opts, msgs_, fragment in (
                ({"continue_final_message": True, "add_generation_prompt": True}, msgs, "cannot both be true"),
                ({"continue_final_message": True}, msgs[:1], "role is 'user'"),
                ({"continue_final_message": "yes"}, msgs, "boolean")):
            status, r = http_json(url + "/v1/chat/completions", "POST", {"messages": msgs_, **opts})
            assert status == 400 and r["error"]["param"] == "continue_final_message", r
            assert fragment in r["error"]["message"], r


def test_tokenize_gives_the_ids_the_completion_routes_use_and_detokenize_inverts_it(srv):
    with side_server(srv, tokenizer=tiny_chat_tokenizer()) as (url, _):
        chat = {"messages": [{"role": "user", "content": "w5 w6 w7"}]}
        status, t = http_json(url + "/tokenize", "POST", chat)
        assert status == 200 and t == {"count": 4, "max_model_len": 128, "tokens": [5, 6, 7, 9]}, t
        status, r = http_json(url + "/v1/chat/completions", "POST", {**chat, "max_tokens": 2})
        assert r["usage"]["prompt_tokens"] == t["count"]
        assert http_json(url + "/tokenize", "POST", {"prompt": "w8 w3"})[1]["tokens"] == [8, 3]
        assert http_json(url + "/tokenize", "POST", {"prompt": [8, 3]})[1]["tokens"] == [8, 3]
        assert http_json(url + "/detokenize", "POST", {"tokens": [8, 3, 2]}) == (200, {"prompt": "w8 w3 </s>"})
        bad = [("/tokenize", {"prompt": "w8", **chat}, "prompt"), ("/tokenize", {}, "prompt"),
               ("/tokenize", {"prompt": [64]}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens"),
               ("/detokenize", {"tokens": [1], "model": "other"}, "model")]
        for path, body, param in bad:
            status, r = http_json(url + path, "POST", body)
            assert status in (400, 404) and r["error"]["param"] == param, (path, body, r)
    status, r = http_json(srv["url"] + "/detokenize", "POST", {"tokens": [5]})  # no tokenizer
    assert status == 400 and r["error"]["param"] == "tokens" and "tokenizer" in r["error"]["message"]
    assert http_json(srv["url"] + "/tokenize", "POST", {"prompt": [5, 6]})[1]["count"] == 2


@pytest.mark.parametrize("raw, param, fragment", [
    (b'{"prompt": [1, 2', None, "malformed JSON"),
    (b'[1, 2]', None, "JSON object"),
    (b'{"max_tokens": 3}', "prompt", "prompt"),
    (b'{"prompt": ' + str([5] * 65).encode() + b'}', "prompt", "limit is 64"),
    (b'{"prompt": [5, 6], "max_tokens": 33}', "max_tokens", "limit is 32"),
    (b'{"prompt": [5, 6], "max_tokens": 0}', "max_tokens", "positive"),
    (b'{"prompt": [5, 6], "temperature": -1}', "temperature", "temperature"),
    (b'{"prompt": [5, 6], "top_p": 1.5}', "top_p", "top_p"),
    (b'{"prompt": [5, 640]}', "prompt", "vocabulary"),
    (b'{"prompt": "text"}', "prompt", "tokenizer"),
    (b'{"prompt": [5, 6], "stream": "yes"}', "stream", "boolean"),
    (b'{"prompt": [5, 6], "n": 5}', "n", "[1, 4]"),
    (b'{"prompt": [5, 6], "n": 0}', "n", "[1, 4]"),
    (b'{"prompt": [5, 6], "logprobs": 21}', "logprobs", "[0, 20]"),
    (b'{"prompt": [5, 6], "echo": true, "stream": true}', "echo", "not served with 'stream'"),
    (b'{"prompt": [5, 6], "best_of": 2}', "best_of", "not supported"),
    (b'{"prompt": [5, 6], "min_p": 1.5}', "min_p", "min_p must be in [0, 1]"),
    (b'{"prompt": [5, 6], "min_p": "0.1"}', "min_p", "must be a number"),
    (b'{"prompt": [5, 6], "min_tokens": 20}', "min_tokens", "min_tokens must be <= max_tokens (16)"),
    (b'{"prompt": [5, 6], "repetition_penalty": 1.1}', "repetition_penalty", "needs a server started with --penalties"),
    (b'{"prompt": [5, 6], "frequency_penalty": 2.5}', "frequency_penalty", "must be in [-2, 2]"),
    (b'{"prompt": [5, 6], "response_format": {"type": "json_object"}}', "response_format", "--guided-regex"),
    (b'{"prompt": [5, 6], "presence_penalty": true}', "presence_penalty", "must be a number"),
    (b'{"prompt": [5, 6], "ignore_eos": 1}', "ignore_eos", "true or false"),
    (b'{"prompt": [5, 6], "include_stop_str_in_output": "yes"}', "include_stop_str_in_output", "true or false"),
    (b'{"prompt": [5, 6], "truncate_prompt_tokens": 0}', "truncate_prompt_tokens", "must be a positive int, -1"),
    (b'{"prompt": [5, 6], "truncate_prompt_tokens": 1.0}', "truncate_prompt_tokens", "must be an integer"),
    (b'{"prompt": [5, 6], "truncate_prompt_tokens": 100000}', "truncate_prompt_tokens", "at most max_model_len"),
    (b'{"prompt": [5, 6], "priority": -1}', "priority", "needs a server started with --scheduling-policy priority"),
    (b'{"prompt": [5, 6], "priority": "high"}', "priority", "must be an integer"),
    (b'{"prompt": [5, 6], "stop_token_ids": [64]}', "stop_token_ids", "vocabulary"),
    (b'{"prompt": [5, 1.5]}', "prompt", "valid integer"),
    (b'{"prompt": "\\ud800x"}', "prompt", "lone surrogate"),
    (b'{"prompt": ["a\\udfff"]}', "prompt[0]", "lone surrogate"),
    (b'', None, "JSON"),
])
def test_bad_requests_get_400_naming_the_field(srv, raw, param, fragment):
    status, _, data = http_request(srv["url"] + "/v1/completions", "POST", raw=raw)
    err = json.loads(data)["error"]
    assert status == 400 and err["param"] == param and fragment in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_served_vllm_fields_and_off_values_of_unserved_ones_are_answered(srv):
    """ignore_eos, min_p and min_tokens (served) and the "off" values of refused fields (response_format text, a
    float 0 penalty) pass; the fields reach the engine's request (the engine tests their effect)."""
    seen = []
    submit = srv["app"].engine.submit
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(srv["app"].engine, "submit", lambda req, *a, **kw: (seen.append(req), submit(req, *a, **kw))[1])
        status, r = _complete(srv["url"], ignore_eos=True, min_p=0.05, min_tokens=2, presence_penalty=0.0,
                              response_format={"type": "text"}, max_tokens=4)
    assert status == 200 and len(r["choices"][0]["token_ids"]) == 4, r
    assert [(q.ignore_eos, q.min_p, q.min_tokens) for q in seen] == [(True, 0.05, 2)]


def test_truncate_prompt_tokens_answers_the_prompts_last_tokens(srv):
    """vLLM's truncate_prompt_tokens: a longer prompt cut to its last len(PROMPT) tokens answers as PROMPT
    (greedy tokens, usage), also past max_model_len (control: the same prompt uncut is 400)."""
    long = [3, 4] * (srv["app"].max_model_len // 2) + list(PROMPT)
    status, r = _complete(srv["url"], prompt=long, max_tokens=6)
    assert status == 400 and r["error"]["code"] == "context_length_exceeded", r
    srv["llm"].reset_prefix_cache()
    status, cut = _complete(srv["url"], prompt=long, max_tokens=6, truncate_prompt_tokens=len(PROMPT))
    srv["llm"].reset_prefix_cache()
    status2, whole = _complete(srv["url"], prompt=list(PROMPT), max_tokens=6)
    assert status == status2 == 200, cut
    assert cut["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
    assert cut["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] == len(PROMPT)


def test_oversize_body_is_413_and_unknown_model_404_then_still_serving(srv):
    status, _, data = http_request(srv["url"] + "/v1/completions", "POST",
                                   raw=b'{"prompt": [5], "pad": "' + b"x" * 5000 + b'"}')
    assert status == 413 and b"4096" in data
    status, r = _complete(srv["url"], model="other")
    assert status == 404 and r["error"]["param"] == "model"
    assert http_json(srv["url"] + "/nope")[0] == 404
    status, r = _complete(srv["url"], max_tokens=3)
    assert status == 200 and len(r["choices"][0]["token_ids"]) <= 3
    assert http_json(srv["url"] + "/health")[0] == 200


def test_concurrent_requests_batch_continuously_with_the_same_greedy_results(srv):
    prompts = [[5 + i, 6, 7 + i % 3, 5 + i, 6] for i in range(7)]  # 7 requests, 4 slots
    seq = [_complete(srv["url"], prompt=p, max_tokens=8 + i)[1]["choices"][0]["token_ids"]
           for i, p in enumerate(prompts)]
    rounds0 = http_json(srv["url"] + "/metrics.json")[1]["rounds"]["count"]
    with ThreadPoolExecutor(7) as ex:
        par = list(ex.map(lambda ip: _complete(srv["url"], prompt=ip[1], max_tokens=8 + ip[0]),
                          enumerate(prompts)))
    rounds = http_json(srv["url"] + "/metrics.json")[1]["rounds"]["count"] - rounds0
    assert [r[0] for r in par] == [200] * 7
    assert [r[1]["choices"][0]["token_ids"] for r in par] == seq
    # requests shared rounds: fewer engine rounds than the requests' rounds added up
    assert rounds < sum(r[1]["spec_metrics"]["num_rounds"] for r in par)


def test_metrics_count_what_the_responses_report(srv):
    url = srv["url"]
    before = http_json(url + "/metrics.json")[1]
    rs = [_complete(url, prompt=[9, 10, 11, 9, 10, 11, 9], max_tokens=10)[1], _complete(url, max_tokens=7)[1]]
    after = http_json(url + "/metrics.json")[1]
    d = lambda k: after["spec_decode"][k] - before["spec_decode"][k]  # noqa: E731
    for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert d(k) == sum(r["spec_metrics"][k] for r in rs), k
    assert d("num_drafts") > 0
    per_pos = [a - b for a, b in zip(after["spec_decode"]["num_accepted_tokens_per_pos"],
                                     before["spec_decode"]["num_accepted_tokens_per_pos"])]
    assert per_pos == [sum(x) for x in zip(*(r["spec_metrics"]["accepted_per_pos"] for r in rs))]
    assert after["tokens"]["generation"] - before["tokens"]["generation"] == sum(
        r["usage"]["completion_tokens"] for r in rs)
    status, headers, text = http_request(url + "/metrics")
    text = text.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "specjax:verification_length_bucket", "specjax:scheduler_tokens_bucket_bucket",
                 "specjax:round_seconds_bucket"):
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), name
    m = re.search(r'^vllm:spec_decode_num_drafts_total\{model_name="tiny"\} (\S+)$', text, re.M)
    assert float(m.group(1)) == after["spec_decode"]["num_drafts"]
    assert re.search(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{model_name="tiny",position="3"\}',
                     text, re.M)
    assert re.search(r'^vllm:request_success_total\{finished_reason="length",model_name="tiny"\} [1-9]', text, re.M)
    by_kind = after["rounds"]["by_kind"]  # every round counted once under the scheduler's decision
    assert sorted(by_kind) == ["draft", "lite", "upkeep"] and sum(by_kind.values()) == after["rounds"]["count"]
    assert re.search(r'^specjax:scheduler_rounds_total\{kind="draft",model_name="tiny"\} [1-9]', text, re.M)


def _check_spec_decode_stats(st: dict, sm: dict, gamma: int) -> None:
    """vLLM's `metrics.speculative_decoding` against the same request's `spec_metrics`, whose counts
    come from other counters: the histograms must add up to them and to its per-position counts."""
    assert st["num_spec_steps"] == sm["num_drafts"] > 0  # drafts were verified
    assert st["num_accepted_draft_tokens"] == sm["num_accepted_tokens"]
    assert st["num_draft_tokens"] == sm["num_draft_tokens"] and st["num_spec_tokens"] == gamma
    assert st["mean_acceptance_length"] == pytest.approx(sm["mean_acceptance_length"])
    assert st["draft_acceptance_rate"] == pytest.approx(sm["num_accepted_tokens"] / sm["num_draft_tokens"])
    hist = st["acceptance_histogram"]
    assert len(hist) == gamma + 1 and sum(hist) == sm["num_drafts"]
    assert sum(j * h for j, h in enumerate(hist)) == sm["num_accepted_tokens"]
    # accepted_per_pos[k] counts the rounds that accepted more than k drafts (padded to the engine's gamma)
    per_pos = sm["accepted_per_pos"]
    assert [sum(hist[k + 1:]) for k in range(gamma)] == per_pos[:gamma] and not any(per_pos[gamma:])
    by_len = {int(k): v for k, v in st["acceptance_histogram_by_draft_length"].items()}
    assert all(len(v) == k + 1 and 1 <= k <= gamma for k, v in by_len.items())
    assert [sum(v[j] for v in by_len.values() if j < len(v)) for j in range(gamma + 1)] == hist
    assert sum(k * sum(v) for k, v in by_len.items()) == sm["num_draft_tokens"]


def test_per_request_spec_decode_metrics_add_up_to_the_rounds_verified(srv):
    gamma = srv["llm"].engine.gamma
    srv["llm"].reset_prefix_cache()  # whole prefills: the streamed repeat below runs the same rounds
    status, r = _complete(srv["url"], max_tokens=24)  # the fixture's server: --per-request-... summary
    assert status == 200, r
    st = r["metrics"]["speculative_decoding"]
    _check_spec_decode_stats(st, r["spec_metrics"], gamma)
    assert "per_step_drafted" not in st
    bad = {**st, "acceptance_histogram": [0, *st["acceptance_histogram"][:-1]]}  # control: shifted by one
    with pytest.raises(AssertionError):
        _check_spec_decode_stats(bad, r["spec_metrics"], gamma)

    status, r1 = _complete(srv["url"], max_tokens=24, num_speculative_tokens=1)  # the request's own cap
    _check_spec_decode_stats(r1["metrics"]["speculative_decoding"], r1["spec_metrics"], 1)
    status, r2 = _complete(srv["url"], max_tokens=8, n=2)
    assert status == 200 and r2["metrics"] == {"speculative_decoding": None}  # vLLM: null for n > 1

    srv["llm"].reset_prefix_cache()
    status, _, data = http_request(srv["url"] + "/v1/completions", "POST", {
        "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = sse_events(data)[:-1]
    assert [c.get("metrics") for c in chunks[:-2]] == [None] * (len(chunks) - 2)  # only at the end
    assert chunks[-2]["metrics"] == chunks[-1]["metrics"] == r["metrics"]  # greedy: the same rounds
    assert [c.get("usage") for c in chunks[:-2]] == [None] * (len(chunks) - 2)  # no continuous usage asked

    status, _, data = http_request(srv["url"] + "/v1/completions", "POST", {  # vLLM's continuous usage
        "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks, so_far = sse_events(data)[:-1], 0
    assert len(chunks) > 3  # rounds streamed apart
    for c in chunks[:-1]:
        so_far += len(c["choices"][0]["token_ids"])
        assert c["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": so_far,
                              "total_tokens": len(PROMPT) + so_far}
    assert so_far == 24 and chunks[-1]["usage"] == chunks[-2]["usage"] == r["usage"]

    with side_server(srv, spec_decode_metrics="detailed") as (url, _):
        status, d = _complete(url, max_tokens=24)
        st = d["metrics"]["speculative_decoding"]
        _check_spec_decode_stats(st, d["spec_metrics"], gamma)
        steps = list(zip(st["per_step_drafted"], st["per_step_accepted"]))
        assert len(steps) == st["num_spec_steps"] and all(0 <= a <= k <= gamma for k, a in steps)
        assert sum(a for _, a in steps) == st["num_accepted_draft_tokens"]
        assert sum(k for k, _ in steps) == st["num_draft_tokens"]
    with side_server(srv) as (url, _):  # off by default: the response is unchanged
        srv["llm"].reset_prefix_cache()
        status, off = _complete(url, max_tokens=24)
        assert status == 200 and "metrics" not in off and off["spec_metrics"] == r["spec_metrics"]


def test_spec_decode_metrics_are_null_without_a_drafter_and_absent_when_off():
    req = build_engine_request([1, 2], SamplingParams(max_tokens=2), request_id="r")
    plain = types.SimpleNamespace(gamma=0)  # an engine without a drafter, as far as the block goes
    plain.speculative_decoding = types.MethodType(Engine.speculative_decoding, plain)
    assert response_metrics("summary", [req], plain) == {"speculative_decoding": None}
    assert response_metrics("none", [req], types.SimpleNamespace(gamma=4)) is None


def test_spec_decode_metrics_level_is_checked_by_name():
    with pytest.raises(SystemExit):
        serve_cli.build_parser().parse_args(["--per-request-spec-decode-metrics", "full"])
    with pytest.raises(ValueError, match="spec_decode_metrics must be one of none, summary, detailed, got 'full'"):
        OpenAIApp(None, model_name="x", max_model_len=8, vocab_size=8, spec_decode_metrics="full")


def _latency_sums(url: str) -> dict[str, float]:
    """_sum and _count of the request-latency histograms (REQUEST_LATENCIES' keys), from the Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families
    from specjax.serving.metrics import REQUEST_LATENCIES
    text = http_request(url + "/metrics")[2].decode()
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.labels.get("model_name") == "tiny"}
    names = {key: name for key, (name, _, _) in REQUEST_LATENCIES.items()} | {
        f"{kind}_tokens": f"vllm:request_{kind}_tokens" for kind in ("prompt", "generation")}
    return {f"{key}_{part}": samples[f"{name}_{part}"] for part in ("sum", "count") for key, name in names.items()}


def test_time_per_output_token_is_each_requests_decode_time_over_its_later_tokens(srv):
    url = srv["url"]
    before = _latency_sums(url)
    n = _complete(url, max_tokens=6)[1]["usage"]["completion_tokens"]
    after = _latency_sums(url)
    d = {k: after[k] - before[k] for k in after}
    assert n >= 2 and d["ttft_count"] == d["e2e_count"] == d["tpot_count"] == 1
    # one request: its mean TPOT times its tokens after the first is its time from first token to finish
    # (counting all n tokens, or from the arrival, would break this)
    assert d["tpot_sum"] * (n - 1) == pytest.approx(d["e2e_sum"] - d["ttft_sum"], abs=1e-6)
    assert 0 < d["tpot_sum"] < d["e2e_sum"]
    # vLLM's phases: arrival -> slot (queue) -> first token (prefill) -> finish (decode); slot -> finish (inference)
    assert all(d[f"{k}_count"] == 1 and d[f"{k}_sum"] > 0 for k in ("queue", "prefill", "decode", "inference"))
    assert d["queue_sum"] + d["prefill_sum"] == pytest.approx(d["ttft_sum"], abs=1e-6)
    assert d["prefill_sum"] + d["decode_sum"] == pytest.approx(d["inference_sum"], abs=1e-6)
    assert d["queue_sum"] + d["inference_sum"] == pytest.approx(d["e2e_sum"], abs=1e-6)
    # vLLM's per-request token counts: this request's prompt and generated tokens, in 1-2-5 buckets
    assert (d["prompt_tokens_count"], d["prompt_tokens_sum"]) == (1, len(PROMPT))
    assert (d["generation_tokens_count"], d["generation_tokens_sum"]) == (1, n)
    # a one-token request has no decode time: its TTFT is observed, no TPOT
    _complete(url, max_tokens=1)
    last = _latency_sums(url)
    assert last["ttft_count"] - after["ttft_count"] == 1 and last["tpot_count"] == after["tpot_count"]
    snap = http_json(url + "/metrics.json")[1]["latency_mean_s"]
    assert snap["tpot"] == pytest.approx(last["tpot_sum"] / last["tpot_count"])
    assert snap["ttft"] == pytest.approx(last["ttft_sum"] / last["ttft_count"])


def test_async_engine_reports_a_bad_request_to_it_alone_and_aborts(srv):
    eng = srv["app"].engine
    good = eng.submit(build_engine_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=5), request_id="g"))
    bad = eng.submit(build_engine_request([5] * 300, SamplingParams(max_tokens=5), request_id="b"))
    with pytest.raises(RequestError, match="does not fit") as ei:
        bad.result(60)
    assert ei.value.rejected
    assert good.result(60).finish_reason in ("stop", "length") and good.error is None
    long = eng.submit(build_engine_request([5, 6], SamplingParams(temperature=0, max_tokens=100), request_id="l"))
    first = long.get(timeout=60)
    assert first.token_ids and not first.finished
    eng.abort(long)
    req = long.result(60)
    assert req.finish_reason == "abort" and len(req.output_ids) < 100
    deadline = time.time() + 10
    while eng.engine.has_work() and time.time() < deadline:
        time.sleep(0.01)
    assert not eng.engine.has_work()  # the slot was freed


def test_serving_engine_config_yaml_loads():
    """The shipped serving YAML is a valid EngineConfig (frozen dataclass, fields checked)."""
    import pathlib

    from specjax.config import ConfigError, load_yaml
    from specjax.decoding.engine import EngineConfig
    root = pathlib.Path(__file__).resolve().parents[1]
    cfg = load_yaml(EngineConfig, root / "configs" / "serve" / "embedded_dspark.yaml")
    assert cfg.policy == "confidence_async" and cfg.slots_buckets[-1] == cfg.max_slots
    bad = root / "configs" / "serve" / "embedded_dspark.yaml"
    import pytest
    import yaml
    data = yaml.safe_load(bad.read_text())
    data["max_slotz"] = 3
    tmp = pathlib.Path(__import__("tempfile").mkdtemp()) / "bad.yaml"
    tmp.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="max_slotz"):
        load_yaml(EngineConfig, tmp)


def test_load_128_clients_512_requests_each_answered_once(srv):
    """128 client threads send 512 short requests on fresh connections: every one gets 200, each
    answer is its own (prompt echoed in usage, distinct ids), and the server counts exactly 512."""
    url, n_req, n_clients = srv["url"], 512, 128
    before = http_json(url + "/metrics.json")[1]["requests"]

    def one(i: int) -> tuple[int, int, dict]:
        prompt = [5 + i % 40, 6, 7 + i % 3] + [9] * (i % 5)
        status, body = http_json(url + "/v1/completions", "POST",
                                 {"prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=120)
        return i, status, body | {"sent_len": len(prompt)}

    with ThreadPoolExecutor(n_clients) as ex:
        futures = [ex.submit(one, i) for i in range(n_req)]
        done, pending = wait(futures, timeout=240)
    assert not pending, f"{len(pending)} requests did not finish within 240 s"
    results = [f.result() for f in futures]  # a reset or a timeout raises here
    assert [s for _, s, _ in results] == [200] * n_req, [b for _, s, b in results if s != 200][:3]
    assert sorted(i for i, _, _ in results) == list(range(n_req))
    assert len({b["id"] for _, _, b in results}) == n_req  # no answer given twice
    assert all(b["usage"]["prompt_tokens"] == b["sent_len"] for _, _, b in results)
    assert all(1 <= len(b["choices"][0]["token_ids"]) <= 2 for _, _, b in results)
    after = http_json(url + "/metrics.json")[1]["requests"]
    finished = sum(after["finished"].values()) - sum(before["finished"].values())
    assert finished == n_req, (before, after)


def _abort_count(url: str) -> float:
    text = http_request(url + "/metrics")[2].decode()
    m = re.search(r'^vllm:request_success_total\{finished_reason="abort",model_name="tiny"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_streaming_client_that_disconnects_frees_its_slot(srv):
    eng = srv["app"].engine
    with side_server(srv, limits=ServerLimits(max_tokens=120)) as (url, api):
        aborts0 = _abort_count(srv["url"])
        others: dict = {}

        def other() -> None:
            others["r"] = http_json(url + "/v1/completions", "POST",
                                    {"prompt": [9, 10, 11], "max_tokens": 30, "temperature": 0})

        host, port = url.rsplit("/", 1)[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": [5, 6], "max_tokens": 120, "temperature": 0, "stream": True}),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: {")
        # vllm:kv_cache_usage_perc: the running request's rows, at most (prompt + its 120 tokens) / all rows
        usage = http_json(srv["url"] + "/metrics.json")[1]["kv_cache_usage_perc"]
        assert 0 < usage <= 122 / (eng.engine.cfg.max_slots * eng.engine.cfg.max_len), usage
        t = threading.Thread(target=other)
        t.start()
        conn.sock.shutdown(2)  # the client goes away after its first chunk
        conn.close()
        t.join(60)
        assert others["r"][0] == 200 and len(others["r"][1]["choices"][0]["token_ids"]) == 30
        deadline = time.time() + 20
        while (eng.num_open or eng.engine.has_work() or _abort_count(srv["url"]) == aborts0) \
                and time.time() < deadline:
            time.sleep(0.02)
        assert _abort_count(srv["url"]) == aborts0 + 1  # ended by the abort, not by max_tokens
        assert eng.num_open == 0 and eng.engine.num_active == 0 and not eng.engine.has_work()  # slot freed
        assert http_json(srv["url"] + "/metrics.json")[1]["kv_cache_usage_perc"] == 0  # its rows are free


def test_beyond_the_waiting_limit_is_a_503_with_a_clear_message(srv):
    eng = srv["app"].engine
    saved = eng.max_waiting
    eng.max_waiting = 0  # every request would have to wait: all refused
    try:
        status, r = _complete(srv["url"])
    finally:
        eng.max_waiting = saved
    assert status == 503 and r["error"]["code"] == "queue_full"
    assert "waiting" in r["error"]["message"] and "limit 0" in r["error"]["message"]
    assert _complete(srv["url"])[0] == 200  # and it serves again once there is room


def test_async_engine_waiting_limit_counts_queued_requests(srv):
    """An engine whose loop has not started keeps every submission waiting: the limit is exact."""
    inner = srv["llm"].engine
    eng = AsyncEngine(inner, max_waiting=2)  # never started: nothing leaves the queue
    try:
        mk = lambda i: build_engine_request([5, 6], SamplingParams(max_tokens=2), request_id=f"q{i}")  # noqa: E731
        a, b = eng.submit(mk(0)), eng.submit(mk(1))
        assert eng.num_waiting == 2 and eng.num_open == 2
        with pytest.raises(QueueFullError, match="limit 2"):
            eng.submit(mk(2))
    finally:
        eng.shutdown()
    assert a.error == b.error == "engine shut down" and eng.num_open == 0
    assert inner.on_round is not eng._on_round  # handed back


def test_a_waiting_client_that_disconnects_has_its_request_aborted(srv):
    """Not streamed: the handler polls the connection while it waits and aborts a gone client's request."""
    eng = srv["app"].engine
    with side_server(srv, limits=ServerLimits(max_tokens=120)) as (url, api):
        aborts0 = _abort_count(srv["url"])
        host, port = url.rsplit("/", 1)[1].split(":")
        inner = eng.engine
        slow_round = inner.on_round

        def slow(info):  # 0.1 s per round: the request outlives the 1 s poll
            time.sleep(0.1)
            if slow_round is not None:
                slow_round(info)
        inner.on_round = slow
        try:
            sock = __import__("socket").create_connection((host, int(port)), timeout=30)
            body = json.dumps({"prompt": [5, 6], "max_tokens": 120, "temperature": 0}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.time() + 20
            while eng.engine.num_active == 0 and time.time() < deadline:
                time.sleep(0.01)
            sock.close()
            while (eng.num_open or _abort_count(srv["url"]) == aborts0) and time.time() < deadline:
                time.sleep(0.02)
        finally:
            inner.on_round = slow_round
        assert _abort_count(srv["url"]) == aborts0 + 1
        assert eng.num_open == 0 and not eng.engine.has_work()


def test_bench_server_load_client_counts_tokens_latencies_and_errors(srv):
    """bench.server_load's closed-loop client against this server: every streamed request counted with
    its TTFT and ITL; with the waiting limit at 0 every request is an error (the goal check can fail)."""
    from bench import server_load

    level = server_load.run_level(srv["port"], clients=4, n_requests=12, max_tokens=8, prompt_len=5, bound_s=60,
                                  timeout=60, vocab_size=64)
    assert (level["requests"], level["completed"], level["errors"]) == (12, 12, 0)
    assert level["tokens_per_s"] == pytest.approx(8 * level["requests_per_s"])
    assert 0 < level["ttft_ms_p50"] <= level["ttft_ms_p99"] and 0 <= level["itl_ms_p50"] <= level["itl_ms_p99"]
    eng = srv["app"].engine
    saved, eng.max_waiting = eng.max_waiting, 0
    try:
        bad = server_load.run_level(srv["port"], clients=2, n_requests=4, max_tokens=8, prompt_len=5, bound_s=60,
                                    timeout=60, vocab_size=64)
    finally:
        eng.max_waiting = saved
    assert (bad["completed"], bad["errors"]) == (0, 4) and "HTTP 503" in bad["error_examples"][0]


def test_bench_server_load_openai_client_level(srv):
    """bench.server_load's level through the openai async client: n = 2 choices, logprobs on."""
    from bench import server_load

    level = server_load.run_openai_level(srv["port"], clients=3, n_requests=6, max_tokens=6, prompt_len=5,
                                         bound_s=60, timeout=60, model="tiny", vocab_size=64)
    assert (level["requests"], level["completed"], level["errors"]) == (6, 6, 0), level["error_examples"]
    assert level["tokens_per_s"] == pytest.approx(2 * 6 * level["requests_per_s"])
    assert 0 < level["ttft_ms_p50"] <= level["ttft_ms_p99"] and 0 <= level["itl_ms_p50"] <= level["itl_ms_p99"]


def test_reset_prefix_cache_route_forgets_the_rows_of_free_slots(srv):
    """vLLM's POST /reset_prefix_cache: a prompt a free slot holds is reused (control), not after it."""
    def hits() -> float:
        text = http_request(srv["url"] + "/metrics")[2].decode()
        return float(re.search(r'^vllm:prefix_cache_hits_total\{model_name="tiny"\} (\S+)$', text, re.M).group(1))
    assert _complete(srv["url"], max_tokens=2)[0] == 200
    before = hits()
    assert _complete(srv["url"], max_tokens=2)[0] == 200
    assert hits() - before == len(PROMPT) - 1  # the whole prompt but the token its prefill re-reads
    assert http_json(srv["url"] + "/reset_prefix_cache", "POST", {}) == (200, {"reset": True})
    before = hits()
    assert _complete(srv["url"], max_tokens=2)[0] == 200
    assert hits() == before
    from specjax.serving.async_engine import AsyncEngine  # prefix caching off: nothing to forget
    assert AsyncEngine.reset_prefix_cache(types.SimpleNamespace(engine=types.SimpleNamespace(prefixes=None))) is False
