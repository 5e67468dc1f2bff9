"""A request as the engine sees it (`EngineRequest`), its speculative metrics with vLLM's
definitions (`RequestMetrics`), its per-token log-probability entries, and the host's record of a
dispatched round (`Launched`)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from specjax.decoding.automata import TokenAutomaton
from specjax.decoding.engine_config import LOGIT_RULES, PRIORITY_OPTION, EngineConfig
from specjax.decoding.logit_rules import BAD_WORD_TOKENS, CHOICE_TOKENS, ROW_BAD_WORDS, ROW_CHOICES
from specjax.decoding.row_state import ROW_STOP_IDS

PENALTY_FIELDS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}  # name: off
BIAS_FIELDS = ("logit_bias", "allowed_token_ids", "bad_words")  # served by an engine with logit bias
MAX_LOGIT_BIAS = 100.0  # |logit_bias| values (OpenAI's range)


class RequestFieldError(ValueError):
    """A request refused for one field: `field`, its SamplingParams name."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def penalties_asked(params: Any) -> list[str]:
    """The penalty fields (PENALTY_FIELDS) that `params` (SamplingParams or EngineRequest) sets on."""
    return [f for f, off in PENALTY_FIELDS.items() if getattr(params, f) != off]


def missing_rule(params: Any, served: Mapping[str, bool]) -> tuple[str, str] | None:
    """(the first field `params` sets, the opt-in option that serves it: engine_config.LOGIT_RULES or
    PRIORITY_OPTION) of an option `served` (`EngineConfig.options_served`) does not hold, or None."""
    asked = {"penalties": penalties_asked(params), "logit_bias": bias_asked(params),
             "guided_choice": ["guided_choice"] if params.guided_choice else [], "guided_regex": regex_asked(params),
             PRIORITY_OPTION: ["priority"] if params.priority else []}
    return next(((fields[0], rule) for rule, fields in asked.items() if fields and not served.get(rule)), None)


def regex_asked(params: Any) -> list[str]:
    """The fields of `params` an automaton serves: SamplingParams' guided_regex / guided_json, an
    EngineRequest's automaton (by the field it came from)."""
    automaton = getattr(params, "automaton", None)
    if automaton is not None:
        return [automaton.field]
    return [f for f in ("guided_regex", "guided_json") if getattr(params, f, None) is not None]


