"""The pure device functions the runner compiles, one per executable family (see runner.FAMILIES).

Each takes a `Context` (the static parts: module graphs, tap layers, gamma, the verifier, state
shardings) and arrays only; the tokens-per-slot bucket of a round arrives as the static `tokens`,
the round's sampling variant (sampling.VARIANTS, picked by the host from every row's parameters) as
the static `variant` and whether any row asked for log-probabilities as the static `logprobs` (a
round without such a row computes no vocabulary-wide log-softmax or top-N): no program branches on
the rows' sampling parameters except the filtered variant's exact fallback (see
sampling.probs_from_logits). Prefill samples in the filtered variant.
The programs that run the target over its cache (prefill, lite, fused, fused_fill, verify) attend to
its rows [0:attn] only: the static `attn`, an attention bucket the host picks to cover every
participating row's length plus the tokens it writes (writes still reach the whole cache).
A round, for the rows [0:sb] of the slots:
  draft   -> tokens, q (float32, over the drafter's draft vocabulary when it has one: see
             decoding/verify.py) and confidences for every row, from its anchor (with automata and
             `Context.guided_drafts`, drawn only from what each row's automaton allows);
  verify  -> one target pass over [anchor, d_1..d_{tb-1}] (tb = tokens bucket >= 1 + max ell),
             exact chain rejection sampling, commit: cache lengths += accepted + 1, drafter context
             appended with the anchor and accepted drafts, new anchor = the corrected/bonus token.
`score` (echo's prompt log-likelihoods) is a cache-free target pass that touches no state.
`fused` is draft and verify in one call (lengths known before drafting); `fused_fill` is draft,
the device-side choice of lengths from the fresh confidences and verify in one call (the async
policy); `lite` is a plain decoding step that taps nothing and leaves the drafter's context behind.
Each slot's row state (`RowState`: active, round counter, tokens still wanted, draft cap, whether
eos ends it, tokens still to emit before a stop id may be drawn (min_tokens) and the row's own stop
ids, sampling parameters, key) is resident on the device: prefill writes it at admission,
`release` clears a row's active flag when the host ends a request the device cannot see end (a stop
string, a request's own stop ids), and every round advances it (counter; tokens wanted; active off
after a global stop id unless the row ignores them (ignore_eos), the last wanted token, or a full
cache), so the host can dispatch a round before reading the previous one. A round's per-call input
is the host's plan ell_b [sb] (plus fused_fill's k_total_1 and verify's draft), an upper bound the
device caps by each row's draft cap, room in the cache and tokens still wanted; its outputs come
back as one int32 array (`ROUND_COLUMNS`, then the tokens, then the confidences' float32 bits), plus
the log-probabilities when `logprobs`. Prefill takes ints_4b = (n_valid, slot, start, top_k),
floats_3b = (temperature, top_p, min_p), the rows' raw key data keys_b2, limits_4b = (max_tokens, draft
cap, eos_stops, min_tokens) and stops_bk, the rows' own stop ids (-1 padding; rows with min_tokens).
While a row has emitted fewer than min_tokens tokens, every program that samples it gives its stop ids
(the engine's eos ids unless it ignores them, and its own) probability zero at those positions.
Prefill also takes pens_3b = (presence, frequency, repetition penalty), bias_bv [P, V] (logit_bias,
-inf outside allowed_token_ids and at one-token bad words), words_bwl [P, ROW_BAD_WORDS,
BAD_WORD_TOKENS] (multi-token bad words), choices_bcl [P, ROW_CHOICES, CHOICE_TOKENS] (guided
choices), fsm_start_b [P] (the initial state of the row's automaton in the table, -1: none) and
pred_bl [P, L] (the row's predicted tokens, -1 padding), read when the row state holds penalties /
logit bias / choices / an automaton table / predictions (an engine built with them; zero-width
otherwise): every sampled position's logits then get the row's bias and bad words,
its choices (only a token that continues one, or a stop id after a whole one), its automaton (only
a token it allows, or a stop id in an accepting state), then vLLM's
penalties from its prompt tokens and its output up to that position (its committed output and the
drafts before it; `row_state.target_rules`). A row with a prediction drafts its next predicted tokens
while its output follows them (`decoding.prediction`); every round counts the predicted drafts it
verified and accepted. With the online acceptance estimate (`decoding.acceptance`: an engine whose
policy reads confidences its drafter does not give) the drafts carry it as their confidences and
every verified round updates it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.decoding import logit_rules as lr
from specjax.decoding import row_state as rs
from specjax.decoding.row_state import RowState
from specjax.decoding.verify import VerifyResult
from specjax.drafters.base import ContextUpdate, DraftBlock
from specjax.drafters.drafting import DraftGuide
from specjax.models import cache as kvc
from specjax.sampling import DEFAULT_TOP_K_CAP, SamplingArrays, probs_from_logits, round_key, sample

Array = jax.Array

# the leading columns of a round's packed int32 outputs [sb, C]; tokens [tb] follow, then (drafting
# families) the float32 bits of the gamma confidences. "live": the row is still active afterwards;
# "pred_accepted" / "pred_drafted": predicted drafts accepted / verified (row_state.tally_predictions)
ROUND_COLUMNS = ("num_emitted", "num_accepted", "stopped", "ell", "live", "pred_accepted", "pred_drafted")
@dataclasses.dataclass(frozen=True, eq=False)
class Context:
    """What the programs close over: static for the life of an engine. Compared and hashed by value
    (module graphs, verifier function, shardings...): engines with equal contexts and shapes share
    one trace, lowering and executable per bucket (it is the programs' static argument, runner)."""

    t_graph: Any
    d_graph: Any  # None without a drafter
    tap_layers: tuple[int, ...]
    needs_hidden: bool
    gamma: int
    max_len: int
    verifier: Callable[..., VerifyResult]
    max_logprobs: int = 0  # top alternatives computed per emitted token (0: no log-probabilities)
    top_k_cap: int = DEFAULT_TOP_K_CAP  # the filtered variant's lax.top_k size
    attention: str = "xla"  # cached attention (the target's, and a drafter's that has it): XLA's ops or Pallas kernels
    mlp: str = "xla"  # gate/up products and SiLU gate (the target's, and a drafter's that has it): XLA's ops or the kernel
    guided_drafts: bool = False  # drafters draw only tokens the rows' automata allow (drafting.DraftGuide)
    cache_shardings: Any = None  # state shardings under a mesh (None without one)
    dstate_shardings: Any = None
    replicated: Any = None

    def _value(self) -> tuple[Any, ...]:
        """Every field as (tree structure, leaves): hashable also where a field is a dict of shardings."""
        out = []
        for f in dataclasses.fields(self):
            leaves, treedef = jax.tree.flatten(getattr(self, f.name))
            out.append((treedef, tuple(leaves)))
        return tuple(out)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Context) and self._value() == other._value()

    def __hash__(self) -> int:
        return hash(self._value())

    def drafter(self, d_params: Any) -> Any:
        return nnx.merge(self.d_graph, d_params)

    def constrain(self, cache: Any, dstate: Any, anchors: Array) -> tuple[Any, Any, Array]:
        """Keep the state's shardings fixed across calls (the compiled executables require them)."""
        if self.replicated is None:
            return cache, dstate, anchors
        cache = jax.lax.with_sharding_constraint(cache, self.cache_shardings)
        if dstate is not None:  # None: a lite round, which does not carry the drafter's state
            dstate = jax.lax.with_sharding_constraint(dstate, self.dstate_shardings)
        return cache, dstate, jax.lax.with_sharding_constraint(anchors, self.replicated)

    def replicate(self, tree: Any) -> Any:
        """Keep a replicated state (the row state) replicated under a mesh."""
        return tree if self.replicated is None else jax.lax.with_sharding_constraint(tree, self.replicated)

    def gamma_columns(self, conf_bk: Array) -> Array:
        """The first gamma confidence columns: a block drafter may draft past gamma, and every round
        reports (and schedules on) gamma columns whichever program produced them."""
        return conf_bk[:, : max(self.gamma, 1)]


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


