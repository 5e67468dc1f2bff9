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
    ({"input": "w5", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "w5", "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),  # "auto": no --tool-call-parser
    ({"input": "w5", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name"),  # not listed
    ({"input": "w5", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": [{"type": "file_search_call", "id": "c"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}, "input[0].arguments"),
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


def check_function_calls(url: str, chat_tools: list[dict], history: list[dict], chat_call: dict) -> None:
    """Function tools on a server started with --guided-regex (run by test_guided_regex's tool-call test,
    on its server): `history` (user, an assistant's tool call, its result) given as Responses input items
    and a named tool_choice answer the chat route's call (`chat_call`, the same greedy arguments) as one
    `function_call` item; streamed, its arguments arrive as deltas in pieces between the item's added and
    done events. Control: tool_choice "none" answers a message, no call."""
    user, assistant, result = history
    (asked,) = assistant["tool_calls"]
    items = [user, {"type": "function_call", "call_id": asked["id"], "name": asked["function"]["name"],
                    "arguments": asked["function"]["arguments"]},
             {"type": "function_call_output", "call_id": result["tool_call_id"], "output": result["content"]}]
    body = {"input": items, "tools": [{"type": "function", **t["function"]} for t in chat_tools], "temperature": 0,
            "tool_choice": {"type": "function", "name": chat_call["function"]["name"]}, "max_output_tokens": 60}
    status, r = http_json(url + "/v1/responses", "POST", body)
    assert status == 200 and r["status"] == "completed" and r["tool_choice"] == body["tool_choice"], r
    (item,) = r["output"]
    assert (item["type"], item["name"], item["status"]) == ("function_call", chat_call["function"]["name"], "completed")
    assert item["id"].startswith("fc_") and item["call_id"].startswith("call_"), item
    assert item["arguments"] == chat_call["function"]["arguments"], (item, chat_call)
    status, _, raw = http_request(url + "/v1/responses", "POST", {**body, "stream": True})
    events = [json.loads(block.split("data: ", 1)[1]) for block in raw.decode().strip().split("\n\n")]
    kinds = [e["type"] for e in events]
    assert status == 200 and kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 2 and "".join(deltas) == item["arguments"] == events[-3]["arguments"], deltas
    assert events[2]["item"]["name"] == item["name"] and events[-1]["response"]["output"][0]["arguments"] == item["arguments"]
    status, r = http_json(url + "/v1/responses", "POST", {**body, "tool_choice": "none", "max_output_tokens": 8})
    assert status == 200 and [o["type"] for o in r["output"]] == ["message"], r


def test_streamed_text_then_calls_close_each_item_before_the_next_opens():
    """A streamed chat answer with thinking, text and two calls (an "auto" answer read by a parser) gives
    the items in that order, each closed before the next opens, at output indexes 0-3, and the final
    response holds the same items (control: the events of a text-only answer have no call)."""
    import asyncio

    from specjax.serving.responses_api import Answer, response_events

    def chunk(finish=None, **delta):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def call(k, args, id=None, name=None):  # a chat tool_calls delta: the first of a call names it
        return {"index": k, "function": {"arguments": args}} if id is None else \
            {"index": k, "id": id, "type": "function", "function": {"name": name, "arguments": args}}
    chunks = [chunk(reasoning="hm"), chunk(content="Checking."),
              chunk(tool_calls=[call(0, "", id="call_a", name="f")]), chunk(tool_calls=[call(0, '{"x": ')]),
              chunk(tool_calls=[call(0, "1}")]), chunk(tool_calls=[call(1, "{}", id="call_b", name="g")]),
              chunk("tool_calls"), {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}}]

    def run(given):
        async def gen():
            for c in given:
                yield c

        async def collect():
            return [e async for e in response_events(Answer({"input": "q"}, "tiny", tiny_chat_tokenizer()), gen())]
        return asyncio.run(collect())
    events = run(chunks)
    opened = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    closed = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == [(0, "reasoning"), (1, "message"), (2, "function_call"), (3, "function_call")]
    order = [e["type"] for e in events if e["type"].startswith("response.output_item")]
    assert order == ["response.output_item.added", "response.output_item.done"] * 4  # one item open at a time
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and [o["type"] for o in final["output"]] == [
        "reasoning", "message", "function_call", "function_call"]
    assert [(o["call_id"], o["name"], o["arguments"]) for o in final["output"][2:]] == [
        ("call_a", "f", '{"x": 1}'), ("call_b", "g", "{}")]
    assert final["output"][1]["content"][0]["text"] == "Checking."
    plain = run([chunk(content="Hi."), chunk("stop"), chunks[-1]])
    assert not any("function_call" in e["type"] for e in plain) and plain[-1]["type"] == "response.completed"
