"""OpenAI's Responses API (`POST /v1/responses`, as vLLM serves it), text and function calls, over the
chat route: a Responses body becomes a chat completion request (`chat_body`), and the chat answer a
`response` object, or, streamed, the Responses API's events (`response_events`).

Served: `input` (a string, or a list of messages: role user, system, developer (read as system) or
assistant, content a string or `input_text` / `output_text` parts), `instructions` (a system message
first), `max_output_tokens`, `temperature`, `top_p`, `stream`, `text.format` (`text`, `json_schema`,
`json_object`: guided as chat's `response_format`, a server with --guided-regex), `metadata` (echoed),
`user`, `store` (nothing is stored: there is no retrieval route) and the chat route's sampling fields
(vLLM's extensions: top_k, seed, stop, ...) and `chat_template_kwargs`. With --reasoning-parser the
thinking comes first as a `reasoning` output item. Function tools: `tools` of type "function" (name,
description, parameters, strict), `tool_choice` ("none", "auto", "required" or {"type": "function",
"name": ...}) and `parallel_tool_calls` become the chat route's (`serving.tool_calls`: guided calls on a
server with --guided-regex, "auto" read by --tool-call-parser); the calls come back as `function_call`
output items (after the message, when the answer has text too), streamed as the Responses API's
function-call events; `function_call` and `function_call_output` input items are the chat history's
assistant tool calls and tool results. Refused, naming the field (400): what needs state this server
does not keep or calls it does not make here: `previous_response_id`, `conversation`, `background`,
`prompt`, tools of other types (web search, files, ...), `max_tool_calls`, `reasoning`,
`top_logprobs`, `truncation` "auto", and other input item or content types. An answer cut by
`max_output_tokens` is "incomplete" (reason max_output_tokens; streamed, its last event is
`response.incomplete`, as OpenAI's).
"""
from __future__ import annotations

import itertools
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import pydantic

from specjax.serving.bodies import _Body
from specjax.serving.errors import APIError, parse_request
from specjax.serving.schema import SAMPLING_FIELDS

# fields that change the answer and that this server does not serve: the values meaning "off" pass
REFUSED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,), "conversation": (None,), "background": (None, False), "prompt": (None,),
    "reasoning": (None,), "top_logprobs": (None, 0), "truncation": (None, "disabled"), "max_tool_calls": (None,)}
_TOOL_FIELDS = ("name", "description", "parameters", "strict")
_PASSED = tuple(f for f in SAMPLING_FIELDS if f not in ("n", "response_format", "structured_outputs", "max_tokens"))
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")


class ResponsesRequest(_Body):
    """POST /v1/responses: OpenAI's Responses API, text in and out (see the module docstring)."""

    model: pydantic.StrictStr | None = None
    input: pydantic.StrictStr | list[dict[str, Any]]
    instructions: pydantic.StrictStr | None = None
    max_output_tokens: pydantic.StrictInt | None = pydantic.Field(None, description="at most this many output tokens")
    temperature: pydantic.StrictFloat | pydantic.StrictInt | None = None
    top_p: pydantic.StrictFloat | pydantic.StrictInt | None = None
    stream: pydantic.StrictBool | None = None
    text: dict[str, Any] | None = pydantic.Field(None, description='{"format": {"type": "text" | "json_schema" '
                                                                   '(with "schema") | "json_object"}}')
    metadata: dict[str, pydantic.StrictStr] | None = None
    user: pydantic.StrictStr | None = None
    store: pydantic.StrictBool | None = None
    tools: list[dict[str, Any]] | None = pydantic.Field(None, description='function tools: {"type": "function", '
                                                                         '"name", "parameters", ...}')
    tool_choice: pydantic.StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: pydantic.StrictBool | None = None


