"""Tool calls in a model family's own format, read from its answer (a server's `--tool-call-parser`).

A parser reads the answer as it streams (`push` each new piece of text; `final` at the end) and returns
the content it can release and the calls that have closed: a finished answer is read the same way in
one push, so streamed and whole answers give the same calls and the same content (up to whitespace
around the calls).

hermes (Qwen2.5, Qwen3, Hermes): each call is a block `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
text outside the blocks is content (whitespace between and after calls dropped); a block that is not
such JSON stays content; text that may begin a block is held until it does or cannot.

`ListedCalls` reads the JSON array of calls a "required" tool_choice answers (guided: always such JSON).
"""
from __future__ import annotations

import json
from typing import Any

Call = tuple[str, str]  # (function name, arguments as JSON text)


class HermesCalls:
    """A streaming reader of hermes `<tool_call>` blocks (module docstring)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.text = ""  # everything pushed so far
        self.read = 0  # characters of it released as content or calls
        self.calls = 0  # calls found so far

    def push(self, piece: str, final: bool = False) -> tuple[str, list[Call]]:
        """(content to release, calls closed) after `piece`; `final`: the answer ended (what is held
        is released as content)."""
        self.text += piece
        content: list[str] = []
        calls: list[Call] = []
        while True:
            rest = self.text[self.read:]
            start = rest.find(self.OPEN)
            if start < 0:
                n = len(rest) if final else len(rest) - _partial_tail(rest, self.OPEN)
                content.append(rest[:n])
                self.read += n
                break
            content.append(rest[:start])
            end = rest.find(self.CLOSE, start)
            if end < 0:
                self.read += start
                if final:
                    content.append(rest[start:])
                    self.read += len(rest) - start
                break
            call = _call(rest[start + len(self.OPEN):end])
            if call is None:
                content.append(rest[start:end + len(self.CLOSE)])
            else:
                calls.append(call)
                self.calls += 1
            self.read += end + len(self.CLOSE)
        out = "".join(content)
        return ("" if self.calls and not out.strip() else out), calls


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: a tag may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _call(block: str) -> Call | None:
    try:
        call: Any = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", {})
    return call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class ListedCalls:
    """A streaming reader of a "required" answer, the JSON array of {"name", "parameters"} objects its
    guide allows (serving.tool_calls): each call once its object has closed; no content."""

    def __init__(self) -> None:
        self.text = ""
        self.at: int | None = None  # where the next element (or a comma or the closing bracket) begins

    def push(self, piece: str, final: bool = False) -> tuple[str, list[Call]]:
        self.text += piece
        if self.at is None:
            if "[" not in self.text:
                return "", []
            self.at = self.text.index("[") + 1
        calls: list[Call] = []
        while True:
            at = len(self.text[self.at:]) - len(self.text[self.at:].lstrip()) + self.at
            if at >= len(self.text) or self.text[at] == "]":
                break
            if self.text[at] == ",":
                self.at = at + 1
                continue
            try:
                obj, self.at = _DECODER.raw_decode(self.text, at)
            except ValueError:  # an object still arriving
                break
            calls.append((obj["name"], json.dumps(obj["parameters"], ensure_ascii=False)))
        return "", calls


_DECODER = json.JSONDecoder()
PARSERS = {"hermes": HermesCalls}  # --tool-call-parser NAME (vLLM's names)


def read_calls(parser: str, text: str) -> tuple[str | None, list[Call]]:
    """(content or None, calls) of a whole answer under `parser` (the same as streaming it)."""
    content, calls = PARSERS[parser]().push(text, final=True)
    return content.strip() or None, calls


__all__ = ["Call", "HermesCalls", "ListedCalls", "PARSERS", "read_calls"]