def bias_asked(params: Any) -> list[str]:
    """The BIAS_FIELDS that `params` (SamplingParams or EngineRequest) sets (allowed_token_ids: not None)."""
    def asked(f: str) -> bool:
        return getattr(params, f) is not None if f == "allowed_token_ids" else bool(getattr(params, f))
    return [f for f in BIAS_FIELDS if asked(f)]


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
    # predicted outputs (OpenAI's usage.completion_tokens_details names): predicted drafts verification
    # accepted, and those it verified and did not accept
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose cache rows a freed slot held (prefix caching): not prefilled
    first_token_time: float | None = None
    start_time: float = 0.0  # arrival (add_request)
    scheduled_time: float | None = None  # given a slot (admission)
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

    def latencies(self, n_tokens: int) -> dict[str, float | None]:
        """vLLM's per-request intervals in seconds (None where a moment was not reached): ttft (arrival
        to first token), e2e (arrival to finish), tpot (`time_per_output_token`), queue (arrival to a
        slot), prefill (slot to first token), decode (first token to finish), inference (slot to finish)."""
        t = {"arrival": self.start_time, "slot": self.scheduled_time, "first": self.first_token_time,
             "finish": self.finish_time}

        def span(a: str, b: str) -> float | None:
            return None if t[a] is None or t[b] is None else t[b] - t[a]
        return {"ttft": span("arrival", "first"), "e2e": span("arrival", "finish"),
                "tpot": self.time_per_output_token(n_tokens), "queue": span("arrival", "slot"),
                "prefill": span("slot", "first"), "decode": span("first", "finish"),
                "inference": span("slot", "finish")}

    def as_dict(self) -> dict[str, Any]:
        return {"mean_acceptance_length": self.mean_acceptance_length, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "num_rounds": self.num_rounds, "accepted_prediction_tokens": self.accepted_prediction_tokens,
                "rejected_prediction_tokens": self.rejected_prediction_tokens}

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

    def record_prediction(self, drafted: int, accepted: int) -> None:
        """One round's predicted drafts: `drafted` verified, `accepted` of them accepted."""
        self.accepted_prediction_tokens += accepted
        self.rejected_prediction_tokens += drafted - accepted

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
    # an engine with EngineConfig.logit_bias: added to the target's logits (token id: bias in [-100, 100]);
    # only these ids sampled (None: all); token sequences whose last token is banned after the others
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    guided_choice: tuple[tuple[int, ...], ...] = ()  # the output is one of these, then eos (EngineConfig.guided_choice)
    automaton: TokenAutomaton | None = None  # the output follows it, then eos (EngineConfig.guided_regex)
    automaton_start: int = -1  # filled by the engine: its initial state's id in the engine's table
    # (output, min_tokens) -> (tokens to keep, the output's text, the stop string) when one ends the output
    stop_check: Callable[[list[int], int], tuple[int, str, str] | None] | None = None
    max_draft_tokens: int | None = None  # per-request cap on ell (None: engine gamma)
    prediction_ids: tuple[int, ...] = ()  # predicted output tokens, drafted while the output follows them
    logprobs: int | None = None  # top alternatives per token (0: the token's own only); None: none
    priority: int = 0  # admission order under EngineConfig.scheduling_policy "priority": lower first
    # filled by the engine
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # with `logprobs`: per output token (its log-probability, top ids, their log-probabilities)
    output_logprobs: list[tuple[float, list[int], list[float]]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    output_text: str | None = None  # set by a stop string (its `stop_check`'s text); else the tokens' text
    stop_reason: int | str | None = None  # vLLM's: the stop id or stop string that ended it (None: eos, length)
    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)
    slot: int = -1
    rounds: int = 0
    # preemption (decoding/preemption.py): output tokens held when last admitted, times preempted
    resume_at: int = 0
    preemptions: int = 0

    def context_ids(self) -> list[int]:
        """What its admission prefills: the prompt, then (preempted before) the output it held then."""
        return self.prompt_ids + self.output_ids[:self.resume_at] if self.resume_at else self.prompt_ids

    @property
    def context_len(self) -> int:
        """len(context_ids()), without building it."""
        return len(self.prompt_ids) + self.resume_at


def token_logprobs(req: EngineRequest, outs: dict[str, Any], row: int, n: int
                    ) -> list[tuple[float, list[int], list[float]]]:
    """The first `n` tokens' entries of `req.output_logprobs` from a program's outputs (row `row`)."""
    k = req.logprobs or 0
    return [(float(outs["logprob"][row, j]), outs["top_id"][row, j, :k].tolist(),
             outs["top_logprob"][row, j, :k].tolist()) for j in range(n)]


def check_request(req: EngineRequest, cfg: EngineConfig, *, vocab: int, stop_ids: Sequence[int] = ()) -> None:
    """Refuse a request an engine of config `cfg` cannot serve (its max_len, top_k_cap, max_logprobs,
    logit rules, automaton table and prediction_tokens; a ValueError naming the field, a
    RequestFieldError for the logit rules' fields and the prediction)."""
    max_len, top_k_cap, max_logprobs = cfg.max_len, cfg.top_k_cap, cfg.max_logprobs
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
    missing = missing_rule(req, cfg.options_served)
    if missing:
        field, rule = missing
        what = LOGIT_RULES[rule][0] if rule in LOGIT_RULES else "priority scheduling"
        raise RequestFieldError(f"request {req.request_id}: {field} needs an engine with {what} (EngineConfig."
                                f"{rule.replace(' ', '=')}; the server's --{rule.replace('_', '-')})", field)
    if bias_asked(req):
        _check_bias(req, vocab, () if req.ignore_eos else stop_ids)
    if req.guided_choice:
        _check_choices(req, vocab, stop_ids)
    if req.automaton is not None:
        _check_automaton(req, vocab, stop_ids, cfg.automaton_states)
    if req.prediction_ids:
        _check_prediction(req, vocab, cfg.prediction_tokens)
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