def chat_body(body: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """(the chat completion body a Responses body asks for, the system messages put before `input`'s);
    APIError 400 naming the Responses field."""
    for name, off in REFUSED.items():
        if body.get(name) not in off:
            raise APIError(400, f"'{name}' is not served by this server's /v1/responses (accepted: "
                                f"{', '.join('null' if o is None else repr(o) for o in off)})", param=name)
    messages = [] if body.get("instructions") is None else [{"role": "system", "content": body["instructions"]}]
    offset = len(messages)
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif not given:
        raise APIError(400, "'input' is empty", param="input")
    for i, item in enumerate(given if isinstance(given, list) else ()):
        messages.append(_message(i, item))
    out: dict[str, Any] = {k: body[k] for k in (*_PASSED, "model", "stream", "chat_template_kwargs", "user",
                                                "parallel_tool_calls") if body.get(k) is not None}
    out["messages"] = messages
    if body.get("tools"):
        out["tools"] = [_tool(i, t) for i, t in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"], [t["function"]["name"] for t in out.get("tools", ())])
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("stream"):
        out["stream_options"] = {"include_usage": True}
    fmt = _format(body)
    if fmt["type"] == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt["type"] == "json_object":
        out["response_format"] = {"type": "json_object"}
    return out, offset


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """The chat route's tool of a Responses `tools` entry (a function: its fields are not nested)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise APIError(400, f"'tools[{i}].type' must be \"function\" (tools of type {kind!r} are not served)",
                       param=f"tools[{i}].type")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(400, f"'tools[{i}].name' must be a non-empty string", param=f"tools[{i}].name")
    return {"type": "function", "function": {k: tool[k] for k in _TOOL_FIELDS if tool.get(k) is not None}}


def _tool_choice(choice: Any, names: list[str]) -> Any:
    """The chat route's `tool_choice` of a Responses one ({"type": "function", "name"} names one of the
    functions `names`)."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                "\"name\": ...}", param="tool_choice")
        if choice["name"] not in names:
            raise APIError(400, f"'tool_choice.name' must name a function in 'tools' ({', '.join(names) or 'none'}), "
                                f"got {choice['name']!r}", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # a string: the chat route checks it


def _call_message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    """The chat message of a `function_call` (an assistant's tool call) or `function_call_output` input item."""
    names = ("call_id", "name", "arguments") if item["type"] == "function_call" else ("call_id", "output")
    for name in names:
        if not isinstance(item.get(name), str):
            raise APIError(400, f"'input[{i}].{name}' must be a string", param=f"input[{i}].{name}")
    if item["type"] == "function_call_output":
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}]}


def _message(i: int, item: Any) -> dict[str, Any]:
    """A chat message of an `input` item."""
    if isinstance(item, dict) and item.get("type") in ("function_call", "function_call_output"):
        return _call_message(i, item)
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise APIError(400, f"'input[{i}]' must be a message, function_call or function_call_output (items of "
                            f"type {kind!r} are not served)",
                       param=f"input[{i}].type" if isinstance(item, dict) else f"input[{i}]")
    if item.get("role") not in _ROLES:
        raise APIError(400, f"'input[{i}].role' must be one of {sorted(_ROLES)}, got {item.get('role')!r}",
                       param=f"input[{i}].role")
    content = item.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)):
                raise APIError(400, f"'input[{i}].content[{j}]' must be a text part ({' or '.join(_TEXT_PARTS)} with "
                                    f"a string 'text'); other content is not served", param=f"input[{i}].content[{j}]")
        content = [{"type": "text", "text": part["text"]} for part in content]
    elif not isinstance(content, str):
        raise APIError(400, f"'input[{i}].content' must be a string or a list of text parts",
                       param=f"input[{i}].content")
    return {"role": _ROLES[item["role"]], "content": content}


def _format(body: dict[str, Any]) -> dict[str, Any]:
    text = body.get("text") or {}
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_schema", "json_object"):
        raise APIError(400, "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_schema\", \"schema\": ...} "
                            "or {\"type\": \"json_object\"}", param="text.format")
    if fmt["type"] == "json_schema" and not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "'text.format.schema' must be a JSON schema object", param="text.format.schema")
    return fmt


def responses_param(param: str | None, offset: int, string_input: bool) -> str | None:
    """The Responses field of a chat field an error names (messages[k] -> instructions or input[k - offset])."""
    if param is None:
        return None
    if param.startswith("messages"):
        rest = param[len("messages"):]
        if not rest.startswith("["):
            return "input"
        k, tail = int(rest[1:rest.index("]")]), rest[rest.index("]") + 1:]
        if k < offset:
            return "instructions"
        return "input" if string_input else f"input[{k - offset}]{tail}"
    for chat, ours in (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                       ("response_format", "text.format")):
        if param.startswith(chat):
            return ours + param[len(chat):]
    return param.replace(".function.", ".", 1) if param.startswith(("tools[", "tool_choice.")) else param


