"""A request as the engine sees it (`EngineRequest`), its speculative metrics with vLLM's
definitions (`RequestMetrics`), and its per-token log-probability entries."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass
class RequestMetrics:
    """Per-request speculative metrics with vLLM's definitions."""

    num_drafts: int = 0  # rounds that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rounds: int = 0  # target passes after prefill (incl. ones without drafting)
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    start_time: float = 0.0
    finish_time: float | None = None

    @property
    def mean_acceptance_length(self) -> float:
        """Accepted tokens per drafting round including the bonus token (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"mean_acceptance_length": self.mean_acceptance_length, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "num_rounds": self.num_rounds}

    def record_round(self, ell: int, accepted: int, gamma: int) -> None:
        """One round of this request that verified `ell` drafts and accepted `accepted` of them."""
        self.num_rounds += 1
        if ell <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += ell
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < gamma:
            self.accepted_per_pos += [0] * (gamma - len(self.accepted_per_pos))
        for k in range(accepted):
            self.accepted_per_pos[k] += 1


@dataclasses.dataclass
class EngineRequest:
    """One request as the engine sees it (validated by the API layer)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_check: Callable[[list[int]], int | None] | None = None  # -> tokens to keep, if a stop hit
    max_draft_tokens: int | None = None  # per-request cap on ell (None: engine gamma)
    logprobs: int | None = None  # top alternatives per token (0: the token's own only); None: none
    # filled by the engine
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # with `logprobs`: per output token (its log-probability, top ids, their log-probabilities)
    output_logprobs: list[tuple[float, list[int], list[float]]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)
    slot: int = -1
    rounds: int = 0


def token_logprobs(req: EngineRequest, outs: dict[str, Any], row: int, n: int
                    ) -> list[tuple[float, list[int], list[float]]]:
    """The first `n` tokens' entries of `req.output_logprobs` from a program's outputs (row `row`)."""
    k = req.logprobs or 0
    return [(float(outs["logprob"][row, j]), outs["top_id"][row, j, :k].tolist(),
             outs["top_logprob"][row, j, :k].tolist()) for j in range(n)]
