"""Streaming detokenization in linear time, and stop strings checked on it.

`StreamDetokenizer` turns a growing list of token ids into text with the tokenizers library's
incremental decoder (`tokenizers.decoders.DecodeStream`): each token is decoded once, so a request's
text costs O(length) in total instead of re-decoding the whole output every round (O(length^2)). A
token that ends inside a multi-byte UTF-8 character yields no text until the character is complete,
so a stream never shows a partial character (no U+FFFD in the middle of an emoji).

`StopStringChecker` is the engine's `stop_check` for stop strings: it searches only the new text
(plus the last len(stop) - 1 characters before it); on a hit the output keeps its tokens through the
one that completes the stop string, and its text ends exactly where the stop string begins (or, with
include_stop_str_in_output, ends), as vLLM's does: a stop string that begins inside a token keeps
that token's text before it. `request_text` is an output's text either way.
"""
from __future__ import annotations

from typing import Any, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["StopStringChecker", "StreamDetokenizer", "backend_tokenizer", "request_text"]


def request_text(tokenizer: Any, request: Any) -> str:
    """An engine request's output text: the text a stop string cut (`output_text`), else its tokens
    decoded without special tokens."""
    if request.output_text is not None:
        return request.output_text
    return tokenizer.decode(list(request.output_ids), skip_special_tokens=True)


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the tokenizer itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"streaming detokenization needs a fast (tokenizers-backed) tokenizer, "
                        f"got {type(tokenizer).__name__}")
    return backend


class StreamDetokenizer:
    """Text of a token sequence that grows at the end; `push(ids)` returns the new text.

    After every push, `length` is the number of characters produced so far, and `ends[k]` is the
    text length after token k, or None for a token that ends inside a character (its text comes out
    with a later token)."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True):
        self._tok = backend_tokenizer(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.length = 0
        self.ends: list[int | None] = []

    def push(self, ids: Sequence[int]) -> str:
        pieces = []
        for t in ids:
            piece = self._stream.step(self._tok, int(t))
            if piece is None:
                self.ends.append(None)
                continue
            pieces.append(piece)
            self.length += len(piece)
            self.ends.append(self.length)
        return "".join(pieces)


class StopStringChecker:
    """`EngineRequest.stop_check` for stop strings: called with the request's whole output so far
    (a list that only grows) and the fewest tokens a stop may keep (min_tokens), returns None, or
    when a stop string appears (the first, by where it begins, that keeps enough tokens) the tokens
    to keep (the shortest prefix whose text holds the stop string), the output's text (up to the
    stop string's start; with `include`, vLLM's include_stop_str_in_output, through its end) and the
    stop string."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], *, include: bool = False):
        if not stops or any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self.stops = tuple(stops)
        self.include = include
        self._carry_len = max(len(s) for s in self.stops) - 1
        self._reset()

    def _reset(self) -> None:
        self._detok = StreamDetokenizer(self._tokenizer)
        self._texts: list[str] = []  # the output's text, as pushed
        self._carry = ""  # the last _carry_len characters already searched

    def __call__(self, ids: list[int], min_keep: int = 0) -> tuple[int, str, str] | None:
        seen = len(self._detok.ends)
        if len(ids) < seen:  # not the same growing output: start over
            self._reset()
            seen = 0
        before = self._detok.length
        new = self._detok.push(ids[seen:])
        if not new:
            return None
        self._texts.append(new)
        window = self._carry + new
        base = before - len(self._carry)  # text position of window[0]
        self._carry = window[-self._carry_len:] if self._carry_len else ""
        for at, end, stop in sorted(_occurrences(window, self.stops)):
            keep = self._tokens_through(base + end)
            if keep >= min_keep:
                return keep, "".join(self._texts)[:base + (end if self.include else at)], stop
        return None

    def _tokens_through(self, cut: int) -> int:
        """The shortest token prefix whose text reaches text position `cut`."""
        return next(k for k, end in enumerate(self._detok.ends, 1) if end is not None and end >= cut)


def _occurrences(text: str, stops: Sequence[str]) -> set[tuple[int, int, str]]:
    """(start, end, stop string) of every occurrence of every stop string in `text` (overlapping ones too)."""
    out = set()
    for s in stops:
        i = text.find(s)
        while i >= 0:
            out.add((i, i + len(s), s))
            i = text.find(s, i + 1)
    return out
