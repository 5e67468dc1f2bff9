"""The resumable, sharded JSONL -> engine -> JSONL job runner (regeneration and batch jobs).

A job reads an input JSONL file row by row (its non-blank lines; a row's index is its 0-based
position among them), turns each row into one or more engine requests through its `JobKind`, and
writes exactly one line per row: to the output file, or to the errors file when the row fails
(malformed JSON, a bad field, a refusal by the tokenizer, the chat template or the engine); the
job goes on. Each line is one fsynced write (`DurableAppender`), so after `kill -9` the files hold
whole lines only (a torn last line is cut on the next start).

Resume, chosen by the kind:
    ordered  rows are written in input order; finished rows wait in a reorder buffer until every
             earlier row is written. After a kill the two files hold exactly the shard's first K
             rows: a rerun checks that the output's ids and the error rows' `index` fields are
             those rows and continues from row K (no duplicate, no gap, same order).
    by_id    rows are written as they finish. A rerun skips the rows whose id is in the output
             (on the first line carrying that id) and the lines already in the errors file. Ids
             must be unique: a row repeating an id of an earlier line (in any shard) is an error.

Sharding: with `Shard(i, n)` this process takes the rows whose index is i modulo n and writes
`<stem>.shard-<i>-of-<n>.jsonl` (and its own errors file); row indices and ids stay global, so
the shards together hold exactly the rows one process would have written.

`deadline` (a `time.monotonic()` value) ends a run early: past it the runner admits and steps no
more and returns (`JobSummary.stopped`); the rows written stay, the rows in flight are dropped
(the engine still holds their requests: discard it), and a rerun continues as after a kill.

`window` bounds the rows admitted but not yet written (requests in flight, plus the reorder
buffer when ordered), so continuous batching keeps the engine's slots full with bounded memory.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Iterator, Literal, Protocol

from specjax.io import DurableAppender, JsonlLine, iter_jsonl, read_jsonl

Submit = Callable[[Any], None]  # hands one EngineRequest of the current row to the engine


@dataclasses.dataclass(frozen=True)
class Shard:
    """This process's share of the input: rows with index % count == index."""

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

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def _stem(path: str) -> str:
    return path[: -len(".jsonl")] if path.endswith(".jsonl") else path


def shard_output_path(output: str, shard: Shard) -> str:
    """The output file of one shard (the path itself when there is one shard)."""
    if shard.count == 1:
        return output
    return f"{_stem(output)}.shard-{shard.index}-of-{shard.count}.jsonl"


def default_errors_path(output: str) -> str:
    """`<output stem>.errors.jsonl`."""
    return f"{_stem(output)}.errors.jsonl"


def valid_id(rid: Any) -> bool:
    """A row id is a non-empty string or an integer (not a bool)."""
    return (isinstance(rid, str) and rid != "") or (isinstance(rid, int) and not isinstance(rid, bool))


@dataclasses.dataclass
class Outcome:
    """A row's one line: `record` goes to the output file, or to the errors file when `failed`."""

    index: int
    record: dict[str, Any]
    failed: bool = False


class JobKind(Protocol):
    """What a job does with its rows (the runner owns files, order, resume, shards and the engine
    loop). `admit` and `finished` return the row's outcome, or None while a request of the row is
    in the engine (submitted through `submit`); a failing row is an `Outcome(failed=True)`."""

    resume: Literal["ordered", "by_id"]

    def row_id(self, index: int, row: JsonlLine) -> Any:
        """ordered: the id the row's output line carries; by_id: the row's id, None if it has none."""

    def output_id(self, out: dict[str, Any]) -> Any:
        """The row id an output line carries (None if none)."""

    def error(self, index: int, row: JsonlLine, message: str, field: str | None) -> Outcome:
        """The error line of a row the runner refuses (by_id: a repeated id)."""

    def admit(self, index: int, row: JsonlLine, submit: Submit) -> Outcome | None:
        """Start a row."""

    def finished(self, index: int, request: Any, submit: Submit) -> Outcome | None:
        """A request of row `index` finished."""


@dataclasses.dataclass
class JobSummary:
    """What one run of a job did."""

    output_path: str
    errors_path: str
    shard: str = "0/1"  # "i/n": this process's rows (index % n == i)
    rows: int = 0  # input rows of the shard
    skipped_done: int = 0  # written by earlier runs
    completed: int = 0
    errors: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    stopped: str | None = None  # why the run ended before the shard's last row ("time limit")
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tokens_per_second"] = self.generated_tokens / self.seconds if self.seconds > 0 else 0.0
        return d


