"""The compiled programs: device state, warm-up and every call, driven by one table row per family.

This is the only module that calls compiled executables. Each executable family (`FAMILIES`) names
its pure function (decoding/programs.py), its argument layout, the state it donates and its bucket
key fields; warm-up lowers each bucket key from that layout and `Runner.run` passes arguments in it,
so a family's argument list is written once. Arguments named in `STATE` are the runner's resident
device state (returned state replaces it); the others are per-call inputs, shaped by `INPUTS`.
Every bucket key is compiled ahead; a call with an unwarmed key raises `UnwarmedBucketError`.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import sharding as shd
from specjax.decoding import map_budget, programs
from specjax.decoding.logit_rules import BAD_WORD_TOKENS, CHOICE_TOKENS, ROW_BAD_WORDS, ROW_CHOICES
from specjax.decoding.row_state import ROW_STOP_IDS, RowState
from specjax.models import cache as kvc
from specjax.models.pallas_attention import check_head_dim
from specjax.models.pallas_mlp import check_sizes as check_mlp_sizes
from specjax.sampling import DEFAULT_TOP_K_CAP


@dataclasses.dataclass(frozen=True)
class Family:
    """One executable family: a pure function compiled once per bucket key."""

    name: str
    fn: Callable[..., Any]  # fn(context, *args, **{f: size for f in static})
    args: tuple[str, ...]  # argument layout: names in STATE or INPUTS
    returns: tuple[str, ...]  # outputs in order; a name in STATE replaces that state
    # bucket key fields: "rows" (slots or prompts), "tokens", "plen", "logprobs" (bool: a row of the
    # round asked for log-probabilities), "attn" (attended cache rows; a drafter's context rows too),
    # "variant" (sampling.VARIANTS)
    bucket: tuple[str, ...]
    donate: tuple[str, ...] = ()  # state arguments whose buffers the call may reuse
    static: tuple[str, ...] = ()  # bucket fields the function takes as static values (not in any shape)


_STATE = ("cache", "dstate", "anchors", "row_state")
_ROUND = ("rows", "tokens", "logprobs", "attn", "variant")  # the bucket key of a round that verifies drafts
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("prefill", programs.prefill,
           ("t_params", "d_params", *_STATE, "tokens_bt", "ints_4b", "floats_3b", "keys_b2", "limits_4b", "stops_bk",
            "pens_3b", "bias_bv", "words_bwl", "choices_bcl", "fsm_start_b", "pred_bl", "stop_ids"),
           (*_STATE, "first"), ("rows", "plen", "attn"), donate=_STATE, static=("attn",)),
    Family("lite", programs.lite,
           ("t_params", "cache", "anchors", "row_state", "ell_b", "stop_ids"),
           ("cache", "anchors", "row_state", "outs"), ("rows", "logprobs", "attn", "variant"),
           donate=("cache", "anchors", "row_state"), static=("logprobs", "attn", "variant")),
    Family("fused", programs.fused,
           ("t_params", "d_params", *_STATE, "ell_b", "stop_ids"),
           (*_STATE, "outs"), _ROUND, donate=_STATE, static=_ROUND[1:]),
    Family("draft", programs.draft,
           ("d_params", "dstate", "cache_lengths", "anchors", "row_state", "ell_b", "stop_ids"),
           ("draft_bg", "q_bgn", "conf_bg"), ("rows", "attn", "variant"), static=("attn", "variant")),
    Family("verify", programs.verify,
           ("t_params", "d_params", *_STATE, "draft_bg", "q_bgn", "ell_b", "stop_ids"),
           (*_STATE, "outs"), _ROUND, donate=_STATE, static=_ROUND[1:]),
    Family("fused_fill", programs.fused_fill,
           ("t_params", "d_params", *_STATE, "ell_b", "k_total_1", "stop_ids"),
           (*_STATE, "outs"), _ROUND, donate=_STATE, static=_ROUND[1:]),
    Family("release", programs.release, ("row_state", "free_s"), ("row_state",), ("rows",), donate=("row_state",)),
    Family("copy", programs.copy_slot, ("cache", "dstate", "anchors", "src_dst_2"), ("cache", "dstate", "anchors"),
           ("rows",), donate=("cache", "dstate", "anchors")),
    Family("score", programs.score, ("t_params", "tokens_bt", "ints_4b", "floats_3b"), ("outs",), ("rows", "plen")),
)}


def bucket_key(family: str, **fields: Any) -> tuple[Any, ...]:
    """`family`'s bucket key from named fields (fields it does not key on are ignored)."""
    missing = [f for f in FAMILIES[family].bucket if f not in fields]
    if missing:
        raise TypeError(f"{family}'s bucket key needs fields {list(FAMILIES[family].bucket)}, missing {missing}")
    return tuple(fields[f] for f in FAMILIES[family].bucket)


