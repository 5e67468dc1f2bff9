"""Regenerate training answers with the target itself, through specjax's batched engine (§7.2).

Input rows (JSONL, one object a line; blank lines are ignored):
    {"turns": ["user turn", ...]}                                     chat, user turns only
    {"conversations": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
        (ShareGPT {"from": "human"|"gpt"|..., "value": ...} messages are read too)
    {"prompt": "text"}                                                plain completion, no template
An optional "id" is kept; without one the row's 0-based index is its id.

Chat rows: every original assistant turn is dropped; system and user turns are replayed in order,
and after each user turn the target generates the assistant reply on the regenerated history
(chat template from the tokenizer, generation prompt added, `enable_thinking` on or off): turn k's
prompt holds the target's own earlier answers, never the original ones. A later user turn that
leaves no room in the context ends the conversation after the answers it has. Output:
    {"id": ..., "conversations": [{"role", "content"}, ...]}
Completion rows: {"id": ..., "prompt": ..., "completion": ...}.

Sampling defaults are Qwen3's non-thinking ones (temperature 0.7, top-p 0.8, top-k 20, max_tokens
4096); each request's max_tokens is capped by the room left in the context. Request seeds are
derived from (seed, row index, turn), so a row regenerates the same way whatever its batch mates.

Serving defaults (`default_dtype`, `data_max_len`; train.regenerate and the build use them unless
told otherwise): bfloat16 on an accelerator (float32 on CPU), and a context from the data — the
longest request a file can make — rather than the model's maximum.

Resumable and sharded as a `specjax.jobs` job that resumes ordered: rows are written in input
order, each to exactly one file — the output, or the errors file ({"line": 1-based line, "index":
0-based row, "id", "error": reason}) — so after `kill -9` a rerun continues from the first row not
written (no duplicate, no gap, same order). With `shard=(i, n)` this process regenerates the rows
whose index is i modulo n into `<output stem>.shard-<i>-of-<n>.jsonl`; row indices, ids and seeds
stay global.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from specjax.api import SamplingParams
from specjax.request_builder import encode_chat, encode_text
from specjax.io import JsonlLine, iter_jsonl
from specjax.jobs import JobSummary, Outcome, Shard, Submit, run_jsonl_job, valid_id

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


def row_id(obj: Any, index: int) -> Any:
    """The output id of a decoded row: its "id" when valid, else the 0-based row index."""
    if isinstance(obj, dict) and valid_id(obj.get("id")):
        return obj["id"]
    return index


def parse_row(obj: Any, index: int, line: int) -> Item:
    """Validate one decoded row into an `Item`; RowError names the field."""
    rid = row_id(obj, index)
    if not isinstance(obj, dict):
        raise RowError(f"row must be a JSON object, got {type(obj).__name__}")
    if "id" in obj and not valid_id(obj["id"]):
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


def request_seed(seed: int, index: int, turn: int) -> int:
    """The sampling seed of a row's `turn`-th reply (distinct per (seed, row, turn), < 2**63)."""
    return ((seed & 0x7FFFFFFF) << 32 | (index & 0xFFFFFF) << 8 | (turn & 0xFF)) & ((1 << 63) - 1)