def shard_rows(path: str, shard: Shard) -> Iterator[tuple[int, JsonlLine]]:
    """(row index, line) of every row of `shard`; an undecodable line has `error` set."""
    for index, row in enumerate(iter_jsonl(path, strict=False)):
        if index % shard.count == shard.index:
            yield index, row


def _id_key(rid: Any) -> str:
    return json.dumps(rid)


def _ordered_done(kind: JobKind, input_path: str, out_rows: list[dict[str, Any]],
                  err_rows: list[dict[str, Any]], out_path: str, err_path: str,
                  shard: Shard) -> int:
    """Rows already done (K); ValueError if the files are not exactly the shard's first K rows."""
    done = len(out_rows) + len(err_rows)
    err_idx = []
    for r in err_rows:
        if not isinstance(r.get("index"), int):
            raise ValueError(f"{err_path}: row without an integer 'index' was not written by this job")
        err_idx.append(r["index"])
    first = {shard.index + k * shard.count for k in range(done)}  # the shard's first K rows
    if sorted(err_idx) != err_idx or len(set(err_idx)) != len(err_idx) or any(i not in first for i in err_idx):
        raise ValueError(f"{err_path}: error rows {err_idx} do not fit the {done} rows already written "
                         f"(was {out_path} or {err_path} edited or replaced?)")
    errs, outs, n_rows = set(err_idx), iter(out_rows), 0
    for index, row in shard_rows(input_path, shard):
        if index not in first:
            break
        n_rows += 1
        if index in errs:
            continue
        want, got = kind.row_id(index, row), kind.output_id(next(outs))
        if got != want:
            raise ValueError(f"{out_path} does not continue {input_path}: output row for input line {row.line} "
                             f"has id {got!r}, expected {want!r} (use a new --out, or the same input)")
    if n_rows < done:
        raise ValueError(f"{out_path} and {err_path} hold {done} rows but {input_path} has only {n_rows}")
    return done


def _first_lines(kind: JobKind, input_path: str) -> dict[str, int]:
    """id key -> the first line carrying it (over the whole input, every shard)."""
    first: dict[str, int] = {}
    for index, row in enumerate(iter_jsonl(input_path, strict=False)):
        rid = kind.row_id(index, row)
        if rid is not None:
            first.setdefault(_id_key(rid), row.line)
    return first


def _rows_to_do(kind: JobKind, input_path: str, out_path: str, err_path: str, shard: Shard,
                summary: JobSummary) -> tuple[list[tuple[int, JsonlLine]], dict[str, int] | None]:
    """The shard's rows that earlier runs did not write (and, by_id, the first line of each id)."""
    resumed = dict(objects=True, repair_torn_tail=True, missing_ok=True)
    out_rows, err_rows = read_jsonl(out_path, **resumed), read_jsonl(err_path, **resumed)
    mine = list(shard_rows(input_path, shard))
    summary.rows = len(mine)
    if kind.resume == "ordered":
        done = _ordered_done(kind, input_path, out_rows, err_rows, out_path, err_path, shard)
        summary.skipped_done = done
        return mine[done:], None
    first = _first_lines(kind, input_path)
    done_ids = {_id_key(rid) for r in out_rows if (rid := kind.output_id(r)) is not None}
    done_lines = {int(r["line"]) for r in err_rows if isinstance(r.get("line"), int)}
    todo = []
    for index, row in mine:
        rid = kind.row_id(index, row)
        if row.line in done_lines or (rid is not None and _id_key(rid) in done_ids
                                      and first.get(_id_key(rid)) == row.line):
            summary.skipped_done += 1
        else:
            todo.append((index, row))
    return todo, first


