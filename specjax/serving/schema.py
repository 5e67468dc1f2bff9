"""The one request schema: the sampling fields of a server request body or a batch-job row.

    sp = parse_sampling(body, defaults=SamplingParams(max_tokens=16), has_tokenizer=True)

`SamplingFields` (pydantic) checks each field's JSON type; `parse_sampling` then builds a
`specjax.api.SamplingParams` (which checks the values) and raises `FieldError` naming the offending
field, e.g. `'top_p': top_p must be in (0, 1], got 1.5` with field "top_p". Fields left out or null
take the value from `defaults`. vLLM's `top_k: -1` means off (0).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import pydantic

from specjax.api import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "max_tokens", "stop", "stop_token_ids", "seed",
                   "num_speculative_tokens")


class FieldError(ValueError):
    """A bad request field; `field` names it (None when the request as a whole is at fault)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(name: str, v: Any) -> Any:
    if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
        raise ValueError(f"'{name}' must be a number, got {v!r}")
    return v


def _integer(name: str, v: Any) -> Any:
    if v is not None and not _is_int(v):
        raise ValueError(f"'{name}' must be an integer, got {v!r}")
    return v


class SamplingFields(pydantic.BaseModel):
    """JSON types of the sampling fields (vLLM / OpenAI names); unknown keys are ignored here."""

    model_config = pydantic.ConfigDict(extra="ignore", frozen=True)

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    num_speculative_tokens: int | None = None

    @pydantic.field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _numbers(cls, v: Any, info: pydantic.ValidationInfo) -> Any:
        return _number(info.field_name, v)

    @pydantic.field_validator("top_k", "seed", "num_speculative_tokens", mode="before")
    @classmethod
    def _integers(cls, v: Any, info: pydantic.ValidationInfo) -> Any:
        v = _integer(info.field_name, v)
        return 0 if info.field_name == "top_k" and v == -1 else v

    @pydantic.field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens(cls, v: Any) -> Any:
        if v is not None and not (_is_int(v) and v >= 1):
            raise ValueError(f"'max_tokens' must be a positive integer, got {v!r}")
        return v

    @pydantic.field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if v is not None and not (isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v)):
            raise ValueError("'stop' must be a string or a list of strings")
        return None if v is None else tuple(v)

    @pydantic.field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, v: Any) -> Any:
        if v is not None and not (isinstance(v, (list, tuple)) and all(_is_int(t) for t in v)):
            raise ValueError("'stop_token_ids' must be a list of integers")
        return None if v is None else tuple(v)

    def given(self) -> dict[str, Any]:
        """The fields that were set (not None)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


def _first_error(e: pydantic.ValidationError) -> FieldError:
    err = e.errors()[0]
    field = str(err["loc"][0]) if err.get("loc") else None
    cause = (err.get("ctx") or {}).get("error")
    message = str(cause) if cause is not None else f"'{field}': {err['msg']}"
    return FieldError(message, field)


def parse_sampling(obj: Mapping[str, Any], defaults: SamplingParams, *, has_tokenizer: bool = True) -> SamplingParams:
    """`SamplingParams` from a request's fields (the `SAMPLING_FIELDS` in `obj`; others ignored).

    Raises `FieldError` naming the first bad field: its JSON type (`SamplingFields`), its value
    (`SamplingParams`' own checks), or stop strings without a tokenizer."""
    try:
        fields = SamplingFields.model_validate({k: obj[k] for k in SAMPLING_FIELDS if k in obj})
    except pydantic.ValidationError as e:
        raise _first_error(e) from None
    given = fields.given()
    if given.get("stop") and not has_tokenizer:
        raise FieldError("'stop' strings need a tokenizer; this model has none (use 'stop_token_ids')", "stop")
    for name, v in given.items():  # each field alone, so that the error names it
        try:
            dataclasses.replace(defaults, **{name: v})
        except (ValueError, TypeError) as e:
            raise FieldError(f"'{name}': {e}", name) from None
    try:
        return dataclasses.replace(defaults, **given)
    except (ValueError, TypeError) as e:
        raise FieldError(str(e)) from None
