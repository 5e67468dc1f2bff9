"""The OpenAI-compatible HTTP server: FastAPI routes over `OpenAIApp`, served by uvicorn.

Endpoints:
    POST /v1/completions        prompt: a string (needs a tokenizer) or a list of token ids
    POST /v1/chat/completions   messages through the tokenizer's chat template
    POST /v1/responses          OpenAI's Responses API, text in and out, answered by the chat route
                                (`specjax.serving.responses_api`; streamed as named events, no [DONE])
    GET  /v1/models             the one served model and its max_model_len
    POST /tokenize, /detokenize vLLM's: a prompt or messages as the token ids the completion routes use;
                                token ids as text
    GET  /version               specjax's version
    POST /reset_prefix_cache    vLLM's: no later request reuses the rows slots keep (prefix caching)
    GET  /health                200 once warm-up is done and while the engine loop runs, else 503 + reason
    GET  /metrics               Prometheus text (see specjax.serving.metrics); /metrics.json: JSON snapshot
    GET  /openapi.json, /docs   the schema: the pydantic models of `specjax.serving.schema` are the routes'
                                bodies and answers, so every field, limit and error body is described

`"stream": true` answers with Server-Sent Events: `data: {json}\\n\\n` chunks (each names its choice
`index`), the last one of a choice carrying `finish_reason`, `usage` and `spec_metrics`; with
`stream_options.include_usage` one more chunk with no choices and the usage of all of them; then
`data: [DONE]\\n\\n`. A client that disconnects
mid-stream (or while waiting for a plain answer) has its request aborted and its slot freed.

Errors are JSON `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON and bad
fields (see `openai_api`), 404 for unknown paths or models, 405 for a wrong method, 413 for a body
over `max_body_bytes`, 503 while warming up or when the engine's waiting queue is full. Refused requests
are counted by reason (`specjax:request_rejected_total{reason=...}`).

With an API key (`ServedApp(api_key=...)`, the server's `--api-key` or SPECJAX_API_KEY) the routes that
read or change the model (/v1/*, /tokenize, /detokenize, /reset_prefix_cache) need the header
`Authorization: Bearer <key>` (else 401, OpenAI's `invalid_api_key`); /health, /version and /metrics stay open.

`run_server` serves until SIGTERM / SIGINT, then stops accepting connections, lets the requests in
flight finish (up to `shutdown_timeout_s`), drains the engine and returns. Binds 127.0.0.1 by default.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import socket
import threading
from typing import Any, Awaitable, Callable

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from specjax.serving.metrics import CONTENT_TYPE
from specjax.serving.errors import APIError, rejection_reason, validation_error
from specjax.serving.limits import ServerLimits
from specjax.serving.openai_api import OpenAIApp
from specjax.serving.responses_api import ResponsesRequest, respond
from specjax.serving.streams import ClientGone
from specjax.serving.responses import (ChatCompletionResponse, CompletionResponse, DetokenizeResponse, ErrorResponse,
                                       Health, ModelList, TokenizeResponse, Version)
from specjax.serving.bodies import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"


class ServedApp:
    """What the routes serve: the `OpenAIApp` once it is ready, before that the reason it is not
    (`/health` and the API answer 503 with that reason). `limits` bound request bodies meanwhile;
    `api_key` (None: none) is the bearer token the model's routes ask for."""

    def __init__(self, api: OpenAIApp | None = None, *, reason: str = "starting",
                 limits: ServerLimits | None = None, api_key: str | None = None):
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string (None: no key)")
        self.api = api
        self.reason = reason
        self.failed = False
        self.limits = api.limits if api is not None else (limits or ServerLimits())
        self.api_key = api_key

    def ready(self, api: OpenAIApp) -> None:
        self.api, self.limits = api, api.limits

    def fail(self, reason: str) -> None:
        self.reason, self.failed = reason, True

    def get(self) -> OpenAIApp:
        """The app; APIError 503 naming the reason while it is not ready."""
        if self.api is None:
            raise APIError(503, f"the server is not ready: {self.reason}", type="service_unavailable",
                           code="not_ready")
        return self.api

    def count_rejected(self, err: APIError) -> None:
        reason = rejection_reason(err)
        if reason is not None and self.api is not None and self.api.metrics is not None:
            self.api.metrics.request_rejected(reason)


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


