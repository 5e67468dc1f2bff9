"""OpenAI's Responses API (`/v1/responses`, `serving.responses_api`) through the OpenAI SDK: the answer
is the chat route's for the same messages (instructions first), streamed as the Responses events whose
deltas join to the same text; an answer cut by max_output_tokens is incomplete; what is not served is
refused naming the Responses field (chat's errors renamed)."""
from __future__ import annotations

import json

import openai
import pytest

try:
    from tests.serving_fixtures import http_json, http_request, shared_tiny_llm, tiny_chat_tokenizer
except ImportError:  # tests/ itself on sys.path
    from serving_fixtures import http_json, http_request, shared_tiny_llm, tiny_chat_tokenizer

from specjax.serving.limits import ServerLimits
from specjax.serving.responses_api import responses_param


@pytest.fixture(scope="module")
def served():
    from specjax.serving.http_server import ServerThread
    from specjax.serving.openai_api import OpenAIApp
    api = OpenAIApp.from_llm(shared_tiny_llm(), model_name="tiny", tokenizer=tiny_chat_tokenizer(),
                             limits=ServerLimits(max_tokens=16))
    server = ServerThread(api)
    try:
        yield server.url, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    finally:
        server.stop()
        api.engine.drain(60)
        api.engine.shutdown()


SAMPLING = dict(temperature=0, extra_body={"ignore_eos": True})


def test_a_response_is_the_chat_answer_to_the_same_messages(served):
    url, client = served
    chat = client.chat.completions.create(model="tiny", max_tokens=6, messages=[
        {"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w6 w7"}], **SAMPLING)
    r = client.responses.create(model="tiny", instructions="w3 w4", input="w5 w6 w7", max_output_tokens=6,
                                **SAMPLING)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == chat.choices[0].message.content and r.output[0].type == "message"
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # cut at 6 tokens
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.model_extra["spec_metrics"]["num_rounds"] >= 1
    # a list of messages with text parts (an assistant turn as output_text) reads as chat's messages
    history = [{"role": "user", "content": [{"type": "input_text", "text": "w5"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "w8"}]},
               {"role": "developer", "content": "w9 w10"}]
    r2 = client.responses.create(model="tiny", input=history, max_output_tokens=5, **SAMPLING)
    chat2 = client.chat.completions.create(model="tiny", max_tokens=5, messages=[
        {"role": "user", "content": "w5"}, {"role": "assistant", "content": "w8"},
        {"role": "system", "content": "w9 w10"}], **SAMPLING)
    assert r2.output_text == chat2.choices[0].message.content and r2.output_text != r.output_text


def test_streamed_events_join_to_the_same_answer(served):
    url, client = served
    kw = dict(model="tiny", input="w5 w6 w7", max_output_tokens=8, **SAMPLING)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    # the wire: each event named, no [DONE] line (the Responses API's)
    status, _, raw = http_request(url + "/v1/responses", "POST", {"model": "tiny", "input": "w5", "stream": True,
                                                                  "max_output_tokens": 2})
    lines = raw.decode().strip().split("\n\n")
    assert status == 200 and lines[0].startswith("event: response.created\ndata: ") and "[DONE]" not in raw.decode()
    assert json.loads(lines[-1].split("data: ", 1)[1])["type"] == "response.incomplete"


@pytest.mark.parametrize("body, param", [
    ({"input": "w5", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "w5", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": "w5", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"input": "w5", "max_output_tokens": 500}, "max_output_tokens"),
    ({"input": "w5", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "w5", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format"),
    ({"input": "w5", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": "w5", "model": "gpt-9"}, "model"),
    ({"input": [{"role": "user", "content": "w5"}], "instructions": 3}, "instructions"),
    ({"input": "w5", "temperature": "0.5"}, "temperature"),
    ({"input": "w5", "top_p": 2}, "top_p"),
])
def test_what_is_not_served_is_refused_naming_the_responses_field(served, body, param):
    url, _ = served
    status, r = http_json(url + "/v1/responses", "POST", body)
    assert status in (400, 404) and r["error"]["param"] == param, r


def test_chat_fields_in_errors_become_the_responses_fields():
    assert responses_param("messages[2].content", 1, False) == "input[1].content"
    assert responses_param("messages[0].content", 1, False) == "instructions"
    assert responses_param("messages", 0, True) == "input"
    assert responses_param("messages[0].content", 0, True) == "input"
    assert responses_param("max_completion_tokens", 0, True) == "max_output_tokens"
    assert responses_param("response_format.json_schema", 0, True) == "text.format.json_schema"
    assert responses_param("top_p", 0, True) == "top_p"
