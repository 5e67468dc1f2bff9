"""The batched serving engine: cache slots, bucketed prefill, speculative rounds, plain decoding.

This is the only module that calls compiled executables. Device state (target params, KV cache,
drafter params and per-slot drafter state, per-slot anchor tokens) is threaded through
ahead-of-time compiled functions; the host keeps per-request bookkeeping (tokens, stop conditions,
metrics) and decides each round's per-request verification lengths.

A round, for the rows [0:sb] of the slots (sb = slots bucket covering every active slot):
  draft   -> DraftBlock (tokens, q, confidence) for every row, from its anchor;
  lengths -> ell_r in 0..gamma per row (policy; 0 for idle rows);
  verify  -> one target pass over [anchor, d_1..d_{tb-1}] (tb = tokens bucket >= 1 + max ell),
             exact chain rejection sampling, commit: cache lengths += accepted + 1, drafter context
             appended with the anchor and accepted drafts, new anchor = the corrected/bonus token.
When the lengths do not depend on this round's confidences, draft and verify are one executable.
Plain decoding runs "lite" rounds: the target alone, one token per row, nothing tapped or committed
to a drafter. The async policy may also skip drafting: a "plain" round (ell = 0 everywhere) keeps the
drafter's context up to date; a lite round costs exactly a plain decoding step but leaves those rows'
drafter context behind, so they decode plainly to the end.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import sharding as shd
from specjax.decoding import buckets as bk
from specjax.sampling import SamplingArrays, probs_from_logits, round_key, sample
from specjax.decoding.verify import VerifyResult, verify_chain
from specjax.drafters.base import ContextUpdate
from specjax.models import cache as kvc
from specjax.models.decoder import CausalLM

Array = jax.Array

FIXED_POLICIES = ("plain", "fixed", "mtp1")  # lengths known before drafting: one fused executable
HOST_POLICIES = ("threshold", "confidence")  # lengths chosen on the host from this round's confidences
DEVICE_POLICIES = ("confidence_async",)  # capacity from old confidences, filled on the device
ALL_POLICIES = FIXED_POLICIES + HOST_POLICIES + DEVICE_POLICIES


def _target_identity(target: CausalLM) -> str:
    """A stable identity of a target: its config and a checksum of its weights."""
    import hashlib
    import json
    h = hashlib.sha256(json.dumps(dataclasses.asdict(target.config), sort_keys=True).encode())
    for leaf in jax.tree.leaves(nnx.state(target, nnx.Param))[:4]:
        h.update(np.asarray(leaf, np.float32).tobytes()[:4096])
    return f"qwen3-{target.config.num_hidden_layers}x{target.config.hidden_size}-{h.hexdigest()[:12]}"


def topk_prefix_fill(conf_bg: Array, k_total: Array, active_b: Array, cap: int) -> Array:
    """Admit the `k_total` draft positions with the largest prefix survival a_{r,j} = prod_{i<=j} c_{r,i}.

    Only positions j < cap of active rows compete; ties go to earlier positions, then lower rows, so
    each row's admitted set is a prefix (a is non-increasing along a row). Returns ell [B].
    """
    b, g = conf_bg.shape
    if cap <= 0 or g == 0:
        return jnp.zeros((b,), jnp.int32)
    cap = min(cap, g)
    surv = jnp.cumprod(conf_bg[:, :cap].astype(jnp.float32), axis=1)  # [B, cap]
    surv = jnp.where(active_b[:, None], surv, -1.0)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, cap)).reshape(-1)
    pos = jnp.broadcast_to(jnp.arange(cap)[None, :], (b, cap)).reshape(-1)
    order = jnp.lexsort((rows, pos, -surv.reshape(-1)))  # primary: survival desc, then position, then row
    rank = jnp.zeros((b * cap,), jnp.int32).at[order].set(jnp.arange(b * cap, dtype=jnp.int32))
    chosen = (rank < k_total) & (surv.reshape(-1) >= 0)
    return jnp.sum(chosen.reshape(b, cap), axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine shape and policy. `gamma` defaults to the drafter's."""

    max_slots: int = 8
    max_len: int = 1024
    gamma: int | None = None
    policy: str = "fixed"  # plain | fixed | mtp1 | threshold | confidence | confidence_async
    threshold: float | None = None  # per-step confidence threshold of the `threshold` policy
    max_prefill: int = 256
    seed: int = 0
    cache_dtype: str | None = None
    slots_buckets: tuple[int, ...] | None = None
    tokens_buckets: tuple[int, ...] | None = None
    prefill_buckets: tuple[int, ...] | None = None
    prefill_batch_buckets: tuple[int, ...] | None = None  # prompts per prefill call

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")


@dataclasses.dataclass
class RequestMetrics:
    """Per-request speculative metrics with vLLM's definitions."""

    num_drafts: int = 0  # rounds that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rounds: int = 0  # target passes after prefill (incl. plain ones)
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
    # filled by the engine
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)
    slot: int = -1
    rounds: int = 0