async def respond(api: Any, req: ResponsesRequest, is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                  ) -> tuple[dict[str, Any] | None, AsyncIterator[dict[str, Any]] | None, Callable[[], None]]:
    """`api.complete` (an `OpenAIApp`'s) for a Responses request: (the response object, None, abort) or
    (None, its stream events, abort); errors name the Responses field."""
    body = req.model_dump(exclude_unset=True)
    chat, offset = chat_body(body)
    try:
        result, chunks, abort = await api.complete(parse_request(chat, chat=True), is_disconnected=is_disconnected)
    except APIError as e:
        raise remapped(e, offset, isinstance(body["input"], str)) from None
    answer = Answer(body, body.get("model") or api.model_name, api.tokenizer)
    if chunks is None:
        return response_object(answer, result), None, abort
    return None, response_events(answer, chunks), abort


def remapped(e: APIError, offset: int, string_input: bool) -> APIError:
    """`e` naming the Responses field instead of the chat one."""
    param = responses_param(e.param, offset, string_input)
    message = e.message if e.param is None or param == e.param else e.message.replace(f"'{e.param}'", f"'{param}'")
    return APIError(e.status, message, param=param, type=e.type, code=e.code)


class Answer:
    """What a Responses answer carries besides its output: ids, the request's settings, the tokenizer
    that counts reasoning tokens."""

    def __init__(self, body: dict[str, Any], model: str, tokenizer: Any):
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.body, self.model, self.tokenizer = body, model, tokenizer
        self.message_id, self.reasoning_id = f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}"
        self.call_ids: list[str] = []  # the function_call items' ids, in call order

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 incomplete: str | None = None, spec_metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
               "incomplete_details": None if incomplete is None else {"reason": incomplete},
               "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
               "model": self.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
               "previous_response_id": None, "reasoning": None, "store": False,
               "temperature": b.get("temperature", 1.0), "text": {"format": _format(b)},
               "tool_choice": b.get("tool_choice", "auto" if b.get("tools") else "none"),
               "tools": b.get("tools") or [], "top_p": b.get("top_p", 1.0),
               "truncation": "disabled", "usage": usage, "user": b.get("user"), "metadata": b.get("metadata") or {}}
        if spec_metrics is not None:
            out["spec_metrics"] = spec_metrics
        return out

    def reasoning_item(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def message_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def call_item(self, k: int, call: dict[str, Any], status: str) -> dict[str, Any]:
        """The `function_call` output item of the answer's k-th call (a chat `tool_calls` entry)."""
        while len(self.call_ids) <= k:
            self.call_ids.append(f"fc_{uuid.uuid4().hex}")
        return {"type": "function_call", "id": self.call_ids[k], "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def usage(self, chat_usage: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
        cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        thinking = len(self.tokenizer(reasoning, add_special_tokens=False)["input_ids"]) if reasoning else 0
        return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": chat_usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": thinking}, "total_tokens": chat_usage["total_tokens"]}

    def finished(self, text: str, reasoning: str | None, finish_reason: str | None, chat_usage: dict[str, Any],
                 spec_metrics: dict[str, Any] | None, calls: list[dict[str, Any]] = ()) -> dict[str, Any]:
        """The whole `response` object of a finished answer: its reasoning, its message (unless the answer
        is calls only) and its function calls."""
        status = "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"
        output = [self.reasoning_item(reasoning)] if reasoning is not None else []
        if text or not calls:
            output.append(self.message_item(text, status))
        output += [self.call_item(k, c, "completed") for k, c in enumerate(calls)]
        return self.response(status, output, self.usage(chat_usage, reasoning),
                             None if status == "completed" else "max_output_tokens", spec_metrics)


def response_object(answer: Answer, chat: dict[str, Any]) -> dict[str, Any]:
    """The `response` object of a non-streamed chat completion."""
    choice = chat["choices"][0]
    message = choice["message"]
    return answer.finished(message.get("content") or "", message.get("reasoning"), choice["finish_reason"],
                           chat["usage"], chat.get("spec_metrics"), message.get("tool_calls") or [])


