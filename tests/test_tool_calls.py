"""Tool calls read from the model's own format (`serving.tool_parsers`, a server's --tool-call-parser):
hermes blocks become OpenAI tool calls with the text outside them as content, and so do the JSON
objects a llama3_json answer begins with; text without a call, or a block that is not a call, stays text; an answer streamed in pieces, split anywhere, gives the same
calls and content as the whole answer, and a "required" answer its calls as their objects close;
"auto" without a parser and an unknown parser are refused naming what to set."""
import json

import pytest

from specjax.serving.errors import APIError
from specjax.serving.tool_calls import ToolMode, ToolStream, check_tool_parser, tool_guide, tool_message
from specjax.serving.tool_parsers import PARSERS, ListedCalls, read_calls

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
ANSWER = ('<think>ok</think>Let me look.\n<tool_call>\n{"name": "f", "arguments": {"q": "Zürich", "n": 2}}\n'
          '</tool_call>\n<tool_call>{"name": "g", "arguments": "{}"}</tool_call>\n')


def test_hermes_blocks_are_calls_and_the_text_outside_them_content():
    content, calls = read_calls("hermes", ANSWER)
    assert content == "<think>ok</think>Let me look." and [n for n, _ in calls] == ["f", "g"]
    assert json.loads(calls[0][1]) == {"q": "Zürich", "n": 2} and calls[1][1] == "{}"
    assert read_calls("hermes", '<tool_call>{"name": "f"}</tool_call>') == (None, [("f", "{}")])
    bad = '<tool_call>{not json}</tool_call>'
    assert read_calls("hermes", "a " + bad + ' <tool_call>{"name": "f"}</tool_call>') == ("a " + bad, [("f", "{}")])
    for plain in ["no call here", bad, '<tool_call>["f"]</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                  'unclosed <tool_call>{"name": "f"}', "a < b <tool_"]:
        assert read_calls("hermes", plain) == (plain.strip(), []), plain


LLAMA = ' {"name": "f", "parameters": {"q": "a;b}"}}; {"name": "g", "arguments": {}} ;{"x": 1}'


def test_llama3_json_answers_beginning_with_an_object_are_calls():
    assert read_calls("llama3_json", LLAMA) == ('{"x": 1}', [("f", '{"q": "a;b}"}'), ("g", "{}")])
    assert read_calls("llama3_json", 'Sure: {"name": "f", "parameters": {}}') == (
        'Sure: {"name": "f", "parameters": {}}', [])  # text first: content
    assert read_calls("llama3_json", '{"name": "f", "parameters": {') == ('{"name": "f", "parameters": {', [])


@pytest.mark.parametrize("parser, text", [("hermes", ANSWER), ("hermes", "plain text < with a <tool_ tail"),
                                          ("hermes", 'x<tool_call>{"name": "f"}'), ("llama3_json", LLAMA),
                                          ("llama3_json", "No call; {here}"), ("llama3_json", '{"name": "f"} tail')])
def test_streamed_in_pieces_split_anywhere_equals_the_whole_answer(parser, text):
    whole = read_calls(parser, text)
    for step in (1, 2, 3, 7):
        reader, content, calls = PARSERS[parser](), [], []
        pieces = [text[i:i + step] for i in range(0, len(text), step)] + [""]
        for i, piece in enumerate(pieces):
            c, found = reader.push(piece, final=i == len(pieces) - 1)
            content.append(c)
            calls += found
            if found:
                assert "<tool_call>" not in "".join(content)  # a block's text never leaks as content
        assert ("".join(content).strip() or None, calls) == whole, step


def test_a_required_answer_streamed_in_pieces_gives_its_calls_as_their_objects_close():
    text = '[\n  {"name": "f", "parameters": {"a": [1, {"b": "}]"}]}},\n  {"name": "g", "parameters": {}}\n]'
    whole = [(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
    assert ListedCalls().push(text, final=True) == ("", whole)
    ends = [text.index(',\n  {"name": "g"'), text.rindex("}") + 1]  # where each call's object closes
    for step in (1, 4):
        reader, calls = ListedCalls(), []
        for i in range(0, len(text), step):
            calls += reader.push(text[i:i + step])[1]
            assert len(calls) == sum(e <= i + step for e in ends), (step, i)  # each call as its object closes
        assert calls == whole, step
    stream = ToolStream(ToolMode(None))
    first, _ = stream.delta(text[:30], True, None)
    rest, reason = stream.delta(text[30:], False, "stop")
    assert first == {"role": "assistant", "content": None} and reason == "tool_calls"
    assert [c["index"] for c in rest["tool_calls"]] == [0, 1]


def test_auto_answers_are_calls_only_when_whole_and_parsed():
    auto = ToolMode(None, "hermes")
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    msg, reason = tool_message(call, auto, "stop")
    assert reason == "tool_calls" and msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "f"
    assert tool_message(call, auto, "length") == ({"role": "assistant", "content": call}, "length")  # cut short
    assert tool_message("hello", auto, "stop") == ({"role": "assistant", "content": "hello"}, "stop")


def test_streamed_auto_deltas_carry_the_content_then_each_call_with_its_index():
    stream = ToolStream(ToolMode(None, "hermes"))
    cut = ANSWER.index("Zürich")
    deltas = [stream.delta(piece, i == 0, "stop" if i == 2 else None) for i, piece in
              enumerate([ANSWER[:cut], ANSWER[cut:], ""])]
    assert deltas[0][0] == {"role": "assistant", "content": "<think>ok</think>Let me look.\n"}
    calls = [c for d, _ in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "f"), (1, "g")]
    assert len({c["id"] for c in calls}) == 2
    assert [r for _, r in deltas] == [None, None, "tool_calls"]
    assert ToolStream(ToolMode(None, "hermes")).delta("hi", True, "stop") == ({"role": "assistant", "content": "hi"},
                                                                             "stop")


def test_parallel_tool_calls_false_makes_one_call():
    mode, schema, _ = tool_guide({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, None)
    assert mode.single and (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert "maxItems" not in tool_guide({"tools": TOOLS, "tool_choice": "required"}, None)[1]  # the control
    auto = tool_guide({"tools": TOOLS, "parallel_tool_calls": False}, "hermes")[0]
    assert [c["function"]["name"] for c in tool_message(ANSWER, auto, "stop")[0]["tool_calls"]] == ["f"]
    assert [c["function"]["name"] for c in tool_message(ANSWER, ToolMode(None, "hermes"), "stop")[0]["tool_calls"]] == [
        "f", "g"]
    stream = ToolStream(auto)
    deltas = [stream.delta(ANSWER[i:i + 9], i == 0, "stop" if i + 9 >= len(ANSWER) else None)
              for i in range(0, len(ANSWER), 9)]
    assert [c["function"]["name"] for d, _ in deltas for c in d.get("tool_calls", [])] == ["f"]
    with pytest.raises(APIError) as e:
        tool_guide({"tools": TOOLS, "parallel_tool_calls": "no"}, "hermes")
    assert e.value.param == "parallel_tool_calls"


def test_auto_needs_a_parser():
    assert tool_guide({"tools": TOOLS}, "hermes")[:2] == (ToolMode(None, "hermes"), None)  # no guide: the model's text
    assert tool_guide({"tools": TOOLS, "stream": True}, "hermes")[0] == ToolMode(None, "hermes")
    assert tool_guide({"tools": TOOLS, "tool_choice": "none"}, None) == (None, None, TOOLS)
    for body, parser, param, fragment in [({"tools": TOOLS}, None, "tool_choice", "--tool-call-parser"),
                                          ({"tools": TOOLS, "tool_choice": "auto"}, None, "tool_choice", "parser"),
                                          ({"tools": TOOLS, "guided_regex": "a"}, "hermes", "guided_regex", "not served")]:
        with pytest.raises(APIError) as e:
            tool_guide(body, parser)
        assert e.value.param == param and fragment in str(e.value), (body, e.value)
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        check_tool_parser("pythonic")