# resident state: "row_state" is the slots' row state (row_state.RowState), replaced by the families that return it
STATE = ("t_params", "d_params", "cache", "dstate", "anchors", "row_state", "cache_lengths", "stop_ids")
# per-call inputs: (shape, dtype) from the bucket sizes (+ "gamma" columns, "q_cols": the columns of
# the q a draft carries to verify, the drafter's draft vocabulary or the target's, none in a greedy
# round; "q_dtype": its dtype; "bias_cols" / "words": a row's logit bias columns and bad words' shape,
# V and (ROW_BAD_WORDS, BAD_WORD_TOKENS) with logit bias, else zero; "choices": a row's guided choices
# shape, (ROW_CHOICES, CHOICE_TOKENS) with guided choices, else zero; "pred_cols": predicted tokens a row
# holds, zero without predictions)
INPUTS: dict[str, Callable[[dict[str, int]], tuple[tuple[int, ...], Any]]] = {
    "ell_b": lambda d: ((d["rows"],), jnp.int32),
    "limits_4b": lambda d: ((4, d["rows"]), jnp.int32),
    "stops_bk": lambda d: ((d["rows"], ROW_STOP_IDS), jnp.int32),
    "pens_3b": lambda d: ((3, d["rows"]), jnp.float32),
    "bias_bv": lambda d: ((d["rows"], d["bias_cols"]), jnp.float32),
    "words_bwl": lambda d: ((d["rows"],) + d["words"], jnp.int32),
    "choices_bcl": lambda d: ((d["rows"],) + d["choices"], jnp.int32),
    "fsm_start_b": lambda d: ((d["rows"],), jnp.int32),
    "pred_bl": lambda d: ((d["rows"], d["pred_cols"]), jnp.int32),
    "free_s": lambda d: ((d["rows"],), jnp.int32),
    "src_dst_2": lambda d: ((2,), jnp.int32),
    "ints_4b": lambda d: ((4, d["rows"]), jnp.int32),
    "floats_3b": lambda d: ((3, d["rows"]), jnp.float32),
    "keys_b2": lambda d: ((d["rows"], 2), jnp.uint32),
    "tokens_bt": lambda d: ((d["rows"], d["plen"]), jnp.int32),
    "draft_bg": lambda d: ((d["rows"], d["gamma"]), jnp.int32),
    "q_bgn": lambda d: ((d["rows"], d["gamma"], d["q_cols"]), d["q_dtype"]),
    "k_total_1": lambda d: ((1,), jnp.int32),
}


class UnwarmedBucketError(RuntimeError):
    """An executable was called with a bucket key that was not compiled at warm-up."""


@functools.cache
def _jitted(f: Family) -> Any:
    """A family's function jitted once per process with the context as its static first argument:
    runners whose contexts compare equal (programs.Context) lower and compile a bucket once (JAX's
    caches hold the trace, lowering and executable), e.g. the engines of a test module or a benchmark.
    What a program calls is looked up when it is traced: code that swaps such a function (a test's
    negative control) calls jax.clear_caches() before and after."""
    return jax.jit(f.fn, static_argnums=(0,), static_argnames=f.static,
                   donate_argnums=tuple(1 + f.args.index(a) for a in f.donate))


class Executables:
    """One family's programs for one runner's context, compiled ahead for each bucket key; never
    compiles on a call."""

    def __init__(self, name: str, ctx: programs.Context):
        self.name, self._ctx = name, ctx
        self._compiled: dict[Hashable, Any] = {}
        self.compile_seconds: dict[Hashable, float] = {}  # ~0 where another runner compiled it already

    def lower(self, key: Hashable, *abstract_args: Any, **static: int) -> Any:
        """Trace and lower the function for `key` (None when `key` is compiled already)."""
        if key in self._compiled:
            return None
        return _jitted(FAMILIES[self.name]).lower(self._ctx, *abstract_args, **static)

    def install(self, key: Hashable, lowered: Any) -> None:
        """Compile a `lower` result for `key`. XLA compiles without holding the GIL, so several
        threads may install different keys at once."""
        if lowered is None:
            return
        t0 = time.perf_counter()
        self._compiled[key] = lowered.compile()
        self.compile_seconds[key] = time.perf_counter() - t0

    @property
    def keys(self) -> list[Hashable]:
        return list(self._compiled)

    def compiled(self, key: Hashable) -> Any:
        """The compiled program (jax.stages.Compiled) of a warmed bucket key."""
        return self._compiled[key]

    def __call__(self, key: Hashable, *args: Any) -> Any:
        exe = self._compiled.get(key)
        if exe is None:
            raise UnwarmedBucketError(
                f"{self.name}: bucket {key!r} was not compiled at warm-up (warmed: {sorted(self._compiled, key=str)})")
        return exe(*args)



