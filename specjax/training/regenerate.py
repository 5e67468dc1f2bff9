"""Regenerate training answers with the target itself, through specjax's batched engine (§7.2).

Input rows (JSONL, one object a line; blank lines are ignored):
    {"turns": ["user turn", ...]}                                     chat, user turns only
    {"conversations": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
        (ShareGPT {"from": "human"|"gpt"|..., "value": ...} messages are read too)
    {"prompt": "text"}                                                plain completion, no template
An optional "id" is kept; without one the row's 0-based index is its id.

Chat rows: every original assistant turn is dropped; system and user turns are replayed in order,
and after each user turn the target generates the assistant reply on the regenerated history
(chat template from the tokenizer, generation prompt added, `enable_thinking` on or off). Output:
    {"id": ..., "conversations": [{"role", "content"}, ...]}
Completion rows: {"id": ..., "prompt": ..., "completion": ...}.

Sampling defaults are Qwen3's non-thinking ones (temperature 0.7, top-p 0.8, top-k 20, max_tokens
4096); each request's max_tokens is capped by the room left in the context. Request seeds are
derived from (seed, row index, turn), so a row regenerates the same way whatever its batch mates.

Ordered, resumable writes: rows are written in input order, each to exactly one file — the output,
or the errors file ({"line": 1-based line, "index": 0-based row, "id", "error": reason}) — as one
fsynced line. Finished rows wait in a bounded reorder buffer (`window` rows admitted but not yet
written) until every earlier row is written. So after `kill -9` the two files together hold exactly
the first K rows of the input: a rerun cuts a torn last line, counts K, checks that the files match
the input's first K rows, and continues from row K (no duplicate, no gap, same order).

Sharding (one process per host): with `shard=(i, n)` this process regenerates the rows whose
0-based index is i modulo n into `<output stem>.shard-<i>-of-<n>.jsonl` (and its own errors file),
with the same ordering and resume rules within its shard. Row indices, ids and seeds stay global,
so the shards together hold exactly the rows one process would have written.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Iterator

from specjax.api import SamplingParams, encode_chat, encode_text
from specjax.io import DurableAppender, JsonlLine, iter_jsonl, read_jsonl
from specjax.serving.batch_job import Shard, shard_output_path

QWEN3_DEFAULTS = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=4096)
ROLE_ALIASES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
                "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                "system": "system"}


class RowError(ValueError):
    """A row that cannot be regenerated (its reason goes to the errors file)."""


@dataclasses.dataclass
class Item:
    """One input row being regenerated."""

    index: int  # 0-based among non-blank rows
    line: int  # 1-based line in the file
    id: Any
    kind: str = "chat"  # "chat" | "completion"
    pending: list[dict[str, str]] = dataclasses.field(default_factory=list)  # turns still to replay
    history: list[dict[str, str]] = dataclasses.field(default_factory=list)
    prompt: str = ""
    completion: str | None = None
    turn: int = 0  # assistant replies generated so far
    error: str | None = None
    tokens: int = 0

    def record(self) -> dict[str, Any]:
        if self.kind == "completion":
            return {"id": self.id, "prompt": self.prompt, "completion": self.completion}
        return {"id": self.id, "conversations": self.history}

    def error_record(self) -> dict[str, Any]:
        return {"line": self.line, "index": self.index, "id": self.id, "error": self.error}


def _row_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that fail one row (tokenizer, chat template, context, engine admission checks)."""
    errs: tuple[type[BaseException], ...] = (ValueError, TypeError, KeyError, IndexError)
    try:
        from jinja2 import TemplateError  # chat templates raise it, e.g. for an unsupported role order
        errs += (TemplateError,)
    except ImportError:
        pass
    return errs


def _valid_id(rid: Any) -> bool:
    return (isinstance(rid, str) and rid != "") or (isinstance(rid, int) and not isinstance(rid, bool))


