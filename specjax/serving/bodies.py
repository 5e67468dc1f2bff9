"""The request bodies of the HTTP routes (pydantic models), so /openapi.json describes them.

The models check JSON types (strictly: no "1" for 1, no 1.0 for a token id); the values are checked
by `schema.parse_sampling` and `OpenAIApp`, whose refusals name the field as well. Unknown fields are
ignored (as OpenAI's API does); lone surrogates anywhere are refused.
"""
from __future__ import annotations

from typing import Any, Literal

import pydantic

from specjax.serving.schema import ENGINE_MAX, FieldError, SamplingFields, is_int

MAX_TOP_LOGPROBS = 20
LOGPROBS_DOC = ("log-probabilities of the output tokens under the target's distribution after the request's "
                "logit bias, bad words, penalties and min_tokens hold, temperature, min-p, top-k and top-p (temperature 0 read as 1; "
                "echo's prompt tokens: without those rules); -9999 stands for -inf")
_SEED_MAX = (1 << 63) - 1


def first_surrogate(obj: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string in `obj` holding a lone surrogate, or None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(obj, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    else:
        return None
    for p, v in items:
        found = first_surrogate(v, p)
        if found is not None:
            return found
    return None


def _refuse_surrogates(data: Any) -> Any:
    bad = first_surrogate(data)
    if bad is not None:
        raise FieldError(f"'{bad}' is not valid Unicode (it holds a lone surrogate code point)", bad)
    return data


class _Body(pydantic.BaseModel):
    """Unknown fields are ignored (as OpenAI's API does); lone surrogates anywhere are refused."""

    model_config = pydantic.ConfigDict(extra="allow")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return _refuse_surrogates(data)


class StreamOptions(pydantic.BaseModel):
    include_usage: pydantic.StrictBool | None = None
    continuous_usage_stats: pydantic.StrictBool | None = pydantic.Field(
        None, description="vLLM's: with include_usage, every chunk carries its choice's usage so far")


class ContentPart(_Body):
    """One part of a message's content; only `"type": "text"` parts are served (text concatenated)."""

    type: pydantic.StrictStr
    text: pydantic.StrictStr | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: pydantic.StrictStr | list[ContentPart] | None = None
    name: pydantic.StrictStr | None = None


class _GenerationRequest(SamplingFields):
    """Fields shared by completions and chat completions (sampling fields from `SamplingFields`)."""

    model_config = pydantic.ConfigDict(extra="allow", frozen=True)

    model: pydantic.StrictStr | None = None
    n: pydantic.StrictInt | None = pydantic.Field(None, description="choices per prompt (at most the engine's slots)")
    stream: pydantic.StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: pydantic.StrictStr | None = None
    stop: str | tuple[str, ...] | None = None  # one string or a list (the `SamplingFields` check applies)
    prompt_logprobs: pydantic.StrictInt | None = pydantic.Field(
        None, description="vLLM's: the prompt tokens' log-probabilities with this many alternatives (not streamed)")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return _refuse_surrogates(data)


_LIMITS = {"temperature": {"minimum": 0, "maximum": ENGINE_MAX["temperature"]},
           "top_p": {"exclusiveMinimum": 0, "maximum": 1}, "min_p": {"minimum": 0, "maximum": 1},
           "presence_penalty": {"minimum": -2, "maximum": 2}, "frequency_penalty": {"minimum": -2, "maximum": 2},
           "repetition_penalty": {"exclusiveMinimum": 0}, "top_k": {"minimum": -1, "maximum": ENGINE_MAX["top_k"]},
           "max_tokens": {"minimum": 1}, "min_tokens": {"minimum": 0}, "seed": {"minimum": 0, "maximum": _SEED_MAX},
           "num_speculative_tokens": {"minimum": 0, "maximum": ENGINE_MAX["num_speculative_tokens"]}, "n": {"minimum": 1}, "max_completion_tokens": {"minimum": 1},
           "top_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS}, "logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
           "prompt_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS}}


def _document_limits(schema: dict[str, Any]) -> None:
    for name, limits in _LIMITS.items():
        prop = schema.get("properties", {}).get(name)
        if prop is not None:
            for alt in prop.get("anyOf", [prop]):
                if alt.get("type") in ("integer", "number"):
                    alt.update(limits)


def _document_completion_limits(schema: dict[str, Any]) -> None:
    _document_limits(schema)
    for alt in schema["properties"]["max_tokens"].get("anyOf", []):
        if alt.get("type") == "integer":
            alt["minimum"] = 0  # with echo only


_Prompt = pydantic.StrictStr | list[pydantic.StrictInt] | list[pydantic.StrictStr] | list[list[pydantic.StrictInt]]


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: `prompt` is a string (needs a tokenizer) or a list of token ids."""

    model_config = pydantic.ConfigDict(extra="allow", frozen=True, json_schema_extra=_document_completion_limits)

    prompt: _Prompt = pydantic.Field(description="a string (needs a tokenizer) or token ids, or a list of up to 64 "
                                                 "of either: choice k * n + j answers prompt k")
    echo: pydantic.StrictBool | None = pydantic.Field(
        None, description="the prompt before the completion, in the text and (with logprobs: the first prompt "
                          "token's null) in the logprobs; not streamed; allows max_tokens 0")
    logprobs: pydantic.StrictInt | None = pydantic.Field(
        None, description=f"top alternatives per token, with the {LOGPROBS_DOC}")

    @pydantic.field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens(cls, v: Any) -> Any:
        """0 passes here: it is served with `echo` only (the handler refuses it otherwise)."""
        if v is not None and not (is_int(v) and v >= 0):
            raise ValueError(f"'max_tokens' must be a positive integer (0 with 'echo'), got {v!r}")
        return v


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions: `messages` through the tokenizer's chat template."""

    model_config = pydantic.ConfigDict(extra="allow", frozen=True, json_schema_extra=_document_limits)

    messages: list[ChatMessage] = pydantic.Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: pydantic.StrictInt | None = pydantic.Field(None, description="alias of max_tokens")
    logprobs: pydantic.StrictBool | None = pydantic.Field(None, description=f"answer the {LOGPROBS_DOC}")
    top_logprobs: pydantic.StrictInt | None = pydantic.Field(None, description="top alternatives per token")
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: pydantic.StrictBool | None = pydantic.Field(
        None, description="vLLM's: open the assistant's turn (default true)")
    continue_final_message: pydantic.StrictBool | None = pydantic.Field(
        None, description="vLLM's: continue the last message, an assistant's (add_generation_prompt then false)")
    tools: list[dict[str, Any]] | None = pydantic.Field(None, description="OpenAI's functions (passed to the chat template)")
    tool_choice: str | dict[str, Any] | None = pydantic.Field(
        None, description="\"none\", \"required\" or a named function (a server with --guided-regex), or \"auto\" "
                          "(a server with --tool-call-parser)")




class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): exactly one of `prompt`, read as /v1/completions reads it, or
    `messages`, rendered as /v1/chat/completions renders them (with the same template options)."""

    model: pydantic.StrictStr | None = None
    prompt: pydantic.StrictStr | list[pydantic.StrictInt] | None = None
    messages: list[ChatMessage] | None = pydantic.Field(None, json_schema_extra={"minItems": 1})
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: pydantic.StrictBool | None = None
    continue_final_message: pydantic.StrictBool | None = None


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): token ids in the vocabulary."""

    model: pydantic.StrictStr | None = None
    tokens: list[pydantic.StrictInt]
