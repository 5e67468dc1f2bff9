"""A request as the engine sees it (`EngineRequest`), its speculative metrics with vLLM's
definitions (`RequestMetrics`), its per-token log-probability entries, and the host's record of a
dispatched round (`Launched`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from specjax.decoding.programs import ROW_STOP_IDS

PENALTY_FIELDS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}  # name: off


def penalties_asked(params: Any) -> list[str]:
    """The penalty fields (PENALTY_FIELDS) that `params` (SamplingParams or EngineRequest) sets on."""
    return [f for f, off in PENALTY_FIELDS.items() if getattr(params, f) != off]


@dataclasses.dataclass
class RequestMetrics:
    """Per-request speculative metrics with vLLM's definitions."""

    num_drafts: int = 0  # rounds that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rounds: int = 0  # target passes after prefill (incl. ones without drafting)
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    # per drafting round, in order: drafts verified (ell > 0) and drafts accepted of them
    per_step_drafted: list[int] = dataclasses.field(default_factory=list)
    per_step_accepted: list[int] = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    start_time: float = 0.0
    finish_time: float | None = None

    @property
    def mean_acceptance_length(self) -> float:
        """Accepted tokens per drafting round including the bonus token (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def time_per_output_token(self, n_tokens: int) -> float | None:
        """Seconds per output token after the first, vLLM's per-request TPOT (1 / TPOT is the per-user
        speed): the time from the first token to the finish over the `n_tokens` - 1 tokens after the
        first. None before the finish or for a request of fewer than two tokens."""
        if self.first_token_time is None or self.finish_time is None or n_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (n_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {"mean_acceptance_length": self.mean_acceptance_length, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "num_rounds": self.num_rounds}

    def speculative_decoding(self, num_spec_tokens: int, *, detailed: bool = False) -> dict[str, Any]:
        """vLLM's per-request `speculative_decoding` block for a request whose rounds verified at most
        `num_spec_tokens` drafts each: the counts, `draft_acceptance_rate`, `acceptance_histogram`
        [num_spec_tokens + 1] (index j: drafting rounds that accepted exactly j drafts, the bonus token
        not counted), `acceptance_histogram_by_draft_length` {"k": [k + 1]} (the same for the rounds
        that verified k drafts); `detailed` adds `per_step_drafted` / `per_step_accepted`."""
        drafted, accepted = self.per_step_drafted, self.per_step_accepted
        if max(drafted, default=0) > num_spec_tokens:
            raise ValueError(f"a round verified {max(drafted)} drafts, more than num_spec_tokens {num_spec_tokens}")
        hist = [0] * (num_spec_tokens + 1)
        by_length: dict[int, list[int]] = {}
        for k, j in zip(drafted, accepted):
            hist[j] += 1
            by_length.setdefault(k, [0] * (k + 1))[j] += 1
        out: dict[str, Any] = {
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "acceptance_histogram": hist,
            "acceptance_histogram_by_draft_length": {str(k): by_length[k] for k in sorted(by_length)},
            "num_spec_steps": self.num_drafts, "num_accepted_draft_tokens": self.num_accepted_tokens,
            "num_draft_tokens": self.num_draft_tokens, "num_spec_tokens": int(num_spec_tokens)}
        if detailed:
            out["per_step_drafted"], out["per_step_accepted"] = list(drafted), list(accepted)
        return out

    def record_round(self, ell: int, accepted: int, gamma: int) -> None:
        """One round of this request that verified `ell` drafts and accepted `accepted` of them."""
        self.num_rounds += 1
        if ell <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += ell
        self.num_accepted_tokens += accepted
        self.per_step_drafted.append(ell)
        self.per_step_accepted.append(accepted)
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
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # the engine's eos ids do not end this request (its stop_token_ids still do)
    min_tokens: int = 0  # tokens emitted before a stop id may be drawn (or a stop string end the output)
    presence_penalty: float = 0.0  # vLLM's penalties (an engine with EngineConfig.penalties)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_check: Callable[[list[int], int], int | None] | None = None  # (output, min_tokens) -> tokens to keep, if a stop hit
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


def check_request(req: EngineRequest, *, max_len: int, vocab: int, top_k_cap: int, max_logprobs: int,
                  penalties: bool = False) -> None:
    """Refuse a request an engine of these limits cannot serve (a ValueError naming the field)."""
    n = len(req.prompt_ids)
    if n == 0:
        raise ValueError(f"request {req.request_id}: prompt is empty")
    if n + 1 > max_len:
        raise ValueError(f"request {req.request_id}: prompt of {n} tokens does not fit the context "
                         f"(max_len {max_len} must hold the prompt plus one generated token)")
    bad = [t for t in req.prompt_ids if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"request {req.request_id}: prompt token id {bad[0]} outside the vocabulary [0, {vocab})")
    if req.max_tokens <= 0:
        raise ValueError(f"request {req.request_id}: max_tokens must be > 0, got {req.max_tokens}")
    if not 0 <= req.min_tokens <= req.max_tokens:
        raise ValueError(f"request {req.request_id}: min_tokens must be in [0, max_tokens = {req.max_tokens}], "
                         f"got {req.min_tokens}")
    asked = penalties_asked(req)
    if asked and not penalties:
        raise ValueError(f"request {req.request_id}: {asked[0]} needs an engine with penalties "
                         f"(EngineConfig.penalties; the server's --penalties)")
    if req.min_tokens and len(req.stop_token_ids) > ROW_STOP_IDS:
        raise ValueError(f"request {req.request_id}: with min_tokens at most {ROW_STOP_IDS} stop_token_ids are "
                         f"held back (the device's per-row limit), got {len(req.stop_token_ids)}")
    if req.top_k > top_k_cap:
        raise ValueError(f"request {req.request_id}: top_k {req.top_k} exceeds the engine's top_k_cap {top_k_cap}")
    if req.logprobs is not None and max_logprobs == 0:
        raise ValueError(f"request {req.request_id}: logprobs asked of an engine built without them "
                         f"(EngineConfig.max_logprobs = 0)")
    if req.logprobs is not None and not 0 <= req.logprobs <= max_logprobs:
        raise ValueError(f"request {req.request_id}: logprobs must be in [0, {max_logprobs}] "
                         f"(the engine's max_logprobs), got {req.logprobs}")


def held_stop_ids(req: EngineRequest) -> np.ndarray:
    """The request's own stop ids the device holds back while its min_tokens are due: int32
    [ROW_STOP_IDS], -1 padding (all padding without min_tokens)."""
    out = np.full((ROW_STOP_IDS,), -1, np.int32)
    if req.min_tokens:
        out[:len(req.stop_token_ids)] = req.stop_token_ids
    return out


def prefill_inputs(chunks: list[tuple[EngineRequest, int, int, int, np.ndarray]], pb: int, plen: int,
                   slots: int) -> dict[str, np.ndarray]:
    """The prefill program's per-call inputs for prompt chunks (request, offset, length, draft cap,
    key data), padded to `pb` rows (padding rows point past the last of `slots`: dropped) of `plen`."""
    toks = np.zeros((pb, plen), np.int32)
    ints = np.zeros((4, pb), np.int32)  # n_valid, slot, start, top_k
    ints[1] = slots
    floats = np.repeat(np.array([[1.0], [1.0], [0.0]], np.float32), pb, axis=1)  # temperature, top_p, min_p
    key_data = np.zeros((pb, 2), np.uint32)
    limits = np.zeros((4, pb), np.int32)  # max_tokens, draft cap, eos_stops, min_tokens
    stops = np.full((pb, ROW_STOP_IDS), -1, np.int32)
    pens = np.repeat(np.array([[0.0], [0.0], [1.0]], np.float32), pb, axis=1)  # presence, frequency, repetition
    for row, (r, offset, n, draft_cap, key) in enumerate(chunks):
        toks[row, :n] = r.prompt_ids[offset:offset + n]
        ints[:, row] = n, r.slot, offset, r.top_k
        floats[:, row] = r.temperature, r.top_p, r.min_p
        key_data[row] = key
        limits[:, row] = r.max_tokens, draft_cap, not r.ignore_eos, r.min_tokens
        stops[row] = held_stop_ids(r)
        pens[:, row] = r.presence_penalty, r.frequency_penalty, r.repetition_penalty
    return {"tokens_bt": toks, "ints_4b": ints, "floats_3b": floats, "keys_b2": key_data, "limits_4b": limits,
            "stops_bk": stops, "pens_3b": pens}


def seed_key_data(seed: int) -> np.ndarray:
    """Raw threefry key data of a seed's base key, computed on the host (no device call). For seeds
    below 2**32 this equals `jax.random.key_data(jax.random.key(seed))`; larger seeds use their high
    word as the key's first word, so distinct 64-bit seeds give distinct streams."""
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


@dataclasses.dataclass
class Launched:
    """A dispatched round the host has not read yet."""

    plan: Any  # scheduling.planner.RoundPlan
    tb: int  # tokens bucket
    attn: int  # attention bucket
    reqs: list[EngineRequest | None]  # rows [0:sb]: the request each active row served at dispatch
    outs: Any  # the round's outputs, on the device
    firsts: list[tuple[EngineRequest, Any, int]]  # admitted before it: (request, prefill outputs, row)
    t0: float
    conf: np.ndarray | None = None  # float32 [sb, gamma]: a host fill's draft confidences, read at dispatch

    def may_overflow(self, lengths_s: np.ndarray, buckets: Any, max_len: int) -> bool:
        """Whether a round planned before reading this one might need more cache rows than the largest
        attention bucket of `buckets` (a `buckets.BucketSet`) holds: the host knows its rows' lengths
        `lengths_s` only up to this round's tokens bucket, and the next round writes up to the largest."""
        if buckets.attention[-1] >= max_len:  # calls never read past max_len
            return False
        bound = lengths_s[:len(self.reqs)] + self.tb + buckets.tokens[-1]
        return bool(np.any(bound[[r is not None for r in self.reqs]] > buckets.attention[-1]))