class Engine:
    """Speculative decoding over a fixed set of cache slots (see module docstring)."""

    # async policy: rounds without drafting before a drafting probe (doubling up to PROBE_MAX while
    # probes keep confirming that plain rounds pay more), and consecutive plain decisions after which
    # plain rounds stop maintaining the drafter's context (lite rounds)
    PROBE_EVERY, PROBE_MAX, LITE_AFTER = 32, 512, 8

    def __init__(self, target: CausalLM, drafter: nnx.Module | None = None,
                 config: EngineConfig = EngineConfig(), *, mesh: jax.sharding.Mesh | None = None,
                 eos_token_ids: Sequence[int] = (), cost_table: Any = None, target_id: str | None = None,
                 progress: bool = True, verifier: Callable[..., VerifyResult] = verify_chain,
                 schedule_fn: Callable[..., np.ndarray] | None = None):
        self.cfg = config
        self.verifier = verifier  # tests swap in a deliberately biased one to prove the checks have teeth
        self.target_config = target.config
        self.mesh = mesh
        self.progress = progress
        self.drafter = drafter
        self.gamma = 0 if drafter is None else int(config.gamma or drafter.gamma)
        if drafter is not None and self.gamma > drafter.gamma:
            raise ValueError(f"gamma {self.gamma} exceeds the drafter's block size {drafter.gamma}")
        if config.policy not in ALL_POLICIES and schedule_fn is None:
            raise ValueError(f"unknown policy {config.policy!r}; choose one of {ALL_POLICIES}")
        if config.policy == "threshold" and config.threshold is None:
            raise ValueError("policy 'threshold' needs EngineConfig.threshold")
        if drafter is None and config.policy != "plain":
            config = dataclasses.replace(config, policy="plain")
            self.cfg = config
        # schedule_fn(confidences[R, gamma], caps[R]) -> lengths[R]: a custom host policy (tests use a
        # deliberately anticipating one to show the losslessness checks have teeth)
        self.schedule_fn = schedule_fn
        self.cost_table = cost_table
        self.target_id = target_id or _target_identity(target)
        self.eos_token_ids = tuple(int(e) for e in eos_token_ids)
        self.tap_layers = tuple(drafter.tap_layers) if drafter is not None else ()
        self.needs_hidden = bool(getattr(drafter, "needs_hidden", False)) if drafter is not None else False
        max_len, slots = config.max_len, config.max_slots
        self.buckets = bk.BucketSet(
            slots=tuple(config.slots_buckets or bk.pow2_buckets(1, slots)),
            tokens=tuple(config.tokens_buckets or bk.pow2_buckets(1, self.gamma + 1)),
            prefill=tuple(config.prefill_buckets or bk.pow2_buckets(min(16, config.max_prefill),
                                                                    min(config.max_prefill, max_len))))
        self.prefill_batches = tuple(config.prefill_batch_buckets or sorted({1, min(8, slots)}))
        if self.buckets.slots[-1] != slots:
            raise ValueError(f"largest slots bucket {self.buckets.slots[-1]} must equal max_slots {slots}")
        # device state
        self.t_graph, t_params = nnx.split(target)
        cache = target.init_cache(slots, max_len, dtype=config.cache_dtype)
        if drafter is not None:
            self.d_graph, d_params = nnx.split(drafter)
            dstate = drafter.init_state(slots, max_len)
        else:
            self.d_graph, d_params, dstate = None, nnx.State({}), ()
        anchors = jnp.zeros((slots,), jnp.int32)
        if mesh is not None:
            t_params = shd.shard_state(t_params, mesh, "serve")
            d_params = shd.shard_state(d_params, mesh, "serve")
            cache = shd.shard_tree(cache, self._cache_axes(cache), mesh, "serve")
            dstate = shd.shard_tree(dstate, self._slot_axes(dstate), mesh, "serve")
            anchors = jax.device_put(anchors, shd.replicated(mesh))
        self.t_params, self.d_params = t_params, d_params
        self.cache, self.dstate, self.anchors = cache, dstate, anchors
        self._cache_shardings = None if mesh is None else shd.tree_shardings(
            cache, self._cache_axes(cache), mesh, "serve")
        self._dstate_shardings = None if mesh is None else shd.tree_shardings(
            dstate, self._slot_axes(dstate), mesh, "serve")
        stop = np.asarray(self.eos_token_ids or (-1,), np.int32)
        self._stop_ids = self._resident(stop)
        # host state
        self.lengths = np.zeros((slots,), np.int64)
        self.slot_req: list[EngineRequest | None] = [None] * slots
        self.queue: list[EngineRequest] = []
        self._key_data = np.zeros((slots, 2), np.uint32)
        self._seed_counter = 0
        self.last_confidence: np.ndarray | None = None
        self._tb_markers: dict[int, Any] = {}
        # async policy state, all on the host: per-slot confidences [slots, gamma] as known after the
        # last round and after the one before (the plan reads only the latter), the mean confidences of
        # the last drafting round (a prior for rows not yet seen), whether each slot's drafter context
        # is complete (False once a lite round left it behind), and the plain-decision streak
        g = max(self.gamma, 1)
        self._conf_known = np.full((slots, g), np.nan)
        self._conf_lagged = np.full((slots, g), np.nan)
        self._conf_prior: np.ndarray | None = None
        self._fresh = np.zeros((slots,), bool)
        self.plain_seconds: dict[int, float] | None = None  # per slots bucket: a lite round's seconds
        self._rounds_since_draft = 0
        self._plain_streak = 0
        self._probe_interval = self.PROBE_EVERY
        self.stats = {"rounds": 0, "prefills": 0, "verify_tokens": 0, "round_seconds": 0.0}
        self.on_round: Callable[[dict[str, Any]], None] | None = None
        self._build_executables()

    # ------------------------------------------------------------------ sharding helpers
    @staticmethod
    def _cache_axes(cache: kvc.KVCache) -> kvc.KVCache:
        return kvc.KVCache(k=tuple(kvc.CACHE_AXES for _ in cache.k), v=tuple(kvc.CACHE_AXES for _ in cache.v),
                           lengths=kvc.LENGTHS_AXES)

    @staticmethod
    def _slot_axes(tree: Any) -> Any:
        return jax.tree.map(lambda x: ("cache_batch",) + (None,) * (x.ndim - 1), tree)

    def _put(self, x: np.ndarray) -> Any:
        """A per-call host input of an executable. On one device the numpy array itself: the compiled
        call copies it in for a fraction of a separate device_put's cost (which is ~5% of a small
        batch's step). Every step waits for its outputs before the host touches its arrays again."""
        if self.mesh is None:
            return x
        return self._resident(x)

    def _resident(self, x: np.ndarray) -> Any:
        """A device array that stays (replicated over the mesh when there is one)."""
        return jax.device_put(x) if self.mesh is None else jax.device_put(x, shd.replicated(self.mesh))

    def _constrain(self, cache: kvc.KVCache, dstate: Any, anchors: Array) -> tuple[kvc.KVCache, Any, Array]:
        """Keep the state's shardings fixed across calls (the compiled executables require them)."""
        if self.mesh is None:
            return cache, dstate, anchors
        cache = jax.lax.with_sharding_constraint(cache, self._cache_shardings)
        if dstate is not None:  # None: a lite round, which does not carry the drafter's state
            dstate = jax.lax.with_sharding_constraint(dstate, self._dstate_shardings)
        anchors = jax.lax.with_sharding_constraint(anchors, shd.replicated(self.mesh))
        return cache, dstate, anchors

    # ------------------------------------------------------------------ device functions
    def _target(self, t_params: Any) -> CausalLM:
        return nnx.merge(self.t_graph, t_params)

    def _drafter(self, d_params: Any) -> Any:
        return nnx.merge(self.d_graph, d_params)

    @staticmethod
    def _keys(key_data_b2: Array, counter_b: Array) -> Array:
        return round_key(jax.random.wrap_key_data(key_data_b2), counter_b)

    def _verify_commit(self, t_params, d_params, cache, dstate, anchors, draft_bg, q_bgv, ell_b, active_b,
                       sa, keys_b, stop_ids, tb: int, maintain: bool = True):
        """Target pass over [anchor, drafts[:tb-1]], exact acceptance, commit. Returns new state + outputs.
        With `maintain` False (a lite plain round) the target taps nothing and the drafter's context is
        left behind: those rows may not draft again (see `Engine._fresh`)."""
        target = self._target(t_params)
        sb = ell_b.shape[0]
        anchor_b = anchors[:sb]
        start_b = cache.lengths[:sb]
        toks = anchor_b[:, None] if tb == 1 else jnp.concatenate([anchor_b[:, None], draft_bg[:, :tb - 1]], 1)
        positions = start_b[:, None] + jnp.arange(tb, dtype=jnp.int32)[None, :]
        ell_b = jnp.where(active_b, jnp.minimum(ell_b, tb - 1), 0)
        out = target.forward(toks, positions, cache, ell_b + 1, tap_layers=self.tap_layers if maintain else (),
                             logits="all")
        p = probs_from_logits(out.logits, sa)  # [sb, tb, V]
        if tb == 1:  # plain decoding: no drafts; the chain rule reduces to sampling from the target
            q_bgv = jnp.zeros((sb, 0, p.shape[-1]), jnp.float32)
            draft_bg = jnp.zeros((sb, 0), jnp.int32)
        res = self.verifier(keys_b, p, q_bgv[:, :tb - 1], draft_bg[:, :tb - 1], ell_b, stop_ids)
        n_commit = jnp.where(active_b, res.num_accepted + 1, 0)
        new_lengths = cache.lengths.at[:sb].set(start_b + n_commit)
        cache = out.cache.with_lengths(new_lengths)
        if self.d_graph is not None and maintain:
            taps = jnp.concatenate(out.taps, axis=-1) if out.taps else None
            upd = ContextUpdate(tokens=toks, positions=positions, taps=taps,
                                hidden=out.hidden if self.needs_hidden else None, n_valid=n_commit)
            dstate = self._drafter(d_params).commit(dstate, upd)
        new_anchor = jnp.where(active_b & (res.next_token >= 0), res.next_token, anchor_b)
        anchors = anchors.at[:sb].set(new_anchor)
        cache, dstate, anchors = self._constrain(cache, dstate, anchors)
        outs = {"tokens": res.tokens, "num_emitted": res.num_emitted, "num_accepted": res.num_accepted,
                "stopped": res.stopped_on_draft}
        return cache, dstate, anchors, outs

    def _split_keys(self, key_data, counters):
        keys = self._keys(key_data, counters)
        return round_key(keys, 0), round_key(keys, 1)

    @staticmethod
    def _unpack(ints_4b: Array, floats_2b: Array):
        """Per-round row inputs travel packed (one host->device copy each): ints = (ell, active, counter,
        top_k), floats = (temperature, top_p)."""
        sa = SamplingArrays(floats_2b[0], ints_4b[3], floats_2b[1])
        return ints_4b[0], ints_4b[1].astype(bool), ints_4b[2], sa

    def _fn_lite(self):
        def fn(t_params, cache, anchors, ints, floats, key_data, stop_ids):
            """A plain step that leaves the drafter alone (no drafter arguments to pass either)."""
            ell_b, active_b, counters, sa = self._unpack(ints, floats)
            _, kv = self._split_keys(key_data, counters)
            cache, _, anchors, outs = self._verify_commit(t_params, None, cache, None, anchors, None, None, ell_b,
                                                          active_b, sa, kv, stop_ids, 1, maintain=False)
            return cache, anchors, outs
        return fn

    def _fn_fused(self, tb: int):
        def fn(t_params, d_params, cache, dstate, anchors, ints, floats, key_data, stop_ids):
            ell_b, active_b, counters, sa = self._unpack(ints, floats)
            kd, kv = self._split_keys(key_data, counters)
            sb = ell_b.shape[0]
            conf = jnp.zeros((sb, max(self.gamma, 1)), jnp.float32)
            if tb > 1:
                block = self._drafter(d_params).propose(dstate, anchors[:sb], cache.lengths[:sb], sa, kd)
                draft, q = block.tokens, block.q
                if block.confidence is not None:
                    conf = self._gamma_columns(block.confidence)
            else:
                draft, q = None, None
            cache, dstate, anchors, outs = self._verify_commit(
                t_params, d_params, cache, dstate, anchors, draft, q, ell_b, active_b, sa, kv, stop_ids, tb)
            outs["confidence"] = conf
            return cache, dstate, anchors, outs
        return fn

    def _fn_draft(self):
        def fn(d_params, dstate, cache_lengths, anchors, ints, floats, key_data):
            _, _, counters, sa = self._unpack(ints, floats)
            kd, _ = self._split_keys(key_data, counters)
            sb = key_data.shape[0]
            block = self._drafter(d_params).propose(dstate, anchors[:sb], cache_lengths[:sb], sa, kd)
            conf = block.confidence if block.confidence is not None else jnp.ones(block.tokens.shape, jnp.float32)
            return block.tokens, block.q, self._gamma_columns(conf)
        return fn

    def _gamma_columns(self, conf_bk):
        """The first gamma confidence columns: a block drafter may draft past gamma, and every round
        reports (and schedules on) gamma columns whichever executable produced them."""
        return conf_bk[:, : max(self.gamma, 1)]

    def _fn_verify(self, tb: int):
        def fn(t_params, d_params, cache, dstate, anchors, draft, q, conf, ints, floats, key_data, ctrl, stop_ids):
            """Verify drafts; with ctrl = (K, 1), ell = top-K fill of the current survivals (async policy)."""
            ell_b, active_b, counters, sa = self._unpack(ints, floats)
            k_total, device_fill = ctrl[0], ctrl[1] > 0
            _, kv = self._split_keys(key_data, counters)
            filled = topk_prefix_fill(conf, k_total, active_b & (ell_b > 0), tb - 1)  # capped rows take none
            ell = jnp.where(device_fill, jnp.minimum(filled, ell_b), ell_b)
            cache, dstate, anchors, outs = self._verify_commit(t_params, d_params, cache, dstate, anchors, draft,
                                                               q, ell, active_b, sa, kv, stop_ids, tb)
            outs["ell"] = jnp.where(active_b, jnp.minimum(ell, tb - 1), 0)
            return cache, dstate, anchors, outs
        return fn

    def _fn_prefill(self, plen: int):
        max_len, slots = self.cfg.max_len, self.cfg.max_slots

        def fn(t_params, d_params, cache, dstate, anchors, tokens_pt, n_valid_p, slot_p, start_p, sa, key_data):
            """Prefill P prompt chunks into slots `slot_p` (an id >= slots marks a padding row)."""
            target = self._target(t_params)
            pb = tokens_pt.shape[0]
            cache = cache.with_lengths(cache.lengths.at[slot_p].set(start_p, mode="drop"))
            positions = start_p[:, None] + jnp.arange(plen, dtype=jnp.int32)[None, :]
            out = target.forward(tokens_pt, positions, cache, n_valid_p, rows_b=slot_p,
                                 tap_layers=self.tap_layers, logits="last")
            cache = out.cache
            if self.d_graph is not None:
                drafter = self._drafter(d_params)
                fresh = drafter.init_state(pb, max_len)
                old = jax.tree.map(lambda x: jnp.take(x, slot_p, axis=0, mode="clip"), dstate)
                first = start_p == 0
                sub = jax.tree.map(
                    lambda f, o: jnp.where(first.reshape((pb,) + (1,) * (f.ndim - 1)), f, o), fresh, old)
                taps = jnp.concatenate(out.taps, axis=-1) if out.taps else None
                sub = drafter.commit(sub, ContextUpdate(tokens=tokens_pt, positions=positions, taps=taps,
                                                        hidden=out.hidden if self.needs_hidden else None,
                                                        n_valid=n_valid_p))
                dstate = jax.tree.map(lambda x, s_: x.at[slot_p].set(s_, mode="drop"), dstate, sub)
            p = probs_from_logits(out.logits[:, 0], sa)  # [P, V]
            keys = self._keys(key_data, jnp.zeros((pb,), jnp.int32))
            tok = sample(keys, p)
            anchors = anchors.at[slot_p].set(tok, mode="drop")
            cache, dstate, anchors = self._constrain(cache, dstate, anchors)
            return cache, dstate, anchors, tok
        del slots
        return fn

    def _build_executables(self) -> None:
        self.exe_prefill = bk.Executables("prefill", self._dispatch_prefill, donate_argnums=(2, 3, 4))
        self.exe_fused = bk.Executables("round", self._dispatch_fused, donate_argnums=(2, 3, 4))
        self.exe_lite = bk.Executables("lite", self._dispatch_lite, donate_argnums=(1, 2))
        self.exe_draft = bk.Executables("draft", self._dispatch_draft)
        self.exe_verify = bk.Executables("verify", self._dispatch_verify, donate_argnums=(2, 3, 4))

    # jax.jit needs one Python function per executable family; the bucket picks the static size.
    def _dispatch_prefill(self, *args):
        return self._fn_prefill(args[5].shape[1])(*args)  # tokens_pt [P, plen]

    def _dispatch_fused(self, *args):
        return self._fn_fused(self._tb_from_args(args))(*args[:-1])

    def _dispatch_lite(self, *args):
        return self._fn_lite()(*args)

    def _dispatch_draft(self, *args):
        return self._fn_draft()(*args)

    def _dispatch_verify(self, *args):
        return self._fn_verify(self._tb_from_args(args))(*args[:-1])

    def _tb_marker(self, tb: int) -> Any:
        """A cached [tb] device array whose shape tells the executable its static tokens bucket."""
        m = self._tb_markers.get(tb)
        if m is None:
            m = self._tb_markers[tb] = self._resident(np.zeros((tb,), np.int32))
        return m

    @staticmethod
    def _tb_from_args(args) -> int:
        return int(args[-1].shape[0])  # a dummy [tb] array carries the static tokens bucket

    # ------------------------------------------------------------------ warm-up
    def _abstract_round_inputs(self, sb: int):
        f = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=None if self.mesh is None
                                                    else shd.replicated(self.mesh))
        sa = SamplingArrays(f((sb,), jnp.float32), f((sb,), jnp.int32), f((sb,), jnp.float32))
        return dict(sa=sa, key=f((sb, 2), jnp.uint32), ints=f((4, sb), jnp.int32), floats=f((2, sb), jnp.float32),
                    f=f)

    def warm_keys(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every (family, bucket) this engine may execute under its policy."""
        keys: list[tuple[str, tuple[int, ...]]] = [("prefill", (pb, p)) for pb in self.prefill_batches
                                                    for p in self.buckets.prefill]
        fixed = self.cfg.policy in FIXED_POLICIES
        for sb in self.buckets.slots:
            if self.cfg.policy == "plain":
                keys.append(("lite", (sb,)))
            elif fixed:
                tbs = {1, bk.pick(self.buckets.tokens, self._policy_ell() + 1)}
                tbs |= {t for t in self.buckets.tokens if t <= self._policy_ell() + 1}
                keys += [("round", (sb, tb)) for tb in sorted(tbs)]
            else:
                keys.append(("draft", (sb,)))
                keys += [("verify", (sb, tb)) for tb in self.buckets.tokens]
                if self.cfg.policy in DEVICE_POLICIES:
                    keys += [("round", (sb, 1)), ("lite", (sb,))]  # rounds that skip drafting
        return keys

    def warmup(self, threads: int | None = None) -> float:
        """Compile every bucket ahead (with progress). Returns seconds spent.

        Tracing runs in order on this thread; with `threads` > 1 that many threads then compile the
        lowered executables at once (XLA compiles without the GIL). Default: one per CPU core, at
        most 4 (a 30-layer target's bucket takes seconds to compile on a small CPU)."""
        from concurrent.futures import ThreadPoolExecutor

        from tqdm.auto import tqdm
        from specjax.decoding import compile_cache
        if threads is None:
            threads = max(1, min(4, os.cpu_count() or 1))
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        compile_cache.enable()  # a second start loads the executables from disk
        t0 = time.perf_counter()
        A = bk.abstract
        state = (A(self.t_params), A(self.d_params), A(self.cache), A(self.dstate), A(self.anchors))
        stop = A(self._stop_ids)
        keys = self.warm_keys()
        jobs: list[tuple[bk.Executables, tuple[int, ...], Any]] = []
        for fam, key in tqdm(keys, desc="tracing buckets", disable=not self.progress, leave=False):
            if fam == "prefill":
                pb, plen = key
                r = self._abstract_round_inputs(pb)
                f = r["f"]
                exe, args = self.exe_prefill, (*state, f((pb, plen), jnp.int32), f((pb,), jnp.int32),
                                               f((pb,), jnp.int32), f((pb,), jnp.int32), r["sa"], r["key"])
            elif fam == "round":
                sb, tb = key
                r = self._abstract_round_inputs(sb)
                exe, args = self.exe_fused, (*state, r["ints"], r["floats"], r["key"], stop, r["f"]((tb,), jnp.int32))
            elif fam == "lite":
                (sb,) = key
                r = self._abstract_round_inputs(sb)
                exe, args = self.exe_lite, (state[0], state[2], state[4], r["ints"], r["floats"], r["key"], stop)
            elif fam == "draft":
                (sb,) = key
                r = self._abstract_round_inputs(sb)
                exe, args = self.exe_draft, (state[1], state[3], A(self.cache.lengths), state[4], r["ints"],
                                             r["floats"], r["key"])
            else:
                sb, tb = key
                r = self._abstract_round_inputs(sb)
                f = r["f"]
                g = max(self.gamma, 1)
                v = self.target_config.vocab_size
                exe, args = self.exe_verify, (*state, f((sb, g), jnp.int32), f((sb, g, v), jnp.float32),
                                              f((sb, g), jnp.float32), r["ints"], r["floats"], r["key"],
                                              f((2,), jnp.int32), stop, f((tb,), jnp.int32))
            jobs.append((exe, key, exe.lower(key, *args)))
        bar = tqdm(total=len(jobs), desc="compiling buckets", disable=not self.progress, leave=False)

        def install(job) -> None:
            job[0].install(job[1], job[2])
            bar.update(1)
        if threads == 1:
            for job in jobs:
                install(job)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(install, jobs))  # list(): re-raises the first failure
        bar.close()
        seconds = time.perf_counter() - t0
        if self.needs_cost_table:
            from specjax.decoding.profiling import measure_cost_table, measure_plain_seconds
            if self.cost_table is None:
                self.cost_table = measure_cost_table(self, progress=self.progress)
            else:
                self.use_cost_table(self.cost_table)
            if self.cfg.policy in DEVICE_POLICIES:
                self.plain_seconds = measure_plain_seconds(self)
        return seconds

    @property
    def needs_cost_table(self) -> bool:
        return self.cfg.policy in ("confidence", "confidence_async") and self.schedule_fn is None

    def cost_table_meta(self):
        """The metadata a cost table for this engine must carry (target, dtype, hardware, buckets)."""
        from specjax.scheduling import CostTableMeta
        dev = jax.devices()[0]
        n = 1 if self.mesh is None else self.mesh.size
        dtype = str(jax.tree.leaves(self.t_params)[0].dtype)
        return CostTableMeta(target=self.target_id, dtype=dtype, hardware=f"{dev.platform}:{dev.device_kind} x{n}",
                             context_length=self.cfg.max_len, slots_buckets=tuple(self.buckets.slots),
                             tokens_buckets=tuple(self.buckets.tokens))

    def use_cost_table(self, table) -> None:
        """Install a measured cost table; refuses one measured for another target, dtype or bucket set."""
        if table.meta is None:
            raise ValueError("cost table has no metadata: cannot check it was measured for this engine")
        table.check_matches(self.cost_table_meta())
        self.cost_table = table

    def compile_counts(self) -> dict[str, int]:
        return {e.name: e.jit_cache_size() for e in (self.exe_prefill, self.exe_fused, self.exe_lite,
                                                      self.exe_draft, self.exe_verify)}

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
        req.metrics.start_time = time.perf_counter()
        self.queue.append(req)

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
                self._fresh[req.slot] = True  # the prefill commits its whole prompt to the drafter
                self._conf_known[req.slot] = self._conf_lagged[req.slot] = np.nan
                batch.append(req)
            self._prefill(batch)
            for req in batch:
                self.stats["prefills"] += 1
                self.lengths[req.slot] = len(req.prompt_ids)
                req.metrics.first_token_time = time.perf_counter()
                self._append(req, [req.output_ids.pop()])  # the sampled first token, checked for stops
                if req.finish_reason:
                    finished.append(req)
        return finished

    def _prefill(self, batch: list[EngineRequest]) -> None:
        """Run prompt chunks of up to `prefill_batches[-1]` requests per call; the first token is sampled."""
        biggest = self.buckets.prefill[-1]
        slots = self.cfg.max_slots
        offsets = [0] * len(batch)
        first = [0] * len(batch)
        while True:
            todo = [i for i, r in enumerate(batch) if offsets[i] < len(r.prompt_ids)]
            if not todo:
                break
            pb = bk.pick(self.prefill_batches, len(todo), what="prefill batch")
            chunk_lens = [min(biggest, len(batch[i].prompt_ids) - offsets[i]) for i in todo]
            plen = bk.pick(self.buckets.prefill, max(chunk_lens), what="prompt chunk length")
            toks = np.zeros((pb, plen), np.int32)
            n_valid = np.zeros((pb,), np.int32)
            slot = np.full((pb,), slots, np.int32)  # padding rows point past the last slot: dropped
            start = np.zeros((pb,), np.int32)
            temp = np.ones((pb,), np.float32)
            top_k = np.zeros((pb,), np.int32)
            top_p = np.ones((pb,), np.float32)
            key_data = np.zeros((pb, 2), np.uint32)
            for row, (i, n) in enumerate(zip(todo, chunk_lens)):
                r = batch[i]
                toks[row, :n] = r.prompt_ids[offsets[i]:offsets[i] + n]
                n_valid[row], slot[row], start[row] = n, r.slot, offsets[i]
                temp[row], top_k[row], top_p[row] = r.temperature, r.top_k, r.top_p
                key_data[row] = self._key_data[r.slot]
            sa = SamplingArrays(self._put(temp), self._put(top_k), self._put(top_p))
            self.cache, self.dstate, self.anchors, tok = self.exe_prefill(
                (pb, plen), self.t_params, self.d_params, self.cache, self.dstate, self.anchors,
                self._put(toks), self._put(n_valid), self._put(slot), self._put(start), sa, self._put(key_data))
            tok = np.asarray(tok)
            for row, (i, n) in enumerate(zip(todo, chunk_lens)):
                offsets[i] += n
                first[i] = int(tok[row])
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
    def _policy_ell(self) -> int:
        p = self.cfg.policy
        return 0 if p == "plain" else (min(1, self.gamma) if p == "mtp1" else self.gamma)

    def _caps(self, sb: int) -> np.ndarray:
        """Largest ell each row may verify: gamma, its own cap, room in the cache, tokens still wanted."""
        caps = np.zeros((sb,), np.int64)
        for i in range(sb):
            r = self.slot_req[i]
            if r is None:
                continue
            if not self._fresh[i]:
                continue  # its drafter context was left behind by a lite round: plain to the end
            cap = self.gamma if r.max_draft_tokens is None else min(self.gamma, r.max_draft_tokens)
            cap = min(cap, self.cfg.max_len - 1 - int(self.lengths[i]), r.max_tokens - len(r.output_ids) - 1)
            caps[i] = max(cap, 0)
        return caps

    def _host_lengths(self, conf_rg: np.ndarray) -> np.ndarray:
        """Verification lengths from this round's (calibrated) confidences on the host."""
        if self.schedule_fn is not None:
            return np.asarray(self.schedule_fn(conf_rg), np.int64)
        from specjax.scheduling import prefix_schedule
        if self.cfg.policy == "threshold":
            return prefix_schedule(conf_rg, None, "threshold", gamma=self.gamma, threshold=self.cfg.threshold)
        return prefix_schedule(conf_rg, self.cost_table, "confidence", gamma=self.gamma)

    def _async_plan(self, sb: int, active: np.ndarray) -> tuple[int, int, str]:
        """(K, cap, round kind) of the async policy, all from confidences two rounds old.

        Kinds: "draft" (draft, then fill K on the device), "plain" (no drafting; the drafter's context
        is still maintained) and "lite" (no drafting and no drafter upkeep: exactly plain decoding's
        cost, after which those rows stay plain). A round drafts when it admits a draft and its
        expected tokens/s beat a plain round's (rows with a stale drafter context count as one token
        each); otherwise plain, turning lite after `LITE_AFTER` plain decisions in a row. A drafting
        probe refreshes the confidences after `_probe_interval` rounds without drafting; the interval
        doubles (up to `PROBE_MAX`) each time a probe changes nothing. Nothing here looks at this
        round's tokens, so it stays lossless."""
        rows = np.flatnonzero(active)
        fresh = self._fresh[rows]
        if not fresh.any():
            return 0, 0, "lite"  # nobody can draft
        from specjax.scheduling import async_plan
        prior = np.full((self.gamma,), 0.5) if self._conf_prior is None else self._conf_prior
        c = self._conf_lagged[rows]
        c = np.where(np.isnan(c), prior[None, :], c)
        c[~fresh] = 0.0
        # theta: expected tokens/s of the schedule the async policy picks on these confidences
        k_total, cap, theta = async_plan(c, self.cost_table, gamma=self.gamma)
        plain_s = self.plain_seconds.get(sb) if self.plain_seconds else None
        if plain_s is None or self._conf_prior is None:
            return k_total, cap, "draft"  # nothing to judge by yet: draft (a probe)
        # a round that admits no draft is a plain round plus a proposal: never better than plain,
        # whatever the noise between the cost table's 1-token entry and the measured plain round
        if k_total > 0 and theta > len(rows) / plain_s:
            self._plain_streak, self._probe_interval = 0, self.PROBE_EVERY
            return k_total, cap, "draft"
        self._plain_streak += 1
        if self._rounds_since_draft >= self._probe_interval:
            self._probe_interval = min(2 * self._probe_interval, self.PROBE_MAX)
            return k_total, cap, "draft"
        return k_total, cap, "lite" if self._plain_streak > self.LITE_AFTER else "plain"

    def step(self) -> list[EngineRequest]:
        """Admit waiting requests into free slots, then run one round. Returns requests finished now."""
        finished = self._admit_waiting()
        active_idx = [i for i, r in enumerate(self.slot_req) if r is not None]
        if not active_idx:
            return finished
        t0 = time.perf_counter()
        sb = bk.pick(self.buckets.slots, max(active_idx) + 1, what="active slot count")
        active = np.array([self.slot_req[i] is not None for i in range(sb)])
        caps = self._caps(sb)
        reqs = [self.slot_req[i] for i in range(sb)]
        ints = np.zeros((4, sb), np.int32)  # ell, active, counter, top_k
        floats = np.ones((2, sb), np.float32)  # temperature, top_p
        for i, r in enumerate(reqs):
            if r is not None:
                ints[1, i], ints[2, i], ints[3, i] = 1, r.rounds + 1, r.top_k
                floats[0, i], floats[1, i] = r.temperature, r.top_p
        key_data = self._put(self._key_data[:sb])
        conf = None
        policy = self.cfg.policy
        kind = "lite" if policy == "plain" else "draft"  # what this round does (on_round's "kind")
        device_policy = policy in DEVICE_POLICIES and self.schedule_fn is None
        if device_policy:
            k_total, cap, kind = self._async_plan(sb, active)
            self._rounds_since_draft = 0 if kind == "draft" else self._rounds_since_draft + 1
        fused = policy in FIXED_POLICIES and self.schedule_fn is None  # lengths known before drafting
        if kind == "lite":
            tb = 1
            ints[0] = 0
            self._fresh[:sb] &= ~active  # these rows' drafter context is now behind
            self.cache, self.anchors, outs = self.exe_lite(
                (sb,), self.t_params, self.cache, self.anchors, self._put(ints), self._put(floats), key_data,
                self._stop_ids)
        elif fused or kind == "plain":
            ell = np.minimum(np.full((sb,), 0 if kind == "plain" else self._policy_ell()), caps) * active
            tb = bk.pick(self.buckets.tokens, int(ell.max()) + 1, what="tokens per slot")
            ints[0] = ell
            self.cache, self.dstate, self.anchors, outs = self.exe_fused(
                (sb, tb), self.t_params, self.d_params, self.cache, self.dstate, self.anchors, self._put(ints),
                self._put(floats), key_data, self._stop_ids, self._tb_marker(tb))
        else:
            ints_dev, floats_dev = self._put(ints), self._put(floats)
            draft, q, conf_dev = self.exe_draft((sb,), self.d_params, self.dstate, self.cache.lengths, self.anchors,
                                                ints_dev, floats_dev, key_data)
            conf_dev.copy_to_host_async()  # confidences travel to the host while the device works on
            if device_policy:
                # capacity and per-row cap from confidences two rounds old; no wait on this round's
                ell = np.minimum(caps, cap) * active
                device_fill = True
            else:
                conf = np.asarray(conf_dev)
                ell = np.zeros((sb,), np.int64)
                ell[active] = np.minimum(self._host_lengths(conf[active]), caps[active])
                k_total, device_fill = 0, False
            tb = bk.pick(self.buckets.tokens, int(ell.max()) + 1, what="tokens per slot")
            ints[0] = ell
            self.cache, self.dstate, self.anchors, outs = self.exe_verify(
                (sb, tb), self.t_params, self.d_params, self.cache, self.dstate, self.anchors, draft, q, conf_dev,
                self._put(ints), floats_dev, key_data, self._put(np.array([k_total, int(device_fill)], np.int32)),
                self._stop_ids, self._tb_marker(tb))
            if device_fill:
                conf = np.asarray(conf_dev)
        outs = jax.device_get(outs)
        if "ell" in outs:
            ell = np.asarray(outs["ell"], np.int64)
        elif kind == "lite":
            ell = np.zeros((sb,), np.int64)
        if conf is None and self.gamma > 0 and kind != "lite":
            conf = np.asarray(outs["confidence"])
        self.last_confidence = conf
        if device_policy:  # the async plan's memory; rows with a complete drafter context drafted for real
            self._conf_lagged = self._conf_known.copy()
            seen = active & self._fresh[:sb]
            if kind == "draft" and seen.any():
                self._conf_known[np.flatnonzero(seen)] = conf[seen]
                self._conf_prior = conf[seen].mean(axis=0)
        n_acc = outs["num_accepted"]
        # taken before the loop frees finished slots; only for an on_round hook (off the hot path)
        request_ids = [self.slot_req[i].request_id for i in active_idx] if self.on_round is not None else []
        for i in active_idx:
            r = self.slot_req[i]
            r.rounds += 1
            m = r.metrics
            m.num_rounds += 1
            e = int(ell[i])
            if e > 0:
                m.num_drafts += 1
                m.num_draft_tokens += e
                m.num_accepted_tokens += int(n_acc[i])
                if len(m.accepted_per_pos) < self.gamma:
                    m.accepted_per_pos += [0] * (self.gamma - len(m.accepted_per_pos))
                for k in range(int(n_acc[i])):
                    m.accepted_per_pos[k] += 1
            self.lengths[i] += int(n_acc[i]) + 1
            emitted = outs["tokens"][i, : int(outs["num_emitted"][i])]
            self._append(r, emitted.tolist())
            if r.finish_reason:
                finished.append(r)
        dt = time.perf_counter() - t0
        self.stats["rounds"] += 1
        self.stats["verify_tokens"] += int(sb * tb)
        self.stats["round_seconds"] += dt
        if self.on_round is not None:
            # per active slot, in slot order: its request, verified length, accepted drafts, whether
            # an accepted stop token ended the round (no bonus), the drafter's per-position confidences
            info = {"slots_bucket": sb, "tokens_bucket": tb, "kind": kind, "request_ids": request_ids,
                    "ell": ell[active].tolist(), "accepted": [int(n_acc[i]) for i in active_idx],
                    "seconds": dt, "stopped": [bool(outs["stopped"][i]) for i in active_idx]}
            if conf is not None:
                info["confidence"] = np.asarray(conf)[active].tolist()
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