def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, for lowering."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


class Runner:
    """Device state threaded through the compiled programs of one engine, and the programs themselves."""

    def __init__(self, target: Any, drafter: Any, *, slots: int, max_len: int, gamma: int,
                 stop_ids: Sequence[int], verifier: Callable[..., Any], cache_dtype: str | None = None,
                 mesh: jax.sharding.Mesh | None = None, max_logprobs: int = 0, top_k_cap: int = DEFAULT_TOP_K_CAP,
                 attention: str = "xla", mlp: str = "xla", penalties: bool = False, logit_bias: bool = False,
                 guided_choice: bool = False, guided_regex: bool = False, automaton_states: int = 0,
                 guided_drafts: bool = True, prediction_tokens: int = 0, acceptance_estimate: bool = False,
                 allocate: bool = True):
        # allocate False: the state is abstract (ShapeDtypeStructs; models from nnx.eval_shape and an
        # explicit cache_dtype): such a runner only lowers programs (`lower`), e.g. for bench.round_ops;
        # guided_regex: a table of `automaton_states` states over the target's vocabulary (`set_automata`),
        # drafts drawn under the rows' automata unless guided_drafts is False; prediction_tokens: predicted
        # tokens each row holds (0: no predictions); acceptance_estimate: draft confidences from the online
        # acceptance estimate (`decoding.acceptance`)
        self.mesh, self.gamma, self.max_len = mesh, gamma, max_len
        if guided_regex and automaton_states < 1:
            raise ValueError(f"guided_regex needs automaton_states >= 1, got {automaton_states}")
        vocab = getattr(drafter, "draft_vocab", None)  # q travels over it from draft to verify
        self.q_cols = target.config.vocab_size if vocab is None else vocab.size
        self.q_dtype = jnp.dtype(getattr(drafter, "dtype", jnp.float32))  # ... in the drafter's dtype
        make = (lambda f: f()) if allocate else jax.eval_shape
        t_graph, t_params = nnx.split(target)
        cache = make(lambda: target.init_cache(slots, max_len, dtype=cache_dtype))
        if drafter is not None:
            d_graph, d_params = nnx.split(drafter)
            dstate = make(lambda: drafter.init_state(slots, max_len))
        else:
            d_graph, d_params, dstate = None, nnx.State({}), ()
        anchors = make(lambda: jnp.zeros((slots,), jnp.int32))
        row_state = make(self._rows(slots, target.config.vocab_size, drafter is not None, penalties, logit_bias,
                                    guided_choice, guided_regex and automaton_states, prediction_tokens,
                                    max(gamma, 1) if acceptance_estimate else 0))
        shardings: dict[str, Any] = {}
        if mesh is not None:
            t_params = shd.shard_state(t_params, mesh, "serve")
            d_params = shd.shard_state(d_params, mesh, "serve")
            cache_axes, dstate_axes = _cache_axes(cache), _slot_axes(dstate)
            cache = shd.shard_tree(cache, cache_axes, mesh, "serve")
            dstate = shd.shard_tree(dstate, dstate_axes, mesh, "serve")
            anchors = shd.place(anchors, shd.replicated(mesh))
            row_state = shd.place(row_state, shd.replicated(mesh))
            shardings = dict(cache_shardings=shd.tree_shardings(cache, cache_axes, mesh, "serve"),
                             dstate_shardings=shd.tree_shardings(dstate, dstate_axes, mesh, "serve"),
                             replicated=shd.replicated(mesh))
        self.t_params, self.d_params, self.cache, self.dstate, self.anchors = t_params, d_params, cache, dstate, anchors
        self.row_state = row_state
        stops = np.asarray(tuple(stop_ids) or (-1,), np.int32)
        self.stop_ids = self._resident(stops) if allocate else self._abstract(stops)
        tap_layers = tuple(drafter.tap_layers) if drafter is not None else ()
        needs_hidden = bool(getattr(drafter, "needs_hidden", False))
        self.platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        if attention == "pallas":
            check_head_dim(target.config.head_dim, self.platform)
        if mlp == "pallas":
            check_mlp_sizes(target.config.hidden_size, target.config.intermediate_size)
        ctx = programs.Context(t_graph, d_graph, tap_layers, needs_hidden, gamma, max_len, verifier, max_logprobs,
                               top_k_cap, attention, mlp, guided_regex and guided_drafts, **shardings)
        self.exes = {name: Executables(name, ctx) for name in FAMILIES}

    def _rows(self, slots: int, vocab: int, drafting: bool, penalties: bool, logit_bias: bool, guided_choice: bool,
              automaton_states: int, prediction_tokens: int, estimate_gamma: int) -> Callable[[], RowState]:
        """Sets the per-call input widths of the rules served (automaton_states: the table's with
        guided_regex, else 0) and predictions; returns what builds the slots' row state for them and the
        acceptance estimate."""
        if not drafting and prediction_tokens:
            raise ValueError("prediction_tokens needs a drafter (predicted tokens are drafted in its rounds; "
                             "drafter='ngram' for predictions and prompt lookup alone)")
        self.automaton_shape = (automaton_states, vocab) if automaton_states else (0, 0)
        self.bias_cols = vocab if logit_bias else 0
        self.choice_shape = (ROW_CHOICES, CHOICE_TOKENS) if guided_choice else (0, 0)
        self.pred_cols = prediction_tokens
        return lambda: RowState.init(slots, vocab if penalties else 0, self.bias_cols, guided_choice,
                                     self.automaton_shape, prediction_tokens, estimate_gamma)

    @property
    def cache_lengths(self) -> jax.Array:
        return self.cache.lengths

    def set_automata(self, next_nv: np.ndarray, final_n: np.ndarray, allowed_nw: np.ndarray) -> None:
        """Replace the automaton table (`decoding.automata.AutomatonTable`'s host copy: next states,
        accepting states, allowed tokens packed): later calls read it; a call already dispatched keeps
        the one it was given."""
        if next_nv.shape != self.automaton_shape or allowed_nw.shape != self.row_state.fsm_allowed_nw.shape:
            raise ValueError(f"automaton table {next_nv.shape} / {allowed_nw.shape} differs from the engine's "
                             f"{self.automaton_shape}")
        self.row_state = self.row_state._replace(fsm_next_nv=self._resident(next_nv.astype(np.int16)),
                                                 fsm_final_n=self._resident(final_n.astype(bool)),
                                                 fsm_allowed_nw=self._resident(allowed_nw.astype(np.uint32)))

    def run(self, family: str, key: tuple[Any, ...], **inputs: Any) -> Any:
        """Call `family`'s executable for bucket `key` with the resident state and `inputs` (numpy
        arrays are copied in); state outputs replace the state. Returns the other outputs (one, or a tuple)."""
        fam = FAMILIES[family]
        missing = set(fam.args) - set(STATE) - set(inputs)
        if missing or set(inputs) - set(fam.args):
            raise TypeError(f"{family} takes inputs {[a for a in fam.args if a not in STATE]}, got {sorted(inputs)}")
        args = [getattr(self, a) if a in STATE else self.put(inputs[a]) for a in fam.args]
        rest = []
        for name, value in zip(fam.returns, self.exes[family](key, *args)):
            if name in STATE:
                setattr(self, name, value)
            else:
                rest.append(value)
        return rest[0] if len(rest) == 1 else tuple(rest)

    def warm(self, keys: Sequence[tuple[str, tuple[Any, ...]]], *, threads: int | None = None,
             progress: bool = True, maps_by_family: dict[str, float] | None = None) -> float:
        """Compile every (family, bucket key) ahead. Returns seconds spent.

        Tracing runs in order on this thread; with `threads` > 1 that many threads then compile the
        lowered executables at once (XLA compiles without the GIL). Default: one per CPU core, at
        most 4 (a 30-layer target's bucket takes seconds to compile on a small CPU). On XLA:CPU a
        warm-up that would pass the process's memory mappings stops with `map_budget.ProgramBudgetError`
        (before compiling when `maps_by_family`, from `maps_by_family()`, projects it)."""
        from concurrent.futures import ThreadPoolExecutor

        from tqdm.auto import tqdm
        from specjax.decoding import compile_cache
        if threads is None:
            threads = max(1, min(4, os.cpu_count() or 1))
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        compile_cache.enable()  # a second start loads the executables from disk
        t0 = time.perf_counter()
        compiled = {f: set(e.keys) for f, e in self.exes.items()}
        todo = [f for f, key in keys if key not in compiled[f]]
        expected = None if not maps_by_family else sum(maps_by_family.get(f, max(maps_by_family.values()))
                                                       for f in todo)
        guard = map_budget.WarmupGuard(len(todo), self.platform, expected)  # before tracing: may stop at once
        jobs = [(self.exes[family], key, self.lower(family, key))
                for family, key in tqdm(keys, desc="tracing buckets", disable=not progress, leave=False)]
        bar = tqdm(total=len(jobs), desc="compiling buckets", disable=not progress, leave=False)

        def install(job: tuple[Executables, tuple[Any, ...], Any]) -> None:
            job[0].install(job[1], job[2])
            if job[2] is not None:
                guard.installed()  # stops before XLA:CPU runs out of memory mappings
            bar.update(1)
        if threads == 1:
            for job in jobs:
                install(job)
        else:
            pool = ThreadPoolExecutor(threads)
            try:
                for future in [pool.submit(install, job) for job in jobs]:
                    future.result()  # re-raises the first failure
            finally:  # after a failure no queued program starts compiling
                pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        return time.perf_counter() - t0

    def maps_by_family(self, keys: Sequence[tuple[str, tuple[Any, ...]]]) -> dict[str, float] | None:
        """On XLA:CPU where the process's mapping limit is known (`map_budget`): compile the last key
        of each family in `keys` alone and return the memory mappings each took; else None."""
        if self.platform != "cpu" or map_budget.map_limit() is None:
            return None
        last = {family: key for family, key in keys}
        out: dict[str, float] = {}
        for family, key in last.items():
            lowered = self.lower(family, key)
            before = map_budget.mapped_regions()
            self.exes[family].install(key, lowered)
            after = map_budget.mapped_regions()
            if lowered is not None and before is not None and after is not None:
                out[family] = float(max(after - before, 1))
        return out or None

    def lower(self, family: str, key: tuple[Any, ...]) -> Any:
        """Lower one bucket key from the family's argument layout (abstract state, INPUTS shapes);
        None when that key is compiled already."""
        fam = FAMILIES[family]
        dims = dict(zip(fam.bucket, key), gamma=max(self.gamma, 1), q_dtype=self.q_dtype, bias_cols=self.bias_cols,
                    words=(ROW_BAD_WORDS, BAD_WORD_TOKENS) if self.bias_cols else (0, 0), choices=self.choice_shape,
                    pred_cols=self.pred_cols)
        dims["q_cols"] = programs.carried_q_columns(dims.get("variant"), self.q_cols)
        sharding = None if self.mesh is None else shd.replicated(self.mesh)

        def arg(name: str) -> Any:
            if name in STATE:
                return abstract(getattr(self, name))
            shape, dtype = INPUTS[name](dims)
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        return self.exes[family].lower(key, *map(arg, fam.args), **{f: dims[f] for f in fam.static})

    def compile_counts(self) -> dict[str, int]:
        """Executables per family: set at warm-up, never grown by a call."""
        return {name: len(e.keys) for name, e in self.exes.items()}

    def put(self, x: Any) -> Any:
        """A per-call host input; device arrays pass through. On one device the numpy array itself:
        the compiled call copies it in for a fraction of a separate device_put's cost (which is ~5%
        of a small batch's step). The call may still be running when this returns (the engine
        dispatches a round before reading the previous one): callers never write to an array
        after passing it."""
        return self._resident(x) if self.mesh is not None and isinstance(x, np.ndarray) else x

    def _abstract(self, x: np.ndarray) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=None if self.mesh is None else shd.replicated(self.mesh))

    def _resident(self, x: np.ndarray) -> Any:
        """A device array that stays (replicated over the mesh when there is one)."""
        return jax.device_put(x) if self.mesh is None else jax.device_put(x, shd.replicated(self.mesh))


def _cache_axes(cache: kvc.KVCache) -> kvc.KVCache:
    return kvc.KVCache(kv=tuple(kvc.KV_AXES for _ in cache.kv), lengths=kvc.LENGTHS_AXES)


def _slot_axes(tree: Any) -> Any:
    """Logical axes of a drafter state: `cache_batch` on each leaf's slot axis (`kvc.slot_axes`)."""
    return jax.tree.map(lambda x, a: (None,) * a + ("cache_batch",) + (None,) * (x.ndim - a - 1), tree,
                        kvc.slot_axes(tree))
