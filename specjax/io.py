"""JSON Lines and durable files: the one JSONL reader and the writers every part of specjax uses.

    for row in iter_jsonl(path):            # non-blank lines, decoded; errors name file:line
        row.line, row.value
    write_atomic(path, text)                # temp file + fsync + rename (+ fsync of the directory)
    with DurableAppender(path) as out:      # one write() per JSON line, then fsync
        out.append({"id": 1})

A file that a killed writer left with a torn last line (no trailing newline) is repaired by
`iter_jsonl(..., repair_torn_tail=True)`: the torn line is cut off the file (and fsynced) before
reading, so an appender can resume after `kill -9` without losing or duplicating a row.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

__all__ = ["DurableAppender", "JsonlError", "JsonlLine", "iter_jsonl", "read_jsonl", "write_atomic",
           "write_json_atomic", "write_jsonl_atomic"]


class JsonlError(ValueError):
    """A JSONL line that is not what the reader was asked for; the message names file and line."""

    def __init__(self, message: str, path: str, line: int):
        super().__init__(message)
        self.path, self.line = path, line


@dataclasses.dataclass(frozen=True)
class JsonlLine:
    """One non-blank line: its 1-based line number in the file, its decoded value, and (only with
    `strict=False`) why it could not be decoded (`value` is None then)."""

    line: int
    value: Any
    error: str | None = None


def _cut_torn_tail(path: str) -> None:
    """Truncate a last line that has no newline (a write cut short by a kill), then fsync."""
    size = os.path.getsize(path)
    if size == 0:
        return
    with open(path, "rb") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # find the last newline, reading backwards in blocks
        pos, keep = size, 0
        while pos > 0:
            step = min(1 << 16, pos)
            pos -= step
            f.seek(pos)
            i = f.read(step).rfind(b"\n")
            if i >= 0:
                keep = pos + i + 1
                break
    with open(path, "r+b") as f:
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())


def iter_jsonl(path: str | os.PathLike[str], *, strict: bool = True, objects: bool = False,
               repair_torn_tail: bool = False, missing_ok: bool = False) -> Iterator[JsonlLine]:
    """The non-blank lines of a JSONL file, decoded, in file order.

    strict: a line that is not UTF-8 JSON (or, with `objects`, not a JSON object) raises
        `JsonlError` "<path>:<line>: ..."; with strict=False it is yielded with `error` set instead.
    repair_torn_tail: first cut a torn last line (no trailing newline) off the file itself.
    missing_ok: a missing file yields nothing instead of raising FileNotFoundError.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        if missing_ok and not os.path.exists(path):
            return
        raise FileNotFoundError(f"JSONL file does not exist: {path}")
    if repair_torn_tail:
        _cut_torn_tail(path)
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8"))
                err = None if not objects or isinstance(value, dict) else \
                    f"line is a JSON {type(value).__name__}, not a JSON object"
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                value, err = None, f"not valid JSON ({e})"
            if err is not None:
                if strict:
                    raise JsonlError(f"{path}:{n}: {err}", path, n)
                value = None
            yield JsonlLine(n, value, err)


def read_jsonl(path: str | os.PathLike[str], **kw: Any) -> list[Any]:
    """The decoded values of `iter_jsonl(path, **kw)` (strict), as a list."""
    return [row.value for row in iter_jsonl(path, **kw)]


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Replace `path` with `data` all at once: write a temp file in the same directory, fsync it,
    rename it over `path`, fsync the directory. A reader sees the old file or the new one, never a
    part; after a crash the file is one of the two."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def write_jsonl_atomic(path: str | os.PathLike[str], rows: Any) -> None:
    """Replace `path` with one JSON object per line (UTF-8, not ASCII-escaped), atomically."""
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 1,
                      sort_keys: bool = False, allow_nan: bool = True) -> None:
    """`write_atomic` of `json.dumps(obj)` plus a final newline."""
    write_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, allow_nan=allow_nan) + "\n")


class DurableAppender:
    """Appends JSON lines to a file: each row is one write() of one whole line (O_APPEND), then fsync."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, row: Any) -> None:
        if self._fd < 0:
            raise ValueError(f"{self.path}: appender is closed")
        view = memoryview((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        while view:  # a regular file takes it in one call; loop only in case of a short write
            n = os.write(self._fd, view)
            view = view[n:]
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "DurableAppender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