def _filtered_sampling(ctx: Context, ints_4b: Array, floats_3b: Array) -> SamplingArrays:
    """Per-row sampling of the programs that always sample in the filtered variant (prefill, score),
    with the engine's top-k cap."""
    return SamplingArrays(floats_3b[0], ints_4b[3], floats_3b[1], floats_3b[2], "filtered", ctx.top_k_cap)


def _unpack(ctx: Context, rows: RowState, ell_b: Array, lengths_b: Array, variant: str
            ) -> tuple[Array, Array, SamplingArrays, Array, Array]:
    """A round's rows [0:sb] from the resident row state: (ell, active, sampling, draft keys, verify
    keys). ell is the host's plan capped by each row's draft cap, room in the cache (`lengths_b`)
    and tokens still wanted, 0 for inactive rows: the caps hold however stale the host's view."""
    sb = ell_b.shape[0]
    ints = rows.ints_7s[:, :sb]
    active = ints[0] > 0
    cap = jnp.minimum(jnp.minimum(ints[4], ctx.max_len - 1 - lengths_b), ints[3] - 1)
    ell = jnp.where(active, jnp.clip(jnp.minimum(ell_b, cap), 0), 0)
    fl = rows.floats_3s[:, :sb]
    sa = SamplingArrays(fl[0], ints[2], fl[1], fl[2], variant, ctx.top_k_cap)
    keys = round_key(jax.random.wrap_key_data(rows.keys_s2[:sb]), ints[1] + 1)
    return ell, active, sa, round_key(keys, 0), round_key(keys, 1)


