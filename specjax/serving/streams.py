"""Waiting on and streaming one engine request for the OpenAI handlers: `Waiter` (deadline, client
gone), `ChoiceStream` (one choice's deltas: incremental text, token ids, log-probabilities)."""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from specjax.serving.async_engine import AsyncEngine, RequestStream, StreamEvent
from specjax.serving.detokenize import StreamDetokenizer
from specjax.serving.errors import APIError
from specjax.serving.reasoning import ReasoningStream, reasoning_fields
from specjax.serving.tool_calls import ToolStream

_POLL_S = 1.0  # how often a waiting non-streamed request checks whether its client is still there


class ClientGone(Exception):
    """The client disconnected while its request was running (the request was aborted)."""


class Waiter:
    """Awaits one request's events under its deadline (504 and abort after it); with `is_disconnected`,
    also asks every `_POLL_S` seconds whether the client is still there (abort and `ClientGone` if not)."""

    def __init__(self, engine: AsyncEngine, stream: RequestStream, timeout_s: float,
                 is_disconnected: Callable[[], Awaitable[bool]] | None):
        self.engine, self.stream, self.timeout_s, self.is_disconnected = engine, stream, timeout_s, is_disconnected
        now = time.monotonic()
        self.deadline, self.poll_at = now + timeout_s, now + _POLL_S

    async def next(self) -> StreamEvent:
        while True:
            now = time.monotonic()
            left = self.deadline - now
            if left <= 0:
                self.engine.abort(self.stream)
                raise APIError(504, f"the request did not finish within {self.timeout_s} s", type="timeout")
            if self.is_disconnected is not None and now >= self.poll_at:
                self.poll_at = now + _POLL_S
                if await self.is_disconnected():
                    self.engine.abort(self.stream)
                    raise ClientGone()
            wait = left if self.is_disconnected is None else min(left, max(self.poll_at - now, 1e-3))
            try:
                return await self.stream.aget(timeout=wait)
            except TimeoutError:
                continue


# fields we do not implement: a non-default value is refused rather than silently ignored


class ChoiceStream:
    """One choice's streamed deltas: incremental text and token ids (a chat answer under a reasoning
    parser: its thinking as `reasoning`, `reasoning.ReasoningStream`; under a tool mode: its calls,
    `tool_calls.ToolStream`); the final chunk completes the text."""

    def __init__(self, app: Any, index: int, stream: RequestStream, chat: bool):
        self.app, self.index, self.stream, self.chat = app, index, stream, chat
        self.detok = StreamDetokenizer(app.tokenizer) if app.tokenizer is not None else None
        self.sent_ids: list[int] = []
        self.sent_text: list[str] = []
        self.token_chars = 0  # completions' `text_offset` of the next token
        self.first = True
        self.tools: ToolStream | None = None  # a chat answer's tool calls, once the first chunk is made
        self.reasoning: ReasoningStream | None = None  # a chat answer's thinking, once the first chunk is made

    def chunk(self, ev: StreamEvent, parsed: Any) -> dict[str, Any]:
        start = len(self.sent_ids)
        if ev.finished:
            final_ids = list(ev.output_ids or [])
            sent = self.sent_ids
            ids = final_ids[len(sent):] if final_ids[:len(sent)] == sent else []
            # the rest of the text: one full decode at the end (linear), which also renders a
            # trailing incomplete character the way the non-streamed answer does
            full, before = self.app._text(self.stream.request), "".join(self.sent_text)
            text = full[len(before):] if full.startswith(before) else ""
        else:
            ids = list(ev.token_ids)
            self.sent_ids += ids
            text = self.detok.push(ids) if self.detok is not None else ""
            self.sent_text.append(text)
        finish = ev.finish_reason if ev.finished else None
        logprobs = self.app._logprobs_block(parsed, self.stream.request, start, start + len(ids), self.chat,
                                            self.token_chars)
        if logprobs is not None and not self.chat:
            self.token_chars += sum(len(t) for t in logprobs["tokens"])
        c: dict[str, Any] = {"index": self.index, "finish_reason": finish, "token_ids": ids, "logprobs": logprobs}
        if ev.finished:
            c["stop_reason"] = self.stream.request.stop_reason  # vLLM's, on the choice's last chunk
        tools, thinking = getattr(parsed, "tools", None), None
        if self.chat and getattr(parsed, "reasoning", None) is not None:  # the thinking apart from the content
            self.reasoning = self.reasoning or ReasoningStream(parsed.reasoning)
            thinking, text = self.reasoning.push(text, final=ev.finished)
        if self.chat and tools is not None:  # tool calls (tool_calls.ToolStream)
            self.tools = self.tools or ToolStream(tools)
            c["delta"], c["finish_reason"] = self.tools.delta(text, self.first, finish)
        elif self.chat:
            c["delta"] = ({"role": "assistant", "content": text} if self.first else
                          ({"content": text} if text or finish is None else {}))
        else:
            c["text"] = text
        if thinking:
            if not text and not c["delta"].get("tool_calls"):
                c["delta"].pop("content", None)
            c["delta"].update(reasoning_fields(thinking))
        self.first = False
        return c
