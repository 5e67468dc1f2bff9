"""The server's error answers: `APIError` (OpenAI's error body with an HTTP status, `param` naming
the field), the 400 for a request body that fails its schema, and the reason label under which a
refusal is counted (`specjax:request_rejected_total`)."""
from __future__ import annotations

import re
from typing import Any, Sequence

import pydantic

from specjax.serving.bodies import ChatCompletionRequest, CompletionRequest
from specjax.serving.schema import FieldError

ENGINE_REJECTED = "rejected_by_engine"  # the engine refused the request (and counted it as invalid_request)
_UNION_TAG = re.compile(r"^(str|int|bool|float|none)$|\[")  # pydantic's names of union members in an error's loc


class APIError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _path(loc: Sequence[Any]) -> str:
    """`("messages", 0, "role")` -> `messages[0].role` (union member tags left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _UNION_TAG.search(str(part)):
            out += f".{part}" if out else str(part)
    return out


def validation_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """The 400 for pydantic errors of a request body (the first error; `param` is its field path)."""
    if not errors:
        return APIError(400, "invalid request body")
    def loc_of(e: dict[str, Any]) -> tuple[Any, ...]:
        loc = tuple(e.get("loc") or ())
        return loc[1:] if loc and loc[0] == "body" else loc  # FastAPI's prefix

    err = errors[0]
    loc = loc_of(err)
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON in the request body: {(err.get('ctx') or {}).get('error', err['msg'])}")
    if not loc and err.get("type") in ("model_attributes_type", "dict_type", "model_type", "missing"):
        return APIError(400, "the request body must be a JSON object")
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return APIError(400, str(cause), param=cause.field)
    path = _path(loc) or None
    if err.get("type") == "missing":
        return APIError(400, f"missing field '{path}'", param=path)
    if cause is not None:
        return APIError(400, str(cause), param=path)
    # a union (e.g. `prompt`: a string or token ids) fails once per member: name their common field
    def clean(e: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(p for p in loc_of(e) if isinstance(p, int) or not _UNION_TAG.search(str(p)))
    group = [e for e in errors if clean(e)[:1] == clean(err)[:1]]
    if len(group) == 1:
        return APIError(400, f"'{path}': {err['msg']}", param=path)
    prefix = clean(err)
    for e in group:
        c = clean(e)
        k = 0
        while k < min(len(prefix), len(c)) and prefix[k] == c[k]:
            k += 1
        prefix = prefix[:k]
    path = _path(prefix) or None
    forms = "; ".join(dict.fromkeys(f"{_path(clean(e))}: {e['msg']}" for e in group))
    return APIError(400, f"'{path}' matches none of its allowed forms ({forms})", param=path)


def parse_request(body: Any, *, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """A request model from a decoded JSON body (callers without FastAPI); APIError 400 naming the field."""
    cls = ChatCompletionRequest if chat else CompletionRequest
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except pydantic.ValidationError as e:
        raise validation_error(e.errors()) from None


def rejection_reason(err: APIError) -> str | None:
    """The `specjax:request_rejected_total` reason label of an error answer; None when it is no refusal
    to count here (a failure after admission, or a refusal the engine counted itself)."""
    if err.code == ENGINE_REJECTED or (err.status >= 500 and err.status != 503):
        return None
    if err.code is not None:
        return err.code
    return {400: "invalid_request", 404: "not_found", 405: "method_not_allowed",
            413: "request_too_large"}.get(err.status, err.type)
