"""An OpenAI-compatible HTTP server on the standard library (`http.server.ThreadingHTTPServer`).

Endpoints:
    POST /v1/completions        prompt: a string (needs a tokenizer) or a list of token ids
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /v1/models             the one served model
    GET  /health                200 while the engine loop runs, else 503
    GET  /metrics               Prometheus text (see specjax.metrics); /metrics.json: JSON snapshot

`"stream": true` answers with Server-Sent Events: `data: {json}\\n\\n` chunks, the last one carrying
`finish_reason`, `usage` and `spec_metrics`, then `data: [DONE]\\n\\n`. Every response carries OpenAI's
`usage` and a `spec_metrics` block (mean_acceptance_length, num_drafts, num_draft_tokens,
num_accepted_tokens, accepted_per_pos) for that request; choices also carry `token_ids`.

Errors are JSON `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON, bad or
unsupported fields, prompts longer than the limit and max_tokens over the limit; 413 for a body
over `max_body_bytes`; 404 for unknown paths or models. Requests are served from threads; one
background thread owns the engine (`AsyncEngine`), so requests batch continuously.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from specjax.api import SamplingParams, build_engine_request, encode_chat, encode_text
from specjax.metrics import CONTENT_TYPE, ServingMetrics, request_spec_metrics
from specjax.serving.async_engine import AsyncEngine, RequestError, RequestStream, StreamEvent

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
_FROM_LLM = object()  # sentinel: use the LLM's own tokenizer


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Request limits. None: derived from the engine (max_model_len - 1)."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for name in ("max_prompt_tokens", "max_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {v}")
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


# fields we do not implement: a non-default value is refused rather than silently ignored
_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
                "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None,
                "tool_choice": None, "functions": None, "use_beam_search": False}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "num_speculative_tokens")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
        eng = llm.engine
        metrics = ServingMetrics(model_name=model_name, gamma=eng.gamma, max_tokens_bucket=eng.buckets.tokens[-1],
                                 max_slots=eng.cfg.max_slots)
        async_engine = AsyncEngine(eng, metrics=metrics).start()
        return cls(async_engine, model_name=model_name, max_model_len=eng.cfg.max_len,
                   vocab_size=llm.config.vocab_size, tokenizer=llm.tokenizer if tokenizer is _FROM_LLM else tokenizer,
                   limits=limits, metrics=metrics)

    # ------------------------------------------------------------------ parsing
    def _parse_sampling(self, body: dict[str, Any], max_tokens: int) -> SamplingParams:
        kw: dict[str, Any] = {}
        for name in _SAMPLING_FIELDS:
            v = body.get(name)
            if v is None:
                continue
            if name in ("temperature", "top_p") and not _is_num(v):
                raise APIError(400, f"'{name}' must be a number, got {v!r}", param=name)
            if name in ("top_k", "seed", "num_speculative_tokens") and not _is_int(v):
                raise APIError(400, f"'{name}' must be an integer, got {v!r}", param=name)
            if name == "top_k" and v == -1:
                v = 0  # vLLM's "off"
            if name == "stop":
                if isinstance(v, str):
                    v = [v]
                if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
                    raise APIError(400, "'stop' must be a string or a list of strings", param=name)
                if v and self.tokenizer is None:
                    raise APIError(400, "'stop' strings need a tokenizer; this model has none "
                                        "(use 'stop_token_ids')", param=name)
                v = tuple(v)
            if name == "stop_token_ids":
                if not isinstance(v, list) or not all(_is_int(t) for t in v):
                    raise APIError(400, "'stop_token_ids' must be a list of integers", param=name)
                v = tuple(v)
            try:  # each field alone, so that the error names it
                SamplingParams(**{name: v})
            except (ValueError, TypeError) as e:
                raise APIError(400, f"'{name}': {e}", param=name) from None
            kw[name] = v
        try:
            return SamplingParams(max_tokens=max_tokens, **kw)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None

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
        mt_name = "max_tokens"
        mt = body.get("max_tokens")
        if chat and body.get("max_completion_tokens") is not None:
            mt_name, mt = "max_completion_tokens", body["max_completion_tokens"]
        room = self.max_model_len - n
        if mt is None:
            mt = 16 if not chat else min(self.max_tokens, room)
        if not _is_int(mt) or mt < 1:
            raise APIError(400, f"'{mt_name}' must be a positive integer, got {mt!r}", param=mt_name)
        if mt > self.max_tokens:
            raise APIError(400, f"'{mt_name}' is {mt}; the limit is {self.max_tokens}", param=mt_name)
        if n + mt > self.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the request "
                                f"asks for {n + mt} ({n} in the {what}, {mt} in the completion): lower '{mt_name}'",
                           param=mt_name, code="context_length_exceeded")
        sp = self._parse_sampling(body, mt)
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
        except RequestError as e:
            raise APIError(503, str(e), type="service_unavailable") from None

    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def _usage(self, parsed: _Parsed, n_out: int) -> dict[str, int]:
        n = len(parsed.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": n_out, "total_tokens": n + n_out}

    def _wait(self, stream: RequestStream) -> Any:
        try:
            return stream.result(self.limits.request_timeout_s)
        except TimeoutError:
            self.engine.abort(stream)
            raise APIError(504, f"the request did not finish within {self.limits.request_timeout_s} s",
                           type="timeout") from None
        except RequestError as e:
            if e.rejected:
                raise APIError(400, str(e)) from None
            raise APIError(503 if not self.engine.is_alive else 500, str(e), type="server_error") from None

    def complete(self, body: Any, *, chat: bool) -> tuple[dict[str, Any] | None, Iterator[dict[str, Any]] | None,
                                                            Callable[[], None]]:
        """Parse, submit, and return (json body, None, abort) or (None, chunk iterator, abort)."""
        parsed = self._parse_common(body, chat=chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        stream = self._submit(parsed, rid)
        abort = lambda: self.engine.abort(stream)  # noqa: E731
        if parsed.stream:  # the first event decides between a 4xx answer and a 200 event stream
            first = self._next_event(stream)
            if first.error is not None:
                if first.rejected:
                    raise APIError(400, first.error)
                raise APIError(503 if not self.engine.is_alive else 500, first.error, type="server_error")
            return None, self._chunks(parsed, stream, rid, chat, first), abort
        req = self._wait(stream)
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

    def _next_event(self, stream: RequestStream) -> StreamEvent:
        try:
            return stream.get(timeout=self.limits.request_timeout_s)
        except queue.Empty:
            self.engine.abort(stream)
            raise APIError(504, f"no tokens within {self.limits.request_timeout_s} s", type="timeout") from None

    def _chunks(self, parsed: _Parsed, stream: RequestStream, rid: str, chat: bool,
                ev: StreamEvent) -> Iterator[dict[str, Any]]:
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
        sent_text = ""
        first = True
        while True:
            if ev.error is not None:
                yield APIError(500, ev.error, type="server_error").body()
                return
            if ev.finished:
                final_ids = list(ev.output_ids or [])
                new_ids = final_ids[len(sent_ids):] if final_ids[:len(sent_ids)] == sent_ids else []
                full = self._decode(final_ids)
                text = full[len(sent_text):] if full.startswith(sent_text) else ""
                out = chunk(text, new_ids, ev.finish_reason, first)
                out["usage"] = self._usage(parsed, len(final_ids))
                out["spec_metrics"] = request_spec_metrics(stream.request.metrics)
                yield out
                if parsed.include_usage:
                    yield {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                           "usage": out["usage"], "spec_metrics": out["spec_metrics"]}
                return
            sent_ids += ev.token_ids
            full = self._decode(sent_ids)
            if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
                full = full[:-1]
            text = full[len(sent_text):] if full.startswith(sent_text) else ""
            sent_text += text
            yield chunk(text, list(ev.token_ids), None, first)
            first = False
            ev = self._next_event(stream)

    # ------------------------------------------------------------------ other endpoints
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specjax", "max_model_len": self.max_model_len}]}

    def health(self) -> tuple[int, dict[str, Any]]:
        if self.engine.is_alive:
            return 200, {"status": "ok"}
        return 503, {"status": "error", "error": self.engine.error or "engine not running"}


class _Handler(BaseHTTPRequestHandler):
    app: OpenAIApp  # set on the subclass made by make_server
    protocol_version = "HTTP/1.1"
    server_version = "specjax"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.info("%s %s", self.address_string(), format % args)

    def _send_json(self, status: int, obj: Any, *, close: bool = False) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, err: APIError, *, close: bool = False) -> None:
        self._send_json(err.status, err.body(), close=close)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = urlsplit(self.path).path.rstrip("/") or "/"
        app = self.app
        if path == "/health":
            status, body = app.health()
            self._send_json(status, body)
        elif path == "/v1/models":
            self._send_json(200, app.models())
        elif path == "/metrics":
            data = app.metrics.exposition() if app.metrics is not None else b""
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif path == "/metrics.json":
            self._send_json(200, app.metrics.snapshot() if app.metrics is not None else {})
        elif path in ("/v1/completions", "/v1/chat/completions"):
            self._send_error(APIError(405, f"{path} takes POST", type="method_not_allowed"))
        else:
            self._send_error(APIError(404, f"no route {path}", type="not_found_error"))

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise APIError(411, "chunked request bodies are not supported: send Content-Length",
                           type="length_required")
        length = self.headers.get("Content-Length")
        if length is None:
            raise APIError(411, "missing Content-Length header", type="length_required")
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            raise APIError(400, f"bad Content-Length {length!r}") from None
        limit = self.app.limits.max_body_bytes
        if n > limit:
            raise APIError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes",
                           type="request_too_large")
        return self.rfile.read(n)

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        path = urlsplit(self.path).path.rstrip("/")
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._send_error(APIError(404, f"no route {path}", type="not_found_error"), close=True)
            return
        try:
            raw = self._read_body()
        except APIError as e:  # the body was not read: the connection cannot be reused
            self._send_error(e, close=True)
            return
        try:
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"malformed JSON in the request body: {e}") from None
            result, chunks, abort = self.app.complete(body, chat=path.endswith("chat/completions"))
        except APIError as e:
            if self.app.metrics is not None:
                self.app.metrics.request_rejected(e.type)
            self._send_error(e)
            return
        except Exception as e:  # a bug, not the client's fault: answer 500 and keep serving
            log.exception("internal error")
            self._send_error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
            return
        if chunks is None:
            self._send_json(200, result)
            return
        self._stream(chunks, abort)

    def _stream(self, chunks: Iterator[dict[str, Any]], abort: Callable[[], None]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        try:
            try:
                for c in chunks:
                    self.wfile.write(b"data: " + json.dumps(c).encode() + b"\n\n")
                    self.wfile.flush()
            except APIError as e:
                self.wfile.write(b"data: " + json.dumps(e.body()).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client went away: free its slot
            abort()


def make_server(app: OpenAIApp, host: str = DEFAULT_HOST, port: int = 8000) -> ThreadingHTTPServer:
    """A threading HTTP server bound to (host, port); port 0 picks a free port (see `server_address`)."""
    handler = type("SpecjaxHandler", (_Handler,), {"app": app})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve_in_thread(app: OpenAIApp, host: str = DEFAULT_HOST, port: int = 0) -> tuple[ThreadingHTTPServer,
                                                                                    threading.Thread]:
    """Start `make_server(...)` on a daemon thread; stop it with `server.shutdown(); server.server_close()`."""
    server = make_server(app, host, port)
    thread = threading.Thread(target=server.serve_forever, name="specjax-http", daemon=True)
    thread.start()
    return server, thread
