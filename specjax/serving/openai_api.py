"""OpenAI-compatible request handling, independent of the HTTP stack (see `http_server` for routes).

`OpenAIApp` validates a request body (errors are `APIError`: OpenAI-style JSON naming the field),
submits it to the continuous-batching `AsyncEngine`, and answers a response body or, for
`"stream": true`, an async iterator of chunks. Every response carries OpenAI's `usage` and a
`spec_metrics` block (mean_acceptance_length, num_drafts, num_draft_tokens, num_accepted_tokens,
accepted_per_pos) for that request; choices also carry `token_ids`. Streamed text is detokenized
incrementally (`specjax.serving.detokenize`), linear in the output's length.

Status codes: 400 bad or unsupported fields, prompts or max_tokens over the limits; 404 unknown
model; 503 when the engine's waiting queue is full or the engine is not running; 504 when a request
does not finish within `request_timeout_s`.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from specjax.api import SamplingParams, build_engine_request, encode_chat, encode_text
from specjax.serving.detokenize import StreamDetokenizer
from specjax.serving.metrics import ServingMetrics, request_spec_metrics
from specjax.serving.async_engine import AsyncEngine, QueueFullError, RequestError, RequestStream, StreamEvent
from specjax.serving.schema import SAMPLING_FIELDS, FieldError, parse_sampling

_FROM_LLM = object()  # sentinel: use the LLM's own tokenizer
DEFAULT_MAX_WAITING = 512


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Request limits. None: derived from the engine (max_model_len - 1); max_waiting None: unbounded."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    request_timeout_s: float = 600.0
    max_waiting: int | None = DEFAULT_MAX_WAITING

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for name in ("max_prompt_tokens", "max_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {v}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {self.max_waiting}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


class APIError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client disconnected while its request was running (the request was aborted)."""


class _Waiter:
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
_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
                "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None,
                "tool_choice": None, "functions": None, "use_beam_search": False}
_POLL_S = 1.0  # how often a waiting non-streamed request checks whether its client is still there


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass
class _Parsed:
    prompt_ids: list[int]
    sp: SamplingParams
    stream: bool
    include_usage: bool


