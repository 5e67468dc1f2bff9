"""Request prompts as token ids, for every route that reads one: a completion's `prompt` and a chat's
`messages` (OpenAI's fields; errors are `APIError` 400 whose `param` names the field)."""
from __future__ import annotations

from typing import Any

from specjax.api import encode_chat, encode_text
from specjax.serving.errors import APIError


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def completion_prompt_ids(tokenizer: Any, vocab_size: int, body: dict[str, Any]) -> list[int]:
    """A completion body's `prompt` as token ids: a string (needs a tokenizer), token ids in the
    vocabulary, or a batch of one of either; APIError 400 naming `prompt` otherwise."""
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send 'prompt' as a list of token ids", param="prompt")
        if not p:
            raise APIError(400, "'prompt' is empty", param="prompt")
        ids = encode_text(tokenizer, p)
        if not ids:
            raise APIError(400, "'prompt' has no tokens", param="prompt")
        return ids
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"'prompt' token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                           param="prompt")
        return list(p)
    if isinstance(p, list) and len(p) > 1:
        raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
    raise APIError(400, "'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt")


def message_text(i: int, content: Any) -> str:
    """A message's content as one string: text parts joined by newlines (as vLLM does)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text":
            raise APIError(400, f"'messages[{i}].content[{j}].type': content parts of type {part.get('type')!r} "
                                f"are not supported (only 'text')", param=f"messages[{i}].content[{j}].type")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"'messages[{i}].content[{j}].text' must be a string",
                           param=f"messages[{i}].content[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_prompt_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """A chat body's `messages` through the tokenizer's chat template (generation prompt added; the
    `chat_template_kwargs` enable_thinking honoured); APIError 400 naming the message field otherwise."""
    msgs = body["messages"]
    if not msgs:
        raise APIError(400, "'messages' is empty", param="messages")
    if tokenizer is None:
        raise APIError(400, "chat completions need a tokenizer with a chat template; this model has no "
                            "tokenizer (use /v1/completions with token ids)", param="messages")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the tokenizer has no chat template; use /v1/completions", param="messages")
    msgs = [{**m, "content": message_text(i, m.get("content"))} for i, m in enumerate(msgs)]
    think = body.get("chat_template_kwargs") or {}
    try:
        return encode_chat(tokenizer, msgs, enable_thinking=think.get("enable_thinking", False))
    except (ValueError, TypeError, KeyError) as e:
        raise APIError(400, f"'messages': {e}", param="messages") from None
    except Exception as e:  # template rendering errors (jinja) are the request's fault too
        raise APIError(400, f"'messages' could not be rendered by the chat template: {e}",
                       param="messages") from None