def _is_stop(tokens_b: Array, stop_be: Array) -> Array:
    return jnp.any((tokens_b[:, None] == stop_be) & (stop_be >= 0), axis=-1)


def _row_stops(stop_ids_e: Array, eos_stops_b: Array) -> Array:
    """Each row's stop ids [b, E]: the engine's, or none (-1 padding) for a row with eos_stops 0."""
    return jnp.where(eos_stops_b[:, None] > 0, stop_ids_e[None, :], -1)


def _advance(ctx: Context, rows: RowState, res: VerifyResult, active_b: Array, new_len_b: Array,
             stop_be: Array) -> tuple[RowState, Array, Array]:
    """The row state after a round: counter + 1 and tokens wanted - emitted for active rows, which
    stay active unless they emitted one of their stop ids, want no more tokens, or their cache is full.
    Returns (rows, emitted [sb], live [sb])."""
    sb = active_b.shape[0]
    emitted = jnp.where(active_b, res.num_emitted, 0)
    remaining = rows.ints_7s[3, :sb] - emitted
    ended = res.stopped_on_draft | _is_stop(res.next_token, stop_be)
    live = active_b & ~ended & (remaining > 0) & (new_len_b + 1 <= ctx.max_len)
    min_left = jnp.maximum(rows.ints_7s[6, :sb] - emitted, 0)
    ints = (rows.ints_7s.at[0, :sb].set(live.astype(jnp.int32)).at[1, :sb].add(active_b.astype(jnp.int32))
            .at[3, :sb].set(remaining).at[6, :sb].set(min_left))
    return ctx.replicate(rows._replace(ints_7s=ints)), emitted, live


def _pack(emitted, res: VerifyResult, ell_b, live_b, predicted_2b: tuple[Array, Array],
          conf_bg: Array | None = None) -> Array:
    """A round's int outputs as one int32 [sb, C] array (ROUND_COLUMNS, tokens, confidence bits)."""
    cols = jnp.stack([emitted, res.num_accepted, res.stopped_on_draft, ell_b, live_b, *predicted_2b],
                     axis=1).astype(jnp.int32)
    parts = [cols, res.tokens.astype(jnp.int32)]
    if conf_bg is not None:
        parts.append(jax.lax.bitcast_convert_type(conf_bg.astype(jnp.float32), jnp.int32))
    return jnp.concatenate(parts, axis=1)


