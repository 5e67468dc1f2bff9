"""The batched serving engine: a request queue over cache slots, stop rules, metrics, the round loop.

Each `step` admits waiting requests into free slots (bucketed, chunked prefill; with prefix caching
from the rows a slot already holds, decoding/prefix_cache.py), asks the round planner
(scheduling/planner.py: policy, probes, lagged confidences; numpy only) what the round runs,
dispatches it through the runner (decoding/runner.py: device state and the only calls of compiled
executables; the programs themselves are in decoding/programs.py), and appends each row's emitted
tokens to its request under the stop rules. Device state stays on the device, the slots' row state
included (sampling parameters, keys, counters, active flags: written at admission and release);
the host keeps per-request bookkeeping (tokens, stop conditions, metrics). For the plain, fixed and
confidence_async policies the host runs one round behind (`step`).
"""
from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from specjax.decoding import buckets as bk, map_budget, preemption
from specjax.decoding.automata import AutomatonTable
from specjax.decoding.requests import (EngineRequest, Launched, append_output, check_request, prefill_inputs,
                                      seed_key_data, token_logprobs)
from specjax.decoding.engine_config import EngineConfig
from specjax.decoding.prefix_cache import SlotPrefixes
from specjax.decoding.profiling import cost_table_meta, target_identity
from specjax.decoding.programs import unpack_round
from specjax.decoding.runner import Runner, bucket_key
from specjax.decoding.scoring import score_prompt
from specjax.decoding.warm_plan import warm_keys
from specjax.decoding.verify import VerifyResult, verify_chain
from specjax.models.decoder import CausalLM
from specjax.sampling import covering_variant
from specjax.scheduling.names import COST_AWARE_POLICIES
from specjax.scheduling.planner import RoundPlanner


