"""The response bodies of the HTTP routes (pydantic models, so /openapi.json describes them);
the request bodies are `bodies`'."""
from __future__ import annotations

from typing import Any, Literal

import pydantic

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class CompletionTokensDetails(pydantic.BaseModel):
    """OpenAI's predicted-output counts (a request with `prediction`)."""

    accepted_prediction_tokens: int = pydantic.Field(description="predicted drafts verification accepted")
    rejected_prediction_tokens: int = pydantic.Field(description="predicted drafts verified and not accepted")


class PromptTokensDetails(pydantic.BaseModel):
    """OpenAI's cached prompt tokens (prefix caching: a response whose prompts reused cache rows)."""

    cached_tokens: int = pydantic.Field(description="prompt tokens read from a freed slot's cache, not prefilled")


class Usage(pydantic.BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class SpecMetrics(pydantic.BaseModel):
    """Speculative decoding of one request (vLLM's definitions: acceptance length counts the bonus token)."""

    mean_acceptance_length: float
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]
    num_rounds: int


class SpeculativeDecodingStats(pydantic.BaseModel):
    """vLLM's per-request block (`--per-request-spec-decode-metrics`); fields in `serving.request_metrics`."""

    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]
    acceptance_histogram_by_draft_length: dict[str, list[int]]
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int
    per_step_drafted: list[int] | None = pydantic.Field(None, description="detailed only")
    per_step_accepted: list[int] | None = pydantic.Field(None, description="detailed only")


class ResponseMetrics(pydantic.BaseModel):
    """Present when the server reports per-request metrics; `speculative_decoding` null for n > 1."""

    speculative_decoding: SpeculativeDecodingStats | None


class ToolCallFunction(pydantic.BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(pydantic.BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(pydantic.BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the answer is tool calls
    tool_calls: list[ToolCall] | None = None


STOP_REASON_DOC = "vLLM's: the stop_token_ids entry or stop string that ended the answer (null: eos, length)"


class ChatChoice(pydantic.BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    stop_reason: int | str | None = pydantic.Field(None, description=STOP_REASON_DOC)
    token_ids: list[int]
    logprobs: dict[str, Any] | None = None


PromptLogprobs = list[dict[str, dict[str, Any]] | None]  # vLLM's prompt_logprobs (logprob_blocks)


class CompletionChoice(pydantic.BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    stop_reason: int | str | None = pydantic.Field(None, description=STOP_REASON_DOC)
    token_ids: list[int]
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ChatCompletionResponse(pydantic.BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    spec_metrics: SpecMetrics
    metrics: ResponseMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(pydantic.BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    spec_metrics: SpecMetrics
    metrics: ResponseMetrics | None = None


class ErrorDetail(pydantic.BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(pydantic.BaseModel):
    """Every error answer (OpenAI's shape); `param` names the offending field."""

    error: ErrorDetail


class ModelCard(pydantic.BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(pydantic.BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Version(pydantic.BaseModel):
    version: str


class Health(pydantic.BaseModel):
    """`status` "ok" (200), else "starting" or "error" (503) with the `reason`."""

    status: Literal["ok", "starting", "error"]
    reason: str | None = None


class TokenizeResponse(pydantic.BaseModel):
    """The token ids the completion routes would feed the engine for that prompt."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(pydantic.BaseModel):
    """The ids' text, special tokens included (a chat prompt from /tokenize comes back whole)."""

    prompt: str