def unpack_round(packed_bc: np.ndarray, tb: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray | None]:
    """The host's view of `_pack`'s array: (ROUND_COLUMNS by name, tokens [sb, tb], confidences
    [sb, gamma] float32 or None when the family reports none)."""
    n = len(ROUND_COLUMNS)
    cols = {name: packed_bc[:, j] for j, name in enumerate(ROUND_COLUMNS)}
    conf = np.ascontiguousarray(packed_bc[:, n + tb:]).view(np.float32) if packed_bc.shape[1] > n + tb else None
    return cols, packed_bc[:, n:n + tb], conf


def release(ctx: Context, rows: RowState, free_s: Array) -> tuple[RowState]:
    """Clear the active flag of the rows with free_s > 0 (requests the host ended). A 1-tuple."""
    return (ctx.replicate(rows._replace(ints_7s=rows.ints_7s.at[0].set(
        jnp.where(free_s > 0, 0, rows.ints_7s[0])))),)


def copy_slot(ctx: Context, cache, dstate, anchors, src_dst_2: Array):
    """Slot src's cache rows and drafter state copied into slot dst (src_dst_2 = (src, dst)): a prompt
    that begins with a busy slot's prompt starts from its rows (prefix caching; the prefill after it
    sets the lengths and cuts the drafter's state back). Returns (cache, dstate, anchors)."""
    def one(x: Array, axis: int) -> Array:
        row = jax.lax.dynamic_index_in_dim(x, src_dst_2[0], axis=axis, keepdims=True)
        return jax.lax.dynamic_update_index_in_dim(x, row, src_dst_2[1], axis=axis)
    cache = jax.tree.map(one, cache, kvc.slot_axes(cache))
    dstate = jax.tree.map(one, dstate, kvc.slot_axes(dstate))
    return ctx.constrain(cache, dstate, anchors)


def _taps_update(ctx: Context, out: Any, tokens: Array, positions: Array, n_valid: Array) -> ContextUpdate:
    taps = jnp.concatenate(out.taps, axis=-1) if out.taps else None
    return ContextUpdate(tokens=tokens, positions=positions, taps=taps,
                         hidden=out.hidden if ctx.needs_hidden else None, n_valid=n_valid)


def _verify_commit(ctx: Context, t_params, d_params, cache, dstate, anchors, rows, draft_bg, q_bgn, ell_b, active_b,
                   sa, keys_b, stop_ids, tb: int, attn: int, logprobs: bool, maintain: bool = True,
                   conf_bg: Array | None = None):
    """Target pass over [anchor, drafts[:tb-1]], exact acceptance, commit. Returns new state + outputs
    (packed, see `_pack`; with the emitted tokens' log-probabilities when `logprobs`). With
    `maintain` False (a lite round) the target taps nothing and the drafter's context is left
    behind: those rows may not draft again (see `RoundPlanner.fresh`)."""
    target = nnx.merge(ctx.t_graph, t_params)
    sb = ell_b.shape[0]
    anchor_b = anchors[:sb]
    start_b = cache.lengths[:sb]
    toks = anchor_b[:, None] if tb == 1 else jnp.concatenate([anchor_b[:, None], draft_bg[:, :tb - 1]], 1)
    positions = start_b[:, None] + jnp.arange(tb, dtype=jnp.int32)[None, :]
    ell_b = jnp.where(active_b, jnp.minimum(ell_b, tb - 1), 0)
    out = target.forward(toks, positions, cache, ell_b + 1, tap_layers=ctx.tap_layers if maintain else (),
                         logits="all", kv_len=attn, attention=ctx.attention, mlp=ctx.mlp)
    stop_be = _row_stops(stop_ids, rows.ints_7s[5, :sb])
    logits = rs.target_rules(rows, out.logits, toks, stop_be)
    p = probs_from_logits(logits, sa)  # [sb, tb, V]
    q_ids = None if tb == 1 else _q_ids(ctx, d_params)
    if tb == 1:  # plain decoding: no drafts; the chain rule reduces to sampling from the target
        q_bgn = jnp.zeros((sb, 0, p.shape[-1]), jnp.float32)
        draft_bg = jnp.zeros((sb, 0), jnp.int32)
    res = ctx.verifier(keys_b, p, q_bgn[:, :tb - 1], draft_bg[:, :tb - 1], ell_b, stop_be, q_ids,
                       greedy=sa.greedy)
    n_commit = jnp.where(active_b, res.num_accepted + 1, 0)
    cache = out.cache.with_lengths(cache.lengths.at[:sb].set(start_b + n_commit))
    if ctx.d_graph is not None and maintain:
        dstate = ctx.drafter(d_params).commit(dstate, _taps_update(ctx, out, toks, positions, n_commit))
    new_anchor = jnp.where(active_b & (res.next_token >= 0), res.next_token, anchor_b)
    cache, dstate, anchors = ctx.constrain(cache, dstate, anchors.at[:sb].set(new_anchor))
    rows, emitted, live = _advance(ctx, rows, res, active_b, start_b + n_commit, stop_be)
    rows, *predicted = rs.tally_predictions(rows, draft_bg if tb > 1 else None, ell_b, res.num_accepted)
    if rows.estimated and tb > 1:  # rounds of predicted drafts say nothing of the drafter's
        rows = rs.observe_acceptance(rows, ell_b, res.num_accepted, active_b & (predicted[1] == 0))
    rows = ctx.replicate(rs.record_output(rows, res.tokens, emitted))
    outs = {"packed": _pack(emitted, res, ell_b, live, predicted, conf_bg)}
    if logprobs:
        outs.update(_logprobs(ctx, logits, sa, res.tokens))
    return cache, dstate, anchors, rows, outs


