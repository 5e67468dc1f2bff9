"""Resumable offline batch jobs: JSONL in, JSONL out keyed by `id`.

Input rows (one JSON object a line):
    {"id": "a1", "prompt": "text" | [token ids], ...}   or   {"id": 7, "messages": [{"role": ..., "content": ...}]}
    optional: temperature, top_k, top_p, max_tokens, stop, stop_token_ids, seed,
    num_speculative_tokens (sampling; defaults from the job), metadata (copied to the output).
Output rows (in completion order, not input order):
    {"id", "token_ids", "text", "finish_reason", "prompt_tokens", "completion_tokens", "metrics", ["metadata"]}
Error rows (`<output stem>.errors.jsonl` unless given):
    {"line": 1-based input line, "id": id or null, "field": offending field or null, "error": reason}

Resuming: on start the output and errors files are read (a torn last line, left by a kill, is cut
off first); rows whose id is in the output, and lines already in the errors file, are skipped. Each
finished row is one `write()` of one full line, then flush + fsync, so after `kill -9` a rerun loses
nothing and duplicates nothing. Ids must be unique: a later row with an id seen on an earlier line
(in any shard) is an error row. Rows without an explicit `seed` are sampled with engine seeds, so
a rerun of a sampled row may give different text (greedy rows are identical).

Sharding: with `shard=(i, n)` this process takes the input lines whose 0-based line index is i
modulo n and writes `<stem>.shard-<i>-of-<n>.jsonl` (and its own errors file). Rows are fed to the
engine in a window (default 2 x max_num_seqs in flight), so continuous batching keeps slots full.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Iterator

from specjax.api import SamplingParams, build_engine_request, encode_chat, encode_text
from specjax.decoding.engine import EngineRequest
from specjax.io import DurableAppender, JsonlLine, iter_jsonl, read_jsonl
from specjax.serving.metrics import ServingMetrics, request_spec_metrics
from specjax.serving.schema import SAMPLING_FIELDS, FieldError, parse_sampling

ROW_FIELDS = frozenset(("id", "prompt", "messages", "metadata") + SAMPLING_FIELDS)


@dataclasses.dataclass(frozen=True)
class Shard:
    """This process's share of the input: lines with index % count == index."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard must satisfy 0 <= index < count, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> "Shard":
        """'i/n' -> Shard(i, n)."""
        try:
            i, n = (int(x) for x in text.split("/"))
        except ValueError:
            raise ValueError(f"shard must look like 'i/n' (e.g. 0/4), got {text!r}") from None
        return cls(i, n)

    @classmethod
    def from_jax(cls) -> "Shard":
        """jax.process_index() / jax.process_count()."""
        import jax
        return cls(jax.process_index(), jax.process_count())


def _stem(path: str) -> str:
    return path[: -len(".jsonl")] if path.endswith(".jsonl") else path


def shard_output_path(output: str, shard: Shard) -> str:
    """The output file of one shard (the path itself when there is one shard)."""
    if shard.count == 1:
        return output
    return f"{_stem(output)}.shard-{shard.index}-of-{shard.count}.jsonl"


def default_errors_path(output: str) -> str:
    return f"{_stem(output)}.errors.jsonl"


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


def _id_key(rid: Any) -> str:
    return json.dumps(rid)


def _valid_id(rid: Any) -> bool:
    return (isinstance(rid, str) and rid != "") or (isinstance(rid, int) and not isinstance(rid, bool))