def _check_bias(req: EngineRequest, vocab: int, eos_ids: Sequence[int]) -> None:
    """Refuse bad logit_bias, allowed_token_ids or bad_words (ids outside the vocabulary, a bias out of
    range, more or longer bad words than the device holds, no token left to sample), naming the field."""
    def refuse(field: str, message: str) -> None:
        raise RequestFieldError(f"request {req.request_id}: {field}{message}", field)
    for t, b in (req.logit_bias or {}).items():
        if not 0 <= int(t) < vocab:
            refuse("logit_bias", f" token id {t} outside the vocabulary [0, {vocab})")
        if not (math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS):
            refuse("logit_bias", f" values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {b!r} "
                                 f"for token {t}")
    allowed = req.allowed_token_ids
    if allowed is not None and not allowed:
        refuse("allowed_token_ids", " is empty (no token could be sampled)")
    if allowed is not None and any(not 0 <= int(t) < vocab for t in allowed):
        refuse("allowed_token_ids", f" has an id outside the vocabulary [0, {vocab})")
    for i, w in enumerate(req.bad_words):
        if not w or any(not 0 <= int(t) < vocab for t in w):
            refuse("bad_words", f"[{i}] must be token ids in [0, {vocab}), got {list(w)}")
        if len(w) > BAD_WORD_TOKENS:
            refuse("bad_words", f"[{i}] is {len(w)} tokens; at most {BAD_WORD_TOKENS} are served")
    if sum(len(w) > 1 for w in req.bad_words) > ROW_BAD_WORDS:
        refuse("bad_words", f": at most {ROW_BAD_WORDS} of more than one token (tokenizations) are served")
    if allowed is not None:
        left = set(allowed) - {w[0] for w in req.bad_words if len(w) == 1}
        if not left:
            refuse("allowed_token_ids", " are all bad_words (no token could be sampled)")
        if req.min_tokens and not left - set(eos_ids) - set(req.stop_token_ids):
            refuse("allowed_token_ids", " are all stop ids, which min_tokens holds back (no token could be sampled)")


def _check_choices(req: EngineRequest, vocab: int, eos_ids: Sequence[int]) -> None:
    """Refuse guided choices the device cannot hold or that could leave no token to sample (the
    fields that also ban tokens, or none of the eos ids that end a whole choice)."""
    def refuse(message: str, field: str = "guided_choice") -> None:
        raise RequestFieldError(f"request {req.request_id}: {message}", field)
    if len(req.guided_choice) > ROW_CHOICES:
        refuse(f"guided_choice: at most {ROW_CHOICES} choices are served, got {len(req.guided_choice)}")
    for i, c in enumerate(req.guided_choice):
        if not c or len(c) > CHOICE_TOKENS or any(not 0 <= int(t) < vocab for t in c):
            refuse(f"guided_choice[{i}] must be 1 to {CHOICE_TOKENS} token ids in [0, {vocab}), got {list(c)}")
    if not eos_ids or req.ignore_eos:
        refuse("guided_choice ends a whole choice with eos: " + ("the engine has no eos ids" if not eos_ids
                                                                  else "not with ignore_eos"),
               "ignore_eos" if eos_ids else "guided_choice")
    for field in ("min_tokens", "allowed_token_ids", "bad_words"):
        if getattr(req, field):
            refuse(f"{field} is not served with guided_choice (they could leave no token to sample)", field)


