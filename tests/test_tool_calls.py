"""Tool calls read from the model's own format (`serving.tool_calls`, a server's --tool-call-parser):
hermes blocks become OpenAI tool calls with the text before them as content; text without a call, or
with a block that is not a call, stays text; "auto" without a parser, and an unknown parser, are
refused naming what to set."""
import json

import pytest

from specjax.serving.errors import APIError
from specjax.serving.tool_calls import ToolMode, check_tool_parser, hermes_calls, tool_guide, tool_message

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_hermes_blocks_are_calls_and_the_text_before_them_content():
    text = ('<think>ok</think>Let me look.\n<tool_call>\n{"name": "f", "arguments": {"q": "Zürich", "n": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "g", "arguments": "{}"}</tool_call>')
    content, calls = hermes_calls(text)
    assert content == "<think>ok</think>Let me look." and [n for n, _ in calls] == ["f", "g"]
    assert json.loads(calls[0][1]) == {"q": "Zürich", "n": 2} and calls[1][1] == "{}"
    assert hermes_calls('<tool_call>{"name": "f"}</tool_call>') == (None, [("f", "{}")])
    for plain in ["no call here", "<tool_call>{not json}</tool_call>", '<tool_call>["f"]</tool_call>',
                  '<tool_call>{"arguments": {}}</tool_call>']:
        assert hermes_calls(plain) is None, plain


def test_auto_answers_are_calls_only_when_whole_and_parsed():
    auto = ToolMode(None, "hermes")
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    msg, reason = tool_message(call, auto, "stop")
    assert reason == "tool_calls" and msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "f"
    assert tool_message(call, auto, "length") == ({"role": "assistant", "content": call}, "length")  # cut short
    assert tool_message("hello", auto, "stop") == ({"role": "assistant", "content": "hello"}, "stop")


def test_auto_needs_a_parser_and_is_not_streamed():
    assert tool_guide({"tools": TOOLS}, "hermes")[:2] == (ToolMode(None, "hermes"), None)  # no guide: the model's text
    assert tool_guide({"tools": TOOLS, "tool_choice": "none"}, None) == (None, None, TOOLS)
    for body, parser, param, fragment in [({"tools": TOOLS}, None, "tool_choice", "--tool-call-parser"),
                                          ({"tools": TOOLS, "tool_choice": "auto"}, None, "tool_choice", "parser"),
                                          ({"tools": TOOLS, "stream": True}, "hermes", "stream", "not streamed"),
                                          ({"tools": TOOLS, "guided_regex": "a"}, "hermes", "guided_regex", "not served")]:
        with pytest.raises(APIError) as e:
            tool_guide(body, parser)
        assert e.value.param == param and fragment in str(e.value), (body, e.value)
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        check_tool_parser("pythonic")
