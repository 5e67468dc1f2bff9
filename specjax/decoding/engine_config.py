"""The engine's static shape and policy (`EngineConfig`), validated on construction."""
from __future__ import annotations

import dataclasses

from specjax.decoding.buckets import attention_buckets
from specjax.models.pallas_attention import ATTENTION_IMPLEMENTATIONS, MIN_KEY_BLOCK
from specjax.models.pallas_mlp import MLP_IMPLEMENTATIONS
from specjax.sampling import DEFAULT_TOP_K_CAP, VARIANTS

# the opt-in logit rules: EngineConfig's flag -> (what refusals call it, what it serves); each adds per-slot
# state and work to every round, so an engine carries only those it is built with
LOGIT_RULES = {
    "penalties": ("penalties", "presence, frequency and repetition penalties (each slot keeps [vocab] token counts)"),
    "logit_bias": ("logit bias", "logit_bias, allowed_token_ids and bad_words (each slot keeps a [vocab] bias row)"),
    "guided_choice": ("guided choices", "guided_choice (the answer is one of the request's texts; each slot keeps "
                                        "its choices)"),
    "guided_regex": ("guided regular expressions", "guided_regex, guided_json and response_format json_schema (each "
                                                   "request follows a token automaton in one shared table)"),
}
MAX_AUTOMATON_STATES = 32767  # the table holds state ids as int16
CONFIDENCE_SOURCES = ("drafter", "online")
SCHEDULING_POLICIES = ("fcfs", "priority")
# the option that serves requests' `priority`, named as the server's flag (`--scheduling-policy priority`)
PRIORITY_OPTION = "scheduling_policy priority"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine shape and policy. `gamma` defaults to the drafter's."""

    max_slots: int = 8
    max_len: int = 1024
    gamma: int | None = None
    policy: str = "fixed"  # one of scheduling.names.LOSSLESS_POLICIES
    threshold: float | None = None  # per-step confidence threshold of the `threshold` policy
    max_prefill: int = 256
    seed: int = 0
    cache_dtype: str | None = None
    slots_buckets: tuple[int, ...] | None = None
    tokens_buckets: tuple[int, ...] | None = None
    prefill_buckets: tuple[int, ...] | None = None
    prefill_batch_buckets: tuple[int, ...] | None = None  # prompts per prefill call
    max_logprobs: int = 0  # top alternatives a request may ask for (0: no log-probabilities computed)
    # the sampling variants compiled for rounds (sampling.VARIANTS; each is one executable per round
    # bucket): a round runs the narrowest one its rows allow, a request no variant here covers is refused
    sampling_variants: tuple[str, ...] = VARIANTS
    top_k_cap: int = DEFAULT_TOP_K_CAP  # largest top_k a request may ask for (the lax.top_k of filtering)
    attention: str = "xla"  # attention over the caches in rounds: "xla" ops or "pallas" kernels (the
    # target's, and a drafter's that lists it in `attention_implementations`)
    mlp: str = "xla"  # MLPs' gate/up products and SiLU gate: "xla" ops or a "pallas" kernel (the target's in
    # every call, and a drafter's that lists it in `mlp_implementations`)
    # presence, frequency and repetition penalties served (vLLM's): each slot keeps its output token counts
    # and prompt tokens ([slots, vocab] each) and every sampled position is penalised; off, they are refused
    penalties: bool = False
    # logit_bias, allowed_token_ids and bad_words served (vLLM's): each slot keeps a [vocab] bias row, up to
    # 16 bad words of 2-8 tokens and its last output tokens; the drafter proposes without them (verification
    # applies them exactly); off, they are refused
    logit_bias: bool = False
    # guided_choice served (vLLM's): each slot keeps up to 16 choices of up to 16 tokens; every sampled position
    # allows only a token that continues a choice the output so far begins, or eos after a whole one; where every
    # open choice continues with the same token, that token is the draft
    guided_choice: bool = False
    # guided_regex served (vLLM's guided_regex, guided_json and response_format json_schema, each a regular
    # expression compiled on the host to a token automaton, `decoding.automata`): one table of
    # automaton_states states x vocab (int16 next states, and allowed tokens one bit each) holds the automata
    # of the live requests, each loaded once and kept while room allows (a request waits while its automaton
    # does not fit); every sampled position allows only the tokens its row's automaton allows, or eos in an
    # accepting state
    guided_regex: bool = False
    automaton_states: int = 2048  # vLLM's json_object (any JSON object) takes ~1,600
    # with guided_regex: drafters draw only the tokens each row's automaton allows (q renormalised over them,
    # so verification stays exact); False proposes free drafts, which verification rejects where not allowed
    guided_drafts: bool = True
    # OpenAI's predicted outputs served (`prediction`): each slot keeps up to this many predicted tokens, and a
    # row whose output follows its prediction drafts the next predicted tokens instead of the drafter's (q
    # one-hot: exact); needs a drafter (the n-gram drafter for predictions alone). 0: predictions refused
    prediction_tokens: int = 0
    # where the confidence policies (threshold, confidence, confidence_async) read draft confidences: "drafter"
    # from the drafter's confidence head, or the online acceptance estimate (`decoding.acceptance`: each
    # request's moving average of what verification accepted at each draft position) for a drafter without
    # one; "online" the estimate for every drafter (e.g. to compare it with a head)
    confidence_source: str = "drafter"
    # prefix caching (vLLM's, on by default there too): a freed slot keeps its cache rows, and a request whose
    # prompt begins with what a free slot holds goes there and prefills only the rest (`decoding.prefix_cache`)
    prefix_caching: bool = True
    # vLLM's chunked prefill: a prompt longer than one prefill call takes one call per engine step after
    # its first, between decoding rounds, so running requests keep decoding; off, all its calls at admission
    chunked_prefill: bool = True
    # vLLM's: "fcfs" admits requests in arrival order (a request's priority must be 0), "priority" by their
    # priority (lower first), arrival order among equals, and a waiting request that outranks a running one
    # takes its slot (decoding/preemption.py: the running one waits and continues from its prompt and output)
    scheduling_policy: str = "fcfs"
    pipeline: bool = True  # plain, fixed, confidence_async: the host reads a round after dispatching the next
    # cache rows the target attends to (each bucket <= max_len; one executable per round and prefill
    # bucket each): a call reads the smallest covering its longest row plus the tokens it writes,
    # and a call no bucket covers is refused before dispatch. Default buckets.attention_buckets(max_len)
    attention_buckets: tuple[int, ...] | None = None

    @property
    def logit_rules(self) -> dict[str, bool]:
        """Which of LOGIT_RULES this engine serves."""
        return {name: bool(getattr(self, name)) for name in LOGIT_RULES}

    @property
    def options_served(self) -> dict[str, bool]:
        """Which opt-in request features this engine serves: the LOGIT_RULES and PRIORITY_OPTION."""
        return self.logit_rules | {PRIORITY_OPTION: self.scheduling_policy == "priority"}

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        if not 1 <= self.automaton_states <= MAX_AUTOMATON_STATES:
            raise ValueError(f"automaton_states must be in [1, {MAX_AUTOMATON_STATES}], got {self.automaton_states}")
        if isinstance(self.prediction_tokens, bool) or not isinstance(self.prediction_tokens, int) \
                or self.prediction_tokens < 0:
            raise ValueError(f"prediction_tokens must be an int >= 0, got {self.prediction_tokens!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.confidence_source not in CONFIDENCE_SOURCES:
            raise ValueError(f"confidence_source must be one of {CONFIDENCE_SOURCES}, got {self.confidence_source!r}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        variants = tuple(self.sampling_variants)
        if not variants or any(v not in VARIANTS for v in variants) or len(set(variants)) != len(variants):
            raise ValueError(f"sampling_variants must be distinct names from {VARIANTS}, "
                             f"got {self.sampling_variants!r}")
        object.__setattr__(self, "sampling_variants", tuple(v for v in VARIANTS if v in variants))
        if isinstance(self.top_k_cap, bool) or not isinstance(self.top_k_cap, int) or self.top_k_cap < 1:
            raise ValueError(f"top_k_cap must be a positive int, got {self.top_k_cap!r}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {self.attention!r}")
        if self.mlp not in MLP_IMPLEMENTATIONS:
            raise ValueError(f"mlp must be one of {MLP_IMPLEMENTATIONS}, got {self.mlp!r}")
        if self.attention == "pallas":
            blocked = [a for a in self.attention_buckets or attention_buckets(self.max_len) if a % MIN_KEY_BLOCK]
            if blocked:
                raise ValueError(f"attention 'pallas' reads the cache in blocks of {MIN_KEY_BLOCK} rows: attention "
                                 f"buckets {blocked} (max_len {self.max_len}) must be multiples of {MIN_KEY_BLOCK}")
        if self.attention_buckets is not None and any(a > self.max_len for a in self.attention_buckets):
            raise ValueError(f"attention_buckets must not exceed max_len {self.max_len}, "
                             f"got {self.attention_buckets!r}")