def _logprobs(ctx: Context, logits: Array, sa: SamplingArrays, tokens: Array, rank: bool = False) -> dict[str, Array]:
    """With `max_logprobs` K > 0: log-probabilities of `tokens` [B, T] and the top K alternatives under
    `logits` (the rows' logit rules applied, except in score) after the request's temperature, min-p,
    top-k and top-p (temperature 0 read as 1), at the positions that emitted them ({} when K = 0). Each position's distribution depends
    only on the prefix, so speculation does not change the values. Rounds call it only when their
    static `logprobs` is set; prefill (one position per prompt) and score always do."""
    if ctx.max_logprobs == 0:
        return {}
    variant = "plain" if sa.variant == "greedy" else sa.variant  # greedy rounds set no filter
    sa_lp = dataclasses.replace(sa, temperature=jnp.where(sa.temperature > 0, sa.temperature, 1.0), variant=variant)
    lp = jnp.log(probs_from_logits(logits, sa_lp))  # [B, T, V]
    tok = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    top_lp, top_id = jax.lax.top_k(lp, min(ctx.max_logprobs, lp.shape[-1]))
    out = {"logprob": tok, "top_logprob": top_lp, "top_id": top_id}
    if rank:  # 1 + the tokens more likely than each token
        out["rank"] = 1 + jnp.sum(lp > tok[..., None], axis=-1, dtype=jnp.int32)
    return out


def lite(ctx: Context, t_params, cache, anchors, rows, ell_b, stop_ids, *, logprobs: bool, attn: int, variant: str):
    """A plain decoding step that leaves the drafter alone (no drafter arguments to pass either)."""
    ell_b, active_b, sa, _, kv = _unpack(ctx, rows, ell_b, cache.lengths[:ell_b.shape[0]], variant)
    cache, _, anchors, rows, outs = _verify_commit(ctx, t_params, None, cache, None, anchors, rows, None, None,
                                                   ell_b, active_b, sa, kv, stop_ids, 1, attn, logprobs,
                                                   maintain=False)
    return cache, anchors, rows, outs


