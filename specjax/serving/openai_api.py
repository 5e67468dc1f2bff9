"""OpenAI-compatible request handling, independent of the HTTP stack (see `http_server` for routes).

`OpenAIApp` takes a validated request model (`specjax.serving.schema`; `parse_request` makes one from
a decoded body), checks its values (errors are `APIError`: OpenAI-style JSON whose `param` names the
field), submits it to the continuous-batching `AsyncEngine`, and answers a response body or, for
`"stream": true`, an async iterator of chunks. Every response carries OpenAI's `usage` and a
`spec_metrics` block (mean_acceptance_length, num_drafts, num_draft_tokens, num_accepted_tokens,
accepted_per_pos; added over the choices) for that request; choices also carry `token_ids`. With
`spec_decode_metrics` "summary" or "detailed", bodies (streamed: each choice's last chunk and the usage
chunk) also carry vLLM's `metrics.speculative_decoding` (`specjax.serving.request_metrics`). Streamed
text is detokenized incrementally (`specjax.serving.detokenize`), linear in the output's length.

OpenAI's fields: message content as a string or text parts (joined by newlines); roles system, user,
assistant, tool; `n` choices up to the engine's slots (one engine request each, choice i seeded with
seed + i when a seed is given); a completion's `prompt` may be a list of up to 64 prompts (strings or
token-id lists; choice k * n + j is prompt k's j-th, usage counts every prompt once); `stop` a string or a list; `max_completion_tokens` (chat) as
`max_tokens`; `stream_options.include_usage` (and vLLM's `continuous_usage_stats`: every chunk carries
its choice's usage so far); chat's `add_generation_prompt` and `continue_final_message` (vLLM's:
the answer continues the last, assistant message). Log-probabilities (chat `logprobs` + `top_logprobs`,
completions `logprobs`, at most the engine's `max_logprobs`) are those of the target's distribution
after the request's temperature, min-p, top-k and top-p, with temperature 0 read as 1 (vLLM's processed
log-probabilities); speculation does not change them. Completions' `echo` puts the prompt's text
before each choice's text and, with `logprobs`, the prompt tokens' entries before the generated ones
(the first prompt token's log-probability and alternatives are null; the others are scored by the
engine's cache-free `score` program under the same distribution); `max_tokens` 0 is allowed only
with `echo` (the prompt alone). Echo with logprobs needs the prompt to fit the engine's largest
prefill bucket (no chunking: 400 naming the limit); echo is not streamed. vLLM's `prompt_logprobs`
k (completions: in each choice; chat: at the top of the answer) gives each prompt token after the
first its log-probability, rank and the top k alternatives, scored as echo's (not streamed). Not
served (400 naming the field, `schema.UNSERVED_FIELDS`): `best_of`, `suffix`, `guided_grammar`. vLLM's
`ignore_eos`, `min_p`, `min_tokens`, `include_stop_str_in_output` and `truncate_prompt_tokens` (a prompt cut to
its last k tokens before the length checks) are served; the presence, frequency and repetition penalties by a
server started with `--penalties`; `logit_bias`, `allowed_token_ids` and `bad_words` by one started with
`--logit-bias`; `guided_choice` by one started with `--guided-choice`; `guided_regex`, `guided_json`,
`response_format` and tool calls (`tool_calls`) by one started with `--guided-regex`, and `tool_choice` "auto"
by one started with `--tool-call-parser`, and a non-zero `priority` by one started with `--scheduling-policy priority`;
`--reasoning-parser` answers chat's thinking apart (`reasoning`).

Status codes: 400 bad or unsupported fields, prompts or max_tokens over the limits; 404 unknown
model; 503 when the engine's waiting queue is full or the engine is not running; 504 when a request
does not finish within `request_timeout_s`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from specjax.api import SamplingParams
from specjax.request_builder import build_engine_request, request_automaton
from specjax.decoding.requests import EngineRequest, RequestMetrics, missing_rule
from specjax.serving.metrics import ServingMetrics
from specjax.serving.async_engine import AsyncEngine, QueueFullError, RequestError, RequestStream, StreamEvent
from specjax.serving.errors import ENGINE_REJECTED, APIError
from specjax.serving.limits import ServerLimits
from specjax.serving.logprob_blocks import logprobs_block, prompt_logprobs_list
from specjax.serving.prompts import chat_prompt_ids, completion_prompts, truncated
from specjax.serving.streams import ChoiceStream, Waiter
from specjax.serving.reasoning import chat_message, check_reasoning_parser, reasoning_start
from specjax.serving.tool_calls import ToolMode, check_tool_parser, tool_guide
from specjax.serving.request_metrics import (check_spec_decode_metrics_level, combined_spec_metrics,
                                             request_spec_metrics, response_metrics, usage)
from specjax.serving.bodies import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from specjax.serving.schema import SAMPLING_FIELDS, FieldError, check_served, guide_source, parse_sampling

_FROM_LLM = object()  # sentinel: use the LLM's own tokenizer
@dataclasses.dataclass
class _Parsed:
    prompts: list[list[int]]  # one, or a completion's batch (choice i answers prompt i // n)
    sp: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token (0: the token's own); None: no log-probabilities
    echo: bool = False  # completions: the prompt before the completion (text and logprobs)
    generate: bool = True  # False: max_tokens 0 with echo (nothing is generated)
    prompt_texts: tuple[str | None, ...] = ()  # string prompts as sent (echo)
    continuous_usage: bool = False  # streamed: every chunk carries its choice's usage so far
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' log-probabilities with this many alternatives
    tools: ToolMode | None = None  # chat: the answer is tool calls (`tool_calls.tool_guide`)
    reasoning: bool | None = None  # chat with a reasoning parser: whether the answer starts thinking (None: not split)

    @property
    def n(self) -> int:
        """Choices per prompt (`SamplingParams.n`)."""
        return self.sp.n


class OpenAIApp:
    """Request handling for the HTTP server, independent of sockets (see module docstring).

    engine: a started `AsyncEngine`; tokenizer: for string prompts, chat and stop strings (None:
    token-id prompts only); max_model_len / vocab_size: the engine's context length and vocabulary;
    spec_decode_metrics: "none" (default), "summary" or "detailed": responses then carry vLLM's
    per-request `metrics.speculative_decoding` (`specjax.serving.request_metrics`; null for n > 1 and
    without a drafter); prompt_tokens_details: usage carries OpenAI's prompt_tokens_details.cached_tokens
    (vLLM's --enable-prompt-tokens-details); reasoning_parser: a `serving.reasoning.PARSERS` name (chat
    answers' thinking as the message's `reasoning`).
    """

    def __init__(self, engine: AsyncEngine, *, model_name: str, max_model_len: int, vocab_size: int,
                 tokenizer: Any = None, limits: ServerLimits | None = None, metrics: ServingMetrics | None = None,
                 spec_decode_metrics: str = "none", tool_parser: str | None = None,
                 prompt_tokens_details: bool = False, reasoning_parser: str | None = None):
        self.prompt_tokens_details = bool(prompt_tokens_details)
        self.spec_decode_metrics = check_spec_decode_metrics_level(spec_decode_metrics)
        self.tool_parser, self.reasoning_parser = check_tool_parser(tool_parser), check_reasoning_parser(reasoning_parser)
        self.engine, self.model_name, self.tokenizer = engine, model_name, tokenizer
        self.max_model_len, self.vocab_size = int(max_model_len), int(vocab_size)
        self.limits = limits or ServerLimits()
        self.metrics = metrics if metrics is not None else engine.metrics
        self.max_prompt_tokens = min(self.limits.max_prompt_tokens or self.max_model_len - 1, self.max_model_len - 1)
        self.max_tokens = min(self.limits.max_tokens or self.max_model_len - 1, self.max_model_len - 1)
        self.max_n = int(engine.engine.cfg.max_slots)
        self.max_logprobs = int(engine.engine.cfg.max_logprobs)
        self.created = int(time.time())

    @classmethod
    def from_llm(cls, llm: Any, *, model_name: str = "specjax", limits: ServerLimits | None = None,
                 tokenizer: Any = _FROM_LLM, spec_decode_metrics: str = "none",
                 tool_parser: str | None = None, prompt_tokens_details: bool = False,
                 reasoning_parser: str | None = None) -> "OpenAIApp":
        """Metrics + a started `AsyncEngine` over `llm.engine` + the app (tokenizer: the LLM's by default)."""
        check_spec_decode_metrics_level(spec_decode_metrics)  # before the engine starts
        check_tool_parser(tool_parser), check_reasoning_parser(reasoning_parser)
        limits = limits or ServerLimits()
        eng = llm.engine
        metrics = ServingMetrics(model_name=model_name, gamma=eng.gamma, max_tokens_bucket=eng.buckets.tokens[-1],
                                 max_slots=eng.cfg.max_slots, max_model_len=eng.cfg.max_len)
        async_engine = AsyncEngine(eng, metrics=metrics, max_waiting=limits.max_waiting).start()
        return cls(async_engine, model_name=model_name, max_model_len=eng.cfg.max_len,
                   vocab_size=llm.config.vocab_size, tokenizer=llm.tokenizer if tokenizer is _FROM_LLM else tokenizer,
                   limits=limits, metrics=metrics, spec_decode_metrics=spec_decode_metrics, tool_parser=tool_parser,
                   prompt_tokens_details=prompt_tokens_details, reasoning_parser=reasoning_parser)

    # ------------------------------------------------------------------ parsing
    def _parse_common(self, req: CompletionRequest | ChatCompletionRequest) -> _Parsed:
        chat = isinstance(req, ChatCompletionRequest)
        body = self._body(req)
        try:
            check_served(body, tools=chat)
        except FieldError as e:
            raise APIError(400, str(e), param=e.field) from None
        n = 1 if body.get("n") is None else body["n"]
        if not 1 <= n <= self.max_n:
            raise APIError(400, f"'n' is {n}; it must be in [1, {self.max_n}] (this server's sequences at once)",
                           param="n")
        logprobs = self._logprobs_asked(body, chat)
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        tools = tool_guide(body, self.tool_parser) if chat else (None, None, None)  # (mode, guided_json, tools)
        if chat:
            pairs, what = [(chat_prompt_ids(self.tokenizer, body, tools[2]), None)], "messages"
        else:
            pairs, what = completion_prompts(self.tokenizer, self.vocab_size, body), "prompt"
        pairs = truncated(pairs, body, self.max_model_len)
        n_prompt = max(len(ids) for ids, _ in pairs)
        if n_prompt > self.max_prompt_tokens:
            raise APIError(400, f"'{what}' has {n_prompt} tokens; the limit is {self.max_prompt_tokens} "
                                f"(max_model_len {self.max_model_len})", param=what, code="context_length_exceeded")
        fields = {k: body[k] for k in SAMPLING_FIELDS if k in body} | ({"guided_json": tools[1]} if tools[1] else {})
        echo = False if chat else self._echo_asked(body, fields, n_prompt, logprobs)
        prompt_logprobs = self._prompt_logprobs_asked(body, n_prompt, what)
        mt_name = "max_tokens"
        if chat and body.get("max_completion_tokens") is not None:
            mt_name, fields["max_tokens"] = "max_completion_tokens", body["max_completion_tokens"]
        default_mt = min(self.max_tokens, self.max_model_len - n_prompt) if chat else 16
        try:
            sp = parse_sampling(fields, SamplingParams(max_tokens=max(default_mt, 1)),
                                has_tokenizer=self.tokenizer is not None)
        except FieldError as e:
            if e.field == "max_tokens" and mt_name != "max_tokens":
                raise APIError(400, str(e).replace("'max_tokens'", f"'{mt_name}'"), param=mt_name) from None
            raise APIError(400, str(e), param=e.field) from None
        if sp.seed is not None and sp.seed + n - 1 >= 1 << 63:
            raise APIError(400, f"'seed' must be below 2**63 - n, got {sp.seed}", param="seed")
        mt = sp.max_tokens
        if mt > self.max_tokens:
            raise APIError(400, f"'{mt_name}' is {mt}; the limit is {self.max_tokens}", param=mt_name)
        if n_prompt + mt > self.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the request "
                                f"asks for {n_prompt + mt} ({n_prompt} in the {what}, {mt} in the completion): lower "
                                f"'{mt_name}'", param=mt_name, code="context_length_exceeded")
        missing = missing_rule(sp, self.engine.engine.cfg.options_served)
        if missing:
            field = guide_source(body, missing[0])
            raise APIError(400, f"'{field}' needs a server started with --{missing[1].replace('_', '-')}",
                           param=field)
        outside = sp.first_id_outside(self.vocab_size)
        if outside:
            raise APIError(400, f"'{outside[0]}' holds {outside[1]}, outside the vocabulary [0, {self.vocab_size})",
                           param=outside[0])
        return _Parsed([ids for ids, _ in pairs], sp, bool(body.get("stream")), include_usage, logprobs, echo,
                       body.get("max_tokens") != 0, tuple(text for _, text in pairs),
                       include_usage and bool(options.get("continuous_usage_stats")), prompt_logprobs, tools[0],
                       reasoning_start(self.reasoning_parser if chat else None, self.tokenizer, pairs[0][0], sp))

    def _echo_asked(self, body: dict[str, Any], fields: dict[str, Any], n_prompt: int, logprobs: int | None) -> bool:
        """Completions' `echo`: not streamed; with logprobs the prompt must fit the largest prefill
        bucket; `max_tokens` 0 only with it (then `fields` asks for 1 token, which is not generated)."""
        echo = bool(body.get("echo"))
        if body.get("max_tokens") == 0:
            if not echo:
                raise APIError(400, "'max_tokens' must be a positive integer, got 0 (0 only with 'echo': true)",
                               param="max_tokens")
            fields["max_tokens"] = 1
        if echo and body.get("stream"):
            raise APIError(400, "'echo' is not served with 'stream': true", param="echo")
        if echo and logprobs is not None:
            self._check_scorable(n_prompt, "prompt", "'echo' with 'logprobs'")
        return echo

    def _check_scorable(self, n_prompt: int, what: str, asked: str) -> None:
        """A prompt to score (one cache-free pass) must fit the engine's largest prefill bucket."""
        limit = self.engine.engine.buckets.prefill[-1]
        if n_prompt > limit:
            raise APIError(400, f"'{what}' has {n_prompt} tokens; {asked} scores prompts of at most {limit} tokens "
                                f"(this engine's largest prefill bucket)", param=what, code="context_length_exceeded")

    def _prompt_logprobs_asked(self, body: dict[str, Any], n_prompt: int, what: str) -> int | None:
        """vLLM's `prompt_logprobs` k: in [0, max_logprobs], not streamed, a prompt the engine can score."""
        k = body.get("prompt_logprobs")
        if k is None:
            return None
        if self.max_logprobs == 0:
            raise APIError(400, "'prompt_logprobs': this server computes no log-probabilities (start it with "
                                "--max-logprobs N)", param="prompt_logprobs")
        if not 0 <= k <= self.max_logprobs:
            raise APIError(400, f"'prompt_logprobs' must be in [0, {self.max_logprobs}] (the server's "
                                f"--max-logprobs), got {k}", param="prompt_logprobs")
        if body.get("stream"):
            raise APIError(400, "'prompt_logprobs' is not served with 'stream': true", param="prompt_logprobs")
        self._check_scorable(n_prompt, what, "'prompt_logprobs'")
        return k

    def _logprobs_asked(self, body: dict[str, Any], chat: bool) -> int | None:
        """Chat: `logprobs` true (+ `top_logprobs` k); completions: `logprobs` k. Bounded by the engine."""
        if chat:
            top = body.get("top_logprobs")
            if top is not None and not body.get("logprobs"):
                raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            k, name = (top or 0) if body.get("logprobs") else None, "top_logprobs" if top is not None else "logprobs"
        else:
            k, name = body.get("logprobs"), "logprobs"
        if k is None:
            return None
        if self.max_logprobs == 0:
            raise APIError(400, f"'{name}': this server computes no log-probabilities (start it with "
                                f"--max-logprobs N)", param=name)
        if not 0 <= k <= self.max_logprobs:
            raise APIError(400, f"'{name}' must be in [0, {self.max_logprobs}], got {k}", param=name)
        return k

    # ------------------------------------------------------------------ generation
    def _submit(self, parsed: _Parsed, rid: str) -> list[RequestStream]:
        """One engine request per choice (choice i = k * n + j answers prompt k: seed + j when a seed
        is given, else its own stream)."""
        # a stop string may begin in tokens already emitted: hold that many back (not when it is kept)
        holdback = max((len(s) for s in parsed.sp.stop or ()), default=0) * (not parsed.sp.include_stop_str_in_output)
        streams: list[RequestStream] = []
        try:
            choices = dataclasses.replace(parsed.sp, logprobs=parsed.logprobs).choices()
            for i in range(parsed.n * len(parsed.prompts) if parsed.generate else 0):
                try:
                    req = build_engine_request(parsed.prompts[i // parsed.n], choices[i % parsed.n],
                                               request_id=f"{rid}-{i}",
                                               tokenizer=self.tokenizer, vocab=self.vocab_size)
                except ValueError as e:
                    raise APIError(400, str(e), param=getattr(e, "field", None)) from None
                try:
                    streams.append(self.engine.submit(req, holdback_tokens=holdback))
                except QueueFullError as e:
                    raise APIError(503, str(e), type="server_overloaded", code="queue_full") from None
                except RequestError as e:
                    raise APIError(503, str(e), type="service_unavailable", code="engine_not_running") from None
        except APIError:
            for s in streams:
                self.engine.abort(s)
            raise
        return streams

    def _logprobs_block(self, parsed: _Parsed, req: Any, a: int, b: int, chat: bool,
                        text_offset: int = 0, echoed: tuple[list[int], list[Any]] | None = None
                        ) -> dict[str, Any] | None:
        """OpenAI's `logprobs` object (`logprob_blocks.logprobs_block`) for output tokens a..b-1, after
        `echoed` = (prompt ids, their entries: None for the first token) when echoing."""
        if parsed.logprobs is None:
            return None
        pre_ids, pre = echoed or ([], [])
        return logprobs_block(self.tokenizer, list(pre_ids) + req.output_ids[a:b],
                              list(pre) + req.output_logprobs[a:b], chat, text_offset)

    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, req: EngineRequest) -> str:
        """A request's output text: the text a stop string cut, else its tokens decoded."""
        return self._decode(list(req.output_ids)) if req.output_text is None else req.output_text

    def _usage(self, parsed: _Parsed, n_out: int, streams: list[RequestStream], choice: int | None = None
               ) -> dict[str, Any]:
        """OpenAI's usage: every prompt once (or one choice's prompt) and `n_out` completion tokens (of
        `streams`' requests: their predicted outputs' counts)."""
        n = sum(map(len, parsed.prompts)) if choice is None else len(parsed.prompts[choice // parsed.n])
        return usage(n, n_out, [s.request for s in streams], prompt_details=self.prompt_tokens_details,
                     n=parsed.n if choice is None else 1)

    def _failed(self, ev: StreamEvent) -> APIError:
        if ev.rejected:
            return APIError(400, ev.error or "rejected", param=ev.field, code=ENGINE_REJECTED)
        return APIError(503 if not self.engine.is_alive else 500, ev.error or "failed", type="server_error")

    async def complete(self, req: CompletionRequest | ChatCompletionRequest,
                       is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                       ) -> tuple[dict[str, Any] | None, AsyncIterator[dict[str, Any]] | None, Callable[[], None]]:
        """Parse, submit, and return (json body, None, abort) or (None, chunk iterator, abort).

        Must run on an event loop. is_disconnected: polled while a non-streamed request waits (a
        gone client's request is aborted: `ClientGone`). The caller of a chunk iterator calls
        `abort` when it stops reading early (a no-op once the request has ended)."""
        chat = isinstance(req, ChatCompletionRequest)
        parsed = self._parse_common(req)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if parsed.sp.guided_regex is not None or parsed.sp.guided_json is not None:
            try:  # compiled (and cached) on a worker thread: a large schema takes seconds
                await asyncio.to_thread(request_automaton, parsed.sp, self.tokenizer, self.vocab_size)
            except ValueError as e:
                raise APIError(400, str(e), param=getattr(e, "field", None)) from None
        streams = self._submit(parsed, rid)

        def abort() -> None:
            for s in streams:
                self.engine.abort(s)
        waiters = [Waiter(self.engine, s, self.limits.request_timeout_s, is_disconnected) for s in streams]
        try:
            firsts = [await w.next() for w in waiters]
            for first in firsts:  # the first events decide between an error and a 200 answer
                if first.error is not None:
                    raise self._failed(first)
            if parsed.stream:
                for w in waiters:
                    w.is_disconnected = None  # the HTTP layer notices a gone stream reader itself
                return None, self._chunks(parsed, streams, rid, chat, firsts, waiters), abort
            for ev, w in zip(firsts, waiters):
                while not ev.finished:
                    ev = await w.next()
                if ev.error is not None:
                    raise self._failed(ev)
        except BaseException:
            abort()
            raise
        choices, n_out = await self._choices(parsed, streams, rid, chat)
        spec = combined_spec_metrics([request_spec_metrics(s.request.metrics) for s in streams]
                                     or [request_spec_metrics(RequestMetrics())])
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": self._usage(parsed, n_out, streams),
                "spec_metrics": spec}
        if chat and parsed.prompt_logprobs is not None:  # vLLM's chat answer holds its one prompt's at the top
            body["prompt_logprobs"] = [c.pop("prompt_logprobs") for c in choices][0]
        return self._with_metrics(body, streams), None, abort

    def _with_metrics(self, body: dict[str, Any], streams: list[RequestStream]) -> dict[str, Any]:
        m = response_metrics(self.spec_decode_metrics, [s.request for s in streams], self.engine.engine)
        return body if m is None else {**body, "metrics": m}

    async def _choices(self, parsed: _Parsed, streams: list[RequestStream], rid: str, chat: bool
                       ) -> tuple[list[dict[str, Any]], int]:
        """The finished choices (echo: the prompt first; prompt_logprobs: each prompt's; prompts scored
        on a worker thread) and their token count."""
        echo_lp = parsed.echo and parsed.logprobs is not None
        echoed: list[Any] = [None] * len(parsed.prompts)
        prompt_lps: list[Any] = [None] * len(parsed.prompts)
        for k, ids in enumerate(parsed.prompts if echo_lp or parsed.prompt_logprobs is not None else ()):
            top = max(parsed.logprobs or 0, parsed.prompt_logprobs or 0)
            req = build_engine_request(ids, dataclasses.replace(parsed.sp, logprobs=top),
                                       request_id=f"{rid}-score-{k}", tokenizer=self.tokenizer)
            entries, ranks = await asyncio.to_thread(self.engine.engine.score, req)
            if echo_lp:
                n = parsed.logprobs
                echoed[k] = (ids, [None] + [(lp, i[:n], v[:n]) for lp, i, v in entries])
            if parsed.prompt_logprobs is not None:
                prompt_lps[k] = prompt_logprobs_list(self.tokenizer, ids, entries, ranks, parsed.prompt_logprobs)
        prefixes = [("" if not parsed.echo else text or self._decode(ids))
                    for ids, text in zip(parsed.prompts, parsed.prompt_texts)]
        choices, n_out = [], 0
        for i in range(parsed.n * len(parsed.prompts)):
            k = i // parsed.n
            r = streams[i].request if streams else EngineRequest(request_id=rid, prompt_ids=parsed.prompts[k],
                                                                   max_tokens=0, finish_reason="length")
            ids = list(r.output_ids)
            n_out += len(ids)
            choice: dict[str, Any] = {"index": i, "finish_reason": r.finish_reason, "stop_reason": r.stop_reason,
                                      "token_ids": ids,
                                      "logprobs": self._logprobs_block(parsed, r, 0, len(ids), chat, echoed=echoed[k])}
            if parsed.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_lps[k]
            text = self._text(r)
            if chat:
                choice["message"], choice["finish_reason"] = chat_message(text, parsed.tools, parsed.reasoning,
                                                                          r.finish_reason)
            else:
                choice["text"] = prefixes[k] + text
            choices.append(choice)
        return choices, n_out

    async def _chunks(self, parsed: _Parsed, streams: list[RequestStream], rid: str, chat: bool,
                      firsts: list[StreamEvent], waiters: list[Waiter]) -> AsyncIterator[dict[str, Any]]:
        """The chunks of every choice, in the order their events arrive (each chunk names its choice)."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        choices = [ChoiceStream(self, i, s, chat) for i, s in enumerate(streams)]

        def wrap(c: dict[str, Any]) -> dict[str, Any]:
            return {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [c]}

        pending: dict[asyncio.Future[StreamEvent], int] = {}
        ready = list(enumerate(firsts))
        finals: list[dict[str, Any]] = []
        sent = [0] * len(choices)  # tokens streamed per choice
        try:
            while ready or pending:
                for i, ev in ready:
                    if ev.error is not None:
                        yield APIError(500, ev.error, type="server_error").body()
                        return
                    c = choices[i].chunk(ev, parsed)
                    sent[i] += len(c.get("token_ids") or [])
                    out = wrap(c)
                    if parsed.continuous_usage and not ev.finished:
                        out["usage"] = self._usage(parsed, sent[i], streams[i:i + 1], choice=i)
                    if ev.finished:
                        out["usage"] = self._usage(parsed, len(ev.output_ids or []), streams[i:i + 1], choice=i)
                        out["spec_metrics"] = request_spec_metrics(streams[i].request.metrics)
                        out = self._with_metrics(out, streams)
                        finals.append(out)
                    else:
                        pending[asyncio.ensure_future(waiters[i].next())] = i
                    yield out
                ready = []
                if not pending:
                    break
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    try:
                        ready.append((i, fut.result()))
                    except APIError as e:  # timed out mid-stream (the request was aborted)
                        yield e.body()
                        return
                ready.sort()
        finally:
            for fut in pending:
                fut.cancel()
        if parsed.include_usage:
            n_out = sum(f["usage"]["completion_tokens"] for f in finals)
            yield self._with_metrics({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                      "choices": [], "usage": self._usage(parsed, n_out, streams),
                                      "spec_metrics": combined_spec_metrics([f["spec_metrics"] for f in finals])},
                                     streams)


    # ------------------------------------------------------------------ other endpoints
    def _body(self, req: Any) -> dict[str, Any]:
        """The fields a request set; 404 naming `model` when it names another model."""
        body = req.model_dump(exclude_unset=True)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist (served: '{self.model_name}')", param="model",
                           code="model_not_found")
        return body

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the ids the completion routes would feed the engine, their count, max_model_len."""
        body = self._body(req)
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise APIError(400, "send exactly one of 'prompt' or 'messages'", param="prompt")
        ids = (completion_prompts(self.tokenizer, self.vocab_size, body)[0][0] if body.get("prompt") is not None
               else chat_prompt_ids(self.tokenizer, body))
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize: the text of token ids, special tokens included."""
        ids = self._body(req)["tokens"]
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer to decode 'tokens' with", param="tokens")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"'tokens' id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                           param="tokens")
        return {"prompt": self.tokenizer.decode(ids)}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specjax", "max_model_len": self.max_model_len}]}

    def health(self) -> tuple[int, dict[str, Any]]:
        if self.engine.is_alive:
            return 200, {"status": "ok"}
        return 503, {"status": "error", "reason": self.engine.error or "engine not running"}