class _JobRun:
    """The engine loop of one run: admits rows into a window, routes finished requests to the
    kind, and writes each row's outcome (in input order when the kind resumes ordered)."""

    def __init__(self, kind: JobKind, engine: Any, summary: JobSummary, shard: Shard,
                 first_line: dict[str, int] | None, next_index: int | None, bar: Any):
        self.kind, self.engine, self.summary, self.bar = kind, engine, summary, bar
        self.shard, self.first_line = shard, first_line
        self.out = DurableAppender(summary.output_path)
        self.err = DurableAppender(summary.errors_path)
        self.by_req: dict[int, int] = {}  # id(EngineRequest) -> its row index
        self.ready: dict[int, Outcome] = {}  # ordered: finished rows waiting for their turn
        self.next_index = next_index  # ordered: the index of the next row to write
        self.open = 0  # rows admitted and not yet written

    def run(self, todo: Iterator[tuple[int, JsonlLine]], window: int,
            deadline: float | None = None) -> None:
        t0, last_post, exhausted = time.perf_counter(), 0.0, False
        try:
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    if self.open or next(todo, None) is not None:
                        self.summary.stopped = "time limit"
                    break
                while not exhausted and self.open < window:
                    nxt = next(todo, None)
                    if nxt is None:
                        exhausted = True
                        break
                    self._admit(*nxt)
                if not self.engine.has_work():
                    # every open row is written or has a request in the engine
                    if self.open:
                        raise RuntimeError("internal error: rows are open but no request is running")
                    if exhausted:
                        break
                    continue
                for req in self.engine.step():
                    self._finished(req)
                now = time.perf_counter()
                if now - last_post > 0.5:
                    rate = self.summary.generated_tokens / max(now - t0, 1e-9)
                    self.bar.set_postfix(tok_s=f"{rate:.1f}", refresh=False)
                    last_post = now
        finally:
            self.out.close()
            self.err.close()

    def _submit(self, index: int, req: Any) -> None:
        self.engine.add_request(req)
        self.by_req[id(req)] = index
        self.summary.requests += 1
        self.summary.prompt_tokens += len(req.prompt_ids)

    def _admit(self, index: int, row: JsonlLine) -> None:
        self.open += 1
        rid = self.kind.row_id(index, row) if self.first_line is not None else None
        first = self.first_line.get(_id_key(rid), row.line) if rid is not None else row.line
        if first != row.line:
            self._emit(self.kind.error(index, row, f"duplicate id {rid!r} (first seen on line {first})", "id"))
            return
        outcome = self.kind.admit(index, row, lambda req: self._submit(index, req))
        if outcome is not None:
            self._emit(outcome)

    def _finished(self, req: Any) -> None:
        index = self.by_req.pop(id(req))
        self.summary.generated_tokens += len(req.output_ids)
        outcome = self.kind.finished(index, req, lambda r: self._submit(index, r))
        if outcome is not None:
            self._emit(outcome)

    def _emit(self, outcome: Outcome) -> None:
        if self.next_index is None:
            self._write(outcome)
            return
        self.ready[outcome.index] = outcome
        while self.next_index in self.ready:
            self._write(self.ready.pop(self.next_index))
            self.next_index += self.shard.count

    def _write(self, outcome: Outcome) -> None:
        if outcome.failed:
            self.err.append(outcome.record)
            self.summary.errors += 1
        else:
            self.out.append(outcome.record)
            self.summary.completed += 1
        self.open -= 1
        self.bar.update(1)


def run_jsonl_job(kind: JobKind, engine: Any, input_path: str, output_path: str, *,
                  window: int, errors_path: str | None = None, shard: Shard | None = None,
                  limit: int | None = None, progress: bool = True, desc: str = "job",
                  deadline: float | None = None) -> JobSummary:
    """Run (or resume) `kind` over `input_path` on `engine` (module docstring).

    output_path: the job's output (a shard suffix is added when `shard.count > 1`); errors_path:
    default `<stem>.errors.jsonl` of the shard's output; shard: default
    jax.process_index()/count(); window: rows admitted but not yet written; limit: process at
    most this many rows in this run; deadline: a `time.monotonic()` value that ends the run
    (module docstring)."""
    from tqdm.auto import tqdm

    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input file does not exist: {input_path}")
    if engine.has_work():
        raise RuntimeError("the LLM's engine is busy with other requests; a job needs it to itself")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    shard = shard or Shard.from_jax()
    out_path = shard_output_path(output_path, shard)
    err_path = errors_path or default_errors_path(out_path)
    if os.path.abspath(err_path) == os.path.abspath(out_path):
        raise ValueError(f"the errors file must differ from the output file ({out_path})")
    summary = JobSummary(output_path=out_path, errors_path=err_path, shard=str(shard))
    todo, first_line = _rows_to_do(kind, input_path, out_path, err_path, shard, summary)
    todo = todo if limit is None else todo[:limit]
    next_index = None
    if kind.resume == "ordered":
        next_index = shard.index + summary.skipped_done * shard.count
    bar = tqdm(total=len(todo), desc=desc, unit="row", disable=not progress)
    t0 = time.perf_counter()
    try:
        _JobRun(kind, engine, summary, shard, first_line, next_index, bar).run(
            iter(todo), window, deadline)
    finally:
        bar.close()
    summary.seconds = time.perf_counter() - t0
    return summary


__all__ = ["JobKind", "JobSummary", "Outcome", "Shard", "Submit", "default_errors_path",
           "run_jsonl_job", "shard_output_path", "shard_rows", "valid_id"]
