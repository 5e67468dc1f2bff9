"""The one request schema (specjax.serving.schema): the server and the batch job share it, and its
errors name the field."""
from __future__ import annotations

import pytest

from specjax.api import SamplingParams
from specjax.serving import batch_job, errors, openai_api
from specjax.serving.schema import SAMPLING_FIELDS, FieldError, SamplingFields, parse_sampling

D = SamplingParams(max_tokens=16)


def test_fields_map_onto_sampling_params():
    sp = parse_sampling({"temperature": 0, "top_k": -1, "top_p": 0.5, "min_p": 0.1, "max_tokens": 3, "stop": "x",
                         "stop_token_ids": [1, 2], "seed": 7, "num_speculative_tokens": 2, "other": "ignored"}, D)
    assert sp == SamplingParams(temperature=0.0, top_k=0, top_p=0.5, min_p=0.1, max_tokens=3, stop=("x",),
                                stop_token_ids=(1, 2), seed=7, num_speculative_tokens=2)
    assert parse_sampling({"temperature": None}, D) == D  # null: the default
    assert set(SamplingFields.model_fields) == set(SAMPLING_FIELDS)


@pytest.mark.parametrize("field, value, fragment", [
    ("temperature", "hot", "must be a number"),
    ("temperature", True, "must be a number"),
    ("temperature", float("nan"), "must be a number"),
    ("temperature", -1, "temperature"),
    ("top_p", 1.5, "top_p"),
    ("min_p", 1.5, "min_p must be in"),
    ("min_p", -0.5, "min_p must be in"),
    ("min_p", "0.1", "must be a number"),
    ("top_k", 1.0, "must be an integer"),
    ("top_k", -2, "top_k"),
    ("seed", -1, "seed"),
    ("max_tokens", 0, "positive integer"),
    ("max_tokens", "8", "positive integer"),
    ("stop", [1], "string or a list of strings"),
    ("stop", [""], "non-empty"),
    ("stop_token_ids", [1, "2"], "list of integers"),
    ("num_speculative_tokens", -1, "num_speculative_tokens"),
    ("num_speculative_tokens", 1 << 31, "at most"),  # beyond the engine's int32 rows
    ("top_k", 1 << 40, "at most"),
    ("temperature", 1e300, "at most"),  # beyond float32
])
def test_errors_name_the_field(field, value, fragment):
    with pytest.raises(FieldError, match=fragment) as ei:
        parse_sampling({"temperature": 0.5, field: value}, D)
    assert ei.value.field == field


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(FieldError, match="tokenizer") as ei:
        parse_sampling({"stop": ["a"]}, D, has_tokenizer=False)
    assert ei.value.field == "stop"
    assert parse_sampling({"stop_token_ids": [3]}, D, has_tokenizer=False).stop_token_ids == (3,)


def test_server_and_batch_job_use_the_same_schema():
    """Both callers go through `parse_sampling` (a field refused by the schema is refused by both, with
    the same message), so there is one set of rules to keep right."""
    assert openai_api.parse_sampling is parse_sampling and batch_job.parse_sampling is parse_sampling
    row = {"id": 1, "prompt": [5], "top_p": 1.5}
    with pytest.raises(batch_job.RowError) as ei:
        batch_job.parse_row(row, 1, D)
    with pytest.raises(FieldError) as ej:
        parse_sampling(row, D)
    assert (ei.value.field, str(ei.value)) == (ej.value.field, str(ej.value)) == ("top_p", str(ej.value))


@pytest.mark.parametrize("chat, body, param, fragment", [
    (True, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "'tool'"),
    (True, {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content",
     "messages[0].content[0].type: Field required"),
    (True, {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content", "lone surrogate"),
    (True, {"messages": "hi"}, "messages", "valid list"),
    (True, {}, "messages", "missing"),
    (False, {"prompt": [1.5]}, "prompt", "matches none of its allowed forms"),
    (False, {"prompt": [1], "stream": "yes"}, "stream", "boolean"),
    (False, {"prompt": [1], "stop": [1]}, "stop", "stop"),
    (False, [1, 2], None, "JSON object"),
])
def test_request_models_refuse_naming_the_field_path(chat, body, param, fragment):
    with pytest.raises(errors.APIError) as ei:
        errors.parse_request(body, chat=chat)
    assert ei.value.status == 400 and ei.value.param == param and fragment in ei.value.message, ei.value.message


def test_request_models_accept_openai_shapes():
    req = errors.parse_request({"messages": [{"role": "system", "content": None},
                                                 {"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                    "stop": "s", "max_completion_tokens": 3, "stream_options": {"include_usage": True},
                                    "unknown_field": 1}, chat=True)
    assert req.stop == ("s",) and req.max_completion_tokens == 3 and req.stream_options.include_usage
    assert errors.parse_request({"prompt": [[1, 2]]}, chat=False).prompt == [[1, 2]]