def row_id(obj: Any, index: int) -> Any:
    """The output id of a decoded row: its "id" when valid, else the 0-based row index."""
    if isinstance(obj, dict) and _valid_id(obj.get("id")):
        return obj["id"]
    return index


def parse_row(obj: Any, index: int, line: int) -> Item:
    """Validate one decoded row into an `Item`; RowError names the field."""
    rid = row_id(obj, index)
    if not isinstance(obj, dict):
        raise RowError(f"row must be a JSON object, got {type(obj).__name__}")
    if "id" in obj and not _valid_id(obj["id"]):
        raise RowError(f"field 'id' must be a non-empty string or an integer, got {obj['id']!r}")
    present = [k for k in ("turns", "conversations", "prompt") if k in obj]
    if len(present) != 1:
        raise RowError("a row needs exactly one of 'turns', 'conversations' or 'prompt' "
                       f"(got {present or sorted(obj)})")
    item = Item(index=index, line=line, id=rid)
    if "prompt" in obj:
        p = obj["prompt"]
        if not isinstance(p, str) or not p:
            raise RowError("field 'prompt' must be a non-empty string")
        item.kind, item.prompt = "completion", p
        return item
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns:
            raise RowError("field 'turns' must be a non-empty list of strings")
        for i, t in enumerate(turns):
            if not isinstance(t, str) or not t:
                raise RowError(f"field 'turns[{i}]' must be a non-empty string")
        item.pending = [{"role": "user", "content": t} for t in turns]
        return item
    conv = obj["conversations"]
    if not isinstance(conv, list) or not conv:
        raise RowError("field 'conversations' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(conv):
        if not isinstance(m, dict):
            raise RowError(f"field 'conversations[{i}]' must be an object")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            raise RowError(f"field 'conversations[{i}].role' must be one of {sorted(ROLE_ALIASES)}, got {role!r}")
        if not isinstance(content, str):
            raise RowError(f"field 'conversations[{i}].content' must be a string")
        role = ROLE_ALIASES[role.lower()]
        if role != "assistant":  # original answers are discarded and regenerated
            item.pending.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in item.pending):
        raise RowError("field 'conversations' has no user turn")
    return item


@dataclasses.dataclass
class RegenSummary:
    """What one run of `regenerate` did."""

    output_path: str
    errors_path: str
    shard: str = "0/1"  # "i/n": this process's rows (index % n == i)
    rows: int = 0  # non-blank input rows of the shard
    skipped_done: int = 0  # written by earlier runs
    completed: int = 0
    errors: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tokens_per_second"] = self.generated_tokens / self.seconds if self.seconds > 0 else 0.0
        return d


def default_errors_path(output: str) -> str:
    """`<output stem>.errors.jsonl`."""
    stem = output[: -len(".jsonl")] if output.endswith(".jsonl") else output
    return f"{stem}.errors.jsonl"


def _input_rows(path: str, shard: Shard = Shard()) -> Iterator[tuple[int, JsonlLine]]:
    """(row index, line) of every non-blank input line of `shard` (index % count == shard
    index); an undecodable line has `error` set."""
    for index, row in enumerate(iter_jsonl(path, strict=False)):
        if index % shard.count == shard.index:
            yield index, row