def _check_automaton(req: EngineRequest, vocab: int, eos_ids: Sequence[int], states: int) -> None:
    """Refuse an automaton over another vocabulary, larger than the engine's table, or beside the
    fields that could leave no token to sample (or without the eos ids that end its output)."""
    a = req.automaton

    def refuse(message: str, field: str = a.field) -> None:
        raise RequestFieldError(f"request {req.request_id}: {message}", field)
    if a.vocab != vocab:
        refuse(f"{a.field}: the automaton is over {a.vocab} token ids, the target's vocabulary {vocab}")
    if a.states > states:
        refuse(f"{a.field} compiles to {a.states} automaton states, more than the engine's table holds "
               f"(EngineConfig.automaton_states = {states}; the server's --automaton-states)")
    if not eos_ids or req.ignore_eos:
        refuse(f"{a.field} ends its output with eos: " + ("the engine has no eos ids" if not eos_ids
                                                           else "not with ignore_eos"),
               "ignore_eos" if eos_ids else a.field)
    for field in ("min_tokens", "allowed_token_ids", "bad_words", "guided_choice"):
        if getattr(req, field):
            refuse(f"{field} is not served with {a.field} (they could leave no token to sample)", field)


def _check_prediction(req: EngineRequest, vocab: int, prediction_tokens: int) -> None:
    """Refuse a prediction the engine holds no room for, longer than a row holds, or of ids outside
    the vocabulary."""
    def refuse(message: str) -> None:
        raise RequestFieldError(f"request {req.request_id}: prediction {message}", "prediction")
    n = len(req.prediction_ids)
    if not prediction_tokens:
        refuse("needs an engine with predicted outputs (EngineConfig.prediction_tokens; the server's "
               "--prediction-tokens)")
    if n > prediction_tokens:
        refuse(f"is {n} tokens, more than a slot holds (EngineConfig.prediction_tokens = {prediction_tokens}; "
               f"the server's --prediction-tokens)")
    bad = [t for t in req.prediction_ids if not 0 <= int(t) < vocab]
    if bad:
        refuse(f"token id {bad[0]} outside the vocabulary [0, {vocab})")


def bias_row(req: EngineRequest, vocab: int) -> np.ndarray:
    """The request's per-token bias float32 [vocab]: -inf outside allowed_token_ids and at one-token
    bad words, its logit_bias added."""
    row = np.zeros((vocab,), np.float32)
    if req.allowed_token_ids is not None:
        row[:] = -np.inf
        row[list(req.allowed_token_ids)] = 0.0
    for t, b in (req.logit_bias or {}).items():
        row[int(t)] += b
    row[[w[0] for w in req.bad_words if len(w) == 1]] = -np.inf
    return row


def bad_word_rows(req: EngineRequest) -> np.ndarray:
    """The request's bad words of more than one token, int32 [ROW_BAD_WORDS, BAD_WORD_TOKENS],
    right-aligned, -1 padding (`logit_rules.ban_bad_words`)."""
    out = np.full((ROW_BAD_WORDS, BAD_WORD_TOKENS), -1, np.int32)
    for i, w in enumerate(w for w in req.bad_words if len(w) > 1):
        out[i, BAD_WORD_TOKENS - len(w):] = w
    return out


def held_stop_ids(req: EngineRequest) -> np.ndarray:
    """The request's own stop ids the device holds back while its min_tokens are due: int32
    [ROW_STOP_IDS], -1 padding (all padding without min_tokens)."""
    out = np.full((ROW_STOP_IDS,), -1, np.int32)
    if req.min_tokens:
        out[:len(req.stop_token_ids)] = req.stop_token_ids
    return out


def append_output(req: EngineRequest, toks: Sequence[int], eos_token_ids: Sequence[int]) -> None:
    """Append emitted tokens to `req.output_ids` under its stop rules (eos unless ignore_eos, its stop ids,
    max_tokens, its stop strings: `stop_check`), setting `finish_reason` when one ends it. A stop string in
    the appended tokens ends the output there, whatever ended the round's tokens (a round may emit
    the stop string and reach max_tokens or eos at once)."""
    stops = set(req.stop_token_ids) | (set() if req.ignore_eos else set(eos_token_ids))
    for t in toks:
        req.output_ids.append(int(t))
        if int(t) in stops:
            req.finish_reason = "stop"
            req.stop_reason = int(t) if int(t) in req.stop_token_ids and (
                req.ignore_eos or int(t) not in eos_token_ids) else None
            break
        if len(req.output_ids) >= req.max_tokens:
            req.finish_reason = "length"
            break
    if req.stop_check is not None:
        hit = req.stop_check(req.output_ids, req.min_tokens)
        if hit is not None:
            keep, req.output_text, req.stop_reason = hit
            del req.output_ids[keep:]
            req.finish_reason = "stop"


