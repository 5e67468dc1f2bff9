"""Reasoning outputs (`serving.reasoning`, a server's or batch job's --reasoning-parser): an answer's
thinking between <think> and </think> comes back as the message's `reasoning`, the rest as content
(read for tool calls); the thinking opens in the prompt (the template left <think> open) or at the
answer's start; streamed in pieces split anywhere gives the same split; without a parser the text is
the content (control)."""
from __future__ import annotations

import openai
import pytest

try:
    from tests.serving_fixtures import read_jsonl, shared_tiny_llm, tiny_chat_tokenizer, write_jsonl
except ImportError:  # tests/ itself on sys.path
    from serving_fixtures import read_jsonl, shared_tiny_llm, tiny_chat_tokenizer, write_jsonl

from specjax.serving.reasoning import (ReasoningStream, chat_message, check_reasoning_parser, prompt_opens_reasoning,
                                       split_reasoning)
from specjax.serving.tool_calls import ToolMode

CASES = [  # (answer, the prompt left <think> open, (reasoning, content))
    ("<think>\nLet me see.</think>\n\nParis.", False, ("\nLet me see.", "\n\nParis.")),
    ("  <think>a < b </thin k></think>x", False, ("a < b </thin k>", "x")),
    ("Let me see.</think>Paris.", True, ("Let me see.", "Paris.")),
    ("still thinking <", True, ("still thinking <", None)),  # cut short while thinking
    ("<think>hmm", False, ("hmm", None)),
    ("Paris. </think> <think>", False, (None, "Paris. </think> <think>")),  # no thinking: all content
    ("<thin", False, (None, "<thin")),
    ("", False, (None, "")),
]


@pytest.mark.parametrize("text, opened, want", CASES)
def test_whole_answers_split_at_the_thinking(text, opened, want):
    assert split_reasoning(text, opened) == want


@pytest.mark.parametrize("text, opened, want", CASES)
def test_streamed_in_pieces_split_anywhere_equals_the_whole_answer(text, opened, want):
    for step in (1, 2, 3, 5):
        stream, reasoning, content = ReasoningStream(opened), [], []
        pieces = [text[i:i + step] for i in range(0, len(text), step)] + [""]
        for i, piece in enumerate(pieces):
            r, c = stream.push(piece, final=i == len(pieces) - 1)
            reasoning.append(r)
            content.append(c)
            assert "</think>" not in "".join(reasoning) and (want[0] is None or "<think>" not in "".join(content))
        got = ("".join(reasoning) if stream.thought else None, "".join(content) or (None if stream.thought else ""))
        assert got == want, step


def test_a_naive_split_of_each_piece_would_leak_the_tag():
    """Negative control: splitting each streamed piece on its own (no held-back tail) leaks a </think>
    cut in two into the reasoning, which the stream above never does."""
    pieces = ["Let me see.</thi", "nk>Paris."]
    naive = [p.split("</think>")[0] for p in pieces]
    assert "</thi" in "".join(naive)
    stream = ReasoningStream(True)
    assert [stream.push(p, final=i == 1) for i, p in enumerate(pieces)] == [("Let me see.", ""), ("", "Paris.")]


def test_chat_messages_carry_reasoning_and_read_the_content_for_tool_calls():
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    msg, reason = chat_message("<think>use f</think>" + call, ToolMode(None, "hermes"), False, "stop")
    assert reason == "tool_calls" and msg["reasoning"] == msg["reasoning_content"] == "use f"
    assert msg["tool_calls"][0]["function"]["name"] == "f" and msg["content"] is None
    msg, reason = chat_message("no end", None, True, "length")
    assert msg == {"role": "assistant", "content": None, "reasoning": "no end", "reasoning_content": "no end"}
    assert chat_message("<think>a</think>b", None, None, "stop")[0] == {"role": "assistant",
                                                                        "content": "<think>a</think>b"}
    with pytest.raises(ValueError, match="--reasoning-parser"):
        check_reasoning_parser("granite")


# ---------------------------------------------------------------- through the server and batch jobs
THINK_ID = 63  # the tokenizer's word "<think>": the template puts it after the generation prompt


def _tokenizer(end_id: int | None = None):
    """The tiny chat tokenizer with word 63 "<think>" (opened by the template when enable_thinking is
    true) and the word of `end_id` "</think>"."""
    renamed = {THINK_ID: "<think>", **({} if end_id is None else {end_id: "</think>"})}
    return tiny_chat_tokenizer(renamed, generation_prompt="w9{% if enable_thinking %} <think>{% endif %}")


MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module")
def thinking():
    """The shared tiny LLM with a tokenizer whose "</think>" is the k-th token (k >= 2) of the greedy
    answer to MESSAGES with the thinking opened, k, and that answer's words."""
    from specjax.api import SamplingParams
    from specjax.request_builder import encode_chat
    llm = shared_tiny_llm()
    saved = llm.tokenizer
    llm.tokenizer = _tokenizer()
    try:
        prompt = encode_chat(llm.tokenizer, MESSAGES, enable_thinking=True)
        assert prompt_opens_reasoning(llm.tokenizer, prompt) and prompt[-1] == THINK_ID
        ids = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
        k = next(k for k in range(2, 7) if ids[k] not in prompt + ids[:k] + [THINK_ID])  # a word of its own
        llm.tokenizer = _tokenizer(ids[k])
        words = llm.tokenizer.decode(ids).split(" ")
        assert words[k] == "</think>" and words.count("</think>") == 1 + (ids[k + 1:].count(ids[k]))
        yield llm, k, words
    finally:
        llm.tokenizer = saved


def test_the_server_answers_the_thinking_apart_streamed_or_not(thinking):
    from specjax.serving.http_server import ServerThread
    from specjax.serving.openai_api import OpenAIApp
    llm, k, words = thinking
    body = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, extra_body={
        "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}})
    for parser in ("qwen3", None):
        api = OpenAIApp.from_llm(llm, model_name="tiny", reasoning_parser=parser)
        server = ServerThread(api)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        try:
            msg = client.chat.completions.create(**body).choices[0].message
            reasoning, content = msg.model_extra.get("reasoning"), msg.content
            chunks = list(client.chat.completions.create(stream=True, **body))
            streamed_r = "".join(c.choices[0].delta.model_extra.get("reasoning") or "" for c in chunks if c.choices)
            streamed_c = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            closed = client.chat.completions.create(**{**body, "extra_body": {"ignore_eos": True}}).choices[0].message
            rbody = dict(model="tiny", input=MESSAGES, max_output_tokens=8, temperature=0, extra_body=body["extra_body"])
            resp = client.responses.create(**rbody)
            events = list(client.responses.create(stream=True, **rbody))
        finally:
            server.stop()
            api.engine.drain(60)
            api.engine.shutdown()
        if parser is None:  # control: the text, tags and all, is the content
            assert reasoning is None and content == " ".join(words) and "</think>" in content
            continue
        assert reasoning == " ".join(words[:k]) + " " and msg.model_extra["reasoning_content"] == reasoning
        assert content == " " + " ".join(words[k + 1:])
        assert (streamed_r, streamed_c) == (reasoning, content)
        # the prompt without <think> (enable_thinking off), an answer not beginning with it: no thinking
        assert closed.model_extra["reasoning"] is None and closed.content and "<think>" not in closed.content
        # the Responses API: the thinking as a reasoning item before the message, streamed or not
        assert [o.type for o in resp.output] == ["reasoning", "message"] and resp.output_text == content
        assert resp.output[0].content[0].text == reasoning and resp.usage.output_tokens_details.reasoning_tokens == k
        streamed = {kind: "".join(e.delta for e in events if e.type == kind)
                    for kind in ("response.reasoning_text.delta", "response.output_text.delta")}
        assert list(streamed.values()) == [reasoning, content]
        assert [e.type for e in events].index("response.reasoning_text.done") < [e.type for e in events].index(
            "response.content_part.added")


def test_batch_chat_lines_answer_the_thinking_apart(thinking, tmp_path):
    from specjax.jobs import Shard
    from specjax.serving.batch_job import run_batch_job
    llm, k, words = thinking
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": True}}
    parts = [{"role": "user", "content": [{"type": "text", "text": "w5 w6 w7"}]}]
    rows = [{"custom_id": "c", "url": "/v1/chat/completions", "body": body},
            {"id": "native", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            {"custom_id": "parts", "url": "/v1/chat/completions", "body": {**body, "messages": parts}},
            {"custom_id": "image", "url": "/v1/chat/completions", "body": {**body, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, rows)
    run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False, reasoning_parser="deepseek_r1")
    by = {r.get("custom_id", r.get("id")): r for r in read_jsonl(out)}
    msg = by["c"]["response"]["body"]["choices"][0]["message"]
    assert msg["reasoning"] == " ".join(words[:k]) + " " and msg["content"] == " " + " ".join(words[k + 1:])
    # the prompt is rendered as the server renders it: text parts joined, chat_template_kwargs honoured
    assert by["parts"]["response"]["body"]["choices"][0]["message"] == msg
    assert "reasoning" not in by["native"] and by["native"]["text"] != " ".join(words)  # no <think> opened
    (err,) = read_jsonl(tmp_path / "out.errors.jsonl")
    assert err["id"] == "image" and err["field"] == "body.messages[0].content[0].type"
