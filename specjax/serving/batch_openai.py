"""OpenAI's batch file format for the offline batch job (what `vllm run-batch` and OpenAI's Batch API read).

An input line that carries `custom_id` is an OpenAI batch request:
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}
    (url "/v1/completions": body {"prompt": ...}). The body takes the server's fields: the sampling
    fields, `max_completion_tokens` (chat), `logprobs` (chat: with `top_logprobs`; answered in OpenAI's
    `logprobs` object; at most the job's --max-logprobs), `model`, `stream`, `user`, `n` (that many choices, as
    the server's: choice j samples with seed + j when a seed is given), and on the chat url messages with
    text content parts, vLLM's `chat_template_kwargs` (`enable_thinking`), `add_generation_prompt` and
    `continue_final_message` (the prompt rendered as the server renders it), and
    `tools` / `tool_choice` as the server serves them (`serving.tool_calls`: a named function or
    "required" with --guided-regex, "auto" with --tool-call-parser); fields that change the output and
    are not served (`schema.UNSERVED_FIELDS`) make it an error row, other fields are ignored.
Its output line:
    {"id": "batch-...", "custom_id": "r1", "response": {"status_code": 200, "request_id": "...",
     "body": {a chat.completion or text_completion object with usage and spec_metrics}}, "error": null}
Bad rows go to the errors file like every other row; `field` names the offending field with its
path (`body.top_p`, `url`, `custom_id`).
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from specjax.api import GUIDES
from specjax.serving.errors import APIError
from specjax.serving.schema import SAMPLING_FIELDS, FieldError, check_served, guide_source
from specjax.serving.reasoning import chat_message
from specjax.serving.tool_calls import ToolMode, tool_guide

# url -> the body field that holds the prompt
OPENAI_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
_LINE_FIELDS = frozenset(("custom_id", "method", "url", "body"))
# chat bodies' fields that shape the prompt (vLLM's; `prompts.chat_prompt_ids` reads them as the server does)
TEMPLATE_FIELDS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")


class OpenAIRowError(ValueError):
    """A bad OpenAI batch line; `field` is the offending field's path in the line."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class OpenAIRequest:
    """What an OpenAI batch line's answer needs: its url (the response object's kind), model name, and
    the chat template's tools and how its answer becomes tool calls (`tool_calls.tool_guide`)."""

    url: str
    model: str
    tools: list[dict[str, Any]] | None = None
    tool_mode: ToolMode | None = None
    guide_sources: dict[str, str] = dataclasses.field(default_factory=dict)  # a guide -> the body field that set it
    reasoning: bool | None = None  # a chat line under --reasoning-parser: whether the answer starts thinking
    template: dict[str, Any] = dataclasses.field(default_factory=dict)  # the body's TEMPLATE_FIELDS (chat)


def is_openai_line(obj: Any) -> bool:
    return isinstance(obj, dict) and "custom_id" in obj