class OpenAIApp:
    """Request handling for the HTTP server, independent of sockets (see module docstring).

    engine: a started `AsyncEngine`; tokenizer: for string prompts, chat and stop strings (None:
    token-id prompts only); max_model_len / vocab_size: the engine's context length and vocabulary.
    """

    def __init__(self, engine: AsyncEngine, *, model_name: str, max_model_len: int, vocab_size: int,
                 tokenizer: Any = None, limits: ServerLimits | None = None, metrics: ServingMetrics | None = None):
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = int(max_model_len)
        self.vocab_size = int(vocab_size)
        self.tokenizer = tokenizer
        self.limits = limits or ServerLimits()
        self.metrics = metrics if metrics is not None else engine.metrics
        self.max_prompt_tokens = min(self.limits.max_prompt_tokens or self.max_model_len - 1, self.max_model_len - 1)
        self.max_tokens = min(self.limits.max_tokens or self.max_model_len - 1, self.max_model_len - 1)
        self.created = int(time.time())

    @classmethod
    def from_llm(cls, llm: Any, *, model_name: str = "specjax", limits: ServerLimits | None = None,
                 tokenizer: Any = _FROM_LLM) -> "OpenAIApp":
        """Metrics + a started `AsyncEngine` over `llm.engine` + the app (tokenizer: the LLM's by default)."""
        limits = limits or ServerLimits()
        eng = llm.engine
        metrics = ServingMetrics(model_name=model_name, gamma=eng.gamma, max_tokens_bucket=eng.buckets.tokens[-1],
                                 max_slots=eng.cfg.max_slots)
        async_engine = AsyncEngine(eng, metrics=metrics, max_waiting=limits.max_waiting).start()
        return cls(async_engine, model_name=model_name, max_model_len=eng.cfg.max_len,
                   vocab_size=llm.config.vocab_size, tokenizer=llm.tokenizer if tokenizer is _FROM_LLM else tokenizer,
                   limits=limits, metrics=metrics)

    # ------------------------------------------------------------------ parsing
    def _parse_common(self, body: Any, *, chat: bool) -> _Parsed:
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist (served: '{self.model_name}')", param="model",
                           code="model_not_found")
        for name, default in _UNSUPPORTED.items():
            v = body.get(name, default)
            if v is not None and v != default and not (name == "logprobs" and v is False):
                raise APIError(400, f"'{name}' is not supported by this server", param=name)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, f"'stream' must be a boolean, got {stream!r}", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise APIError(400, "'stream_options' must be an object", param="stream_options")
        include_usage = bool(opts.get("include_usage", False))
        if chat:
            prompt_ids, what = self._chat_prompt(body), "messages"
        else:
            prompt_ids, what = self._completion_prompt(body), "prompt"
        n = len(prompt_ids)
        if n > self.max_prompt_tokens:
            raise APIError(400, f"'{what}' has {n} tokens; the limit is {self.max_prompt_tokens} "
                                f"(max_model_len {self.max_model_len})", param=what, code="context_length_exceeded")
        fields = {k: body[k] for k in SAMPLING_FIELDS if k in body}
        mt_name = "max_tokens"
        if chat and body.get("max_completion_tokens") is not None:
            mt_name, fields["max_tokens"] = "max_completion_tokens", body["max_completion_tokens"]
        default_mt = min(self.max_tokens, self.max_model_len - n) if chat else 16
        try:
            sp = parse_sampling(fields, SamplingParams(max_tokens=max(default_mt, 1)),
                                has_tokenizer=self.tokenizer is not None)
        except FieldError as e:
            if e.field == "max_tokens" and mt_name != "max_tokens":
                raise APIError(400, str(e).replace("'max_tokens'", f"'{mt_name}'"), param=mt_name) from None
            raise APIError(400, str(e), param=e.field) from None
        mt = sp.max_tokens
        if mt > self.max_tokens:
            raise APIError(400, f"'{mt_name}' is {mt}; the limit is {self.max_tokens}", param=mt_name)
        if n + mt > self.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the request "
                                f"asks for {n + mt} ({n} in the {what}, {mt} in the completion): lower '{mt_name}'",
                           param=mt_name, code="context_length_exceeded")
        return _Parsed(prompt_ids, sp, stream, include_usage)

    def _completion_prompt(self, body: dict[str, Any]) -> list[int]:
        if "prompt" not in body:
            raise APIError(400, "missing field 'prompt'", param="prompt")
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send 'prompt' as a list of token ids", param="prompt")
            if not p:
                raise APIError(400, "'prompt' is empty", param="prompt")
            return encode_text(self.tokenizer, p)
        if isinstance(p, list) and p and all(_is_int(t) for t in p):
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"'prompt' token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               param="prompt")
            return list(p)
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
        raise APIError(400, "'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt")

    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        msgs = body.get("messages")
        if msgs is None:
            raise APIError(400, "missing field 'messages'", param="messages")
        if self.tokenizer is None:
            raise APIError(400, "chat completions need a tokenizer with a chat template; this model has no "
                                "tokenizer (use /v1/completions with token ids)", param="messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "the tokenizer has no chat template; use /v1/completions", param="messages")
        think = body.get("chat_template_kwargs", {}) or {}
        if not isinstance(think, dict):
            raise APIError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        try:
            return encode_chat(self.tokenizer, msgs, enable_thinking=think.get("enable_thinking", False))
        except (ValueError, TypeError, KeyError) as e:
            raise APIError(400, f"'messages': {e}", param="messages") from None
        except Exception as e:  # template rendering errors (jinja) are the request's fault too
            raise APIError(400, f"'messages' could not be rendered by the chat template: {e}",
                           param="messages") from None

    # ------------------------------------------------------------------ generation
    def _submit(self, parsed: _Parsed, rid: str) -> RequestStream:
        try:
            req = build_engine_request(parsed.prompt_ids, parsed.sp, request_id=rid, tokenizer=self.tokenizer)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        holdback = max((len(s) for s in parsed.sp.stop or ()), default=0)
        try:
            return self.engine.submit(req, holdback_tokens=holdback)
        except QueueFullError as e:
            raise APIError(503, str(e), type="server_overloaded", code="queue_full") from None
        except RequestError as e:
            raise APIError(503, str(e), type="service_unavailable") from None

    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def _usage(self, parsed: _Parsed, n_out: int) -> dict[str, int]:
        n = len(parsed.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": n_out, "total_tokens": n + n_out}

    def _failed(self, ev: StreamEvent) -> APIError:
        if ev.rejected:
            return APIError(400, ev.error or "rejected")
        return APIError(503 if not self.engine.is_alive else 500, ev.error or "failed", type="server_error")

    async def complete(self, body: Any, *, chat: bool,
                       is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                       ) -> tuple[dict[str, Any] | None, AsyncIterator[dict[str, Any]] | None, Callable[[], None]]:
        """Parse, submit, and return (json body, None, abort) or (None, chunk iterator, abort).

        Must run on an event loop. is_disconnected: polled while a non-streamed request waits (a
        gone client's request is aborted: `ClientGone`). The caller of a chunk iterator calls
        `abort` when it stops reading early (a no-op once the request has ended)."""
        parsed = self._parse_common(body, chat=chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        stream = self._submit(parsed, rid)
        abort = lambda: self.engine.abort(stream)  # noqa: E731
        waiter = _Waiter(self.engine, stream, self.limits.request_timeout_s, is_disconnected)
        try:
            first = await waiter.next()
            if first.error is not None:  # the first event decides between an error and a 200 answer
                raise self._failed(first)
            if parsed.stream:
                detok = StreamDetokenizer(self.tokenizer) if self.tokenizer is not None else None
                waiter.is_disconnected = None  # the HTTP layer notices a gone stream reader itself
                return None, self._chunks(parsed, stream, rid, chat, first, waiter, detok), abort
            ev = first
            while not ev.finished:
                ev = await waiter.next()
            if ev.error is not None:
                raise self._failed(ev)
        except BaseException:
            abort()
            raise
        req = stream.request
        ids = list(req.output_ids)
        choice: dict[str, Any] = {"index": 0, "finish_reason": req.finish_reason, "token_ids": ids, "logprobs": None}
        text = self._decode(ids)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": self._usage(parsed, len(ids)),
                "spec_metrics": request_spec_metrics(req.metrics)}, None, abort

    async def _chunks(self, parsed: _Parsed, stream: RequestStream, rid: str, chat: bool, ev: StreamEvent,
                      waiter: _Waiter, detok: StreamDetokenizer | None) -> AsyncIterator[dict[str, Any]]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, ids: list[int], finish: str | None, first: bool = False) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": ids, "logprobs": None}
            if chat:
                c["delta"] = ({"role": "assistant", "content": text} if first else
                              ({"content": text} if text or finish is None else {}))
            else:
                c["text"] = text
            return {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [c]}

        sent_ids: list[int] = []
        sent_text: list[str] = []
        first = True
        while True:
            if ev.error is not None:
                yield APIError(500, ev.error, type="server_error").body()
                return
            if ev.finished:
                final_ids = list(ev.output_ids or [])
                new_ids = final_ids[len(sent_ids):] if final_ids[:len(sent_ids)] == sent_ids else []
                # the rest of the text: one full decode at the end (linear), which also renders a
                # trailing incomplete character the way the non-streamed answer does
                full, before = self._decode(final_ids), "".join(sent_text)
                text = full[len(before):] if full.startswith(before) else ""
                out = chunk(text, new_ids, ev.finish_reason, first)
                out["usage"] = self._usage(parsed, len(final_ids))
                out["spec_metrics"] = request_spec_metrics(stream.request.metrics)
                yield out
                if parsed.include_usage:
                    yield {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                           "usage": out["usage"], "spec_metrics": out["spec_metrics"]}
                return
            sent_ids += ev.token_ids
            text = detok.push(ev.token_ids) if detok is not None else ""
            sent_text.append(text)
            yield chunk(text, list(ev.token_ids), None, first)
            first = False
            try:
                ev = await waiter.next()
            except APIError as e:  # timed out mid-stream (the request was aborted)
                yield e.body()
                return

    # ------------------------------------------------------------------ other endpoints
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specjax", "max_model_len": self.max_model_len}]}

    def health(self) -> tuple[int, dict[str, Any]]:
        if self.engine.is_alive:
            return 200, {"status": "ok"}
        return 503, {"status": "error", "error": self.engine.error or "engine not running"}