def _error_response(err: APIError) -> JSONResponse:
    headers = {413: {"Connection": "close"}, 401: {"WWW-Authenticate": "Bearer"}}.get(err.status)
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class _BodyLimit:
    """ASGI middleware: a POST body is read whole (at most `limits.max_body_bytes`, else 413 before or
    while reading it) and then handed to the app."""

    def __init__(self, app: Any, served: ServedApp):
        self.app, self.served = app, served

    async def _refuse(self, err: APIError, scope: Any, receive: Any, send: Any) -> None:
        self.served.count_rejected(err)
        await _error_response(err)(scope, receive, send)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limit = self.served.limits.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                n = int(length)
                if n < 0:
                    raise ValueError
            except ValueError:
                return await self._refuse(APIError(400, f"bad Content-Length {length.decode(errors='replace')!r}"),
                                          scope, receive, send)
            if n > limit:
                return await self._refuse(APIError(413, f"request body of {n} bytes exceeds the limit of {limit} "
                                                        f"bytes", type="request_too_large"), scope, receive, send)
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                return await self._refuse(APIError(413, f"request body exceeds the limit of {limit} bytes",
                                                   type="request_too_large"), scope, receive, send)
            parts.append(part)
            more = message.get("more_body", False)
        body, replayed = b"".join(parts), False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then: disconnect notices
        await self.app(scope, replay, send)


_ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "a bad or unsupported field (`param` names it), or a prompt over the limits"),

    (404, "unknown model"), (413, "request body over the limit"),
    (503, "not ready (warm-up), waiting queue full, or the engine stopped"),
    (504, "the request did not finish in time"))}


# one Server-Sent Event (OpenAPI 3.1 reads a text/event-stream schema per event, as 3.2's itemSchema)
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string", "contentMediaType": "application/json",
                                      "description": "a JSON chunk, or [DONE] after the last"},
                             "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


_KEY_ERROR = {401: {"model": ErrorResponse, "description": "no valid API key (a server started with --api-key)"}}


def _keyed_errors(keyed: list[Any], *statuses: int) -> dict[int | str, Any]:
    """The documented errors of a route: `statuses` (all of _ERRORS when none), and 401 when `keyed`."""
    return {s: _ERRORS[s] for s in statuses or _ERRORS} | (_KEY_ERROR if keyed else {})