def _check_resume(input_path: str, out_rows: list[dict[str, Any]], err_rows: list[dict[str, Any]],
                  out_path: str, err_path: str, shard: Shard = Shard()) -> int:
    """Rows already done (K); ValueError if the files are not exactly the shard's first K rows."""
    done = len(out_rows) + len(err_rows)
    err_idx = []
    for r in err_rows:
        if not isinstance(r.get("index"), int):
            raise ValueError(f"{err_path}: row without an integer 'index' was not written by regenerate")
        err_idx.append(r["index"])
    first = {shard.index + k * shard.count for k in range(done)}  # the shard's first K rows
    if sorted(err_idx) != err_idx or len(set(err_idx)) != len(err_idx) or any(i not in first for i in err_idx):
        raise ValueError(f"{err_path}: error rows {err_idx} do not fit the {done} rows already written "
                         f"(was {out_path} or {err_path} edited or replaced?)")
    errs = set(err_idx)
    outs = iter(out_rows)
    n_rows = 0
    for index, row in _input_rows(input_path, shard):
        if index not in first:
            break
        n_rows += 1
        if index in errs:
            continue
        line = row.line
        want = index if row.error is not None else row_id(row.value, index)
        got = next(outs).get("id")
        if got != want:
            raise ValueError(f"{out_path} does not continue {input_path}: output row for input line {line} "
                             f"has id {got!r}, expected {want!r} (use a new --out, or the same input)")
    if n_rows < done:
        raise ValueError(f"{out_path} and {err_path} hold {done} rows but {input_path} has only {n_rows}")
    return done


def request_seed(seed: int, index: int, turn: int) -> int:
    """The sampling seed of a row's `turn`-th reply (distinct per (seed, row, turn), < 2**63)."""
    return ((seed & 0x7FFFFFFF) << 32 | (index & 0xFFFFFF) << 8 | (turn & 0xFF)) & ((1 << 63) - 1)