def fused(ctx: Context, t_params, d_params, cache, dstate, anchors, rows, ell_b, stop_ids, *,
          tokens: int, logprobs: bool, attn: int, variant: str):
    """Draft and verify in one call; `tokens` = 1 (an upkeep round) drafts nothing."""
    sb = ell_b.shape[0]
    ell_b, active_b, sa, kd, kv = _unpack(ctx, rows, ell_b, cache.lengths[:sb], variant)
    conf = jnp.zeros((sb, max(ctx.gamma, 1)), jnp.float32)
    draft_bg, q_bgn = None, None
    if tokens > 1:
        block = _block(ctx, d_params, dstate, anchors[:sb], cache.lengths[:sb], sa, kd, attn, rows,
                       _row_stops(stop_ids, rows.ints_7s[5, :sb]))
        draft_bg, q_bgn = block.tokens, _carried_q(block)
        if block.confidence is not None:
            conf = ctx.gamma_columns(block.confidence)
    return _verify_commit(ctx, t_params, d_params, cache, dstate, anchors, rows, draft_bg, q_bgn, ell_b, active_b,
                          sa, kv, stop_ids, tokens, attn, logprobs, conf_bg=conf)


def carried_q_columns(variant: str | None, n: int) -> int:
    """Columns of the q a draft carries to verify in a round of `variant`: n (the drafter's draft
    vocabulary or the target's), none in a greedy round (the greedy verifier reads no q)."""
    return 0 if variant == "greedy" else n


def _carried_q(block: DraftBlock) -> Array:
    """The q a block carries to verification: over the drafter's draft vocabulary when it has one
    ([B, G, N], columns `_q_ids`), else over the whole vocabulary ([B, G, V])."""
    return block.q if block.q_draft is None else block.q_draft


def _q_ids(ctx: Context, d_params) -> Array | None:
    """Target ids of the carried q's columns: the drafter's draft vocabulary, or None (all V)."""
    vocab = getattr(ctx.drafter(d_params), "draft_vocab", None)
    return None if vocab is None else vocab.d2t[...]


def _block(ctx: Context, d_params, dstate, anchor_b, lengths_b, sa, kd, attn: int, rows: RowState,
           stop_be: Array) -> DraftBlock:
    """The drafter's block for rows [0:B], its context read from rows [0:attn), with the engine's
    attention and MLP implementations when the drafter has them (`attention_implementations`,
    `mlp_implementations`); with automata (`ctx.guided_drafts`) drawn under each row's from its state
    and stop ids stop_be [B, E]; with the online acceptance estimate, its confidences
    (`row_state.estimate_confidence`); with predictions, an aligned row's predicted tokens
    (`row_state.predict_drafts`); with guided choices, the drafts they force (`row_state.guide_drafts`)."""
    drafter = ctx.drafter(d_params)
    kw = {name: choice for name, choice in (("attention", ctx.attention), ("mlp", ctx.mlp))
          if choice in getattr(drafter, f"{name}_implementations", ())}
    if ctx.guided_drafts and rows.automaton:
        b = anchor_b.shape[0]
        kw["guide"] = DraftGuide(rows.fsm_next_nv, rows.fsm_allowed_nw, rows.fsm_final_n, stop_be,
                                 rows.fsm_state_s[:b])
    block = drafter.propose(dstate, anchor_b, lengths_b, sa, kd, kv_len=attn, **kw)
    greedy = sa.variant == "greedy"  # the round carries no q: any token may be a draft
    if rows.estimated:
        block = rs.estimate_confidence(rows, block)
    if rows.predicted:
        block = rs.predict_drafts(rows, block, _q_ids(ctx, d_params), greedy)
    return rs.guide_drafts(rows, block, _q_ids(ctx, d_params), greedy) if rows.guided else block


def _propose(ctx: Context, d_params, dstate, anchors, cache_lengths, sa, kd, sb: int,
             attn: int, variant: str, rows: RowState, stop_ids: Array) -> tuple[Array, Array, Array]:
    """A block for rows [0:sb]: (tokens [sb, G], carried q [sb, G, N], gamma confidences [sb, gamma];
    all ones from a drafter without a confidence head). The drafter reads its context from rows
    [0:attn) (the attention bucket covers every row's committed length). A greedy round carries q
    without columns (`carried_q_columns`), so it is never built."""
    block = _block(ctx, d_params, dstate, anchors[:sb], cache_lengths[:sb], sa, kd, attn, rows,
                   _row_stops(stop_ids, rows.ints_7s[5, :sb]))
    conf = block.confidence if block.confidence is not None else jnp.ones(block.tokens.shape, jnp.float32)
    q = _carried_q(block)
    return block.tokens, q[:, :, :carried_q_columns(variant, q.shape[-1])], ctx.gamma_columns(conf)


