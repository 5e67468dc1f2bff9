"""The batched serving engine: a request queue over cache slots, stop rules, metrics, the round loop.

Each `step` admits waiting requests into free slots (bucketed, chunked prefill), asks the round
planner (scheduling/planner.py: policy, probes, lagged confidences; numpy only) what the round runs,
runs it through the runner (decoding/runner.py: device state and the only calls of compiled
executables; the programs themselves are in decoding/programs.py), and appends each row's emitted
tokens to its request under the stop rules. Device state stays on the device; the host keeps
per-request bookkeeping (tokens, stop conditions, metrics).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from specjax.decoding import buckets as bk
from specjax.decoding.requests import EngineRequest, token_logprobs
from specjax.decoding.runner import Runner, bucket_key
from specjax.decoding.verify import VerifyResult, verify_chain
from specjax.models.decoder import CausalLM
from specjax.sampling import DEFAULT_TOP_K_CAP, VARIANTS, covering_variant
from specjax.scheduling.names import COST_AWARE_POLICIES
from specjax.scheduling.planner import RoundPlan, RoundPlanner


def _target_identity(target: CausalLM) -> str:
    """A stable identity of a target: its config and a checksum of its weights."""
    import hashlib
    import json
    h = hashlib.sha256(json.dumps(dataclasses.asdict(target.config), sort_keys=True).encode())
    for leaf in jax.tree.leaves(nnx.state(target, nnx.Param))[:4]:
        h.update(np.asarray(leaf, np.float32).tobytes()[:4096])
    return f"qwen3-{target.config.num_hidden_layers}x{target.config.hidden_size}-{h.hexdigest()[:12]}"


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
    # cache rows the target attends to (each bucket <= max_len; one executable per round and prefill
    # bucket each): a call reads the smallest covering its longest row plus the tokens it writes,
    # and a call no bucket covers is refused before dispatch. Default buckets.attention_buckets(max_len)
    attention_buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        variants = tuple(self.sampling_variants)
        if not variants or any(v not in VARIANTS for v in variants) or len(set(variants)) != len(variants):
            raise ValueError(f"sampling_variants must be distinct names from {VARIANTS}, "
                             f"got {self.sampling_variants!r}")
        object.__setattr__(self, "sampling_variants", tuple(v for v in VARIANTS if v in variants))
        if isinstance(self.top_k_cap, bool) or not isinstance(self.top_k_cap, int) or self.top_k_cap < 1:
            raise ValueError(f"top_k_cap must be a positive int, got {self.top_k_cap!r}")
        if self.attention_buckets is not None and any(a > self.max_len for a in self.attention_buckets):
            raise ValueError(f"attention_buckets must not exceed max_len {self.max_len}, "
                             f"got {self.attention_buckets!r}")


class Engine:
    """Speculative decoding over a fixed set of cache slots (see module docstring)."""

    def __init__(self, target: CausalLM, drafter: nnx.Module | None = None,
                 config: EngineConfig = EngineConfig(), *, mesh: jax.sharding.Mesh | None = None,
                 eos_token_ids: Sequence[int] = (), cost_table: Any = None, target_id: str | None = None,
                 progress: bool = True, verifier: Callable[..., VerifyResult] = verify_chain,
                 schedule_fn: Callable[..., np.ndarray] | None = None):
        # verifier: tests swap in a deliberately biased one to prove the checks have teeth;
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
        self.target_id = target_id or _target_identity(target)
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
        self.runner = Runner(target, drafter, slots=slots, max_len=max_len, gamma=self.gamma,
                             stop_ids=self.eos_token_ids, verifier=verifier, cache_dtype=config.cache_dtype,
                             mesh=mesh, max_logprobs=config.max_logprobs, top_k_cap=config.top_k_cap)
        self.lengths = np.zeros((slots,), np.int64)  # committed cache rows per slot
        self.slot_req: list[EngineRequest | None] = [None] * slots
        self.queue: list[EngineRequest] = []
        self._key_data = np.zeros((slots, 2), np.uint32)
        self._seed_counter = 0
        # attention_calls: target calls (rounds and prefill chunks) per attention bucket
        self.stats = {"rounds": 0, "prefills": 0, "verify_tokens": 0, "round_seconds": 0.0, "attention_calls": {}}
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
        """The metadata a cost table for this engine must carry (target, dtype, hardware, buckets)."""
        from specjax.scheduling import CostTableMeta
        dev = jax.devices()[0]
        n = 1 if self.mesh is None else self.mesh.size
        dtype = str(jax.tree.leaves(self.runner.t_params)[0].dtype)
        return CostTableMeta(target=self.target_id, dtype=dtype, hardware=f"{dev.platform}:{dev.device_kind} x{n}",
                             context_length=self.cfg.max_len, slots_buckets=tuple(self.buckets.slots),
                             tokens_buckets=tuple(self.buckets.tokens))

    def use_cost_table(self, table) -> None:
        """Install a measured cost table; refuses one measured for another target, dtype or bucket set."""
        if table.meta is None:
            raise ValueError("cost table has no metadata: cannot check it was measured for this engine")
        table.check_matches(self.cost_table_meta())
        self.cost_table = table

    # ------------------------------------------------------------------ warm-up
    def warm_keys(self) -> list[tuple[str, tuple[Any, ...]]]:
        """Every (family, bucket) this engine may execute under its policy: round buckets once per
        configured sampling variant without log-probabilities, and (max_logprobs > 0) once more in
        the widest variant with them: a round with a row asking for log-probabilities runs that
        variant, which covers every row (see `_round_fields`); each at every attention bucket."""
        attention, plens = self.buckets.attention, self.buckets.prefill
        # a prefill chunk of bucket p is longer than the bucket below (prev): it needs > prev rows
        keys: list[tuple[str, tuple[Any, ...]]] = [("prefill", (pb, p, a)) for pb in self.prefill_batches
                                                    for prev, p in zip((0,) + plens, plens)
                                                    for a in attention if a > prev]
        if self.cfg.max_logprobs > 0:  # echo's prompt log-likelihoods, one prompt per call
            keys += [("score", (1, p)) for p in self.buckets.prefill]
        tokens = self.buckets.tokens
        combos = [(v, False) for v in self.cfg.sampling_variants]
        if self.cfg.max_logprobs > 0:
            combos.append((self.cfg.sampling_variants[-1], True))
        for variant, lp in combos:
            for sb in self.buckets.slots:
                for family, max_ell in self.planner.families.items():
                    if max_ell is None:
                        tbs = [1]  # no tokens field
                    elif family in ("verify", "fused_fill"):  # every tokens bucket: the cost table measures them all
                        tbs = list(tokens)
                    else:
                        tbs = sorted({1, bk.pick(tokens, max_ell + 1)} | {t for t in tokens if t <= max_ell + 1})
                    keys += [(family, bucket_key(family, rows=sb, tokens=tb, logprobs=lp, attn=a, variant=variant))
                             for tb in tbs for a in attention]
        return list(dict.fromkeys(keys))  # draft has no logprobs or attention field: each key once

    def round_variant(self, temperature: Any, top_k: Any, top_p: Any) -> str:
        """The narrowest compiled sampling variant exact for these rows (see `sampling.covering_variant`)."""
        return covering_variant(temperature, top_k, top_p, self.cfg.sampling_variants, "EngineConfig.sampling_variants")

    def warmup(self, threads: int | None = None) -> float:
        """Compile every bucket ahead (see `Runner.warm`), then measure what a cost-aware policy
        needs: the cost table (unless one was given) and, for the async policy, the plain step.
        Returns the compile seconds."""
        seconds = self.runner.warm(self.warm_keys(), threads=threads, progress=self.progress)
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
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError(f"request {req.request_id}: prompt is empty")
        if n + 1 > self.cfg.max_len:
            raise ValueError(f"request {req.request_id}: prompt of {n} tokens does not fit the context "
                             f"(max_len {self.cfg.max_len} must hold the prompt plus one generated token)")
        vocab = self.target_config.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"request {req.request_id}: prompt token id {bad[0]} outside the vocabulary [0, {vocab})")
        if req.max_tokens <= 0:
            raise ValueError(f"request {req.request_id}: max_tokens must be > 0, got {req.max_tokens}")
        if req.top_k > self.cfg.top_k_cap:
            raise ValueError(f"request {req.request_id}: top_k {req.top_k} exceeds the engine's top_k_cap "
                             f"{self.cfg.top_k_cap}")
        self.round_variant(req.temperature, req.top_k, req.top_p)  # refuses a variant not compiled
        if req.logprobs is not None and self.cfg.max_logprobs == 0:
            raise ValueError(f"request {req.request_id}: logprobs asked of an engine built without them "
                             f"(EngineConfig.max_logprobs = 0)")
        if req.logprobs is not None and not 0 <= req.logprobs <= self.cfg.max_logprobs:
            raise ValueError(f"request {req.request_id}: logprobs must be in [0, {self.cfg.max_logprobs}] "
                             f"(the engine's max_logprobs), got {req.logprobs}")
        req.metrics.start_time = time.perf_counter()
        self.queue.append(req)

    def score(self, req: EngineRequest) -> list[tuple[float, list[int], list[float]]]:
        """The `output_logprobs` entries of prompt tokens 1.. given the tokens before them (echo),
        under `req`'s sampling as for generated tokens; one cache-free target pass, no slot used,
        safe beside the engine's loop. The prompt must fit the largest prefill bucket."""
        n = len(req.prompt_ids)
        if self.cfg.max_logprobs == 0 or not 0 <= (req.logprobs or 0) <= self.cfg.max_logprobs:
            raise ValueError(f"request {req.request_id}: logprobs must be in [0, {self.cfg.max_logprobs}]")
        plen = bk.pick(self.buckets.prefill, n, what="prompt length to score")
        toks = np.zeros((1, plen), np.int32)
        toks[0, :n] = req.prompt_ids
        ints = np.array([[n], [0], [0], [req.top_k]], np.int32)
        floats = np.array([[req.temperature], [req.top_p]], np.float32)
        outs = jax.device_get(self.runner.run("score", (1, plen), tokens_bt=toks, ints_4b=ints, floats_2b=floats))
        return token_logprobs(req, outs, 0, n - 1)

    @property
    def num_active(self) -> int:
        return sum(r is not None for r in self.slot_req)

    def has_work(self) -> bool:
        return bool(self.queue) or self.num_active > 0

    def _free_slot(self) -> int:
        for i, r in enumerate(self.slot_req):
            if r is None:
                return i
        return -1

    def _seed_key(self, req: EngineRequest) -> np.ndarray:
        """Raw threefry key data of a request's base key, computed on the host (no device call).

        For seeds below 2**32 this equals `jax.random.key_data(jax.random.key(seed))`; larger seeds
        use their high word as the key's first word, so distinct 64-bit seeds give distinct streams.
        """
        seed = req.seed
        if seed is None:
            self._seed_counter += 1
            seed = ((self.cfg.seed & 0xFFFFFF) << 40) | (1 << 39) | self._seed_counter  # never a small explicit seed
        return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)

    def _admit_waiting(self) -> list[EngineRequest]:
        """Move queued requests into free slots and prefill them (batched; long prompts chunked)."""
        finished: list[EngineRequest] = []
        while self.queue and self._free_slot() >= 0:
            batch: list[EngineRequest] = []
            while self.queue and len(batch) < self.prefill_batches[-1] and self._free_slot() >= 0:
                req = self.queue.pop(0)
                req.slot = self._free_slot()
                self.slot_req[req.slot] = req
                self._key_data[req.slot] = self._seed_key(req)
                self.planner.admit(req.slot)
                batch.append(req)
            self._prefill(batch)
            for req in batch:
                self.stats["prefills"] += 1
                self.lengths[req.slot] = len(req.prompt_ids)
                req.metrics.first_token_time = time.perf_counter()
                self._append(req, [req.output_ids.pop()])  # the sampled first token, checked for stops
                del req.output_logprobs[len(req.output_ids):]
                if req.finish_reason:
                    finished.append(req)
        return finished

    def _prefill(self, batch: list[EngineRequest]) -> None:
        """Run prompt chunks of up to `prefill_batches[-1]` requests per call; the first token is sampled."""
        biggest = self.buckets.prefill[-1]
        offsets = [0] * len(batch)
        first = [0] * len(batch)
        while todo := [i for i, r in enumerate(batch) if offsets[i] < len(r.prompt_ids)]:
            pb = bk.pick(self.prefill_batches, len(todo), what="prefill batch")
            chunk_lens = [min(biggest, len(batch[i].prompt_ids) - offsets[i]) for i in todo]
            plen = bk.pick(self.buckets.prefill, max(chunk_lens), what="prompt chunk length")
            toks = np.zeros((pb, plen), np.int32)
            ints = np.zeros((4, pb), np.int32)  # n_valid, slot, start, top_k
            ints[1] = self.cfg.max_slots  # padding rows point past the last slot: dropped
            floats = np.ones((2, pb), np.float32)  # temperature, top_p
            key_data = np.zeros((pb, 2), np.uint32)
            for row, (i, n) in enumerate(zip(todo, chunk_lens)):
                r = batch[i]
                toks[row, :n] = r.prompt_ids[offsets[i]:offsets[i] + n]
                ints[:, row] = n, r.slot, offsets[i], r.top_k
                floats[:, row] = r.temperature, r.top_p
                key_data[row] = self._key_data[r.slot]
            attn = self._attention_bucket(max(offsets[i] + n for i, n in zip(todo, chunk_lens)))
            outs = jax.device_get(self.runner.run("prefill", (pb, plen, attn), tokens_bt=toks, ints_4b=ints,
                                                  floats_2b=floats, keys_b2=key_data))
            for row, (i, n) in enumerate(zip(todo, chunk_lens)):
                offsets[i] += n
                first[i] = int(outs["tokens"][row, 0])
                if batch[i].logprobs is not None and offsets[i] == len(batch[i].prompt_ids):
                    batch[i].output_logprobs = token_logprobs(batch[i], outs, row, 1)
        for i, r in enumerate(batch):
            r.output_ids.append(first[i])

    def _append(self, req: EngineRequest, toks: Sequence[int]) -> None:
        """Append emitted tokens and apply stop conditions (eos, stop ids, max_tokens, stop strings, length)."""
        stops = set(self.eos_token_ids) | set(req.stop_token_ids)
        for t in toks:
            req.output_ids.append(int(t))
            if int(t) in stops:
                req.finish_reason = "stop"
                break
            if len(req.output_ids) >= req.max_tokens:
                req.finish_reason = "length"
                break
        if req.finish_reason is None and req.stop_check is not None:
            keep = req.stop_check(req.output_ids)
            if keep is not None:
                del req.output_ids[keep:]
                req.finish_reason = "stop"
        if req.finish_reason is None and self.lengths[req.slot] + 1 > self.cfg.max_len:
            req.finish_reason = "length"  # no room left for the anchor: the cache is full
        if req.finish_reason is not None:
            req.metrics.finish_time = time.perf_counter()
            self.slot_req[req.slot] = None

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

    def _row_inputs(self, sb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows [0:sb]: packed ints (ell, set per program; active; counter; top_k), floats
        (temperature, top_p), and each row's largest admissible ell: gamma, its own cap, room in the
        cache, tokens still wanted (0 for idle rows)."""
        ints = np.zeros((4, sb), np.int32)
        floats = np.ones((2, sb), np.float32)
        caps = np.zeros((sb,), np.int64)
        for i, r in enumerate(self.slot_req[:sb]):
            if r is None:
                continue
            ints[1:, i] = 1, r.rounds + 1, r.top_k
            floats[:, i] = r.temperature, r.top_p
            cap = self.gamma if r.max_draft_tokens is None else min(self.gamma, r.max_draft_tokens)
            cap = min(cap, self.cfg.max_len - 1 - int(self.lengths[i]), r.max_tokens - len(r.output_ids) - 1)
            caps[i] = max(cap, 0)
        return ints, floats, caps

    def _round_fields(self, active_b: np.ndarray, ints: np.ndarray, floats: np.ndarray) -> dict[str, Any]:
        """The bucket key fields a round's rows [0:sb] fix: rows, logprobs (a row asked for them: the
        widest compiled variant, the only one compiled with them) and the sampling variant."""
        lp = self.cfg.max_logprobs > 0 and any(r is not None and r.logprobs is not None
                                               for r in self.slot_req[:active_b.shape[0]])
        variant = (self.cfg.sampling_variants[-1] if lp else
                   self.round_variant(floats[0, active_b], ints[3, active_b], floats[1, active_b]))
        return dict(rows=active_b.shape[0], logprobs=lp, variant=variant)

    def _execute(self, plan: RoundPlan, ints: np.ndarray, floats: np.ndarray,
                 keys: np.ndarray) -> tuple[np.ndarray, int, int, np.ndarray | None, dict[str, np.ndarray]]:
        """Run a planned round. Returns (ell int64 [sb], tokens bucket, attention bucket, confidences
        [sb, gamma] or None after a lite round, the round's outputs on the host)."""
        sb, ell, conf = plan.active_b.shape[0], plan.ell_b, None
        fields = self._round_fields(plan.active_b, ints, floats)
        rows = dict(floats_2b=floats, keys_b2=keys)
        if plan.program == "verify":  # a host fill: this round's confidences choose the lengths
            draft, q, conf_dev = self.runner.run("draft", bucket_key("draft", **fields), ints_4b=ints, **rows)
            conf = np.asarray(conf_dev)
            ell = self.planner.host_lengths(plan, conf)
            rows.update(draft_bg=draft, q_bgn=q)
        elif plan.program == "fused_fill":  # a device fill: lengths bounded by ell, chosen inside the call
            rows["k_total_1"] = np.array([plan.k_total], np.int32)
        tb = 1 if plan.program == "lite" else bk.pick(self.buckets.tokens, int(ell.max()) + 1, what="tokens per slot")
        ints[0] = ell
        attn = self._attention_bucket(int(self.lengths[:sb][plan.active_b].max()) + tb)
        outs = self.runner.run(plan.program, bucket_key(plan.program, tokens=tb, attn=attn, **fields), ints_4b=ints,
                               **rows)
        outs = jax.device_get(outs)
        if "ell" in outs:
            ell = np.asarray(outs["ell"], np.int64)
        if conf is None and self.gamma > 0 and plan.kind != "lite":
            conf = np.asarray(outs["confidence"])
        return ell, tb, attn, conf, outs

    def step(self) -> list[EngineRequest]:
        """Admit waiting requests into free slots, then run one round. Returns requests finished now."""
        finished = self._admit_waiting()
        active_idx = [i for i, r in enumerate(self.slot_req) if r is not None]
        if not active_idx:
            return finished
        t0 = time.perf_counter()
        sb = bk.pick(self.buckets.slots, max(active_idx) + 1, what="active slot count")
        ints, floats, caps = self._row_inputs(sb)
        plan = self.planner.plan(caps, ints[1] > 0)
        ell, tb, attn, conf, outs = self._execute(plan, ints, floats, self._key_data[:sb])
        self.planner.observe(plan, conf)
        # taken before the loop frees finished slots; only for an on_round hook (off the hot path)
        request_ids = [self.slot_req[i].request_id for i in active_idx] if self.on_round is not None else []
        n_acc = outs["num_accepted"]
        for i in active_idx:
            r = self.slot_req[i]
            r.rounds += 1
            r.metrics.record_round(int(ell[i]), int(n_acc[i]), self.gamma)
            self.lengths[i] += int(n_acc[i]) + 1
            n0 = len(r.output_ids)
            self._append(r, outs["tokens"][i, : int(outs["num_emitted"][i])].tolist())
            if r.logprobs is not None:  # entries for the tokens kept (stop rules may cut or trim)
                r.output_logprobs += token_logprobs(r, outs, i, max(len(r.output_ids) - n0, 0))
                del r.output_logprobs[len(r.output_ids):]
            if r.finish_reason:
                finished.append(r)
        dt = time.perf_counter() - t0
        self.stats["rounds"] += 1
        self.stats["verify_tokens"] += int(sb * tb)
        self.stats["round_seconds"] += dt
        if self.on_round is not None:
            # per active slot, in slot order: its request, verified length, accepted drafts, whether
            # an accepted stop token ended the round (no bonus), the drafter's per-position confidences
            info = {"slots_bucket": sb, "tokens_bucket": tb, "attention_bucket": attn, "kind": plan.kind,
                    "request_ids": request_ids, "ell": ell[plan.active_b].tolist(),
                    "accepted": [int(n_acc[i]) for i in active_idx], "seconds": dt,
                    "stopped": [bool(outs["stopped"][i]) for i in active_idx]}
            if conf is not None:
                info["confidence"] = np.asarray(conf)[plan.active_b].tolist()
            self.on_round(info)
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
