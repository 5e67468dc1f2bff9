"""Serving metrics: Prometheus text exposition (via `prometheus_client`) and a JSON snapshot.

Names: where vLLM has a metric with the same meaning we keep vLLM's name (prefix `vllm:`), so
existing dashboards and scrapers work unchanged; metrics of our own use the prefix `specjax:`.

vLLM-compatible (every series carries a `model_name` label, as in vLLM):
    vllm:num_requests_running                          gauge: requests holding a cache slot
    vllm:num_requests_waiting                          gauge: requests queued for a slot
    vllm:prompt_tokens_total                           counter: prompt tokens admitted
    vllm:generation_tokens_total                       counter: tokens generated
    vllm:request_success_total{finished_reason=...}    counter: finished requests by reason
    vllm:prefix_cache_queries_total                    counter: prompt tokens of requests that looked up the
                                                       prefix cache (an engine with prefix caching)
    vllm:prefix_cache_hits_total                       counter: of those, tokens whose cache rows were reused
    vllm:spec_decode_num_drafts_total                  counter: request-rounds that verified >= 1 draft
    vllm:spec_decode_num_draft_tokens_total            counter: draft tokens sent to verification
    vllm:spec_decode_num_accepted_tokens_total         counter: draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position=k}
                                                       counter: drafts whose position k was accepted
                                                       (unconditional, vLLM's definition)
    vllm:num_preemptions_total                         counter: running requests that gave their slot to
                                                       a waiting one they were outranked by (priority
                                                       scheduling; they continue once readmitted)
    vllm:kv_cache_usage_perc                           gauge: fraction of the cache rows running requests
                                                       hold (rows kept for prefix caching are free)
    vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds   histograms
    vllm:request_time_per_output_token_seconds         histogram: each request's decode time over its
                                                       tokens after the first (its mean TPOT; 1 / TPOT
                                                       is the per-user speed a scheduler buys)
    vllm:request_prompt_tokens, vllm:request_generation_tokens   histograms: each finished request's
                                                       prompt and generated tokens (1-2-5 buckets up to
                                                       max_model_len, vLLM's)
    vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds, vllm:request_decode_time_seconds,
    vllm:request_inference_time_seconds                histograms: arrival to a slot, slot to first
                                                       token, first token to finish, slot to finish
specjax's own:
    specjax:verification_length                        histogram: ell per request per round
    specjax:scheduler_tokens_bucket                    histogram: tokens-per-slot bucket per round
    specjax:scheduler_slots_bucket                     histogram: slots bucket per round
    specjax:round_seconds                              histogram: wall time of one engine round
    specjax:scheduler_rounds_total{kind=...}           counter: rounds by the scheduler's decision: draft,
                                                       upkeep (no drafting, drafter kept up to date) or
                                                       lite (no drafting, no drafter upkeep; every
                                                       round of plain decoding)
    specjax:request_rejected_total{reason=...}         counter: requests refused before admission, by reason
                                                       (REJECT_REASONS, shown from the start, and any other)

Mean acceptance length (vLLM's, bonus token included) = 1 + accepted / drafts; it is in the JSON
snapshot. Each `ServingMetrics` owns a private `CollectorRegistry`: no process-global state.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specjax.scheduling.planner import ROUND_KINDS  # `Engine.on_round` info["kind"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# the refusals of the HTTP server (`errors.rejection_reason`) and the engine ("invalid_request")
REJECT_REASONS = ("invalid_request", "context_length_exceeded", "model_not_found", "not_found", "request_too_large",
                  "queue_full", "not_ready", "engine_not_running")
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_ROUND_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
# RequestMetrics.latencies' keys: (vLLM's histogram, its help, its buckets)
REQUEST_LATENCIES = {
    "ttft": ("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS),
    "e2e": ("vllm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS),
    "tpot": ("vllm:request_time_per_output_token_seconds",
             "Time per output token of each request: its decode time over its tokens after the first.", _TPOT_BUCKETS),
    "queue": ("vllm:request_queue_time_seconds", "Time from arrival to a cache slot.", _LATENCY_BUCKETS),
    "prefill": ("vllm:request_prefill_time_seconds", "Time from a cache slot to the first token.", _LATENCY_BUCKETS),
    "decode": ("vllm:request_decode_time_seconds", "Time from the first token to the finish.", _LATENCY_BUCKETS),
    "inference": ("vllm:request_inference_time_seconds", "Time from a cache slot to the finish.", _LATENCY_BUCKETS)}


def _125_buckets(hi: int) -> tuple[float, ...]:
    """Histogram bounds 1, 2, 5, 10, 20, 50, ... up to `hi` (vLLM's for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > hi:
                return tuple(float(b) for b in out)
            out.append(m * scale)
        scale *= 10


def _int_buckets(hi: int) -> tuple[float, ...]:
    """Histogram bounds 0, 1, ..., hi (one bucket per integer value)."""
    return tuple(float(i) for i in range(max(int(hi), 0) + 1))


class ServingMetrics:
    """Counters, gauges and histograms of one serving engine (thread-safe).

    gamma: the drafter's block size (0 without a drafter); sizes the per-position counters and the
        verification-length histogram. max_tokens_bucket / max_slots bound the bucket histograms.
    """

    def __init__(self, *, model_name: str = "specjax", gamma: int = 0, max_tokens_bucket: int | None = None,
                 max_slots: int = 8, max_model_len: int = 1024):
        self.model_name = model_name
        self.gamma = int(gamma)
        self.registry = CollectorRegistry(auto_describe=True)
        self._t0 = time.time()
        r, lbl = self.registry, ["model_name"]

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, lbl + list(extra), registry=r)

        self.running = Gauge("vllm:num_requests_running", "Requests holding a cache slot.", lbl, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a cache slot.", lbl, registry=r)
        self.cache_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of the cache rows running requests hold.",
                                 lbl, registry=r)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens whose cache rows were reused.")
        self.request_success = counter("vllm:request_success", "Finished requests by finish reason.",
                                       ["finished_reason"])
        self.preemptions = counter("vllm:num_preemptions", "Running requests preempted for higher-priority ones.")
        self._engine_preemptions = 0  # the engine's count when last read (`engine_preemptions`)
        self.num_drafts = counter("vllm:spec_decode_num_drafts",
                                  "Request-rounds that verified at least one draft token.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Drafts whose draft position was accepted (unconditional).",
                                        ["position"])
        self.rounds_by_kind = counter("specjax:scheduler_rounds", "Engine rounds by scheduler decision.",
                                      ["kind"])
        self.rejected = counter("specjax:request_rejected", "Requests refused before admission.", ["reason"])
        self.latency = {key: Histogram(name, doc, lbl, buckets=buckets, registry=r)
                        for key, (name, doc, buckets) in REQUEST_LATENCIES.items()}
        self.request_tokens = {kind: Histogram(f"vllm:request_{kind}_tokens", f"{what} tokens of each finished request.",
                                               lbl, buckets=_125_buckets(max_model_len), registry=r)
                               for kind, what in (("prompt", "Prompt"), ("generation", "Generated"))}
        self.ell = Histogram("specjax:verification_length",
                             "Verified draft tokens (ell) per request per round.", lbl,
                             buckets=_int_buckets(max(self.gamma, 1)), registry=r)
        self.tokens_bucket = Histogram("specjax:scheduler_tokens_bucket",
                                       "Tokens-per-slot bucket of each round.", lbl,
                                       buckets=_int_buckets(max_tokens_bucket or self.gamma + 1), registry=r)
        self.slots_bucket = Histogram("specjax:scheduler_slots_bucket", "Slots bucket of each round.", lbl,
                                      buckets=_int_buckets(max_slots), registry=r)
        self.round_seconds = Histogram("specjax:round_seconds", "Wall time of one engine round.", lbl,
                                       buckets=_ROUND_BUCKETS, registry=r)
        self._expose_all()

    def _expose_all(self) -> None:
        """Create the label children up front, so that every series is exposed (at 0) from the start."""
        m = self.model_name
        for metric in (self.running, self.waiting, self.prompt_tokens, self.generation_tokens, self.prefix_queries,
                       self.prefix_hits, self.num_drafts, self.num_draft_tokens, self.num_accepted, self.cache_usage,
                       *self.latency.values(), *self.request_tokens.values(), self.ell, self.tokens_bucket,
                       self.slots_bucket, self.round_seconds):
            metric.labels(m)
        for k in range(self.gamma):
            self.accepted_per_pos.labels(m, str(k))
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(m, reason)
        for kind in ROUND_KINDS:
            self.rounds_by_kind.labels(m, kind)
        for reason in REJECT_REASONS:
            self.rejected.labels(m, reason)

    # ------------------------------------------------------------------ recording
    def observe_round(self, info: Mapping[str, Any]) -> None:
        """Record one engine round (the dict `Engine.on_round` receives)."""
        m = self.model_name
        ells = [int(e) for e in info.get("ell", ())]
        accepted = [int(a) for a in info.get("accepted", ())]
        if len(ells) != len(accepted):
            raise ValueError(f"round info: 'ell' has {len(ells)} entries but 'accepted' has {len(accepted)}")
        drafts = sum(1 for e in ells if e > 0)
        draft_tokens = sum(ells)
        acc = sum(a for e, a in zip(ells, accepted) if e > 0)
        if drafts:
            self.num_drafts.labels(m).inc(drafts)
            self.num_draft_tokens.labels(m).inc(draft_tokens)
            self.num_accepted.labels(m).inc(acc)
        for e, a in zip(ells, accepted):
            self.ell.labels(m).observe(e)
            for k in range(min(a, e)):
                self.accepted_per_pos.labels(m, str(k)).inc()
        self.tokens_bucket.labels(m).observe(float(info.get("tokens_bucket", 0)))
        self.slots_bucket.labels(m).observe(float(info.get("slots_bucket", 0)))
        self.round_seconds.labels(m).observe(float(info.get("seconds", 0.0)))
        kind = info.get("kind", "draft")
        if kind not in ROUND_KINDS:
            raise ValueError(f"round info: 'kind' is {kind!r}, expected one of {ROUND_KINDS}")
        self.rounds_by_kind.labels(m, kind).inc()

    def request_admitted(self, prompt_tokens: int) -> None:
        """A request was accepted by the engine (its prompt tokens count now)."""
        self.prompt_tokens.labels(self.model_name).inc(int(prompt_tokens))

    def prefix_cache_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request looked up the prefix cache with its prompt and reused `cached_tokens` of it."""
        self.prefix_queries.labels(self.model_name).inc(int(prompt_tokens))
        self.prefix_hits.labels(self.model_name).inc(int(cached_tokens))

    def tokens_generated(self, n: int) -> None:
        if n > 0:
            self.generation_tokens.labels(self.model_name).inc(int(n))

    def request_finished(self, finish_reason: str, latencies: Mapping[str, float | None] | None = None,
                         tokens: tuple[int, int] | None = None) -> None:
        """A request ended (`finish_reason` stop | length | abort); `latencies`: its intervals in seconds
        (`RequestMetrics.latencies`, keys of REQUEST_LATENCIES; None where not reached); `tokens`: its
        (prompt, generated) token counts."""
        m = self.model_name
        self.request_success.labels(m, finish_reason or "unknown").inc()
        for hist, n in zip(self.request_tokens.values(), tokens or ()):
            hist.labels(m).observe(n)
        for key, value in (latencies or {}).items():
            if value is not None and value >= 0:
                self.latency[key].labels(m).observe(value)

    def request_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def engine_preemptions(self, total: int) -> None:
        """Count the preemptions an engine made since the last call (`total`: how many it made since these
        metrics began)."""
        if total > self._engine_preemptions:
            self.preemptions.labels(self.model_name).inc(total - self._engine_preemptions)
        self._engine_preemptions = total

    def set_queue(self, *, running: int, waiting: int, cache_usage: float = 0.0) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)
        self.cache_usage.labels(self.model_name).set(cache_usage)

    # ------------------------------------------------------------------ exposition
    def exposition(self) -> bytes:
        """Prometheus text format (content type `CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def _value(self, name: str, **labels: str) -> float:
        v = self.registry.get_sample_value(name, {"model_name": self.model_name, **labels})
        return float(v) if v is not None else 0.0

    def _mean(self, histogram: str) -> float | None:
        """A histogram's mean observation (None before the first)."""
        n = self._value(f"{histogram}_count")
        return self._value(f"{histogram}_sum") / n if n else None

    def _label_values(self, sample_name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for fam in self.registry.collect():
            for s in fam.samples:
                if s.name == sample_name and s.labels.get("model_name") == self.model_name and label in s.labels:
                    out[s.labels[label]] = float(s.value)
        return out

    def snapshot(self) -> dict[str, Any]:
        """The same numbers as a JSON-able dict, plus derived rates (mean acceptance length etc.)."""
        drafts = self._value("vllm:spec_decode_num_drafts_total")
        draft_tokens = self._value("vllm:spec_decode_num_draft_tokens_total")
        accepted = self._value("vllm:spec_decode_num_accepted_tokens_total")
        per_pos = self._label_values("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
        per_pos_list = [int(per_pos[k]) for k in sorted(per_pos, key=int)]
        rounds = self._value("specjax:round_seconds_count")
        ell_n, ell_sum = self._value("specjax:verification_length_count"), self._value("specjax:verification_length_sum")
        tb_n, tb_sum = self._value("specjax:scheduler_tokens_bucket_count"), self._value("specjax:scheduler_tokens_bucket_sum")
        return {
            "model_name": self.model_name,
            "uptime_s": time.time() - self._t0,
            "requests": {
                "running": int(self._value("vllm:num_requests_running")),
                "waiting": int(self._value("vllm:num_requests_waiting")),
                "preempted": int(self._value("vllm:num_preemptions_total")),
                "finished": {k: int(v) for k, v in
                             self._label_values("vllm:request_success_total", "finished_reason").items()},
                "rejected": {k: int(v) for k, v in
                             self._label_values("specjax:request_rejected_total", "reason").items()},
            },
            "latency_mean_s": {key: self._mean(name) for key, (name, _, _) in REQUEST_LATENCIES.items()},
            "kv_cache_usage_perc": self._value("vllm:kv_cache_usage_perc"),
            "tokens": {"prompt": int(self._value("vllm:prompt_tokens_total")),
                       "generation": int(self._value("vllm:generation_tokens_total")),
                       "prefix_cache_queries": int(self._value("vllm:prefix_cache_queries_total")),
                       "prefix_cache_hits": int(self._value("vllm:prefix_cache_hits_total"))},
            "spec_decode": {
                "num_drafts": int(drafts), "num_draft_tokens": int(draft_tokens),
                "num_accepted_tokens": int(accepted), "num_accepted_tokens_per_pos": per_pos_list,
                "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
                "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                "acceptance_rate_per_pos": [v / drafts if drafts else 0.0 for v in per_pos_list],
            },
            "rounds": {
                "count": int(rounds), "seconds_sum": self._value("specjax:round_seconds_sum"),
                "mean_verification_length": ell_sum / ell_n if ell_n else 0.0,
                "mean_tokens_bucket": tb_sum / tb_n if tb_n else 0.0,
                "by_kind": {k: int(v) for k, v in
                            self._label_values("specjax:scheduler_rounds_total", "kind").items()},
            },
        }

