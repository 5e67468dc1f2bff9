"""The one request schema: the sampling fields of a server request body or a batch-job row.

    sp = parse_sampling(body, defaults=SamplingParams(max_tokens=16), has_tokenizer=True)

`SamplingFields` (pydantic) checks each field's JSON type; `parse_sampling` then builds a
`specjax.api.SamplingParams` (which checks the values) and raises `FieldError` naming the offending
field, e.g. `'top_p': top_p must be in (0, 1], got 1.5` with field "top_p". Fields left out or null
take the value from `defaults`. vLLM's `top_k: -1` means off (0).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Literal, Mapping

import pydantic

from specjax.api import GUIDES, SamplingParams

# what the engine's per-row float32 / int32 arrays hold: larger values are refused, naming the field
ENGINE_MAX = {"temperature": 1e30, "top_k": (1 << 31) - 1, "num_speculative_tokens": (1 << 31) - 1}
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "max_tokens", "stop", "stop_token_ids", "seed",
                   "num_speculative_tokens", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "guided_choice",
                   "guided_regex", "guided_json", "guided_whitespace_pattern", "response_format", "structured_outputs",
                   "prediction", "include_stop_str_in_output", "truncate_prompt_tokens", "priority", "n")
# vLLM's structured_outputs keys served, as the guide each sets (json_object: any JSON object)
STRUCTURED_KEYS = {"choice": "guided_choice", "regex": "guided_regex", "json": "guided_json",
                   "json_object": "guided_json"}
JSON_OBJECT_SCHEMA = {"type": "object"}

# OpenAI and vLLM request fields that change what is generated and that this server does not serve:
# the values that mean "off" pass, anything else is refused naming the field (never ignored)
UNSERVED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "suffix": (None,), "use_beam_search": (None, False),
    "logits_processors": (None, []), "functions": (None, []),
    "guided_grammar": (None,)}
TOOL_FIELDS = {"tools": (None, []), "tool_choice": (None, "none")}  # the chat route's (serving.tool_calls)


class FieldError(ValueError):
    """A bad request field; `field` names it (None when the request as a whole is at fault)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def is_int(v: Any) -> bool:
    """A JSON integer (a bool is not one)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _number(name: str, v: Any) -> Any:
    if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
        raise ValueError(f"'{name}' must be a number, got {v!r}")
    return v


def _integer(name: str, v: Any) -> Any:
    if v is not None and not is_int(v):
        raise ValueError(f"'{name}' must be an integer, got {v!r}")
    return v


class TextPart(pydantic.BaseModel):
    type: Literal["text"]
    text: str


class PredictionContent(pydantic.BaseModel):
    """OpenAI's predicted output: text the answer is expected to repeat (text parts are concatenated)."""

    type: Literal["content"]
    content: str | list[TextPart]