def prefill_inputs(chunks: list[tuple[EngineRequest, int, int, int, np.ndarray]], pb: int, plen: int,
                   slots: int, bias_cols: int = 0, choice_shape: tuple[int, int] = (0, 0),
                   pred_cols: int = 0) -> dict[str, np.ndarray]:
    """The prefill program's per-call inputs for prompt chunks (request, offset, length, draft cap,
    key data), padded to `pb` rows (padding rows point past the last of `slots`: dropped) of `plen`;
    `bias_cols` the vocabulary with logit bias, else 0 (zero-width bias and bad words); `choice_shape`
    (ROW_CHOICES, CHOICE_TOKENS) with guided choices, else zero; `pred_cols` predicted tokens a row
    holds (0: none)."""
    toks = np.zeros((pb, plen), np.int32)
    ints = np.zeros((4, pb), np.int32)  # n_valid, slot, start, top_k
    ints[1] = slots
    floats = np.repeat(np.array([[1.0], [1.0], [0.0]], np.float32), pb, axis=1)  # temperature, top_p, min_p
    key_data = np.zeros((pb, 2), np.uint32)
    limits = np.zeros((4, pb), np.int32)  # max_tokens, draft cap, eos_stops, min_tokens
    stops = np.full((pb, ROW_STOP_IDS), -1, np.int32)
    pens = np.repeat(np.array([[0.0], [0.0], [1.0]], np.float32), pb, axis=1)  # presence, frequency, repetition
    bias = np.zeros((pb, bias_cols), np.float32)
    words = np.full((pb, ROW_BAD_WORDS, BAD_WORD_TOKENS) if bias_cols else (pb, 0, 0), -1, np.int32)
    choices = np.full((pb,) + tuple(choice_shape), -1, np.int32)
    starts = np.full((pb,), -1, np.int32)  # automaton initial states in the engine's table
    pred = np.full((pb, pred_cols), -1, np.int32)
    for row, (r, offset, n, draft_cap, key) in enumerate(chunks):
        ctx = r.context_ids()  # a preempted request's output counts as prompt, and against its limits
        toks[row, :n] = ctx[offset:offset + n]
        ints[:, row] = n, r.slot, offset, r.top_k
        floats[:, row] = r.temperature, r.top_p, r.min_p
        key_data[row] = key
        # a chunk before the prompt's last leaves its row inactive (no tokens wanted) until that one
        limits[:, row] = (r.max_tokens - r.resume_at if offset + n == r.context_len else 1, draft_cap, not r.ignore_eos,
                          max(r.min_tokens - r.resume_at, 0))
        stops[row] = held_stop_ids(r)
        pens[:, row] = r.presence_penalty, r.frequency_penalty, r.repetition_penalty
        if bias_cols:
            bias[row], words[row] = bias_row(r, bias_cols), bad_word_rows(r)
        starts[row] = r.automaton_start
        if pred_cols:
            pred[row, :len(r.prediction_ids)] = r.prediction_ids
        for i, c in enumerate(r.guided_choice if choice_shape[0] else ()):
            choices[row, i, :len(c)] = c
    return {"tokens_bt": toks, "ints_4b": ints, "floats_3b": floats, "keys_b2": key_data, "limits_4b": limits,
            "stops_bk": stops, "pens_3b": pens, "bias_bv": bias, "words_bwl": words,
            "choices_bcl": choices, "fsm_start_b": starts, "pred_bl": pred}


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