def _completion_responses(model: type, keyed: list[Any]) -> dict[int | str, Any]:
    return {200: {"model": model, "description": "the answer; with `stream: true` Server-Sent Events of chunks "
                                                 "ending with `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}}}, **_keyed_errors(keyed)}


def create_app(served: OpenAIApp | ServedApp) -> FastAPI:
    """The FastAPI application (`/openapi.json`, `/docs`; every error in OpenAI's shape)."""
    if isinstance(served, OpenAIApp):
        served = ServedApp(served)
    app = FastAPI(title="specjax", summary="OpenAI-compatible speculative decoding server",
                  redirect_slashes=False)
    app.add_middleware(_BodyLimit, served=served)
    _add_error_handlers(app, served)
    keyed = _key_check(served)
    _add_info_routes(app, served, keyed)
    _add_completion_routes(app, served, keyed)
    _add_token_routes(app, served, keyed)
    _answer_invalid_bodies_400(app)
    return app


def _key_check(served: ServedApp) -> list[Any]:
    """The dependencies of the routes that read or change the model: with an API key, a bearer token
    equal to it (compared in constant time), else 401; without one, none."""
    if served.api_key is None:
        return []
    bearer = HTTPBearer(auto_error=False, description="the server's --api-key")
    key = served.api_key.encode()

    async def check(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if creds is None or not secrets.compare_digest(creds.credentials.encode(), key):
            err = APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
            served.count_rejected(err)
            raise err
    return [Depends(check)]


def _add_error_handlers(app: FastAPI, served: ServedApp) -> None:
    """Unknown routes and methods, invalid bodies and APIError all answer OpenAI's error body."""
    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 405:
            return _error_response(APIError(405, f"{path} does not take {request.method}",
                                            type="method_not_allowed"))
        if exc.status_code == 404:
            return _error_response(APIError(404, f"no route {path}", type="not_found_error"))
        return _error_response(APIError(exc.status_code, str(exc.detail), type="http_error"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc.errors())
        served.count_rejected(err)
        return _error_response(err)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)


def _add_info_routes(app: FastAPI, served: ServedApp, keyed: list[Any]) -> None:
    """/health, /version, /v1/models, /reset_prefix_cache, /metrics and /metrics.json (`keyed`: the
    API key check of the model's routes)."""
    @app.get("/health", response_model=Health, responses={503: {"model": Health, "description": "not ready"}})
    async def health() -> JSONResponse:
        """200 once warm-up is done and the engine runs; 503 with the reason before or after."""
        if served.api is None:
            return JSONResponse({"status": "error" if served.failed else "starting", "reason": served.reason},
                                status_code=503)
        status, body = served.api.health()
        return JSONResponse(body, status_code=status)

    @app.get("/version", response_model=Version)
    async def version() -> JSONResponse:
        """specjax's version (vLLM's route)."""
        from specjax import __version__
        return JSONResponse({"version": __version__})

    @app.get("/v1/models", response_model=ModelList, responses=_keyed_errors(keyed, 503), dependencies=keyed)
    async def models() -> JSONResponse:
        """The served model, with its maximum context length (`max_model_len`)."""
        return JSONResponse(served.get().models())

    @app.post("/reset_prefix_cache", response_model=dict[str, bool], responses=_keyed_errors(keyed, 503),
              dependencies=keyed)
    async def reset_prefix_cache() -> JSONResponse:
        """Forget the cache rows every slot keeps (vLLM's route): `{"reset": false}` when prefix caching is off."""
        return JSONResponse({"reset": served.get().engine.reset_prefix_cache()})

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics() -> Response:
        """Prometheus metrics (vLLM's names where they exist)."""
        api = served.api
        data = api.metrics.exposition() if api is not None and api.metrics is not None else b""
        return Response(data, media_type=CONTENT_TYPE)

    @app.get("/metrics.json", response_model=dict[str, Any])
    async def metrics_json() -> JSONResponse:
        """The metrics as JSON, with derived rates (mean acceptance length...)."""
        api = served.api
        return JSONResponse(api.metrics.snapshot() if api is not None and api.metrics is not None else {})


def _add_completion_routes(app: FastAPI, served: ServedApp, keyed: list[Any]) -> None:
    """/v1/completions, /v1/chat/completions and /v1/responses (JSON, or SSE when streamed)."""
    async def answer(run: Callable[[OpenAIApp], Awaitable[tuple[Any, Any, Callable[[], None]]]],
                     responses: bool = False) -> Response:
        try:
            result, chunks, abort = await run(served.get())
        except APIError as e:
            served.count_rejected(e)
            return _error_response(e)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was aborted
        except Exception as e:  # a bug, not the client's fault: answer 500 and keep serving
            log.exception("internal error")
            return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
        if chunks is None:
            return JSONResponse(result)

        async def events() -> Any:
            async for c in chunks:  # the Responses API names each event; chat and completions end with [DONE]
                name = f"event: {c['type']}\n".encode() if responses else b""
                yield name + b"data: " + json.dumps(c).encode() + b"\n\n"
            if not responses:
                yield b"data: [DONE]\n\n"
        return _SSEResponse(events(), on_close=abort)

    async def completion(req: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
        return await answer(lambda api: api.complete(req, is_disconnected=request.is_disconnected))

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=_completion_responses(CompletionResponse, keyed), dependencies=keyed)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Complete a prompt (a string, or a list of token ids)."""
        return await completion(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_completion_responses(ChatCompletionResponse, keyed), dependencies=keyed)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Answer a conversation (the tokenizer's chat template; text content parts)."""
        return await completion(body, request)

    @app.post("/v1/responses", responses=_keyed_errors(keyed, 400, 404, 413, 503, 504), dependencies=keyed)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, text in and out, answered by the chat route (`serving.responses_api`)."""
        return await answer(lambda api: respond(api, body, is_disconnected=request.is_disconnected), responses=True)


def _add_token_routes(app: FastAPI, served: ServedApp, keyed: list[Any]) -> None:
    """/tokenize and /detokenize (vLLM's)."""
    token_errors = _keyed_errors(keyed, 400, 404, 413, 503)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=token_errors, dependencies=keyed)
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        """The token ids /v1/completions (`prompt`) or /v1/chat/completions (`messages`) would use."""
        return JSONResponse(served.get().tokenize(body))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=token_errors, dependencies=keyed)
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        """The text of token ids (special tokens included)."""
        return JSONResponse(served.get().detokenize(body))


def _answer_invalid_bodies_400(app: FastAPI) -> None:
    """The schema documents OpenAI's 400 for invalid bodies, never FastAPI's 422."""
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base_openapi()
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]


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


def make_server(served: OpenAIApp | ServedApp, *, shutdown_timeout_s: float = 60.0,
                log_level: str = "warning") -> uvicorn.Server:
    """A uvicorn server for `served` (not yet running): HTTP/1.1 keep-alive, graceful shutdown that waits
    up to `shutdown_timeout_s` for the responses in flight."""
    config = uvicorn.Config(create_app(served), lifespan="off", log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout_s, timeout_keep_alive=30)
    return uvicorn.Server(config)


def run_server(served: OpenAIApp | ServedApp, sock: socket.socket, *, load: Callable[[], OpenAIApp] | None = None,
               on_ready: Callable[[], None] | None = None, shutdown_timeout_s: float = 60.0, drain_timeout_s: float = 60.0, log_level: str = "warning") -> bool:
    """Serve on `sock` (from `bind_socket`) in this thread until SIGTERM / SIGINT (main thread) or
    `server.should_exit`; then stop accepting, finish the responses in flight, drain the engine and
    shut it down.

    load: builds the app (model, engine warm-up) on a thread while the server already answers:
    `/health` and the API say 503 with the reason until it returns (then `on_ready()` is called). If
    it raises, the server stops. Returns False when `load` failed, else True."""
    if isinstance(served, OpenAIApp):
        served = ServedApp(served)
    server = make_server(served, shutdown_timeout_s=shutdown_timeout_s, log_level=log_level)
    if threading.current_thread() is threading.main_thread():
        # uvicorn handles the signal during serve() and re-raises it afterwards: let that be a no-op
        # so that the process exits 0 after the drain below
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)

    def load_app() -> None:
        try:
            api = load()
        except Exception as e:
            log.exception("the model could not be loaded")
            served.fail(f"loading failed: {type(e).__name__}: {e}")
            server.should_exit = True
            return
        if server.should_exit:  # stopped during warm-up: nobody will serve it
            api.engine.shutdown()
        else:
            served.ready(api)
            if on_ready is not None:
                on_ready()
    if load is not None:
        threading.Thread(target=load_app, name="specjax-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        api = served.api
        if api is not None:
            if not api.engine.drain(drain_timeout_s):
                log.warning("%d requests still open %.0f s after shutdown began; failing them",
                            api.engine.num_open, drain_timeout_s)
            api.engine.shutdown()
    return not served.failed


class ServerThread:
    """`create_app(api)` served by uvicorn on a daemon thread (tests, benchmarks, notebooks).

    `url` is ready once the constructor returns; `stop()` shuts the HTTP server down gracefully
    (it leaves the engine running: the caller owns it)."""

    def __init__(self, api: OpenAIApp | ServedApp, host: str = DEFAULT_HOST, port: int = 0, *,
                 shutdown_timeout_s: float = 30.0):
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