def regenerate(llm: Any, input_path: str, output_path: str, *, errors_path: str | None = None,
               sampling: SamplingParams = QWEN3_DEFAULTS, enable_thinking: bool | None = False,
               seed: int = 0, window: int | None = None, limit: int | None = None,
               shard: Shard | None = None, progress: bool = True) -> RegenSummary:
    """Regenerate (or resume regenerating) `input_path` into `output_path` (module docstring).

    llm: a `specjax.LLM` with a tokenizer (chat rows need its chat template); sampling: every
    request's parameters (its `seed` is ignored: seeds derive from `seed`); window: rows admitted
    but not yet written (default 4 x max_num_seqs; bounds the reorder buffer); limit: process at
    most this many rows in this run; shard: this process's rows (default
    jax.process_index()/process_count(); the output gets a shard suffix when count > 1)."""
    from tqdm.auto import tqdm

    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"prompts file does not exist: {input_path}")
    engine = llm.engine
    if engine.has_work():
        raise RuntimeError("the LLM's engine is busy with other requests")
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise ValueError("regenerate needs a tokenizer (the target directory has no tokenizer files)")
    window = window or 4 * engine.cfg.max_slots
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    shard = shard or Shard.from_jax()
    output_path = shard_output_path(output_path, shard)
    err_path = errors_path or default_errors_path(output_path)
    if os.path.abspath(err_path) == os.path.abspath(output_path):
        raise ValueError(f"the errors file must differ from the output file ({output_path})")
    resumed = dict(objects=True, repair_torn_tail=True, missing_ok=True)
    out_rows = read_jsonl(output_path, **resumed)
    err_rows = read_jsonl(err_path, **resumed)
    done = _check_resume(input_path, out_rows, err_rows, output_path, err_path, shard)
    summary = RegenSummary(output_path=output_path, errors_path=err_path,
                           shard=f"{shard.index}/{shard.count}")
    total = sum(1 for _ in _input_rows(input_path, shard))
    summary.rows, summary.skipped_done = total, done
    todo = total - done if limit is None else min(total - done, limit)
    max_len = engine.cfg.max_len
    row_errors = _row_errors()

    out = DurableAppender(output_path)
    err = DurableAppender(err_path)
    ready: dict[int, Item] = {}  # finished (or failed) rows waiting for their turn to be written
    by_req: dict[int, Item] = {}  # id(EngineRequest) -> its row
    open_rows = 0  # admitted and not yet written
    next_write = done  # position in the shard of the next row to write
    first_todo = shard.index + done * shard.count  # its row index
    t0 = time.perf_counter()
    bar = tqdm(total=todo, desc="regenerate", unit="row", disable=not progress)

    def flush() -> None:
        nonlocal next_write, open_rows
        while (index := shard.index + next_write * shard.count) in ready:
            item = ready.pop(index)
            if item.error is None:
                out.append(item.record())
                summary.completed += 1
            else:
                err.append(item.error_record())
                summary.errors += 1
            next_write += 1
            open_rows -= 1
            bar.update(1)

    def fail(item: Item, reason: str) -> None:
        item.error = reason
        ready[item.index] = item

    def submit(item: Item) -> None:
        """Queue the row's next request, or mark it finished when nothing is left to generate."""
        if item.kind == "completion":
            if item.completion is not None:
                ready[item.index] = item
                return
            ids = encode_text(tokenizer, item.prompt)
        else:
            while item.pending and item.pending[0]["role"] != "user":
                item.history.append(item.pending.pop(0))
            if not item.pending:
                ready[item.index] = item
                return
            item.history.append(item.pending.pop(0))
            ids = encode_chat(tokenizer, item.history, enable_thinking=enable_thinking)
        room = max_len - len(ids)
        if room < 1:
            what = "prompt" if item.kind == "completion" else f"conversation at user turn {item.turn + 1}"
            raise RowError(f"{what} is {len(ids)} tokens: no room to generate within max_model_len {max_len}")
        sp = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, room),
                                 seed=request_seed(seed, item.index, item.turn))
        req = llm.make_request(ids, sp, request_id=f"{item.index}:{item.turn}")
        engine.add_request(req)
        by_req[id(req)] = item
        summary.requests += 1
        summary.prompt_tokens += len(ids)

    def admit(index: int, row: JsonlLine) -> None:
        nonlocal open_rows
        open_rows += 1
        line, obj = row.line, row.value
        if row.error is not None:
            fail(Item(index=index, line=line, id=index), f"malformed JSON: {row.error}")
            return
        try:
            item = parse_row(obj, index, line)
        except RowError as e:
            fail(Item(index=index, line=line, id=row_id(obj, index)), str(e))
            return
        try:
            submit(item)
        except row_errors as e:  # template / tokenizer / context refusals
            fail(item, str(e))

    def finished(req: Any) -> None:
        item = by_req.pop(id(req))
        text = tokenizer.decode(list(req.output_ids), skip_special_tokens=True)
        item.tokens += len(req.output_ids)
        summary.generated_tokens += len(req.output_ids)
        item.turn += 1
        if item.kind == "completion":
            item.completion = text
        else:
            item.history.append({"role": "assistant", "content": text})
        try:
            submit(item)
        except row_errors as e:
            fail(item, str(e))

    rows = _input_rows(input_path, shard)
    admitted = 0
    exhausted = todo == 0
    last_post = 0.0
    try:
        while True:
            while not exhausted and open_rows < window:
                nxt = next(rows, None) if admitted < todo else None
                while nxt is not None and nxt[0] < first_todo:  # written by an earlier run
                    nxt = next(rows, None)
                if nxt is None:
                    exhausted = True
                    break
                admitted += 1
                admit(*nxt)
            flush()
            if not engine.has_work():
                # every open row is finished (flushed above) or has a request in the engine
                if open_rows:
                    raise RuntimeError("internal error: rows are open but no request is running")
                if exhausted:
                    break
                continue
            for req in engine.step():
                finished(req)
            flush()
            now = time.perf_counter()
            if now - last_post > 0.5:
                bar.set_postfix(tok_s=f"{summary.generated_tokens / max(now - t0, 1e-9):.1f}", refresh=False)
                last_post = now
    finally:
        rows.close()
        bar.close()
        out.close()
        err.close()
    summary.seconds = time.perf_counter() - t0
    return summary


__all__ = ["QWEN3_DEFAULTS", "RegenSummary", "RowError", "default_errors_path", "parse_row", "regenerate",
           "request_seed", "row_id"]