class Regeneration:
    """The regeneration job kind (`specjax.jobs.JobKind`, ordered resume): a row's user turns
    are replayed one request at a time, each reply generated on the regenerated history."""

    resume = "ordered"

    def __init__(self, llm: Any, sampling: SamplingParams, *, enable_thinking: bool | None,
                 seed: int):
        self.llm, self.tokenizer = llm, llm.tokenizer
        self.sampling, self.enable_thinking, self.seed = sampling, enable_thinking, seed
        self.max_len = llm.engine.cfg.max_len
        self.row_errors = _row_errors()
        self.items: dict[int, Item] = {}  # rows with a request in the engine

    def row_id(self, index: int, row: JsonlLine) -> Any:
        return index if row.error is not None else row_id(row.value, index)

    def output_id(self, out: dict[str, Any]) -> Any:
        return out.get("id")

    def error(self, index: int, row: JsonlLine, message: str, field: str | None) -> Outcome:
        return self._fail(Item(index=index, line=row.line, id=self.row_id(index, row)), message)

    def admit(self, index: int, row: JsonlLine, submit: Submit) -> Outcome | None:
        if row.error is not None:
            return self.error(index, row, f"malformed JSON: {row.error}", None)
        try:
            item = parse_row(row.value, index, row.line)
        except RowError as e:
            return self.error(index, row, str(e), None)
        return self._next(item, submit)

    def finished(self, index: int, request: Any, submit: Submit) -> Outcome | None:
        item = self.items.pop(index)
        text = self.tokenizer.decode(list(request.output_ids), skip_special_tokens=True)
        item.turn += 1
        if item.kind == "completion":
            item.completion = text
        else:
            item.history.append({"role": "assistant", "content": text})
        return self._next(item, submit)

    def _fail(self, item: Item, reason: str) -> Outcome:
        item.error = reason
        return Outcome(item.index, item.error_record(), failed=True)

    def _next(self, item: Item, submit: Submit) -> Outcome | None:
        """Submit the row's next request, or return its outcome when nothing is left to generate
        (or the template, tokenizer, context or engine refuses it)."""
        try:
            ids = self._next_prompt(item)
            if ids is None:
                return Outcome(item.index, item.record())
            room = self.max_len - len(ids)
            if room < 1 and item.kind == "chat" and item.turn > 0:
                item.history.pop()  # the context is full: the conversation ends with its answers
                return Outcome(item.index, item.record())
            if room < 1:
                what = ("prompt" if item.kind == "completion"
                        else f"conversation at user turn {item.turn + 1}")
                raise RowError(f"{what} is {len(ids)} tokens: no room to generate within "
                               f"max_model_len {self.max_len}")
            sp = dataclasses.replace(self.sampling, max_tokens=min(self.sampling.max_tokens, room),
                                     seed=request_seed(self.seed, item.index, item.turn))
            submit(self.llm.make_request(ids, sp, request_id=f"{item.index}:{item.turn}"))
        except self.row_errors as e:
            return self._fail(item, str(e))
        self.items[item.index] = item
        return None

    def _next_prompt(self, item: Item) -> list[int] | None:
        """The token ids of the row's next request (None when the row is complete)."""
        if item.kind == "completion":
            return None if item.completion is not None else encode_text(self.tokenizer, item.prompt)
        while item.pending and item.pending[0]["role"] != "user":
            item.history.append(item.pending.pop(0))
        if not item.pending:
            return None
        item.history.append(item.pending.pop(0))
        return encode_chat(self.tokenizer, item.history, enable_thinking=self.enable_thinking)


def default_dtype() -> str:
    """The target dtype of a regeneration: bfloat16 on an accelerator, float32 on CPU."""
    import jax
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def data_max_len(tokenizer: Any, input_path: str, max_tokens: int, *, enable_thinking: bool | None = False,
                 limit: int, multiple: int = 128) -> int:
    """The context the rows of `input_path` can ask for, rounded up to `multiple` and capped at `limit`:
    per row, its last request (every system and user turn under the chat template, with an empty
    assistant turn standing for each earlier answer) plus `max_tokens` per answer (a completion row:
    its prompt + `max_tokens`). Rows that do not parse are passed over (regeneration reports them)."""
    longest = 1
    for row in iter_jsonl(input_path, strict=False):
        try:
            item = parse_row(row.value, 0, row.line)
            if item.kind == "completion":
                n, answers = len(encode_text(tokenizer, item.prompt)), 1
            else:
                msgs: list[dict[str, str]] = []
                for m in item.pending:  # each user turn is answered before the next message
                    if msgs and msgs[-1]["role"] == "user":
                        msgs.append({"role": "assistant", "content": ""})
                    msgs.append(m)
                answers = sum(m["role"] == "user" for m in msgs)
                n = len(encode_chat(tokenizer, msgs, enable_thinking=enable_thinking))
        except (RowError, *_row_errors()):
            continue
        longest = max(longest, n + answers * max_tokens)
    return min(limit, -(-longest // multiple) * multiple)


def regenerate(llm: Any, input_path: str, output_path: str, *, errors_path: str | None = None,
               sampling: SamplingParams = QWEN3_DEFAULTS, enable_thinking: bool | None = False,
               seed: int = 0, window: int | None = None, limit: int | None = None,
               shard: Shard | None = None, progress: bool = True,
               deadline: float | None = None) -> JobSummary:
    """Regenerate (or resume regenerating) `input_path` into `output_path` (module docstring).

    llm: a `specjax.LLM` with a tokenizer (chat rows need its chat template); sampling: every
    request's parameters (its `seed` is ignored: seeds derive from `seed`); window: rows admitted
    but not yet written (default 4 x max_num_seqs; bounds the reorder buffer); limit: process at
    most this many rows in this run; shard: this process's rows (default
    jax.process_index()/process_count(); the output gets a shard suffix when count > 1); deadline:
    a `time.monotonic()` value past which the run stops, keeping the rows written (a rerun
    resumes)."""
    if llm.tokenizer is None:
        raise ValueError("regenerate needs a tokenizer (the target directory has no tokenizer files)")
    kind = Regeneration(llm, sampling, enable_thinking=enable_thinking, seed=seed)
    return run_jsonl_job(kind, llm.engine, input_path, output_path, errors_path=errors_path,
                         window=window or 4 * llm.engine.cfg.max_slots, shard=shard, limit=limit,
                         progress=progress, desc="regenerate", deadline=deadline)


__all__ = ["QWEN3_DEFAULTS", "Regeneration", "RowError", "data_max_len", "default_dtype", "parse_row",
           "regenerate", "request_seed", "row_id"]