async def response_events(answer: Answer, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """The Responses API's stream events of a streamed chat completion's chunks: created, in_progress, the
    reasoning item's, the message's and each function call's added / delta / done events (an item closes
    when the next one opens), then completed (or incomplete)."""
    seq = itertools.count()

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(seq), **fields}

    yield event("response.created", response=answer.response("in_progress", [], None))
    yield event("response.in_progress", response=answer.response("in_progress", [], None))
    s = _StreamState()
    finish, usage, spec = None, None, None
    async for chunk in chunks:
        usage, spec = chunk.get("usage") or usage, chunk.get("spec_metrics") or spec
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            finish = choice.get("finish_reason") or finish
            if delta.get("reasoning"):
                if s.reasoning is None:
                    s.reasoning = []
                    yield event("response.output_item.added", output_index=0, item=answer.reasoning_item(""))
                s.reasoning.append(delta["reasoning"])
                yield event("response.reasoning_text.delta", item_id=answer.reasoning_id, output_index=0,
                            content_index=0, delta=delta["reasoning"])
            if delta.get("content"):
                if s.text is None:
                    for e in s.close(answer, event) + s.open_message(answer, event):
                        yield e
                s.text.append(delta["content"])
                yield event("response.output_text.delta", item_id=answer.message_id, output_index=s.index,
                            content_index=0, delta=delta["content"], logprobs=[])
            for piece in delta.get("tool_calls") or ():
                for e in s.call_piece(answer, piece, event):
                    yield e
    if s.text is None and not s.calls:
        for e in s.close(answer, event) + s.open_message(answer, event):
            yield e
    for e in s.close(answer, event, "completed" if finish in ("stop", "tool_calls") else "incomplete"):
        yield e
    final = answer.finished("".join(s.text or ()), None if s.reasoning is None else "".join(s.reasoning), finish,
                            usage, spec, s.calls)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)


class _StreamState:
    """A streamed answer's items so far: its reasoning and text pieces, its calls (chat `tool_calls`
    entries, arguments joined), and the item open now (`open`: "reasoning", "message", a call's index)."""

    def __init__(self) -> None:
        self.reasoning: list[str] | None = None
        self.text: list[str] | None = None
        self.calls: list[dict[str, Any]] = []
        self.open: str | int | None = None
        self.index = -1  # the open item's output_index

    def close(self, answer: Answer, event: Any, status: str = "completed") -> list[dict[str, Any]]:
        """The events that close the open item (the reasoning is open until anything else opens); `status`:
        a message's (one closed by a call that follows is complete)."""
        out = []
        if self.open is None and self.reasoning is not None and self.index < 0:
            whole = "".join(self.reasoning)
            out += [event("response.reasoning_text.done", item_id=answer.reasoning_id, output_index=0,
                          content_index=0, text=whole),
                    event("response.output_item.done", output_index=0, item=answer.reasoning_item(whole))]
            self.index = 0
        elif self.open == "message":
            whole = "".join(self.text or ())
            item = answer.message_item(whole, status)
            out += [event("response.output_text.done", item_id=answer.message_id, output_index=self.index,
                          content_index=0, text=whole, logprobs=[]),
                    event("response.content_part.done", item_id=answer.message_id, output_index=self.index,
                          content_index=0, part=item["content"][0]),
                    event("response.output_item.done", output_index=self.index, item=item)]
        elif isinstance(self.open, int):
            item = answer.call_item(self.open, self.calls[self.open], "completed")
            out += [event("response.function_call_arguments.done", item_id=item["id"], output_index=self.index,
                          arguments=item["arguments"]),
                    event("response.output_item.done", output_index=self.index, item=item)]
        self.open = None
        return out

    def open_message(self, answer: Answer, event: Any) -> list[dict[str, Any]]:
        """The events that open the message item (after `close`)."""
        self.text, self.open, self.index = [], "message", self.index + 1
        return [event("response.output_item.added", output_index=self.index,
                      item=answer.message_item("", "in_progress")),
                event("response.content_part.added", item_id=answer.message_id, output_index=self.index,
                      content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def call_piece(self, answer: Answer, piece: dict[str, Any], event: Any) -> list[dict[str, Any]]:
        """The events of one chat `tool_calls` delta: a new call opens its item, arguments are its deltas."""
        out, k, arguments = [], piece["index"], (piece.get("function") or {}).get("arguments")  # chat deltas name it
        if k >= len(self.calls):
            out += self.close(answer, event)
            self.calls.append({"id": piece.get("id") or f"call_{uuid.uuid4().hex}", "type": "function",
                               "function": {"name": piece["function"]["name"], "arguments": ""}})
            self.open, self.index = k, self.index + 1
            out.append(event("response.output_item.added", output_index=self.index,
                             item=answer.call_item(k, self.calls[k], "in_progress")))
        if arguments:
            self.calls[k]["function"]["arguments"] += arguments
            out.append(event("response.function_call_arguments.delta", item_id=answer.call_ids[k],
                             output_index=self.index, delta=arguments))
        return out


__all__ = ["Answer", "REFUSED", "ResponsesRequest", "chat_body", "remapped", "respond", "response_events",
           "response_object", "responses_param"]