class Engine:
    """Speculative decoding over a fixed set of cache slots (see module docstring)."""

    def __init__(self, target: CausalLM, drafter: nnx.Module | None = None,
                 config: EngineConfig = EngineConfig(), *, mesh: jax.sharding.Mesh | None = None,
                 eos_token_ids: Sequence[int] = (), cost_table: Any = None, target_id: str | None = None,
                 progress: bool = True, verifier: Callable[..., VerifyResult] = verify_chain,
                 schedule_fn: Callable[..., np.ndarray] | None = None):
        # verifier: verify_chain's signature; tests swap in a deliberately biased one to prove the checks have teeth;
        # schedule_fn(confidences [R, gamma]) -> lengths [R]: a custom host policy (see RoundPlanner)
        self.drafter, self.mesh, self.progress = drafter, mesh, progress
        self.target_config = target.config
        self.gamma = 0 if drafter is None else int(config.gamma or drafter.gamma)
        if drafter is not None and self.gamma > drafter.gamma:
            raise ValueError(f"gamma {self.gamma} exceeds the drafter's block size {drafter.gamma}")
        planner = RoundPlanner(config.policy, self.gamma, config.max_slots, threshold=config.threshold,
                               schedule_fn=schedule_fn, cost_table=cost_table)  # validates the policy
        if drafter is None and config.policy != "plain":
            config = dataclasses.replace(config, policy="plain")
            planner = RoundPlanner("plain", 0, config.max_slots)
        self.cfg, self.planner = config, planner
        self.target_id = target_id or target_identity(target)
        self.eos_token_ids = tuple(int(e) for e in eos_token_ids)
        max_len, slots = config.max_len, config.max_slots
        self.buckets = bk.BucketSet(
            slots=tuple(config.slots_buckets or bk.pow2_buckets(1, slots)),
            tokens=tuple(config.tokens_buckets or bk.pow2_buckets(1, self.gamma + 1)),
            prefill=tuple(config.prefill_buckets or bk.pow2_buckets(min(16, config.max_prefill),
                                                                    min(config.max_prefill, max_len))),
            attention=tuple(config.attention_buckets or bk.attention_buckets(max_len)))
        self.prefill_batches = tuple(config.prefill_batch_buckets or sorted({1, min(8, slots)}))
        if self.buckets.slots[-1] != slots:
            raise ValueError(f"largest slots bucket {self.buckets.slots[-1]} must equal max_slots {slots}")
        self.coarsened: list[str] = []  # defaults made coarser at warm-up to fit XLA:CPU's mappings
        self.runner = Runner(target, drafter, slots=slots, max_len=max_len, gamma=self.gamma,
                             stop_ids=self.eos_token_ids, verifier=verifier, cache_dtype=config.cache_dtype,
                             mesh=mesh, max_logprobs=config.max_logprobs, top_k_cap=config.top_k_cap,
                             attention=config.attention, mlp=config.mlp, automaton_states=config.automaton_states,
                             guided_drafts=config.guided_drafts, prediction_tokens=config.prediction_tokens,
                             acceptance_estimate=planner.reads_confidence and (
                                 config.confidence_source == "online" or not getattr(drafter, "has_confidence", False)),
                             **config.logit_rules)
        self.automata = AutomatonTable(config.automaton_states, target.config.vocab_size) if config.guided_regex \
            else None
        self.lengths = np.zeros((slots,), np.int64)  # committed cache rows per slot
        self.prefixes = SlotPrefixes(slots) if config.prefix_caching and (drafter is None or hasattr(
            drafter, "restart")) else None  # what freed slots' cache rows hold (a drafter must cut its state back)
        self.slot_req: list[EngineRequest | None] = [None] * slots
        self.queue: list[EngineRequest] = []
        self._key_data = np.zeros((slots, 2), np.uint32)
        self._seed_counter = 0
        # rounds: dispatched (incl. ones whose rows had all ended); rounds_ahead: before the last was read;
        # attention_calls: target calls (rounds and prefill chunks) per attention bucket; prefix_copies: busy slots'
        # rows copied for a prompt that begins with them (prefix caching)
        self.stats = {"rounds": 0, "rounds_ahead": 0, "prefills": 0, "verify_tokens": 0, "round_seconds": 0.0,
                      "attention_calls": {}, "prefix_copies": 0, "preemptions": 0}
        self._one_behind = config.pipeline and planner.mode in ("plain", "fixed", "device")
        planner.one_behind = self._one_behind
        self._pending: Launched | None = None  # dispatched last step, not read yet
        self._unread: list[tuple[EngineRequest, Any, int]] = []  # admitted; first token not read yet
        self._prefilling: list[list[Any]] = []  # [request, next prompt row] of admitted prompts not all prefilled
        self.on_round: Callable[[dict[str, Any]], None] | None = None

    # ------------------------------------------------------------------ cost model
    @property
    def cost_table(self) -> Any:
        return self.planner.cost_table

    @cost_table.setter
    def cost_table(self, table: Any) -> None:
        self.planner.cost_table = table

    @property
    def plain_seconds(self) -> dict[int, float] | None:
        """Per slots bucket: the seconds of a plain decoding (lite) round, which the async policy beats."""
        return self.planner.plain_seconds

    @plain_seconds.setter
    def plain_seconds(self, seconds: dict[int, float] | None) -> None:
        self.planner.plain_seconds = seconds

    @property
    def needs_cost_table(self) -> bool:
        return self.cfg.policy in COST_AWARE_POLICIES and self.planner.schedule_fn is None

    def cost_table_meta(self):
        """The metadata a cost table for this engine must carry (`profiling.cost_table_meta`)."""
        return cost_table_meta(self)

    def use_cost_table(self, table) -> None:
        """Install a measured cost table; refuses one measured for another target, dtype or bucket set."""
        if table.meta is None:
            raise ValueError("cost table has no metadata: cannot check it was measured for this engine")
        table.check_matches(self.cost_table_meta())
        self.cost_table = table

    # ------------------------------------------------------------------ warm-up
    def warm_keys(self) -> list[tuple[str, tuple[Any, ...]]]:
        """Every (family, bucket) this engine may execute under its policy (`warm_plan.warm_keys`)."""
        return warm_keys(self)

    def round_variant(self, temperature: Any, top_k: Any, top_p: Any, min_p: Any = 0.0) -> str:
        """The narrowest compiled sampling variant exact for these rows (see `sampling.covering_variant`)."""
        return covering_variant(temperature, top_k, top_p, self.cfg.sampling_variants,
                                "EngineConfig.sampling_variants", min_p)

    def warmup(self, threads: int | None = None) -> float:
        """Compile every bucket ahead (see `Runner.warm`), then measure what a cost-aware policy
        needs: the cost table (unless one was given) and, for the async policy, the plain step.
        Returns the compile seconds. On XLA:CPU, when the programs might pass the process's memory
        mappings, one program of each family compiles first: the mappings they take decide whether
        the defaults must get coarser (`map_budget.coarsen_engine`)."""
        t0 = time.perf_counter()
        keys = self.warm_keys()
        fits_anyway = map_budget.fits([map_budget.MAPS_BOUND] * len(keys))  # most engines: nothing to measure
        by_family = None if fits_anyway else self.runner.maps_by_family(keys)
        if by_family is not None:
            self.coarsened = map_budget.coarsen_engine(self, by_family)
        seconds = time.perf_counter() - t0 + self.runner.warm(self.warm_keys(), threads=threads,
                                                                progress=self.progress, maps_by_family=by_family)
        if self.needs_cost_table:
            from specjax.decoding.profiling import measure_cost_table, measure_plain_seconds
            if self.cost_table is None:
                self.cost_table = measure_cost_table(self, progress=self.progress)
            else:
                self.use_cost_table(self.cost_table)
            if self.planner.mode == "device":
                self.plain_seconds = measure_plain_seconds(self)
        return seconds

    def compile_counts(self) -> dict[str, int]:
        return self.runner.compile_counts()

    # ------------------------------------------------------------------ requests
    def add_request(self, req: EngineRequest) -> None:
        check_request(req, self.cfg, vocab=self.target_config.vocab_size, stop_ids=self.eos_token_ids)
        self.round_variant(req.temperature, req.top_k, req.top_p, req.min_p)  # refuses a variant not compiled
        req.metrics.start_time = time.perf_counter()
        bisect.insort(self.queue, req, key=lambda r: r.priority)  # after equals: arrival order (fcfs: all 0)

    def score(self, req: EngineRequest) -> tuple[list[tuple[float, list[int], list[float]]], list[int]]:
        """The `output_logprobs` entries of prompt tokens 1.. given the tokens before them (echo,
        prompt_logprobs) and their ranks (1: the most likely), under `req`'s sampling as for generated
        tokens; one cache-free target pass, no slot used, safe beside the engine's loop. The prompt
        must fit the largest prefill bucket."""
        return score_prompt(self, req)

    @property
    def num_active(self) -> int:
        return sum(r is not None for r in self.slot_req)

    def has_work(self) -> bool:
        return bool(self.queue) or self.num_active > 0 or self._pending is not None or bool(self._unread)

    def _seed_key(self, req: EngineRequest) -> np.ndarray:
        """A request's base key (`seed_key_data`); unseeded, or back from preemption (its key's counters
        restart: a fresh key keeps its tokens independent of those before), the engine's seed and a counter
        (never small)."""
        if req.seed is not None and not req.resume_at:
            return seed_key_data(req.seed)
        self._seed_counter += 1
        return seed_key_data(((self.cfg.seed & 0xFFFFFF) << 40) | (1 << 39) | self._seed_counter)

    def _admit_waiting(self) -> None:
        """Move queued requests into free slots and prefill them (up to `prefill_batches[-1]` prompts per
        call, long prompts chunked): each batch's first chunks now, and (`EngineConfig.chunked_prefill`
        off) the rest too; otherwise later steps prefill one chunk call each between rounds. First tokens
        stay on the device; the host reads them in `_collect`."""
        free = [i for i, r in enumerate(self.slot_req) if r is None]
        while self.queue and free:
            batch: list[list[Any]] = []  # [request, its first row not reused]
            while self.queue and len(batch) < self.prefill_batches[-1] and free:
                if self.prefixes is not None and self.prefixes.copies_from(  # prompts in the batch or prefilling
                        self.queue[0].context_ids(), (e[0].context_ids() for e in batch + self._prefilling),
                        free, self.buckets.prefill[0], self.buckets.slots):
                    break  # it copies that prompt's rows (prefix caching) once they are all prefilled
                if self.automata is not None and not self.automata.admit(self.queue[0]):
                    break  # its automaton waits for room in the table (so do the requests behind it)
                req = self.queue.pop(0)
                req.slot, start = self._slot_for(req, free)
                if req.metrics.scheduled_time is None:  # its first admission (not a return after preemption)
                    req.metrics.scheduled_time, req.metrics.cached_tokens = time.perf_counter(), start
                free.remove(req.slot)
                self.slot_req[req.slot] = req
                self._key_data[req.slot] = self._seed_key(req)
                self.planner.admit(req.slot)
                self.lengths[req.slot] = req.context_len
                self.stats["prefills"] += 1
                batch.append([req, start])
            if not batch:
                break
            if self.automata is not None and (table := self.automata.changes()) is not None:
                self.runner.set_automata(*table)
            self._prefilling += batch
            self._prefill_call(batch)
            while not self.cfg.chunked_prefill and (batch := [e for e in batch if e[1] < e[0].context_len]):
                self._prefill_call(batch)

    def _slot_for(self, req: EngineRequest, free: list[int]) -> tuple[int, int]:
        """(slot, prompt tokens reused): the lowest free slot, or with prefix caching (`prefix_cache`; not
        under a repetition penalty, which counts the prompt's tokens as its prefill reads them) the free
        slot sharing the longest prefix, or the least recently used one (given a busy slot's rows, copied
        now) within the slots bucket the lowest would run in."""
        if self.prefixes is None or (self.cfg.penalties and req.repetition_penalty != 1.0):
            return free[0], 0
        slot, start, source = self.prefixes.choose(req.context_ids(), free, copy_margin=self.buckets.prefill[0],
                                                   slots_buckets=self.buckets.slots)
        if source is not None:
            self.stats["prefix_copies"] += 1
            self.runner.run("copy", bucket_key("copy", rows=self.cfg.max_slots),
                            src_dst_2=np.array([source, slot], np.int32))
        return slot, start

    def _prefill_call(self, entries: list[list[Any]]) -> None:
        """One prefill call: the next prompt chunk of each of the first `prefill_batches[-1]` entries
        ([request, its next prompt row], from `_prefilling`: the first is its first row not reused). A
        request whose last chunk this is samples its first token (unread: `_unread`), leaves
        `_prefilling` and, with prefix caching, is a copy source; the others stay inactive on the device."""
        todo = entries[:self.prefill_batches[-1]]
        pb = bk.pick(self.prefill_batches, len(todo), what="prefill batch")
        lens = [min(self.buckets.prefill[-1], r.context_len - start) for r, start in todo]
        plen = bk.pick(self.buckets.prefill, max(lens), what="prompt chunk length")
        chunks = [(r, start, n, self._draft_cap(r), self._key_data[r.slot]) for (r, start), n in zip(todo, lens)]
        attn = self._attention_bucket(max(start + n for (_, start), n in zip(todo, lens)))
        inputs = prefill_inputs(chunks, pb, plen, self.cfg.max_slots, self.runner.bias_cols,
                                self.runner.choice_shape, self.runner.pred_cols)
        outs = self.runner.run("prefill", (pb, plen, attn), **inputs)
        for row, (entry, n) in enumerate(zip(todo, lens)):
            entry[1] += n
            if entry[1] == entry[0].context_len:
                self._unread.append((entry[0], outs, row))
                self._prefilling = [e for e in self._prefilling if e is not entry]
                if self.prefixes is not None:  # its prompt's rows: a source for later prompts
                    self.prefixes.hold(entry[0].slot, entry[0].context_ids())

    def _draft_cap(self, r: EngineRequest) -> int:
        return self.gamma if r.max_draft_tokens is None else min(self.gamma, r.max_draft_tokens)

    def speculative_decoding(self, r: EngineRequest, *, detailed: bool = False) -> dict[str, Any] | None:
        """vLLM's per-request block of `r` (`RequestMetrics.speculative_decoding`); None without a drafter."""
        return r.metrics.speculative_decoding(self._draft_cap(r), detailed=detailed) if self.gamma > 0 else None

    def _append(self, req: EngineRequest, toks: Sequence[int]) -> None:
        """Append emitted tokens under the stop rules (`append_output`, then the cache's length); a request
        that ends frees its slot."""
        append_output(req, toks, self.eos_token_ids)
        if req.finish_reason is None and self.lengths[req.slot] + 1 > self.cfg.max_len:
            req.finish_reason = "length"  # no room left for the anchor: the cache is full
        if req.finish_reason is not None:
            req.metrics.finish_time = time.perf_counter()
            self.slot_req[req.slot] = None
            if self.prefixes is not None:
                self.prefixes.keep(req.slot, [*req.prompt_ids, *req.output_ids], int(self.lengths[req.slot]))
            if self.automata is not None:
                self.automata.end(req)

    # ------------------------------------------------------------------ rounds
    def _attention_bucket(self, rows: int) -> int:
        """The attention bucket of a call whose rows reach `rows` cache rows (longest participating
        row + the tokens it writes; capped at max_len); counted in stats["attention_calls"]. A call
        that no bucket covers is refused here, before dispatch."""
        rows, largest = min(rows, self.cfg.max_len), self.buckets.attention[-1]
        if rows > largest:
            raise ValueError(f"attention length {rows} (cache rows a call reads) exceeds the largest of "
                             f"EngineConfig.attention_buckets, {largest}")
        attn = bk.pick(self.buckets.attention, rows)
        counts = self.stats["attention_calls"]
        counts[attn] = counts.get(attn, 0) + 1
        return attn

    def _row_caps(self, sb: int) -> np.ndarray:
        """Rows [0:sb]: each row's largest admissible ell as the host knows it (draft cap, room in the
        cache, tokens wanted; an unread first token counts): upper bounds the device caps again."""
        return np.array([0 if r is None else max(min(self._draft_cap(r), self.cfg.max_len - 1 - int(self.lengths[i]),
                                                     r.max_tokens - max(len(r.output_ids), 1) - 1), 0)
                         for i, r in enumerate(self.slot_req[:sb])], np.int64)

    def _launch(self, rows: list[int], unread: Launched | None) -> Launched:
        """Plan and dispatch a round over `rows`, not waiting for its outputs (a "host" fill waits for the
        drafts' confidences); `unread`: the round before, whose commits (<= its tb per row) are unread."""
        t0 = time.perf_counter()
        sb = bk.pick(self.buckets.slots, max(rows) + 1, what="active slot count")
        active = np.isin(np.arange(sb), rows)
        plan = self.planner.plan(self._row_caps(sb), active)
        reqs = [self.slot_req[i] if active[i] else None for i in range(sb)]
        live = [r for r in reqs if r is not None]
        lp = self.cfg.max_logprobs > 0 and any(r.logprobs is not None for r in live)  # widest variant (warm_keys)
        variant = self.cfg.sampling_variants[-1] if lp else self.round_variant(
            [r.temperature for r in live], [r.top_k for r in live], [r.top_p for r in live], [r.min_p for r in live])
        fields = dict(rows=sb, logprobs=lp, variant=variant)
        ell, conf = plan.ell_b, None
        rows_in: dict[str, Any] = {}
        lengths = self.lengths[:sb].copy()
        if unread is not None:  # an upper bound of the true lengths: the attention bucket covers them
            lengths[:min(sb, len(unread.reqs))] += unread.tb * np.array([r is not None for r in unread.reqs[:sb]])
        if plan.program == "verify":  # a host fill: this round's confidences choose the lengths
            key = bucket_key("draft", attn=self._attention_bucket(int(lengths[active].max())), **fields)
            draft, q, conf_dev = self.runner.run("draft", key, ell_b=ell.astype(np.int32))  # context rows: attn
            conf = np.asarray(conf_dev)
            ell = self.planner.host_lengths(plan, conf)
            rows_in = dict(draft_bg=draft, q_bgn=q)
        elif plan.program == "fused_fill":  # a device fill: lengths bounded by ell, chosen inside the call
            rows_in = dict(k_total_1=np.array([plan.k_total], np.int32))
        tb = 1 if plan.program == "lite" else bk.pick(self.buckets.tokens, int(ell.max()) + 1, what="tokens per slot")
        attn = self._attention_bucket(int(lengths[active].max()) + tb)
        outs = self.runner.run(plan.program, bucket_key(plan.program, tokens=tb, attn=attn, **fields),
                               ell_b=ell.astype(np.int32), **rows_in)
        firsts, self._unread = self._unread, []
        self.stats["rounds"] += 1
        self.stats["verify_tokens"] += int(sb * tb)
        self.stats["round_seconds"] += time.perf_counter() - t0
        return Launched(plan, tb, attn, reqs, outs, firsts, t0, conf)

    def _collect(self, firsts: list[tuple[EngineRequest, Any, int]], launched: Launched | None = None
                 ) -> list[EngineRequest]:
        """Read the first tokens of `firsts` and a dispatched round's outputs (one packed int array, plus
        log-probabilities when asked) and apply them (`_apply_round`). Returns the requests finished now."""
        t0 = time.perf_counter()
        unique = {id(o): o for _, o, _ in firsts}  # one prefill call may hold several requests
        got, outs = jax.device_get((unique, None if launched is None else launched.outs))
        finished: list[EngineRequest] = []
        release: list[int] = []
        for req, o, row in firsts:
            o = got[id(o)]
            req.metrics.first_token_time = req.metrics.first_token_time or time.perf_counter()
            n0 = len(req.output_ids)  # > 0 for a request back from preemption
            self._append(req, [int(o["tokens"][row, 0])])
            if req.logprobs is not None:
                req.output_logprobs += token_logprobs(req, o, row, len(req.output_ids) - n0)
            if req.finish_reason:
                finished.append(req)
                if o["live"][row]:
                    release.append(req.slot)
        if launched is not None:
            finished += self._apply_round(launched, outs, release)
            self.stats["round_seconds"] += time.perf_counter() - t0
        if release:  # rows the host ended and the device still runs (stop strings, a request's stop ids)
            free = np.zeros((self.cfg.max_slots,), np.int32)
            free[release] = 1
            self.runner.run("release", bucket_key("release", rows=self.cfg.max_slots), free_s=free)
        return finished

    @staticmethod
    def _served(launched: Launched) -> list[int]:
        """Rows whose request had not ended when read (the others ran a round too many: dropped)."""
        return [i for i, r in enumerate(launched.reqs) if r is not None and r.finish_reason is None]

    def _apply_round(self, launched: Launched, outs: dict[str, np.ndarray], release: list[int]
                     ) -> list[EngineRequest]:
        """Apply a round's outputs (host copies) to the requests it served; rows to release are added
        to `release`. Returns the requests finished now."""
        plan, tb = launched.plan, launched.tb
        col, toks, conf = unpack_round(outs["packed"], tb)
        conf = launched.conf if conf is None else conf  # a host fill's confidences came with its drafts
        self.planner.observe(plan, conf if plan.kind != "lite" else None)
        served = self._served(launched)
        finished: list[EngineRequest] = []
        request_ids = [launched.reqs[i].request_id for i in served] if self.on_round is not None else []
        for i in served:
            r = launched.reqs[i]
            r.rounds += 1
            r.metrics.record_round(int(col["ell"][i]), int(col["num_accepted"][i]), self.gamma)
            r.metrics.record_prediction(int(col["pred_drafted"][i]), int(col["pred_accepted"][i]))
            self.lengths[i] += int(col["num_accepted"][i]) + 1
            n0 = len(r.output_ids)
            self._append(r, toks[i, : int(col["num_emitted"][i])].tolist())
            if r.logprobs is not None:  # entries for the tokens kept (stop rules may cut or trim)
                r.output_logprobs += token_logprobs(r, outs, i, max(len(r.output_ids) - n0, 0))
                del r.output_logprobs[len(r.output_ids):]
            if r.finish_reason:
                finished.append(r)
                if col["live"][i]:
                    release.append(i)
        if self.on_round is not None and served:
            # per served slot: request, verified length, accepted drafts, stopped on a draft, confidences
            info = {"slots_bucket": len(launched.reqs), "tokens_bucket": tb, "attention_bucket": launched.attn,
                    "kind": plan.kind,
                    "request_ids": request_ids, "ell": [int(col["ell"][i]) for i in served],
                    "accepted": [int(col["num_accepted"][i]) for i in served],
                    "seconds": time.perf_counter() - launched.t0,
                    "stopped": [bool(col["stopped"][i]) for i in served]}
            if conf is not None:
                info["confidence"] = conf[served].tolist()
            self.on_round(info)
        return finished

    def _preempt_for_waiting(self) -> list[EngineRequest]:
        """Priority scheduling: free the slots of running requests that waiting ones outrank
        (`preemption.victims`) and queue them again; the round in flight is read first, so their state
        is current. Returns the requests that round finished."""
        def chosen() -> list[int]:
            busy = {e[0].slot for e in self._prefilling} | {r.slot for r, _, _ in self._unread}
            running = [(i, r.priority, r.metrics.start_time) for i, r in enumerate(self.slot_req)
                       if r is not None and i not in busy and preemption.preemptible(r)]
            return preemption.victims((r.priority for r in self.queue), running, self.slot_req.count(None))

        if not chosen():
            return []
        pending, self._pending = self._pending, None
        finished = [] if pending is None else self._collect(pending.firsts, pending)
        slots = chosen()  # that round may have ended some
        for i in slots:
            req, self.slot_req[i] = self.slot_req[i], None
            if self.prefixes is not None:
                self.prefixes.keep(i, [*req.prompt_ids, *req.output_ids], int(self.lengths[i]))
            req.resume_at, req.preemptions = len(req.output_ids), req.preemptions + 1
            bisect.insort(self.queue, req, key=lambda r: (r.priority, r.metrics.start_time))  # before later equals
        if slots:
            self.stats["preemptions"] += len(slots)
            free = np.zeros((self.cfg.max_slots,), np.int32)
            free[slots] = 1
            self.runner.run("release", bucket_key("release", rows=self.cfg.max_slots), free_s=free)
        return finished

    def step(self) -> list[EngineRequest]:
        """Prefill the next chunks of prompts admitted earlier (one call), preempt for waiting requests
        (priority scheduling), admit waiting requests, dispatch one round; return the requests whose end
        the host learned now. Plain, fixed and confidence_async (with `EngineConfig.pipeline`) read round t
        after dispatching t+1: a request that ended in round t runs one more round, whose tokens are dropped."""
        if self._prefilling:  # prompts admitted earlier: their next chunks, one call between rounds
            self._prefill_call(self._prefilling)
        priority = self.cfg.scheduling_policy == "priority" and self.queue
        finished: list[EngineRequest] = self._preempt_for_waiting() if priority else []
        self._admit_waiting()
        pending, self._pending = self._pending, None
        if pending is not None and pending.may_overflow(self.lengths, self.buckets, self.cfg.max_len):  # read it first
            finished, pending = finished + self._collect(pending.firsts, pending), None
        # rows to run: not those still being prefilled, nor those whose unread first token is all they want
        busy = {e[0].slot for e in self._prefilling}
        rows = [i for i, r in enumerate(self.slot_req) if r is not None and i not in busy
                and (r.max_tokens - r.resume_at > 1 or len(r.output_ids) > r.resume_at)]
        launched = self._launch(rows, pending) if rows else None
        self.stats["rounds_ahead"] += pending is not None and launched is not None  # before its predecessor was read
        if pending is not None:
            finished += self._collect(pending.firsts, pending)
        if launched is not None and self._one_behind:
            self._pending = launched
        elif launched is not None:
            finished += self._collect(launched.firsts, launched)
        if self._unread:  # admitted, but no round dispatched for them (their first token ends them)
            finished += self._collect(self._unread)
            self._unread = []
        return finished

    def run(self, requests: Sequence[EngineRequest], *, progress: bool | None = None) -> list[EngineRequest]:
        """Serve requests to completion (continuous batching over the slots)."""
        from tqdm.auto import tqdm
        for r in requests:
            self.add_request(r)
        show = self.progress if progress is None else progress
        done: list[EngineRequest] = []
        with tqdm(total=len(requests), desc="decoding", disable=not show, leave=False) as bar:
            while self.has_work():
                fin = self.step()
                done += fin
                bar.update(len(fin))
        return done
