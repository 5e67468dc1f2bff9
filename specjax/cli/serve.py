"""OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).

    specjax-serve --target DIR --drafter ngram --port 8000

FastAPI on uvicorn. Binds 127.0.0.1 unless --host says otherwise; --port 0 picks a free port (printed
on start-up, before warm-up: /health answers 503 with the reason until the engine is warm, then 200,
and "specjax server: ready" is printed). The schema is at /openapi.json, its pages at /docs. A request
that finds --max-waiting requests already queued for a slot gets HTTP 503. With --api-key (or the
environment variable SPECJAX_API_KEY) the model's routes need `Authorization: Bearer <key>`.
SIGTERM (or Ctrl-C): stop accepting connections, finish the requests in flight, then exit 0.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from specjax.serving.cli import add_llm_args, add_parser_flags, build_llm
from specjax.serving.http_server import DEFAULT_HOST
from specjax.serving.limits import DEFAULT_MAX_WAITING
from specjax.serving.request_metrics import SPEC_DECODE_METRICS_LEVELS

API_KEY_ENV = "SPECJAX_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specjax-serve", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=8000, help="port (0: pick a free one)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: target dir name)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"clients of /v1/*, /tokenize, /detokenize and /reset_prefix_cache must send "
                        f"'Authorization: Bearer <key>' (default: ${API_KEY_ENV}; none: open)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="default: max-model-len - 1")
    p.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens (default: max-model-len - 1)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests allowed to wait for a slot; beyond it: HTTP 503")
    p.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds to let requests in flight finish")
    p.add_argument("--per-request-spec-decode-metrics", choices=SPEC_DECODE_METRICS_LEVELS, default="none",
                   help="add vLLM's per-request metrics.speculative_decoding to responses: summary (counts and "
                        "acceptance histograms) or detailed (also every round's drafted / accepted counts)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage carries OpenAI's prompt_tokens_details.cached_tokens: prompt tokens read from a "
                        "freed slot's cache rows (prefix caching)")
    add_parser_flags(p)
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    add_llm_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specjax.serving.http_server import ServedApp, bind_socket, run_server
    from specjax.serving.limits import ServerLimits
    from specjax.serving.openai_api import OpenAIApp

    try:
        limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                              max_tokens=args.max_tokens_limit, request_timeout_s=args.request_timeout,
                              max_waiting=args.max_waiting)
        if args.api_key is not None and not args.api_key.strip():
            raise ValueError("--api-key is empty")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.target)) if args.target else "specjax")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2

    def load() -> OpenAIApp:
        return OpenAIApp.from_llm(build_llm(args, progress=True), model_name=name, limits=limits,
                                  spec_decode_metrics=args.per_request_spec_decode_metrics,
                                  tool_parser=args.tool_call_parser,
                                  prompt_tokens_details=args.enable_prompt_tokens_details,
                                  reasoning_parser=args.reasoning_parser)
    host, port = sock.getsockname()[:2]
    print(f"specjax server: model '{name}' on http://{host}:{port} (warming up: /health answers 200 when ready)",
          flush=True)
    if args.api_key is None and not ipaddress.ip_address(host).is_loopback:
        print(f"warning: serving on {host} without --api-key: anyone who reaches this port can use the model",
              file=sys.stderr, flush=True)
    ok = run_server(ServedApp(reason="loading the model and compiling its executables (warm-up)", limits=limits,
                              api_key=args.api_key),
                    sock, load=load, on_ready=lambda: print("specjax server: ready", flush=True),
                    shutdown_timeout_s=args.shutdown_timeout, drain_timeout_s=args.shutdown_timeout,
                    log_level=args.log_level)
    print("specjax server: stopped", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
