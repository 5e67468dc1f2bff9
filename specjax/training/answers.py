"""Regenerated answers as a build artifact: gzip JSONL of `{"id", "conversations"}` records (the
regenerate stage's rows), read strictly, written deterministically, and matched against the
prompts a build asks for so that answered prompts are not regenerated again."""
from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from typing import Any, Iterable, Sequence

ANSWERS_NAME = "answers.jsonl.gz"


class ArtifactError(ValueError):
    """A regenerated-data artifact that cannot be read (corrupt, truncated or malformed)."""


def _check(path: str, line: int, row: Any) -> dict[str, Any]:
    conv = row.get("conversations") if isinstance(row, dict) else None
    if not isinstance(conv, list) or not conv or "id" not in row:
        raise ArtifactError(f"{path}: line {line} is not an {{\"id\", \"conversations\"}} record")
    for m in conv:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ArtifactError(f"{path}: line {line}: every message needs a role and a content")
    if conv[-1]["role"] != "assistant" or not any(m["role"] == "user" for m in conv):
        raise ArtifactError(f"{path}: line {line}: a record needs a user turn and ends with an "
                            "assistant answer")
    return row


def read_answers(path: str) -> list[dict[str, Any]]:
    """Every record of an answers file (gzip when it ends in .gz, else plain JSONL); a corrupt or
    truncated file raises ArtifactError naming it (nothing is returned in part)."""
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for i, text in enumerate(f, 1):
                if text.strip():
                    rows.append(_check(path, i, json.loads(text)))
    except FileNotFoundError:
        raise ArtifactError(f"regenerated-data artifact does not exist: {path}") from None
    except (EOFError, OSError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: corrupt or truncated regenerated-data artifact "
                            f"({type(e).__name__}: {e})") from None
    return rows


def write_answers(path: str, rows: Iterable[dict[str, Any]]) -> int:
    """Write `rows` as gzip JSONL atomically (no timestamp in the header: the same rows give the
    same bytes); returns the bytes written."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as z:
        for r in rows:
            z.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(buf.getvalue())


def first_user_turn(row: dict[str, Any]) -> str:
    return next(m["content"] for m in row["conversations"] if m["role"] == "user")


def answered(rows: Sequence[dict[str, Any]],
             prompts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of `rows` that answer one of `prompts` ({"id", "turns"} rows): same id and same
    first user turn; in the order of `prompts`. Records of other prompts are left out."""
    by_id = {json.dumps(r["id"]): r for r in rows}
    out = []
    for p in prompts:
        r = by_id.get(json.dumps(p["id"]))
        if r is not None and first_user_turn(r) == p["turns"][0]:
            out.append(r)
    return out


def answer_stats(rows: Iterable[dict[str, Any]], tokenizer: Any = None) -> dict[str, int]:
    """Samples (records), assistant turns and, with a tokenizer, answer tokens of `rows`."""
    samples = turns = tokens = 0
    for r in rows:
        samples += 1
        for m in r.get("conversations", ()):
            if m["role"] == "assistant":
                turns += 1
                if tokenizer is not None:
                    tokens += len(tokenizer.encode(m["content"], add_special_tokens=False))
    out = {"samples": samples, "answer_turns": turns}
    if tokenizer is not None:
        out["answer_tokens"] = tokens
    return out


__all__ = ["ANSWERS_NAME", "ArtifactError", "answer_stats", "answered", "first_user_turn",
           "read_answers", "write_answers"]