def native_row(obj: dict[str, Any], tool_parser: str | None = None) -> tuple[dict[str, Any], OpenAIRequest]:
    """The native row (`id`, `prompt` or `messages`, sampling fields) an OpenAI batch line asks for
    (`tool_parser`: the job's --tool-call-parser, which serves tool_choice "auto")."""
    unknown = sorted(set(obj) - _LINE_FIELDS)
    if unknown:
        raise OpenAIRowError(f"unknown field(s) {unknown} in an OpenAI batch line (allowed: "
                             f"{sorted(_LINE_FIELDS)})", unknown[0])
    url = obj.get("url")
    if url not in OPENAI_URLS:
        raise OpenAIRowError(f"'url' must be one of {sorted(OPENAI_URLS)}, got {url!r}", "url")
    if obj.get("method", "POST") != "POST":
        raise OpenAIRowError(f"'method' must be POST, got {obj.get('method')!r}", "method")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise OpenAIRowError(f"'body' must be a JSON object, got {type(body).__name__}", "body")
    chat = url == "/v1/chat/completions"
    try:
        check_served(body, tools=chat)
        mode, guide, tools = tool_guide(body, tool_parser) if chat else (None, None, None)
    except FieldError as e:
        raise OpenAIRowError(str(e), f"body.{e.field}") from None
    except APIError as e:
        raise OpenAIRowError(e.message, f"body.{e.param}") from None
    key = OPENAI_URLS[url]
    other = "prompt" if key == "messages" else "messages"
    if body.get(other) is not None:
        raise OpenAIRowError(f"{url} reads '{key}', not '{other}'", f"body.{other}")
    row = {k: body[k] for k in SAMPLING_FIELDS if k in body} | _logprobs_asked(body, chat)
    if key == "messages" and body.get("max_completion_tokens") is not None:
        row["max_tokens"] = body["max_completion_tokens"]
    row.update({"id": obj["custom_id"], key: body.get(key)}, **({"guided_json": guide} if guide else {}))
    model = body.get("model")
    return row, OpenAIRequest(url, model if isinstance(model, str) and model else "specjax", tools, mode,
                              {g: guide_source(body, g) for g in GUIDES},
                              template={k: body[k] for k in TEMPLATE_FIELDS if chat and body.get(k) is not None})


def _logprobs_asked(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The native row's `logprobs` (top alternatives per token) a body asks for: chat's `logprobs` true
    with `top_logprobs` (0 by default), completions' `logprobs` k; echo and prompt_logprobs, which score
    the prompt, are refused naming them."""
    for name in ("echo", "prompt_logprobs"):
        if body.get(name) not in (None, False):
            raise OpenAIRowError(f"'{name}' is not served in batch lines (it scores the prompt: use the server)",
                                 f"body.{name}")
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if lp not in (None, True, False):
            raise OpenAIRowError(f"'logprobs' must be true or false, got {lp!r}", "body.logprobs")
        if top is not None and not lp:
            raise OpenAIRowError("'top_logprobs' needs 'logprobs': true", "body.top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
            raise OpenAIRowError(f"'top_logprobs' must be an integer >= 0, got {top!r}", "body.top_logprobs")
        return {"logprobs": 0 if top is None else top} if lp else {}
    return {} if lp is None else {"logprobs": lp}


def native_field(field: str | None) -> str | None:
    """A native row's field as its path in the OpenAI batch line."""
    return None if field is None else "custom_id" if field == "id" else f"body.{field}"


@dataclasses.dataclass(frozen=True)
class Answer:
    """One finished choice of a batch line."""

    text: str | None
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: dict[str, Any] | None = None  # OpenAI's logprobs object (`logprob_blocks.logprobs_block`)


def output_line(custom_id: Any, req: OpenAIRequest, answers: list[Answer], usage: dict[str, Any],
                spec_metrics: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI batch output line of a finished line: one choice per answer, in `n` order (`usage`:
    `request_metrics.usage`'s over all of them)."""
    chat = req.url == "/v1/chat/completions"
    kind, prefix = ("chat.completion", "chatcmpl") if chat else ("text_completion", "cmpl")
    choices = []
    for i, a in enumerate(answers):
        finish_reason = a.finish_reason
        if chat:  # chat rows have a tokenizer
            message, finish_reason = chat_message(a.text, req.tool_mode, req.reasoning, finish_reason)
            choice: dict[str, Any] = {"index": i, "message": message}
        else:
            choice = {"index": i, "text": a.text}
        choice.update(finish_reason=finish_reason, stop_reason=a.stop_reason, token_ids=a.token_ids,
                      logprobs=a.logprobs)
        choices.append(choice)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    body = {"id": request_id, "object": kind, "created": int(time.time()), "model": req.model, "choices": choices,
            "usage": usage, "spec_metrics": spec_metrics}
    return {"id": f"batch-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


__all__ = ["OPENAI_URLS", "Answer", "OpenAIRequest", "OpenAIRowError", "is_openai_line", "native_field", "native_row",
           "output_line"]
