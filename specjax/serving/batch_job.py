"""Resumable offline batch jobs: JSONL in, JSONL out keyed by `id`.

Input rows (one JSON object a line):
    {"id": "a1", "prompt": "text" | [token ids], ...}   or   {"id": 7, "messages": [{"role": ..., "content": ...}]}
    optional: temperature, top_k, top_p, min_p, max_tokens, stop, stop_token_ids, seed,
    num_speculative_tokens, ignore_eos, min_tokens, include_stop_str_in_output, truncate_prompt_tokens
    (sampling; defaults from the job), the server's other request fields (logit rules, guides, OpenAI's
    `prediction`, `priority` with --scheduling-policy priority; the job's options serve them), `logprobs`
    k (top alternatives per token, at most --max-logprobs: the output row's `logprobs`, OpenAI's
    completions object), `n` (answers to the prompt, at most MAX_N; choice j samples with seed + j when
    a seed is given), metadata (copied to the output).
    A line with `custom_id` is an OpenAI batch request and gets an OpenAI batch output line
    (`specjax.serving.batch_openai`); both kinds may share a file.
Output rows (in completion order, not input order):
    {"id", "token_ids", "text", "finish_reason", "stop_reason" (vLLM's: the stop id or string that ended it),
     "prompt_tokens", "completion_tokens", "metrics", ["metadata"],
     ["prompt_tokens_details": {"cached_tokens"}: with --enable-prompt-tokens-details (prefix caching)],
     ["completion_tokens_details": a row with a prediction: accepted / rejected_prediction_tokens]}
    A row that gives `n` answers in `choices` instead, written once every choice has finished:
    {"id", "choices": [{"index", "token_ids", "text", "finish_reason", "stop_reason", "completion_tokens",
     "metrics", ["logprobs"]}, ...], "prompt_tokens", "completion_tokens" (all choices'), "metrics"
     (all choices' counts), ["metadata"], [the details above, over all choices]}
Error rows (`<output stem>.errors.jsonl` unless given):
    {"line": 1-based input line, "id": id or null, "field": offending field or null, "error": reason}

Resumable and sharded as a `specjax.jobs` job that resumes by id: each finished row is one fsynced
line, so after `kill -9` a rerun skips the rows whose id is in the output and the lines in the
errors file, and loses and duplicates nothing. Ids must be unique: a later row with an id seen on
an earlier line (in any shard) is an error row. Rows without an explicit `seed` are sampled with
engine seeds, so a rerun of a sampled row may give different text (greedy rows are identical).

Sharding: with `shard=(i, n)` this process takes the input rows (non-blank lines) whose 0-based
index is i modulo n and writes `<stem>.shard-<i>-of-<n>.jsonl` (and its own errors file). Rows are
fed to the engine in a window (default 2 x max_num_seqs in flight), so continuous batching keeps
slots full.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from specjax.api import SamplingParams
from specjax.request_builder import build_engine_request, encode_text, truncate_prompt
from specjax.decoding.requests import missing_rule
from specjax.io import JsonlLine
from specjax.jobs import JobSummary, Outcome, Shard, Submit, run_jsonl_job, valid_id
from specjax.serving import batch_openai
from specjax.serving.detokenize import request_text
from specjax.serving.errors import APIError
from specjax.serving.logprob_blocks import logprobs_block
from specjax.serving.prompts import chat_prompt_ids
from specjax.serving.reasoning import check_reasoning_parser, reasoning_start
from specjax.serving.tool_calls import check_tool_parser
from specjax.serving.metrics import ServingMetrics
from specjax.serving.request_metrics import combined_spec_metrics, request_spec_metrics, usage
from specjax.serving.schema import SAMPLING_FIELDS, FieldError, is_int, parse_sampling

ROW_FIELDS = frozenset(("id", "prompt", "messages", "metadata", "logprobs") + SAMPLING_FIELDS)
MAX_N = 1024  # answers one row may ask for (`n`): all of them are in flight until the row is written


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------

class RowError(ValueError):
    """A bad input row; `field` names the offending field when there is one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass
class Row:
    line: int
    id: Any
    prompt: Any  # str | list[int] | None
    messages: Any  # list[dict] | None
    sp: SamplingParams
    metadata: Any = None
    openai: batch_openai.OpenAIRequest | None = None  # an OpenAI batch line: how to answer it
    choices: bool = False  # a native row that gives `n`: its answers go to `choices`

    def field(self, name: str | None) -> str | None:
        """A native field's name as this row's input line spells it (a guide: the body field that set it,
        e.g. response_format or tool_choice)."""
        if self.openai is None:
            return name
        return batch_openai.native_field(self.openai.guide_sources.get(name, name))


def parse_row(obj: Any, line: int, defaults: SamplingParams, tool_parser: str | None = None) -> Row:
    """Validate one decoded input row (native, or an OpenAI batch line; `tool_parser`: the job's
    --tool-call-parser); RowError names the field."""
    if batch_openai.is_openai_line(obj):
        try:
            native, request = batch_openai.native_row(obj, tool_parser)
        except batch_openai.OpenAIRowError as e:
            raise RowError(str(e), e.field) from None
        try:
            return dataclasses.replace(parse_row(native, line, defaults), openai=request)
        except RowError as e:
            raise RowError(str(e), batch_openai.native_field(e.field)) from None
    if not isinstance(obj, dict):
        raise RowError(f"row must be a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        raise RowError("missing field 'id'", "id")
    rid = obj["id"]
    if not valid_id(rid):
        raise RowError(f"'id' must be a non-empty string or an integer, got {rid!r}", "id")
    unknown = sorted(set(obj) - ROW_FIELDS)
    if unknown:
        raise RowError(f"unknown field(s) {unknown} (allowed: {sorted(ROW_FIELDS)})", unknown[0])
    has_p, has_m = obj.get("prompt") is not None, obj.get("messages") is not None
    if has_p == has_m:
        raise RowError("a row needs exactly one of 'prompt' or 'messages'", "prompt")
    prompt = obj.get("prompt")
    if has_p:
        if isinstance(prompt, str):
            if not prompt:
                raise RowError("'prompt' is empty", "prompt")
        elif not (isinstance(prompt, list) and prompt
                  and all(is_int(t) for t in prompt)):
            raise RowError("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")
    messages = obj.get("messages")
    if has_m and not (isinstance(messages, list) and messages):
        raise RowError("'messages' must be a non-empty list of {role, content} objects", "messages")
    try:
        sp = parse_sampling(obj, defaults)
    except FieldError as e:
        raise RowError(str(e), e.field) from None
    k = obj.get("logprobs")
    if k is not None and not (is_int(k) and k >= 0):
        raise RowError(f"'logprobs' must be an integer >= 0 (top alternatives per token), got {k!r}", "logprobs")
    if sp.n > MAX_N:
        raise RowError(f"'n' is {sp.n}; a row asks for at most {MAX_N} answers", "n")
    return Row(line=line, id=rid, prompt=prompt, messages=messages, sp=dataclasses.replace(sp, logprobs=k),
               metadata=obj.get("metadata"), choices=obj.get("n") is not None)


# ---------------------------------------------------------------------------------------------
# the job
# ---------------------------------------------------------------------------------------------

class BatchRows:
    """The batch job kind (`specjax.jobs.JobKind`, resume by id): one request per answer of a row (`n`),
    the row's result (tokens, text, finish reason, speculation metrics) one output line once all have
    finished."""

    resume = "by_id"

    def __init__(self, llm: Any, defaults: SamplingParams, metrics: ServingMetrics, tool_parser: str | None = None,
                 prompt_details: bool = False, reasoning_parser: str | None = None):
        self.tokenizer, self.defaults, self.metrics, self.tool_parser = llm.tokenizer, defaults, metrics, tool_parser
        self.reasoning_parser = reasoning_parser
        self.prompt_details = prompt_details
        self.engine, self.max_len = llm.engine, llm.engine.cfg.max_len
        self.rows: dict[int, list[Any]] = {}  # rows with requests in the engine: [row, its requests, unfinished]

    def row_id(self, index: int, row: JsonlLine) -> Any:
        obj = row.value
        key = "custom_id" if batch_openai.is_openai_line(obj) else "id"
        return obj[key] if isinstance(obj, dict) and valid_id(obj.get(key)) else None

    def output_id(self, out: dict[str, Any]) -> Any:
        return out.get("custom_id", out.get("id"))

    def error(self, index: int, row: JsonlLine, message: str, field: str | None) -> Outcome:
        self.metrics.request_rejected("invalid_row")
        return Outcome(index, {"line": row.line, "id": self.row_id(index, row), "field": field,
                               "error": message}, failed=True)

    def admit(self, index: int, row: JsonlLine, submit: Submit) -> Outcome | None:
        if row.error is not None:
            return self.error(index, row, f"malformed JSON: {row.error}", None)
        try:
            parsed = parse_row(row.value, row.line, self.defaults, self.tool_parser)
        except RowError as e:
            return self.error(index, row, str(e), e.field)
        missing = missing_rule(parsed.sp, self.engine.cfg.options_served)
        if missing:
            return self.error(index, row, f"'{missing[0]}' needs a job started with --{missing[1].replace('_', '-')}",
                              parsed.field(missing[0]))
        if (parsed.sp.logprobs or 0) > self.engine.cfg.max_logprobs:
            return self.error(index, row, f"'logprobs' asks for {parsed.sp.logprobs} alternatives; this job computes "
                                          f"at most {self.engine.cfg.max_logprobs} (--max-logprobs)",
                              parsed.field("logprobs"))
        try:
            ids = self._prompt_ids(parsed)
            if parsed.messages is not None and parsed.openai is not None:  # an OpenAI chat line
                parsed.openai = dataclasses.replace(parsed.openai, reasoning=reasoning_start(
                    self.reasoning_parser, self.tokenizer, ids, parsed.sp))
            try:
                reqs = [build_engine_request(ids, sp, request_id=str(parsed.id) + (f"-{j}" if j else ""),
                                             tokenizer=self.tokenizer, vocab=self.engine.target_config.vocab_size)
                        for j, sp in enumerate(parsed.sp.choices())]
            except ValueError as e:
                raise RowError(str(e), getattr(e, "field", None) or ("stop" if parsed.sp.stop else "prompt")) from None
            submit(reqs[0])  # an engine refusal comes with the first, before any request is in flight
            for req in reqs[1:]:
                submit(req)
        except RowError as e:
            return self.error(index, row, str(e), parsed.field(e.field))
        except (ValueError, TypeError, KeyError) as e:  # tokenizer / template / engine refusals
            field = getattr(e, "field", None) or ("messages" if parsed.messages is not None else "prompt")
            return self.error(index, row, str(e), parsed.field(field))
        for _ in reqs:
            self.metrics.request_admitted(len(ids))
        self.rows[index] = [parsed, reqs, len(reqs)]
        return None

    def _prompt_ids(self, row: Row) -> list[int]:
        if row.prompt is None:  # as the server renders chat (content parts; an OpenAI line's template fields)
            template, tools = (row.openai.template, row.openai.tools) if row.openai is not None else ({}, None)
            try:
                ids = chat_prompt_ids(self.tokenizer, {"messages": row.messages, **template}, tools)
            except APIError as e:
                raise RowError(e.message, e.param) from None
        else:
            ids = encode_text(self.tokenizer, row.prompt) if isinstance(row.prompt, str) else list(row.prompt)
        try:
            ids = truncate_prompt(ids, row.sp, self.max_len)
        except ValueError as e:
            raise RowError(str(e), "truncate_prompt_tokens") from None
        if len(ids) + 1 > self.max_len:
            raise RowError(f"prompt of {len(ids)} tokens is too long: max_model_len {self.max_len} must hold "
                           f"the prompt plus one generated token", "messages" if row.messages else "prompt")
        return ids

    def finished(self, index: int, request: Any, submit: Submit) -> Outcome | None:
        n_prompt, n_out = len(request.prompt_ids), len(request.output_ids)
        self.metrics.tokens_generated(n_out)
        self.metrics.request_finished(request.finish_reason or "length", request.metrics.latencies(n_out),
                                      (n_prompt, n_out))
        if self.engine.prefixes is not None:
            self.metrics.prefix_cache_lookup(n_prompt, request.metrics.cached_tokens)
        entry = self.rows[index]
        entry[2] -= 1
        if entry[2]:
            return None  # choices still running
        del self.rows[index]
        return Outcome(index, self._record(entry[0], entry[1]))

    def _record(self, row: Row, reqs: list[Any]) -> dict[str, Any]:
        """The output line of a row whose requests (one per answer) have all finished."""
        chat = row.openai is not None and row.openai.url == "/v1/chat/completions"
        answers = [batch_openai.Answer(
            None if self.tokenizer is None else request_text(self.tokenizer, r), list(r.output_ids),
            r.finish_reason or "length", r.stop_reason,
            None if row.sp.logprobs is None else logprobs_block(self.tokenizer, list(r.output_ids), r.output_logprobs,
                                                                chat))
            for r in reqs]
        n_prompt, n_out = len(reqs[0].prompt_ids), sum(len(a.token_ids) for a in answers)
        counts = usage(n_prompt, n_out, reqs, prompt_details=self.prompt_details, n=len(reqs))
        spec = combined_spec_metrics([request_spec_metrics(r.metrics) for r in reqs])
        if row.openai is not None:
            return batch_openai.output_line(row.id, row.openai, answers, counts, spec)
        outs = [{"token_ids": a.token_ids, "text": a.text, "finish_reason": a.finish_reason,
                 "stop_reason": a.stop_reason, **({"logprobs": a.logprobs} if a.logprobs is not None else {})}
                for a in answers]
        if row.choices:
            rec = {"id": row.id, "choices": [{"index": j, **o, "completion_tokens": len(a.token_ids),
                                              "metrics": request_spec_metrics(r.metrics)}
                                             for j, (o, a, r) in enumerate(zip(outs, answers, reqs))]}
        else:
            rec = {"id": row.id, **outs[0]}
        rec.update(prompt_tokens=n_prompt, completion_tokens=n_out, metrics=spec)
        rec.update({k: counts[k] for k in ("prompt_tokens_details", "completion_tokens_details") if k in counts})
        if row.metadata is not None:
            rec["metadata"] = row.metadata
        return rec


def run_batch_job(llm: Any, input_path: str, output_path: str, *, errors_path: str | None = None,
                  shard: Shard | None = None, defaults: SamplingParams | None = None, window: int | None = None,
                  progress: bool = True, tool_parser: str | None = None,
                  prompt_tokens_details: bool = False, reasoning_parser: str | None = None) -> JobSummary:
    """Run (or resume) a batch job over `input_path` with `llm` (an `specjax.LLM`); see module docstring.

    output_path: the job's output (a shard suffix is added when `shard.count > 1`); errors_path:
    default `<stem>.errors.jsonl` of the shard's output; shard: default jax.process_index()/count();
    defaults: sampling for fields a row leaves out (default SamplingParams()); window: requests in
    flight (default 2 x max_num_seqs); tool_parser: `serving.tool_parsers.PARSERS` name that serves OpenAI
    lines' tool_choice "auto"; prompt_tokens_details: every row's usage carries prompt_tokens_details.cached_tokens
    (prefix caching); reasoning_parser: a `serving.reasoning.PARSERS` name (OpenAI chat lines' thinking as
    the message's `reasoning`). The summary's `metrics` are the job's serving metrics.
    """
    check_tool_parser(tool_parser), check_reasoning_parser(reasoning_parser)
    engine = llm.engine
    metrics = ServingMetrics(model_name="batch", gamma=engine.gamma, max_tokens_bucket=engine.buckets.tokens[-1],
                             max_slots=engine.cfg.max_slots, max_model_len=engine.cfg.max_len)
    shard = shard or Shard.from_jax()
    prev_hook = engine.on_round

    def hook(info: dict[str, Any]) -> None:
        if prev_hook is not None:
            prev_hook(info)
        metrics.observe_round(info)

    kind = BatchRows(llm, defaults or SamplingParams(), metrics, tool_parser, prompt_tokens_details, reasoning_parser)
    engine.on_round, preemptions0 = hook, engine.stats["preemptions"]
    try:
        summary = run_jsonl_job(kind, engine, input_path, output_path, errors_path=errors_path,
                                window=window or 2 * engine.cfg.max_slots, shard=shard,
                                progress=progress, desc=f"batch {shard}")
    finally:
        engine.on_round = prev_hook
    metrics.engine_preemptions(engine.stats["preemptions"] - preemptions0)
    summary.metrics = metrics.snapshot()
    return summary


__all__ = ["BatchRows", "ROW_FIELDS", "Row", "RowError", "parse_row", "run_batch_job"]
