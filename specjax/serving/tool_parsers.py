"""Tool calls in a model family's own format, read from its answer (a server's `--tool-call-parser`).

A parser reads the answer as it streams (`push` each new piece of text; `final` at the end) and returns
the content it can release and the calls that have closed: a finished answer is read the same way in
one push, so streamed and whole answers give the same calls and the same content (up to whitespace
around the calls).

hermes (Qwen2.5, Qwen3, Hermes): each call is a block `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
text outside the blocks is content (whitespace between and after calls dropped); a block that is not
such JSON stays content; text that may begin a block is held until it does or cannot.

llama3_json (Llama 3.1-3.3): an answer that begins with "{" is calls, JSON objects {"name", "parameters"}
separated by ";" (vLLM's reading; Llama's <|python_tag|> is a special token, not in the text).

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
        return _call_of(json.loads(block), "arguments")
    except ValueError:
        return None


def _call_of(obj: Any, key: str) -> Call | None:
    """(name, arguments JSON) of a call object {"name", key: {...} or its JSON}; None if it is not one
    (key "parameters" also takes "arguments")."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class _JSONObjects:
    """Reads successive JSON objects from where `at` is set, skipping whitespace and `SEPARATORS`,
    stopping at `END`: `_objects` returns those that have closed, with their text."""

    SEPARATORS, END = ",", "]"

    def __init__(self) -> None:
        self.text = ""
        self.at: int | None = None  # where the next object (or a separator or the end) begins
        self.ended = False

    def _objects(self) -> list[tuple[Any, str]]:
        out = []
        while self.at is not None and not self.ended:
            at = len(self.text) - len(self.text[self.at:].lstrip())
            if at < len(self.text) and self.text[at] in self.SEPARATORS:
                self.at = at + 1
                continue
            self.ended = at < len(self.text) and self.text[at] == self.END
            if at >= len(self.text) or self.ended:
                break
            try:
                obj, end = _DECODER.raw_decode(self.text, at)
            except ValueError:  # an object still arriving (or not JSON: left where it is)
                break
            out.append((obj, self.text[at:end]))
            self.at = end
        return out


class ListedCalls(_JSONObjects):
    """A streaming reader of a "required" answer, the JSON array of {"name", "parameters"} objects its
    guide allows (serving.tool_calls): each call once its object has closed; no content."""

    def push(self, piece: str, final: bool = False) -> tuple[str, list[Call]]:
        self.text += piece
        if self.at is None and "[" in self.text:
            self.at = self.text.index("[") + 1
        return "", [(o["name"], json.dumps(o["parameters"], ensure_ascii=False)) for o, _ in self._objects()]


class Llama3JSONCalls(_JSONObjects):
    """llama3_json (Llama 3.1-3.3): an answer that begins with "{" (after whitespace) is calls, JSON
    objects {"name", "parameters" (or "arguments")} separated by ";"; any other answer is content. An
    object that is not a call, and text that is not JSON, stay content."""

    SEPARATORS, END = ";", ""

    def __init__(self) -> None:
        super().__init__()
        self.content = False  # the answer is text
        self.released = 0  # characters released as content (text mode)

    def push(self, piece: str, final: bool = False) -> tuple[str, list[Call]]:
        self.text += piece
        if self.at is None and not self.content and self.text.strip():
            if self.text.lstrip().startswith("{"):
                self.at = 0
            else:
                self.content = True
        if self.content:
            out, self.released = self.text[self.released:], len(self.text)
            return out, []
        calls, content = [], []
        for obj, raw in self._objects():
            call = _call_of(obj, "parameters")
            calls += [call] if call else []
            content += [] if call else [raw]
        if final and self.at is not None and self.text[self.at:].strip():
            content.append(self.text[self.at:])  # what never became an object
            self.at = len(self.text)
        return " ".join(content), calls


_DECODER = json.JSONDecoder()
PARSERS = {"hermes": HermesCalls, "llama3_json": Llama3JSONCalls}  # --tool-call-parser NAME (vLLM's names)


def read_calls(parser: str, text: str) -> tuple[str | None, list[Call]]:
    """(content or None, calls) of a whole answer under `parser` (the same as streaming it)."""
    content, calls = PARSERS[parser]().push(text, final=True)
    return content.strip() or None, calls


__all__ = ["Call", "HermesCalls", "ListedCalls", "Llama3JSONCalls", "PARSERS", "read_calls"]