def draft(ctx: Context, d_params, dstate, cache_lengths, anchors, rows, ell_b, stop_ids, *, attn: int, variant: str):
    """Propose a block for every row: (tokens [sb, G], q [sb, G, N] over the drafter's draft vocabulary
    (N = V without one), gamma confidences [sb, gamma]); context read from rows [0:attn)."""
    sb = ell_b.shape[0]
    _, _, sa, kd, _ = _unpack(ctx, rows, ell_b, cache_lengths[:sb], variant)
    return _propose(ctx, d_params, dstate, anchors, cache_lengths, sa, kd, sb, attn, variant, rows, stop_ids)


def verify(ctx: Context, t_params, d_params, cache, dstate, anchors, rows, draft_bg, q_bgn, ell_b, stop_ids, *,
           tokens: int, logprobs: bool, attn: int, variant: str):
    """Verify a `draft` call's blocks, each row's first ell = ell_b drafts (chosen on the host, capped
    on the device)."""
    ell_b, active_b, sa, _, kv = _unpack(ctx, rows, ell_b, cache.lengths[:ell_b.shape[0]], variant)
    return _verify_commit(ctx, t_params, d_params, cache, dstate, anchors, rows, draft_bg, q_bgn, ell_b, active_b, sa,
                          kv, stop_ids, tokens, attn, logprobs)


def fused_fill(ctx: Context, t_params, d_params, cache, dstate, anchors, rows, ell_b, k_total_1, stop_ids, *,
               tokens: int, logprobs: bool, attn: int, variant: str):
    """Draft, choose lengths and verify in one call (the async policy's drafting round): each row
    verifies its share of the top-`k_total_1[0]` fill of this round's prefix survivals
    (`topk_prefix_fill`), at most its bound ell_b (capped on the device). The packed outputs hold the
    lengths (column "ell") and the gamma confidences."""
    sb = ell_b.shape[0]
    ell_b, active_b, sa, kd, kv = _unpack(ctx, rows, ell_b, cache.lengths[:sb], variant)
    draft_bg, q_bgn, conf = _propose(ctx, d_params, dstate, anchors, cache.lengths, sa, kd, sb, attn, variant, rows,
                                     stop_ids)
    filled = topk_prefix_fill(conf, k_total_1[0], active_b & (ell_b > 0), tokens - 1)  # capped rows take none
    ell = jnp.where(active_b, jnp.minimum(filled, ell_b), 0)
    return _verify_commit(ctx, t_params, d_params, cache, dstate, anchors, rows, draft_bg, q_bgn, ell, active_b, sa,
                          kv, stop_ids, tokens, attn, logprobs, conf_bg=conf)


