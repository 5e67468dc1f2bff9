"""Per-request speculative metrics as responses carry them.

`spec_metrics` (every response of the server, every row of a batch job): one request's counts with
vLLM's definitions (`mean_acceptance_length` = 1 + accepted / drafts, the bonus token included).

`metrics.speculative_decoding` (the server's opt-in `--per-request-spec-decode-metrics summary |
detailed`, vLLM's field names; `RequestMetrics.speculative_decoding`): the same counts plus their
shape, which a scheduler that chooses each request's verification length makes worth seeing:
    acceptance_histogram                  [num_spec_tokens + 1]: index j = drafting rounds that accepted
                                          exactly j draft tokens (the bonus token not counted)
    acceptance_histogram_by_draft_length  {"k": [k + 1]}: the same, for the rounds that verified k drafts
    num_spec_steps                        drafting rounds (rounds that verified >= 1 draft token)
    num_spec_tokens                       the most drafts a round of this request may verify (the
                                          engine's gamma, or the request's num_speculative_tokens)
    per_step_drafted / per_step_accepted  (detailed) every drafting round's counts, in order
"""
from __future__ import annotations

from typing import Any, Sequence

from specjax.decoding.requests import EngineRequest

SPEC_DECODE_METRICS_LEVELS = ("none", "summary", "detailed")


def check_spec_decode_metrics_level(level: str) -> str:
    """`level` if it is one of SPEC_DECODE_METRICS_LEVELS, else a ValueError naming the option."""
    if level not in SPEC_DECODE_METRICS_LEVELS:
        raise ValueError(f"spec_decode_metrics must be one of {', '.join(SPEC_DECODE_METRICS_LEVELS)}, "
                         f"got {level!r}")
    return level


def request_spec_metrics(metrics: Any) -> dict[str, Any]:
    """Per-request speculative metrics block (from an engine `RequestMetrics` or its `as_dict()`)."""
    d = metrics.as_dict() if hasattr(metrics, "as_dict") else dict(metrics)
    return {"mean_acceptance_length": float(d.get("mean_acceptance_length", 1.0)),
            "num_drafts": int(d.get("num_drafts", 0)),
            "num_draft_tokens": int(d.get("num_draft_tokens", 0)),
            "num_accepted_tokens": int(d.get("num_accepted_tokens", 0)),
            "accepted_per_pos": [int(x) for x in d.get("num_accepted_tokens_per_pos", [])],
            "num_rounds": int(d.get("num_rounds", 0))}


def combined_spec_metrics(blocks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One `spec_metrics` block for several choices: counts added, acceptance length recomputed."""
    if len(blocks) == 1:
        return blocks[0]
    drafts, accepted = sum(b["num_drafts"] for b in blocks), sum(b["num_accepted_tokens"] for b in blocks)
    width = max(len(b["accepted_per_pos"]) for b in blocks)
    return {"mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0, "num_drafts": drafts,
            "num_draft_tokens": sum(b["num_draft_tokens"] for b in blocks), "num_accepted_tokens": accepted,
            "accepted_per_pos": [sum(b["accepted_per_pos"][k] for b in blocks if k < len(b["accepted_per_pos"]))
                                 for k in range(width)],
            "num_rounds": sum(b["num_rounds"] for b in blocks)}


def usage(prompt_tokens: int, completion_tokens: int, requests: Sequence[EngineRequest] = (), *,
          prompt_details: bool = False, n: int = 1) -> dict[str, Any]:
    """OpenAI's `usage` object; with `prompt_details` (vLLM's --enable-prompt-tokens-details), its
    `prompt_tokens_details.cached_tokens`: prompt tokens read from cache rows (prefix caching) by each
    prompt's first answer (`requests` hold `n` answers per prompt in a row; usage counts each prompt
    once); with a predicted output among them, its `completion_tokens_details`:
    accepted_prediction_tokens (predicted drafts verification accepted) and rejected_prediction_tokens
    (predicted drafts it verified and did not accept)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if prompt_details:
        out["prompt_tokens_details"] = {"cached_tokens": sum(r.metrics.cached_tokens for r in requests[::n])}
    predicted = [r.metrics for r in requests if r.prediction_ids]
    if predicted:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(m.accepted_prediction_tokens for m in predicted),
            "rejected_prediction_tokens": sum(m.rejected_prediction_tokens for m in predicted)}
    return out


def response_metrics(level: str, requests: Sequence[EngineRequest], engine: Any) -> dict[str, Any] | None:
    """A response's `metrics` object at `level` (None at "none": the response carries none):
    `speculative_decoding` of its one request, or null for several choices (n > 1), none generated,
    or an `engine` (a `decoding.engine.Engine`) without a drafter."""
    if level == "none":
        return None
    if len(requests) != 1:
        return {"speculative_decoding": None}
    return {"speculative_decoding": engine.speculative_decoding(requests[0], detailed=level == "detailed")}
