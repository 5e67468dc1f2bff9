"""Property-based fuzzing of the live server with schemathesis, driven by its own /openapi.json.

Bounded and seeded (hypothesis `derandomize`, no example database): a few hundred generated requests,
schema-valid and schema-violating, against a tiny random target with a chat tokenizer. Every answer
must be no 5xx, have a documented status and content type, conform to the response schema (with the
per-request `metrics.speculative_decoding` on, at its most detailed), and, for
a 4xx, carry OpenAI's error body; afterwards no request is left running or waiting. A planted bug (a
field the schema allows but the handler crashes on) is the negative control: the same run finds it."""
from __future__ import annotations

import contextlib
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup, ServerError  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,  # noqa: E402
                                               status_code_conformance)

try:
    from tests.serving_fixtures import http_json, shared_tiny_llm, tiny_chat_tokenizer
except ImportError:  # tests/ itself on sys.path
    from serving_fixtures import http_json, shared_tiny_llm, tiny_chat_tokenizer

from specjax.serving.http_server import ServerThread  # noqa: E402
from specjax.serving.limits import ServerLimits  # noqa: E402
from specjax.serving.openai_api import OpenAIApp  # noqa: E402

EXAMPLES = 300  # generated requests per run (positive and negative together)


def openai_error_body(ctx, response, case) -> None:
    """Every 4xx answer is OpenAI's error object, with a message and a type."""
    if 400 <= response.status_code < 500:
        body = response.json()
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, body
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), body


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          openai_error_body]


class _PlantedBug(OpenAIApp):
    """The negative control: crashes on any request that sets one of a few sampling fields the schema
    allows. The generated sequence changes with the server's answers and its schema (seen: the same
    seed gave other requests after /metrics.json's body grew, and again after the schema gained the
    guided fields, and again after it gained `prediction`), so the control keys on fields that valid
    requests carry often; one keyed on `user`, then one on `num_speculative_tokens` alone, then one on
    it, max_tokens and temperature, each went unfound in 300 examples."""

    async def complete(self, req, is_disconnected=None):
        if any(getattr(req, f, None) is not None for f in ("num_speculative_tokens", "max_tokens", "temperature",
                                                           "top_p", "top_k", "seed", "stop", "n")):
            raise RuntimeError("planted bug")
        return await super().complete(req, is_disconnected=is_disconnected)


@contextlib.contextmanager
def _server(app_cls: type[OpenAIApp]):
    llm = shared_tiny_llm()
    api = app_cls.from_llm(llm, model_name="tiny", tokenizer=tiny_chat_tokenizer(), spec_decode_metrics="detailed",
                           limits=ServerLimits(max_tokens=8, max_body_bytes=1 << 16, request_timeout_s=60))
    server = ServerThread(api)
    try:
        yield server.url, api
    finally:
        server.stop()
        api.engine.drain(60)
        api.engine.shutdown()


def _fuzz(url: str, examples: int) -> None:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    modes = schemathesis.GenerationMode
    strategy = st.one_of(schema.as_strategy(modes.POSITIVE), schema.as_strategy(modes.NEGATIVE))

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case) -> None:
        case.call_and_validate(base_url=url, checks=CHECKS, timeout=60)

    run()


def _idle(api: OpenAIApp, timeout_s: float = 20.0) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        snap = api.metrics.snapshot()["requests"]
        if snap["running"] == snap["waiting"] == 0 and api.engine.num_open == 0:
            break
        time.sleep(0.05)
    return api.metrics.snapshot()["requests"]


def test_fuzzing_finds_no_5xx_and_every_answer_conforms():
    with _server(OpenAIApp) as (url, api):
        _fuzz(url, EXAMPLES)
        requests = _idle(api)
        assert requests["running"] == requests["waiting"] == 0 and api.engine.num_open == 0, requests
        assert not api.engine.engine.has_work()
        assert sum(requests["finished"].values()) > 0  # some generated requests were served, not all refused
        assert requests["rejected"]["invalid_request"] > 0  # and the refusals were counted by reason
        assert http_json(url + "/health") == (200, {"status": "ok"})


def test_fuzzing_finds_a_planted_bug():
    with _server(_PlantedBug) as (url, api):
        with pytest.raises(FailureGroup) as ei:
            _fuzz(url, EXAMPLES)
        assert any(isinstance(e, ServerError) for e in ei.value.exceptions), ei.value
        requests = _idle(api)
        assert requests["running"] == requests["waiting"] == 0
