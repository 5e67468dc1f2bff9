"""Reasoning outputs on the chat route (vLLM's `--reasoning-parser`): the thinking of a model that
writes it between `<think>` and `</think>` (Qwen3, QwQ, DeepSeek-R1 and its distills) answered apart
from the content, as the message's `reasoning` (vLLM's field; `reasoning_content`, its former name that
clients still read, carries the same text).

The answer starts inside its thinking when the prompt does (the chat template's last `<think>` is not
closed: DeepSeek-R1's template, Qwen3.5's) or when the answer itself begins with `<think>` (Qwen3's);
a prompt that closes it (Qwen3 with `enable_thinking` false) answers content only. The thinking ends
at `</think>`, and the rest is the content (read by the tool-call parser when there is one); an answer
cut short while thinking is all reasoning. A guided answer (guided_*, response_format, named or
required tool calls) is content only: the guide shapes the whole answer. Streamed answers split the
same way, holding back only a text piece that may begin `<think>` or `</think>`.
"""
from __future__ import annotations

from typing import Any, Sequence

from specjax.api import GUIDES
from specjax.serving.tool_calls import ToolMode, tool_message

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names; both read <think> ... </think> as above
_PROMPT_TAIL_TOKENS = 32  # prompt tokens decoded to see whether the template left a <think> open


def check_reasoning_parser(name: str | None) -> str | None:
    """`name` if it is None or one of PARSERS, else ValueError naming --reasoning-parser."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {list(PARSERS)}, got {name!r}")
    return name


def prompt_opens_reasoning(tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
    """Whether a chat prompt ends inside a <think> block (its last <think> after its last </think>)."""
    tail = tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
    return tail.rfind(START) > tail.rfind(END)


def reasoning_start(parser: str | None, tokenizer: Any, prompt_ids: Sequence[int], sp: Any) -> bool | None:
    """How a chat request's answer is split: None (not split: no parser, or `sp`, its SamplingParams, has a
    guide, which shapes the whole answer), else whether it starts inside its thinking."""
    if parser is None or any(getattr(sp, g) is not None for g in GUIDES):
        return None
    return prompt_opens_reasoning(tokenizer, prompt_ids)


class ReasoningStream:
    """Splits an answer's text, piece by piece, into (reasoning, content)."""

    def __init__(self, open_at_start: bool):
        self.state = "reasoning" if open_at_start else "start"  # "start": a <think> may still open it
        self.thought = open_at_start  # whether the answer has reasoning
        self.held = ""

    def push(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text that `text` completes; `final`: the answer's last piece."""
        buf, reasoning, content = self.held + text, "", ""
        while True:
            if self.state == "start":
                bare = buf.lstrip()
                if bare.startswith(START):
                    buf, self.state, self.thought = bare[len(START):], "reasoning", True
                    continue
                if START.startswith(bare) and not final:  # whitespace, or a <think> still arriving
                    self.held = buf
                    return reasoning, content
                self.state = "content"
            elif self.state == "reasoning":
                i = buf.find(END)
                if i >= 0:
                    reasoning, buf, self.state = reasoning + buf[:i], buf[i + len(END):], "content"
                    continue
                keep = 0 if final else next((k for k in range(len(END) - 1, 0, -1) if buf.endswith(END[:k])), 0)
                self.held = buf[len(buf) - keep:]
                return reasoning + buf[:len(buf) - keep], content
            else:
                self.held = ""
                return reasoning, content + buf


def split_reasoning(text: str, open_at_start: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer: reasoning None when it has none, content None when it
    is all reasoning."""
    stream = ReasoningStream(open_at_start)
    reasoning, content = stream.push(text, final=True)
    if not stream.thought:
        return None, content
    return reasoning, content or None


def reasoning_fields(reasoning: str | None) -> dict[str, Any]:
    """A message's (or delta's) reasoning fields: vLLM's `reasoning` and its former name."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def chat_message(text: str, tools: ToolMode | None, reasoning_open: bool | None, finish_reason: str | None
                 ) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, the finish reason) of a whole chat answer: with `reasoning_open` (a
    request under a reasoning parser: whether its prompt left a <think> open) its reasoning apart and
    the content read for tool calls (`tool_calls.tool_message`); None: the text as `tool_message` reads it."""
    if reasoning_open is None:
        return tool_message(text, tools, finish_reason)
    reasoning, content = split_reasoning(text, reasoning_open)
    if content is None:  # cut short while thinking
        return {"role": "assistant", "content": None, **reasoning_fields(reasoning)}, finish_reason
    message, finish_reason = tool_message(content, tools, finish_reason)
    return {**message, **reasoning_fields(reasoning)}, finish_reason


__all__ = ["END", "PARSERS", "START", "ReasoningStream", "chat_message", "check_reasoning_parser",
           "prompt_opens_reasoning", "reasoning_fields", "reasoning_start", "split_reasoning"]