def prefill(ctx: Context, t_params, d_params, cache, dstate, anchors, rows, tokens_bt, ints_4b, floats_3b, keys_b2,
            limits_4b, stops_bk, pens_3b, bias_bv, words_bwl, choices_bcl, fsm_start_b, pred_bl, stop_ids, *,
            attn: int):
    """Prefill P prompt chunks into slots (an id >= slots marks a padding row); samples each first token
    and writes each row's state (active unless the first token ends the request, counter 0, tokens
    still wanted, draft cap, whether eos ends it, min_tokens still to emit, own stop ids, sampling
    parameters, key). Outputs: the first tokens [P, 1], "live" [P]."""
    target = nnx.merge(ctx.t_graph, t_params)
    pb, plen = tokens_bt.shape
    n_valid_p, slot_p, start_p = ints_4b[0], ints_4b[1], ints_4b[2]
    sa = _filtered_sampling(ctx, ints_4b, floats_3b)
    cache = cache.with_lengths(cache.lengths.at[slot_p].set(start_p, mode="drop"))
    positions = start_p[:, None] + jnp.arange(plen, dtype=jnp.int32)[None, :]
    out = target.forward(tokens_bt, positions, cache, n_valid_p, rows_b=slot_p, tap_layers=ctx.tap_layers,
                         logits="last", kv_len=attn, mlp=ctx.mlp)
    cache = out.cache
    if ctx.d_graph is not None:
        drafter = ctx.drafter(d_params)
        fresh = drafter.init_state(pb, ctx.max_len)
        axes = kvc.slot_axes(dstate)
        old = jax.tree.map(lambda x, a: jnp.take(x, slot_p, axis=a, mode="clip"), dstate, axes)
        first = start_p == 0

        def renew(f: Array, o: Array, a: int) -> Array:  # fresh state for the rows that start at 0
            return jnp.where(first.reshape((1,) * a + (pb,) + (1,) * (f.ndim - a - 1)), f, o)
        sub = jax.tree.map(renew, fresh, old, axes)
        if hasattr(drafter, "restart"):  # a row reusing a freed slot's rows (prefix caching) cuts back to start
            sub = drafter.restart(sub, start_p)
        sub = drafter.commit(sub, _taps_update(ctx, out, tokens_bt, positions, n_valid_p))
        dstate = jax.tree.map(lambda x, s_, a: x.at[(slice(None),) * a + (slot_p,)].set(s_, mode="drop"),
                              dstate, sub, axes)
    stop_pe = _row_stops(stop_ids, limits_4b[2])
    logits, prompt_pv = rs.prefill_logits(rows, out.logits, tokens_bt, ints_4b, pens_3b, bias_bv, choices_bcl,
                                         fsm_start_b, stop_pe)
    logits = lr.hold_stops(logits, jnp.concatenate([stop_pe, stops_bk], 1), limits_4b[3])
    p = probs_from_logits(logits[:, 0], sa)  # [P, V]
    tok = sample(round_key(jax.random.wrap_key_data(keys_b2), jnp.zeros((pb,), jnp.int32)), p)
    anchors = anchors.at[slot_p].set(tok, mode="drop")
    cache, dstate, anchors = ctx.constrain(cache, dstate, anchors)
    live = (limits_4b[0] > 1) & ~_is_stop(tok, stop_pe)
    ints = jnp.stack([live.astype(jnp.int32), jnp.zeros_like(tok), ints_4b[3], limits_4b[0] - 1, limits_4b[1],
                      limits_4b[2], jnp.maximum(limits_4b[3] - 1, 0)])
    rows = rows._replace(ints_7s=rows.ints_7s.at[:, slot_p].set(ints, mode="drop"),
                         floats_3s=rows.floats_3s.at[:, slot_p].set(floats_3b, mode="drop"),
                         keys_s2=rows.keys_s2.at[slot_p].set(keys_b2, mode="drop"),
                         stops_sk=rows.stops_sk.at[slot_p].set(stops_bk, mode="drop"))
    rows = ctx.replicate(rs.admit_rules(rows, slot_p, tok, pens_3b, prompt_pv, bias_bv, words_bwl, choices_bcl,
                                        fsm_start_b, pred_bl))
    return cache, dstate, anchors, rows, {"tokens": tok[:, None], "live": live,
                                          **_logprobs(ctx, logits, sa, tok[:, None])}


def score(ctx: Context, t_params, tokens_bt, ints_4b, floats_3b):
    """Prompt log-likelihoods, cache-free (no state touched): position t of row p holds the
    `_logprobs` entries of token t + 1 given tokens 0..t, with its rank. ints_4b = (n_valid, -, -, top_k).
    Returns a 1-tuple (the runner's output layout)."""
    target = nnx.merge(ctx.t_graph, t_params)
    positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
    out = target.forward(tokens_bt, positions, None, ints_4b[0], logits="all", mlp=ctx.mlp)
    sa = _filtered_sampling(ctx, ints_4b, floats_3b)
    nxt = jnp.concatenate([tokens_bt[:, 1:], jnp.zeros_like(tokens_bt[:, :1])], axis=1)
    return (_logprobs(ctx, out.logits, sa, nxt, rank=True),)