class SamplingFields(pydantic.BaseModel):
    """JSON types of the sampling fields (vLLM / OpenAI names); unknown keys are ignored here."""

    model_config = pydantic.ConfigDict(extra="ignore", frozen=True)

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = pydantic.Field(None, description="vLLM's: drop tokens whose probability is below min_p "
                                                          "times the top token's (0 = off)")
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    num_speculative_tokens: int | None = None
    min_tokens: int | None = pydantic.Field(None, description="vLLM's: no eos, stop id or stop string ends the answer "
                                                             "before this many tokens")
    presence_penalty: float | None = pydantic.Field(None, description="subtracted once from the logit of a token "
                                                                    "in the output so far (a server with --penalties)")
    frequency_penalty: float | None = pydantic.Field(None, description="subtracted per occurrence in the output")
    repetition_penalty: float | None = pydantic.Field(None, description="vLLM's: divides a positive logit (multiplies "
                                                                      "a negative one) of a prompt or output token")
    logit_bias: dict[int, float] | None = pydantic.Field(None, description="OpenAI's: token id (a string of digits): "
                                                         "bias in [-100, 100] added to its logit (a server with --logit-bias)")
    allowed_token_ids: tuple[int, ...] | None = pydantic.Field(None, description="vLLM's: only these ids are sampled")
    bad_words: tuple[str, ...] | None = pydantic.Field(None, description="vLLM's: words never completed")
    guided_choice: tuple[str, ...] | None = pydantic.Field(None, description="vLLM's: the answer is one of these "
                                                                         "(a server with --guided-choice)")
    guided_regex: str | None = pydantic.Field(None, description="vLLM's: the answer is a full match of this regular "
                                                                "expression (a server with --guided-regex)")
    guided_json: dict[str, Any] | str | None = pydantic.Field(None, description="vLLM's: the answer is JSON of this "
                                                                               "schema (a server with --guided-regex)")
    guided_whitespace_pattern: str | None = pydantic.Field(None, description="vLLM's: the whitespace guided_json "
                                                                             "allows between JSON tokens (a regular "
                                                                             "expression; default: none, one space, or "
                                                                             "a line break and indentation)")
    response_format: dict[str, Any] | None = pydantic.Field(
        None, description="OpenAI's: {\"type\": \"text\"}, {\"type\": \"json_object\"} (any JSON object) or "
                          "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {...}}} (as guided_json)")
    structured_outputs: dict[str, Any] | None = pydantic.Field(
        None, description="vLLM's: one of {\"choice\": [...]}, {\"regex\": ...}, {\"json\": schema}, "
                          "{\"json_object\": true}")
    ignore_eos: bool | None = pydantic.Field(None, description="vLLM's: generate past the model's eos ids (max_tokens, "
                                                              "stop and stop_token_ids still end the answer)")
    include_stop_str_in_output: bool | None = pydantic.Field(
        None, description="vLLM's: the answer keeps the stop string that ended it (through the token completing it)")
    truncate_prompt_tokens: int | None = pydantic.Field(
        None, description="vLLM's: generate from the prompt's last k tokens only (-1: the last max_model_len)")
    priority: int | None = pydantic.Field(
        None, description="vLLM's: a server with --scheduling-policy priority starts waiting requests lower first "
                          "(arrival order among equals; a running request keeps its slot); otherwise only 0")
    n: int | None = pydantic.Field(None, description="OpenAI's and vLLM's: answers per prompt (choice j samples "
                                                     "with seed + j when a seed is given)")
    prediction: PredictionContent | None = pydantic.Field(
        None, description="OpenAI's predicted output: {\"type\": \"content\", \"content\": text or [{\"type\": \"text\", "
                          "\"text\": ...}]}, text the answer is expected to repeat, drafted while the answer follows "
                          "it (a server with --prediction-tokens); the answer is unchanged, only faster")

    @pydantic.field_validator("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                              "repetition_penalty", mode="before")
    @classmethod
    def _numbers(cls, v: Any, info: pydantic.ValidationInfo) -> Any:
        return _number(info.field_name, v)

    @pydantic.field_validator("top_k", "seed", "num_speculative_tokens", "min_tokens", "truncate_prompt_tokens",
                              "priority", "n", mode="before")
    @classmethod
    def _integers(cls, v: Any, info: pydantic.ValidationInfo) -> Any:
        v = _integer(info.field_name, v)
        return 0 if info.field_name == "top_k" and v == -1 else v

    @pydantic.field_validator("ignore_eos", "include_stop_str_in_output", mode="before")
    @classmethod
    def _flag(cls, v: Any, info: pydantic.ValidationInfo) -> Any:
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"'{info.field_name}' must be true or false, got {v!r}")
        return v

    @pydantic.field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens(cls, v: Any) -> Any:
        if v is not None and not (is_int(v) and v >= 1):
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

    @pydantic.field_validator("stop_token_ids", "allowed_token_ids", mode="before")
    @classmethod
    def _token_ids(cls, v: Any, info: pydantic.ValidationInfo) -> Any:
        if v is not None and not (isinstance(v, (list, tuple)) and all(is_int(t) for t in v)):
            raise ValueError(f"'{info.field_name}' must be a list of integers")
        return None if v is None else tuple(v)

    @pydantic.field_validator("bad_words", "guided_choice", mode="before")
    @classmethod
    def _words(cls, v: Any, info: pydantic.ValidationInfo | str) -> Any:
        name = info if isinstance(info, str) else info.field_name
        if v is not None and not (isinstance(v, (list, tuple)) and all(isinstance(w, str) for w in v)):
            raise ValueError(f"'{name}' must be a list of strings")
        return None if v is None else tuple(v)

    @pydantic.field_validator("structured_outputs", "response_format", mode="before")
    @classmethod
    def _guide_forms(cls, v: Any, info: pydantic.ValidationInfo) -> Any:
        if v is not None:
            guide_fields(info.field_name, v)  # raises naming the field
        return v

    @pydantic.field_validator("guided_whitespace_pattern", mode="before")
    @classmethod
    def _whitespace(cls, v: Any) -> Any:
        try:
            re.compile(v) if v is not None else None
        except (re.error, TypeError):
            raise ValueError(f"'guided_whitespace_pattern' must be a regular expression, got {v!r}") from None
        return v

    @pydantic.field_validator("guided_regex", "guided_json", mode="before")
    @classmethod
    def _guides(cls, v: Any, info: pydantic.ValidationInfo) -> Any:
        return None if v is None else _guide(info.field_name, v, info.field_name == "guided_json")

    @pydantic.field_validator("prediction", mode="before")
    @classmethod
    def _prediction(cls, v: Any) -> Any:
        if v is not None:
            prediction_text(v)  # raises naming the field
        return v

    @pydantic.field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, v: Any) -> Any:
        if v is None:
            return None
        if not isinstance(v, dict) or not all(is_int(k) or (isinstance(k, str) and k.isdecimal()) for k in v):
            raise ValueError("'logit_bias' must be an object of token id (a string of digits): bias")
        return {int(k): _number(f"logit_bias[{k!r}]", b) for k, b in v.items()}

    def given(self) -> dict[str, Any]:
        """The fields that were set (not None)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


def prediction_text(v: Any) -> str:
    """The text of OpenAI's `prediction` object ({"type": "content", "content": a string or text parts,
    concatenated}); ValueError naming the part of it that is not so."""
    if not isinstance(v, dict) or v.get("type") != "content":
        raise ValueError(f"'prediction' must be an object with \"type\": \"content\", got {v!r}")
    content = v.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"'prediction.content' must be a string or a list of text parts, got {content!r}")
    for i, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ValueError(f"'prediction.content[{i}]' must be {{\"type\": \"text\", \"text\": a string}}, "
                             f"got {part!r}")
    return "".join(part["text"] for part in content)


def guide_source(body: Mapping[str, Any], field: str) -> str:
    """The body field that set SamplingParams' `field`: itself, or the response_format /
    structured_outputs that asked for that guide."""
    if field in GUIDES and body.get(field) is None:
        return next((f for f in ("response_format", "structured_outputs", "tool_choice") if body.get(f) is not None),
                    field)
    return field


def guide_fields(name: str, v: Any) -> dict[str, Any]:
    """The guide (GUIDES: value) that OpenAI's `response_format` or vLLM's `structured_outputs` value
    `v` asks for ({} for response_format text); ValueError naming what is wrong."""
    if name == "response_format":
        kind = v.get("type") if isinstance(v, dict) else None
        if kind == "text":
            return {}
        if kind == "json_object":
            return {"guided_json": JSON_OBJECT_SCHEMA}
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("'response_format.json_schema' must be an object with a 'schema' object")
            return {"guided_json": _guide("response_format.json_schema.schema", spec["schema"], True)}
        raise ValueError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         f"{{\"type\": \"json_schema\", \"json_schema\": {{\"schema\": ...}}}}, got {v!r}")
    given = {k: x for k, x in v.items() if x is not None} if isinstance(v, dict) else None
    if given is None or len(given) != 1 or set(given) - set(STRUCTURED_KEYS):
        other = sorted(set(given or ()) - set(STRUCTURED_KEYS))
        raise ValueError("'structured_outputs' takes one of " + ", ".join(STRUCTURED_KEYS)
                         + (f" ({', '.join(other)} not supported)" if other else ""))
    (key, x), = given.items()
    if key == "choice":
        return {"guided_choice": SamplingFields._words(x, "structured_outputs.choice")}
    if key == "json_object":
        if x is not True:
            raise ValueError("'structured_outputs.json_object' must be true")
        return {"guided_json": JSON_OBJECT_SCHEMA}
    return {STRUCTURED_KEYS[key]: _guide(f"structured_outputs.{key}", x, key == "json")}


def _guide(name: str, v: Any, schema: bool) -> Any:
    """A regular expression (a non-empty string) or a JSON schema (an object, or its JSON text, that
    compiles to a regular expression), checked; ValueError naming `name`."""
    if not schema:
        if not isinstance(v, str) or not v:
            raise ValueError(f"'{name}' must be a non-empty regular expression")
        return v
    from specjax.grammars import GrammarError, json_schema_regex
    if not isinstance(v, (dict, str)):
        raise ValueError(f"'{name}' must be a JSON schema (an object or its JSON text)")
    try:
        json_schema_regex(v, name)
    except GrammarError as e:
        raise ValueError(str(e)) from None
    return v


def check_served(body: Mapping[str, Any], *, tools: bool = False) -> None:
    """FieldError naming the first of `UNSERVED_FIELDS` (and `TOOL_FIELDS` unless `tools`: the chat
    route serves them) that `body` sets to a value other than off."""
    for name, off in (UNSERVED_FIELDS if tools else {**UNSERVED_FIELDS, **TOOL_FIELDS}).items():
        v = body.get(name)
        if v is not None and not any(v == o and isinstance(v, bool) == isinstance(o, bool) for o in off):
            raise FieldError(f"'{name}' is not supported (accepted: {_offs(off)})", name)


def _offs(off: tuple[Any, ...]) -> str:
    return " or ".join("null" if o is None else json.dumps(o) for o in off)


def _first_error(e: pydantic.ValidationError) -> FieldError:
    err = e.errors()[0]
    field = str(err["loc"][0]) if err.get("loc") else None
    cause = (err.get("ctx") or {}).get("error")
    message = str(cause) if cause is not None else f"'{field}': {err['msg']}"
    return FieldError(message, field)


def parse_sampling(obj: Mapping[str, Any], defaults: SamplingParams, *, has_tokenizer: bool = True) -> SamplingParams:
    """`SamplingParams` from a request's fields (the `SAMPLING_FIELDS` in `obj`; others ignored).

    Raises `FieldError` naming the first bad field: its JSON type (`SamplingFields`), its value
    (`SamplingParams`' own checks), or stop strings without a tokenizer. OpenAI's `response_format`
    and vLLM's `structured_outputs` become the guide they name (guided_choice, guided_regex or
    guided_json; json_object: any JSON object)."""
    try:
        fields = SamplingFields.model_validate({k: obj[k] for k in SAMPLING_FIELDS if k in obj})
    except pydantic.ValidationError as e:
        raise _first_error(e) from None
    given = fields.given()
    for name in ("response_format", "structured_outputs"):  # each sets one of GUIDES
        if name in given:
            guide = guide_fields(name, given.pop(name))
            if guide and any(g in given for g in GUIDES):
                raise FieldError(f"give one of {', '.join(GUIDES)}, response_format and structured_outputs, "
                                 f"not several", name)
            given.update(guide)
    if "prediction" in given:
        given["prediction"] = prediction_text(given["prediction"])
    guides = [g for g in GUIDES if g in given]
    if len(guides) > 1:
        raise FieldError(f"give one of {', '.join(guides)}, not several", guides[-1])
    if given.get("stop") and not has_tokenizer:
        raise FieldError("'stop' strings need a tokenizer; this model has none (use 'stop_token_ids')", "stop")
    for name, v in given.items():  # each field alone, so that the error names it
        if name in ENGINE_MAX and v > ENGINE_MAX[name]:
            raise FieldError(f"'{name}' must be at most {ENGINE_MAX[name]:g}, got {v!r}", name)
        alone = {name: v}
        partner = {"min_tokens": "max_tokens", "guided_whitespace_pattern": "guided_json"}.get(name)
        if partner in given:  # checked beside the field it goes with
            alone[partner] = given[partner]
        try:
            dataclasses.replace(defaults, **alone)
        except (ValueError, TypeError) as e:
            raise FieldError(f"'{name}': {e}", name) from None
    try:
        return dataclasses.replace(defaults, **given)
    except (ValueError, TypeError) as e:
        raise FieldError(str(e)) from None
