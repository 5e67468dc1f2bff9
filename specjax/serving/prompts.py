"""Request prompts as token ids, for every route that reads one: a completion's `prompt` and a chat's
`messages` (OpenAI's fields; errors are `APIError` 400 whose `param` names the field)."""
from __future__ import annotations

from typing import Any

from specjax.api import SamplingParams
from specjax.request_builder import encode_chat, encode_text, truncate_prompt
from specjax.serving.errors import APIError
from specjax.serving.schema import is_int


MAX_BATCH_PROMPTS = 64  # prompts one completion request may carry (choices: prompt by prompt)


def completion_prompts(tokenizer: Any, vocab_size: int, body: dict[str, Any]) -> list[tuple[list[int], str | None]]:
    """A completion body's `prompt` as (token ids, the text when sent as a string) per prompt: a
    string or token ids, or a list of up to MAX_BATCH_PROMPTS of them; APIError 400 naming `prompt`."""
    p = body["prompt"]
    batch = p if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p) else [p]
    if len(batch) > MAX_BATCH_PROMPTS:
        raise APIError(400, f"'prompt' holds {len(batch)} prompts; the limit is {MAX_BATCH_PROMPTS} a request",
                       param="prompt")
    return [(_prompt_ids(tokenizer, vocab_size, x, f"prompt[{k}]" if len(batch) > 1 else "prompt"),
             x if isinstance(x, str) else None) for k, x in enumerate(batch)]


def truncated(pairs: list[tuple[list[int], str | None]], body: dict[str, Any], max_model_len: int
              ) -> list[tuple[list[int], str | None]]:
    """vLLM's `truncate_prompt_tokens`: each prompt's last k token ids (a prompt cut loses its text,
    so echo shows the ids kept); APIError 400 naming the field."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return pairs
    try:
        sp = SamplingParams(truncate_prompt_tokens=k)
        cut = [truncate_prompt(ids, sp, max_model_len) for ids, _ in pairs]
    except ValueError as e:
        raise APIError(400, f"'truncate_prompt_tokens': {e}", param="truncate_prompt_tokens") from None
    return [(kept, text if len(kept) == len(ids) else None) for kept, (ids, text) in zip(cut, pairs)]


def _prompt_ids(tokenizer: Any, vocab_size: int, p: Any, name: str) -> list[int]:
    if isinstance(p, str):
        if tokenizer is None:
            raise APIError(400, f"this model has no tokenizer: send '{name}' as a list of token ids", param="prompt")
        if not p:
            raise APIError(400, f"'{name}' is empty", param="prompt")
        ids = encode_text(tokenizer, p)
        if not ids:
            raise APIError(400, f"'{name}' has no tokens", param="prompt")
        return ids
    if isinstance(p, list) and p and all(is_int(t) for t in p):
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"'{name}' token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                           param="prompt")
        return list(p)
    raise APIError(400, f"'{name}' must be a non-empty string or a non-empty list of token ids", param="prompt")


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


def chat_prompt_ids(tokenizer: Any, body: dict[str, Any], tools: list[dict] | None = None) -> list[int]:
    """A chat body's `messages` through the tokenizer's chat template (vLLM's `add_generation_prompt`,
    default true, and `continue_final_message`; the `chat_template_kwargs` enable_thinking honoured);
    APIError 400 naming the field otherwise."""
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
    gen, cont = body.get("add_generation_prompt"), bool(body.get("continue_final_message"))
    if cont and gen is None:
        gen = False  # continuing the last message: no new turn unless asked (then refused)
    try:
        return encode_chat(tokenizer, msgs, enable_thinking=think.get("enable_thinking", False),
                           add_generation_prompt=True if gen is None else bool(gen), continue_final_message=cont,
                           tools=tools)
    except (ValueError, TypeError, KeyError) as e:
        param = "continue_final_message" if "continue_final_message" in str(e) else "messages"
        raise APIError(400, f"'{param}': {e}", param=param) from None
    except Exception as e:  # template rendering errors (jinja) are the request's fault too
        raise APIError(400, f"'messages' could not be rendered by the chat template: {e}",
                       param="messages") from None