def parse_row(obj: Any, line: int, defaults: SamplingParams) -> Row:
    """Validate one decoded input row; RowError names the field."""
    if not isinstance(obj, dict):
        raise RowError(f"row must be a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        raise RowError("missing field 'id'", "id")
    rid = obj["id"]
    if not _valid_id(rid):
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
                  and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            raise RowError("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")
    messages = obj.get("messages")
    if has_m and not (isinstance(messages, list) and messages):
        raise RowError("'messages' must be a non-empty list of {role, content} objects", "messages")
    try:
        sp = parse_sampling(obj, defaults)
    except FieldError as e:
        raise RowError(str(e), e.field) from None
    return Row(line=line, id=rid, prompt=prompt, messages=messages, sp=sp, metadata=obj.get("metadata"))


def _first_lines(input_path: str) -> dict[str, int]:
    """id key -> the first line carrying it (over the whole input, every shard)."""
    first: dict[str, int] = {}
    for row in iter_jsonl(input_path, strict=False):
        obj = row.value
        if isinstance(obj, dict) and _valid_id(obj.get("id")):
            first.setdefault(_id_key(obj["id"]), row.line)
    return first


# ---------------------------------------------------------------------------------------------
# the job
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class BatchSummary:
    """What one run of a job did."""

    output_path: str
    errors_path: str
    shard: Shard
    rows_in_shard: int = 0
    skipped_done: int = 0  # already in the output or errors file from an earlier run
    completed: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shard"] = f"{self.shard.index}/{self.shard.count}"
        d["tokens_per_second"] = self.generated_tokens / self.seconds if self.seconds > 0 else 0.0
        return d


def run_batch_job(llm: Any, input_path: str, output_path: str, *, errors_path: str | None = None,
                  shard: Shard | None = None, defaults: SamplingParams | None = None, window: int | None = None,
                  progress: bool = True) -> BatchSummary:
    """Run (or resume) a batch job over `input_path` with `llm` (an `specjax.LLM`); see module docstring.

    output_path: the job's output (a shard suffix is added when `shard.count > 1`); errors_path:
    default `<stem>.errors.jsonl` of the shard's output; shard: default jax.process_index()/count();
    defaults: sampling for fields a row leaves out (default SamplingParams()); window: requests in
    flight (default 2 x max_num_seqs).
    """
    from tqdm.auto import tqdm

    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input file does not exist: {input_path}")
    shard = shard or Shard.from_jax()
    defaults = defaults or SamplingParams()
    engine = llm.engine
    if engine.has_work():
        raise RuntimeError("the LLM's engine is busy with other requests; a batch job needs it to itself")
    window = window or 2 * engine.cfg.max_slots
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out_path = shard_output_path(output_path, shard)
    err_path = errors_path or default_errors_path(out_path)
    if os.path.abspath(err_path) == os.path.abspath(out_path):
        raise ValueError(f"errors_path must differ from the output path ({out_path})")
    resumed = dict(objects=True, repair_torn_tail=True, missing_ok=True)
    done_ids = {_id_key(r["id"]) for r in read_jsonl(out_path, **resumed) if "id" in r}
    done_lines = {int(r["line"]) for r in read_jsonl(err_path, **resumed) if isinstance(r.get("line"), int)}
    first_line = _first_lines(input_path)
    tokenizer = llm.tokenizer
    max_len = engine.cfg.max_len
    summary = BatchSummary(output_path=out_path, errors_path=err_path, shard=shard)

    # rows of this shard, minus what earlier runs finished
    mine = [row for row in iter_jsonl(input_path, strict=False) if (row.line - 1) % shard.count == shard.index]
    todo: list[JsonlLine] = []
    for row in mine:
        n, obj = row.line, row.value
        summary.rows_in_shard += 1
        if n in done_lines:
            summary.skipped_done += 1
            continue
        if isinstance(obj, dict) and _valid_id(obj.get("id")) and _id_key(obj["id"]) in done_ids \
                and first_line.get(_id_key(obj["id"])) == n:
            summary.skipped_done += 1
            continue
        todo.append(row)

    metrics = ServingMetrics(model_name="batch", gamma=engine.gamma, max_tokens_bucket=engine.buckets.tokens[-1],
                             max_slots=engine.cfg.max_slots)
    prev_hook = engine.on_round

    def hook(info: dict[str, Any]) -> None:
        if prev_hook is not None:
            prev_hook(info)
        metrics.observe_round(info)
    engine.on_round = hook

    out = DurableAppender(out_path)
    err = DurableAppender(err_path)
    in_flight: dict[int, Row] = {}
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc=f"batch {shard.index}/{shard.count}", unit="row", disable=not progress)

    def fail(line: int, rid: Any, message: str, field: str | None) -> None:
        err.append({"line": line, "id": rid, "field": field, "error": message})
        summary.errors += 1
        metrics.request_rejected("invalid_row")
        bar.update(1)

    def admit(row: JsonlLine) -> None:
        line, obj = row.line, row.value
        if row.error is not None:
            fail(line, None, f"malformed JSON: {row.error}", None)
            return
        rid = obj.get("id") if isinstance(obj, dict) else None
        rid = rid if _valid_id(rid) else None
        if rid is not None and first_line.get(_id_key(rid), line) != line:
            fail(line, rid, f"duplicate id {rid!r} (first seen on line {first_line[_id_key(rid)]})", "id")
            return
        try:
            row = parse_row(obj, line, defaults)
            if row.prompt is not None:
                ids = encode_text(tokenizer, row.prompt) if isinstance(row.prompt, str) else list(row.prompt)
            else:
                ids = encode_chat(tokenizer, row.messages)
            if len(ids) + 1 > max_len:
                raise RowError(f"prompt of {len(ids)} tokens is too long: max_model_len {max_len} must hold "
                               f"the prompt plus one generated token", "messages" if row.messages else "prompt")
            try:
                req = build_engine_request(ids, row.sp, request_id=str(rid), tokenizer=tokenizer)
            except ValueError as e:
                raise RowError(str(e), "stop" if row.sp.stop else "prompt") from None
            engine.add_request(req)
        except RowError as e:
            fail(line, rid, str(e), e.field)
            return
        except (ValueError, TypeError, KeyError) as e:  # tokenizer / template / engine refusals
            fail(line, rid, str(e), "messages" if isinstance(obj, dict) and "messages" in obj else "prompt")
            return
        summary.prompt_tokens += len(ids)
        metrics.request_admitted(len(ids))
        in_flight[id(req)] = row

    def finish(req: EngineRequest) -> None:
        row = in_flight.pop(id(req))
        ids = list(req.output_ids)
        rec: dict[str, Any] = {
            "id": row.id, "token_ids": ids,
            "text": None if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True),
            "finish_reason": req.finish_reason or "length", "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(ids), "metrics": request_spec_metrics(req.metrics)}
        if row.metadata is not None:
            rec["metadata"] = row.metadata
        out.append(rec)
        summary.completed += 1
        summary.generated_tokens += len(ids)
        metrics.tokens_generated(len(ids))
        metrics.request_finished(rec["finish_reason"])
        bar.update(1)

    source: Iterator[JsonlLine] = iter(todo)
    exhausted = False
    last_post = 0.0
    try:
        while True:
            while not exhausted and len(in_flight) < window:
                nxt = next(source, None)
                if nxt is None:
                    exhausted = True
                    break
                admit(nxt)
            if not engine.has_work():
                if exhausted:
                    break
                continue
            for req in engine.step():
                finish(req)
            now = time.perf_counter()
            if now - last_post > 0.5:
                bar.set_postfix(tok_s=f"{summary.generated_tokens / max(now - t0, 1e-9):.1f}", refresh=False)
                last_post = now
    finally:
        engine.on_round = prev_hook
        bar.close()
        out.close()
        err.close()
    summary.seconds = time.perf_counter() - t0
    summary.metrics = metrics.snapshot()
    return summary
