"""The OpenAI-compatible HTTP server: FastAPI routes over `OpenAIApp`, served by uvicorn.

Endpoints:
    POST /v1/completions        prompt: a string (needs a tokenizer) or a list of token ids
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /v1/models             the one served model
    GET  /health                200 while the engine loop runs, else 503
    GET  /metrics               Prometheus text (see specjax.serving.metrics); /metrics.json: JSON snapshot

`"stream": true` answers with Server-Sent Events: `data: {json}\\n\\n` chunks, the last one carrying
`finish_reason`, `usage` and `spec_metrics`, then `data: [DONE]\\n\\n`. A client that disconnects
mid-stream (or while waiting for a plain answer) has its request aborted and its slot freed.

Errors are JSON `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON and bad
fields (see `openai_api`), 404 for unknown paths or models, 405 for a wrong method, 413 for a body
over `max_body_bytes`, 503 when the engine's waiting queue is full.

`run_server` serves until SIGTERM / SIGINT, then stops accepting connections, lets the requests in
flight finish (up to `shutdown_timeout_s`), drains the engine and returns. Binds 127.0.0.1 by default.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specjax.serving.metrics import CONTENT_TYPE
from specjax.serving.openai_api import APIError, ClientGone, OpenAIApp

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


class _SSEResponse(StreamingResponse):
    """An event stream that calls `on_close` however it ends (done, client gone, or cancelled)."""

    def __init__(self, content: Any, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than `limit` bytes (413) before or while reading it."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            raise APIError(400, f"bad Content-Length {length!r}") from None
        if n > limit:
            raise APIError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes",
                           type="request_too_large")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", type="request_too_large")
        parts.append(part)
    return b"".join(parts)


def _error_response(err: APIError) -> JSONResponse:
    headers = {"Connection": "close"} if err.status == 413 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def create_app(api: OpenAIApp) -> FastAPI:
    """The FastAPI application serving `api` (no docs pages; every error in OpenAI's shape)."""
    app = FastAPI(title="specjax", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 405:
            return _error_response(APIError(405, f"{path} does not take {request.method}",
                                            type="method_not_allowed"))
        if exc.status_code == 404:
            return _error_response(APIError(404, f"no route {path}", type="not_found_error"))
        return _error_response(APIError(exc.status_code, str(exc.detail), type="http_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = api.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(api.models())

    @app.get("/metrics")
    async def metrics() -> Response:
        data = api.metrics.exposition() if api.metrics is not None else b""
        return Response(data, media_type=CONTENT_TYPE)

    @app.get("/metrics.json")
    async def metrics_json() -> JSONResponse:
        return JSONResponse(api.metrics.snapshot() if api.metrics is not None else {})

    async def completion(request: Request, chat: bool) -> Response:
        try:
            raw = await _read_body(request, api.limits.max_body_bytes)
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"malformed JSON in the request body: {e}") from None
            result, chunks, abort = await api.complete(body, chat=chat, is_disconnected=request.is_disconnected)
        except APIError as e:
            if api.metrics is not None:
                api.metrics.request_rejected(e.type)
            return _error_response(e)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was aborted
        except Exception as e:  # a bug, not the client's fault: answer 500 and keep serving
            log.exception("internal error")
            return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
        if chunks is None:
            return JSONResponse(result)

        async def events() -> Any:
            async for c in chunks:
                yield b"data: " + json.dumps(c).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        return _SSEResponse(events(), on_close=abort)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completion(request, chat=True)

    return app


def bind_socket(host: str = DEFAULT_HOST, port: int = 0, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one (see `getsockname()`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def make_server(api: OpenAIApp, *, shutdown_timeout_s: float = 60.0, log_level: str = "warning") -> uvicorn.Server:
    """A uvicorn server for `api` (not yet running): HTTP/1.1 keep-alive, graceful shutdown that waits up
    to `shutdown_timeout_s` for the responses in flight."""
    config = uvicorn.Config(create_app(api), lifespan="off", log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout_s, timeout_keep_alive=30)
    return uvicorn.Server(config)


def run_server(api: OpenAIApp, sock: socket.socket, *, shutdown_timeout_s: float = 60.0,
               drain_timeout_s: float = 60.0, log_level: str = "warning") -> None:
    """Serve on `sock` (from `bind_socket`) in this thread until SIGTERM / SIGINT (main thread) or
    `server.should_exit`; then stop accepting, finish the responses in flight, drain the engine and
    shut it down."""
    server = make_server(api, shutdown_timeout_s=shutdown_timeout_s, log_level=log_level)
    if threading.current_thread() is threading.main_thread():
        # uvicorn handles the signal during serve() and re-raises it afterwards: let that be a no-op
        # so that the process exits 0 after the drain below
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        if not api.engine.drain(drain_timeout_s):
            log.warning("%d requests still open %.0f s after shutdown began; failing them", api.engine.num_open,
                        drain_timeout_s)
        api.engine.shutdown()


class ServerThread:
    """`create_app(api)` served by uvicorn on a daemon thread (tests, benchmarks, notebooks).

    `url` is ready once the constructor returns; `stop()` shuts the HTTP server down gracefully
    (it leaves the engine running: the caller owns it)."""

    def __init__(self, api: OpenAIApp, host: str = DEFAULT_HOST, port: int = 0, *, shutdown_timeout_s: float = 30.0):
        self.api = api
        self.sock = bind_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = make_server(api, shutdown_timeout_s=shutdown_timeout_s)
        self.thread = threading.Thread(target=self._serve, name="specjax-http", daemon=True)
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            self.thread.join(0.01)
        if not self.server.started:
            raise RuntimeError("the HTTP server did not start")

    def _serve(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
