"""OpenAI tool calling on the chat route: calls guided by the tools' schemas (guided_json, a server with
--guided-regex), or parsed from the model's own format (`--tool-call-parser`).

A named `tool_choice` ({"type": "function", "function": {"name": ...}}) makes the answer that
function's arguments: JSON of its `parameters` schema, returned as one `tool_calls` entry. "required"
makes the answer a JSON array of one or more {"name", "parameters"} objects, each a listed function
with its schema, returned as that many entries. "none" answers as without tools. "auto" (OpenAI's
default when tools are given) lets the model answer text or calls in its own format, which a server
started with `--tool-call-parser NAME` (`PARSERS`) reads from the finished answer (without one, "auto"
is refused naming `tool_choice`). `parallel_tool_calls` false: "required" answers exactly one call
(guided), "auto" keeps the first. The tools are passed to the chat template. A named function's call
streams as OpenAI's do (the first delta names the call, the next ones carry pieces of its arguments,
the last chunk's finish_reason is "tool_calls"), an "auto" answer as its content and each call once it
has closed, a "required" one as each call once its object has closed.
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Mapping

from specjax.api import GUIDES
from specjax.serving.errors import APIError
from specjax.serving.tool_parsers import PARSERS, ListedCalls, read_calls

ANY_PARAMETERS = {"type": "object"}  # a function listed without a `parameters` schema


def check_tool_parser(name: str | None) -> str | None:
    """`name` if it is None or one of PARSERS, else ValueError naming --tool-call-parser."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {sorted(PARSERS)}, got {name!r}")
    return name


@dataclasses.dataclass(frozen=True)
class ToolMode:
    """How a chat request's answer becomes tool calls: one named function's arguments, a list of
    calls ("required"), or the model's own format read by a parser ("auto")."""

    function: str | None  # the named function; None: a list of calls
    parser: str | None = None  # "auto": the PARSERS entry that reads the answer
    single: bool = False  # OpenAI's parallel_tool_calls false: at most one call ("auto" keeps the first)


def tool_guide(body: Mapping[str, Any], parser: str | None = None
               ) -> tuple[ToolMode | None, dict[str, Any] | None, list[dict] | None]:
    """(mode, the guided_json schema of the answer or None, the tools for the chat template) of a chat
    body's `tools` / `tool_choice` (`parser`: the server's PARSERS name, which serves "auto"); (None,
    None, None) without tools. APIError 400 naming the field of what is not served."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None, None, None
    functions = _functions(tools)
    if choice == "none":
        return None, None, list(tools)
    for guide in (*GUIDES, "response_format", "structured_outputs"):
        if body.get(guide) is not None:
            raise APIError(400, f"'{guide}' is not served with tools (tool calls guide or parse the answer)",
                           param=guide)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise APIError(400, f"'parallel_tool_calls' must be true or false, got {parallel!r}",
                       param="parallel_tool_calls")
    single = parallel is False
    if choice in (None, "auto"):
        if parser is None:
            raise APIError(400, "'tool_choice' \"auto\" (the default with tools) needs a parser of the model's "
                                "tool-call format (a server started with --tool-call-parser): name a function or use "
                                "\"required\"", param="tool_choice")
        return ToolMode(None, parser, single), None, list(tools)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": params},
                  "required": ["name", "parameters"]} for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, **({"maxItems": 1} if single else {}), "items": {"anyOf": calls}}
        return ToolMode(None, None, single), schema, list(tools)
    name = ((choice or {}).get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in functions:
        raise APIError(400, f"'tool_choice' must be \"none\", \"required\" or {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": one of {sorted(functions)}}}}}, got {choice!r}", param="tool_choice")
    return ToolMode(name), functions[name], list(tools)


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """Name -> parameters schema of `tools` (OpenAI's list of {"type": "function", "function": ...})."""
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools if isinstance(tools, list) else [None]):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param=f"tools[{i}]")
        params = f.get("parameters", ANY_PARAMETERS)
        if not isinstance(params, dict):
            raise APIError(400, f"'tools[{i}].function.parameters' must be a JSON schema object",
                           param=f"tools[{i}].function.parameters")
        out[f["name"]] = params
    return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolStream:
    """One streamed chat choice's deltas under a tool mode: a named function's call (the first delta
    names it, the next carry pieces of its arguments), with "auto" the parser's content and each call
    once it has closed (whole, with its index), with "required" each call once its object has closed.
    The last chunk's finish_reason is "tool_calls" when the answer ended whole with calls; cut short,
    the engine's reason."""

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.reader = PARSERS[mode.parser]() if mode.parser is not None else \
            (ListedCalls() if mode.function is None else None)
        self.calls = 1 if self.reader is None else 0  # calls sent (a named function's is its only one)
        self.id = call_id()

    def delta(self, text: str, first: bool, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the delta of the answer's next piece `text`, its chunk's finish reason)."""
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if self.reader is None:
            if first:
                delta.update(content=None, tool_calls=[{"index": 0, "id": self.id, "type": "function", "function": {
                    "name": self.mode.function, "arguments": text}}])
            elif text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
        else:
            content, calls = self.reader.push(text, final=finish_reason is not None)
            calls = calls[:max(0, 1 - self.calls)] if self.mode.single else calls
            if content or first:
                delta["content"] = content if content or self.mode.parser is not None else None
            if calls:
                delta["tool_calls"] = [{"index": self.calls + i, "id": call_id(), "type": "function",
                                        "function": {"name": name, "arguments": args}}
                                       for i, (name, args) in enumerate(calls)]
                self.calls += len(calls)
        return delta, "tool_calls" if finish_reason == "stop" and self.calls else finish_reason


def tool_message(text: str, mode: ToolMode | None, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, the finish reason) of an answer under `mode`: its tool calls and
    "tool_calls" when it ended whole (with "auto", the text outside them as content, and only when the
    parser found calls); its text as content (and the engine's reason) when cut short, or without a mode."""
    if mode is None or finish_reason != "stop":
        return {"role": "assistant", "content": text}, finish_reason
    content = None
    if mode.parser is not None:
        content, calls = read_calls(mode.parser, text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        calls = calls[:1] if mode.single else calls
    elif mode.function is not None:
        calls = [(mode.function, text)]
    else:
        calls = ListedCalls().push(text, final=True)[1]
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": call_id(), "type": "function",
                            "function": {"name": name, "arguments": args}} for name, args in calls]}, "tool_calls"
