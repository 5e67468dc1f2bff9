"""Each slot's row state resident on the device (`RowState`), and the logit rules it carries applied
to the target's logits: a row's logit bias and bad words (an engine with logit_bias), its guided
choices (an engine with guided_choice), its token automaton (an engine with guided_regex), its
penalties (an engine with penalties) and the min_tokens hold of its stop ids (every engine); besides
the rules, a row's predicted output (an engine with prediction_tokens: `prediction`) and its online
acceptance estimate (an engine whose policy reads confidences its drafter does not give:
`acceptance`). A rule is on when its state is (an engine without it carries None there, a static part
of the programs' pytrees), so the programs pass no flags. The rules' arithmetic is `logit_rules`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.decoding import acceptance as ac
from specjax.decoding import logit_rules as lr
from specjax.decoding import prediction as pr

Array = jax.Array

# RowState.ints_7s rows; eos_stops: 1 if the engine's stop ids (eos) end the row, 0 (ignore_eos) if not;
# min_left: tokens the row must still emit before one of its stop ids may be drawn (min_tokens)
ROW_INTS = ("active", "count", "top_k", "remaining", "draft_cap", "eos_stops", "min_left")
ROW_STOP_IDS = 8  # own stop ids a row holds on the device (RowState.stops_sk): those min_tokens holds back


class RowState(NamedTuple):
    """Per-slot row state resident on the device (see programs' module docstring)."""

    ints_7s: Array  # int32 [7, slots]: ROW_INTS (count = rounds run; remaining = tokens still wanted)
    floats_3s: Array  # float32 [3, slots]: temperature, top_p, min_p
    keys_s2: Array  # uint32 [slots, 2]: raw threefry key data of each row's base key
    stops_sk: Array  # int32 [slots, ROW_STOP_IDS]: the row's own stop ids, -1 padding (set with min_tokens)
    # with penalties only
    pens_3s: Array | None = None  # float32 [3, slots]: presence, frequency, repetition penalty
    counts_sv: Array | None = None  # int32 [slots, V]: output token counts
    prompt_sv: Array | None = None  # bool [slots, V]: the prompt's tokens
    # with logit_bias only
    bias_sv: Array | None = None  # float32 [slots, V]: logit_bias, allowed_token_ids, one-token bad words
    words_swl: Array | None = None  # int32 [slots, ROW_BAD_WORDS, BAD_WORD_TOKENS]: multi-token bad words
    tail_sl: Array | None = None  # int32 [slots, BAD_WORD_TOKENS - 1]: the last output tokens, -1 padding
    # with guided_choice only
    choices_scl: Array | None = None  # int32 [slots, ROW_CHOICES, CHOICE_TOKENS]: token ids, -1 padding
    alive_sc: Array | None = None  # bool [slots, ROW_CHOICES]: the choices the output so far begins
    pos_s: Array | None = None  # int32 [slots]: output tokens so far
    # with guided_regex only: the engine's automaton table (every loaded automaton's states, each at its
    # offset; `decoding.automata`) and each row's state in it
    fsm_next_nv: Array | None = None  # int16 [N, V]: the state after each token, -1 where not allowed
    fsm_final_n: Array | None = None  # bool [N]: accepting states (a stop id is allowed there)
    fsm_allowed_nw: Array | None = None  # uint32 [N, ceil(V/32)]: fsm_next_nv >= 0 packed (automata.pack_allowed)
    fsm_state_s: Array | None = None  # int32 [slots]: the state after the row's output, -1: none
    # with prediction_tokens only (`decoding.prediction`)
    pred_sl: Array | None = None  # int32 [slots, L]: the row's predicted tokens, -1 padding
    pred_ints_4s: Array | None = None  # int32 [4, slots]: prediction.PRED_INTS
    pred_last_s: Array | None = None  # int32 [slots]: the row's last output token
    # with the online acceptance estimate only (`decoding.acceptance`)
    accept_sg: Array | None = None  # float32 [slots, gamma]: each row's estimate per draft position
    accept_g: Array | None = None  # float32 [gamma]: the engine's, from which admitted rows start

    @classmethod
    def init(cls, slots: int, penalty_vocab: int = 0, bias_vocab: int = 0, guided: bool = False,
             automaton_shape: tuple[int, int] = (0, 0), prediction_tokens: int = 0,
             estimate_gamma: int = 0) -> "RowState":
        """Empty rows; `penalty_vocab` / `bias_vocab` the target's vocabulary with penalties / logit
        bias, else 0 (no state for them); `guided`: state for guided choices; `automaton_shape`
        (states, V) of the automaton table with guided_regex, else (0, 0): an empty table;
        `prediction_tokens`: predicted tokens a row holds (0: none); `estimate_gamma`: draft positions of
        the online acceptance estimate (0: none)."""
        floats = jnp.asarray([[1.0], [1.0], [0.0]], jnp.float32) * jnp.ones((1, slots), jnp.float32)
        rows = cls(jnp.zeros((len(ROW_INTS), slots), jnp.int32), floats,
                   jnp.zeros((slots, 2), jnp.uint32), jnp.full((slots, ROW_STOP_IDS), -1, jnp.int32))
        if penalty_vocab:
            pens = jnp.asarray([[0.0], [0.0], [1.0]], jnp.float32) * jnp.ones((1, slots), jnp.float32)
            rows = rows._replace(pens_3s=pens, counts_sv=jnp.zeros((slots, penalty_vocab), jnp.int32),
                                 prompt_sv=jnp.zeros((slots, penalty_vocab), bool))
        if bias_vocab:
            rows = rows._replace(bias_sv=jnp.zeros((slots, bias_vocab), jnp.float32),
                                 words_swl=jnp.full((slots, lr.ROW_BAD_WORDS, lr.BAD_WORD_TOKENS), -1, jnp.int32),
                                 tail_sl=jnp.full((slots, lr.BAD_WORD_TOKENS - 1), -1, jnp.int32))
        if guided:
            rows = rows._replace(choices_scl=jnp.full((slots, lr.ROW_CHOICES, lr.CHOICE_TOKENS), -1, jnp.int32),
                                 alive_sc=jnp.zeros((slots, lr.ROW_CHOICES), bool),
                                 pos_s=jnp.zeros((slots,), jnp.int32))
        if automaton_shape[0]:
            rows = rows._replace(fsm_next_nv=jnp.full(automaton_shape, -1, jnp.int16),
                                 fsm_final_n=jnp.zeros(automaton_shape[:1], bool),
                                 fsm_allowed_nw=jnp.zeros((automaton_shape[0], -(-automaton_shape[1] // 32)),
                                                          jnp.uint32),
                                 fsm_state_s=jnp.full((slots,), -1, jnp.int32))
        if prediction_tokens:
            rows = rows._replace(pred_sl=jnp.full((slots, prediction_tokens), -1, jnp.int32),
                                 pred_ints_4s=pr.admit(jnp.zeros((slots,), bool)),
                                 pred_last_s=jnp.full((slots,), -1, jnp.int32))
        if estimate_gamma:
            rows_sg, engine_g = ac.init(slots, estimate_gamma)
            rows = rows._replace(accept_sg=rows_sg, accept_g=engine_g)
        return rows

    @property
    def penalties(self) -> bool:
        return self.counts_sv is not None

    @property
    def logit_bias(self) -> bool:
        return self.bias_sv is not None

    @property
    def guided(self) -> bool:
        return self.choices_scl is not None

    @property
    def automaton(self) -> bool:
        return self.fsm_next_nv is not None

    @property
    def predicted(self) -> bool:
        return self.pred_sl is not None

    @property
    def estimated(self) -> bool:
        return self.accept_sg is not None


def target_rules(rows: RowState, logits_btv: Array, toks_bt: Array, stop_be: Array) -> Array:
    """The rules of rows [0:b] on a verify pass's logits [b, t, V] over toks [anchor, d_1..d_{t-1}]:
    logit bias and bad words, guided choices and the token automaton (ended by the stop ids stop_be
    [b, E]), penalties, the
    min_tokens hold of stop_be and the row's own stop ids."""
    b = toks_bt.shape[0]
    if rows.logit_bias:
        logits_btv = lr.ban_bad_words(lr.add_bias(logits_btv, rows.bias_sv[:b]), rows.words_swl[:b], rows.tail_sl[:b],
                                      toks_bt[:, 1:])
    if rows.guided:
        logits_btv = lr.guide_choices(logits_btv, rows.choices_scl[:b], rows.alive_sc[:b], rows.pos_s[:b],
                                      toks_bt[:, 1:], stop_be)
    if rows.automaton:
        path_bt = lr.automaton_path(rows.fsm_next_nv, rows.fsm_state_s[:b], toks_bt[:, 1:])
        logits_btv = lr.guide_automaton(logits_btv, rows.fsm_allowed_nw, rows.fsm_final_n, path_bt, stop_be)
    if rows.penalties:
        logits_btv = lr.penalize(logits_btv, rows.counts_sv[:b], rows.prompt_sv[:b], rows.pens_3s[:, :b], toks_bt)
    return lr.hold_stops(logits_btv, jnp.concatenate([stop_be, rows.stops_sk[:b]], 1), rows.ints_7s[6, :b])


def record_output(rows: RowState, tokens_bt: Array, emitted_b: Array) -> RowState:
    """Rows [0:b] after emitting their first emitted_b tokens of tokens_bt: the penalties' output
    counts, the bad words' tails, the choices the output still begins, the automaton states."""
    if rows.penalties:
        rows = rows._replace(counts_sv=lr.count_emitted(rows.counts_sv, tokens_bt, emitted_b))
    if rows.logit_bias:
        rows = rows._replace(tail_sl=lr.push_tail(rows.tail_sl, tokens_bt, emitted_b))
    if rows.guided:
        b = tokens_bt.shape[0]
        alive, pos = lr.advance_choices(rows.choices_scl[:b], rows.alive_sc[:b], rows.pos_s[:b], tokens_bt, emitted_b)
        rows = rows._replace(alive_sc=rows.alive_sc.at[:b].set(alive), pos_s=rows.pos_s.at[:b].set(pos))
    if rows.automaton:
        b = tokens_bt.shape[0]
        state = lr.advance_automaton(rows.fsm_next_nv, rows.fsm_state_s[:b], tokens_bt, emitted_b)
        rows = rows._replace(fsm_state_s=rows.fsm_state_s.at[:b].set(state))
    if rows.predicted:
        b = tokens_bt.shape[0]
        ints, last = pr.advance(rows.pred_sl[:b], rows.pred_ints_4s[:, :b], rows.pred_last_s[:b], tokens_bt, emitted_b)
        rows = rows._replace(pred_ints_4s=rows.pred_ints_4s.at[:, :b].set(ints), pred_last_s=rows.pred_last_s.at[:b].set(last))
    return rows


def tally_predictions(rows: RowState, draft_bg: Array, ell_b: Array, accepted_b: Array
                      ) -> tuple[RowState, Array, Array]:
    """Rows [0:b] after a verified round, with their predicted drafts counted (`prediction.tally`; before
    `record_output` moves the rows on). Returns (rows, accepted predicted drafts [b], predicted drafts
    verified [b]); zeros without predictions."""
    b = ell_b.shape[0]
    if not rows.predicted or draft_bg is None:
        zero = jnp.zeros((b,), jnp.int32)
        return rows, zero, zero
    ints, accepted, drafted = pr.tally(rows.pred_sl[:b], rows.pred_ints_4s[:, :b], draft_bg, ell_b, accepted_b)
    return rows._replace(pred_ints_4s=rows.pred_ints_4s.at[:, :b].set(ints)), accepted, drafted


def observe_acceptance(rows: RowState, ell_b: Array, accepted_b: Array, counted_b: Array) -> RowState:
    """Rows [0:b] and the engine after a verified round, with the online acceptance estimate updated
    (`acceptance.observe`; rows with counted_b False leave it)."""
    b = ell_b.shape[0]
    rows_bg, engine_g = ac.observe(rows.accept_sg[:b], rows.accept_g, ell_b, accepted_b, counted_b)
    return rows._replace(accept_sg=rows.accept_sg.at[:b].set(rows_bg), accept_g=engine_g)


def estimate_confidence(rows: RowState, block: Any) -> Any:
    """A DraftBlock for rows [0:b] whose confidences are the rows' online acceptance estimates (the
    last position's for a block longer than the estimate)."""
    b, g = block.tokens.shape
    est = rows.accept_sg[:b]
    est = jnp.concatenate([est, jnp.repeat(est[:, -1:], max(g - est.shape[1], 0), axis=1)], axis=1)[:, :g]
    return block._replace(confidence=est)


def _holdable(tokens_bg: Array, q_ids: Array | None) -> Array:
    """Whether the carried q can hold each token (all can without a draft vocabulary `q_ids`)."""
    held = tokens_bg >= 0
    if q_ids is not None:
        held = held & jnp.any(q_ids[None, None, :] == tokens_bg[:, :, None], axis=-1)
    return held


def _force(block: Any, tokens_bg: Array, keep_bg: Array, q_ids: Array | None, conf_bg: Array) -> Any:
    """`block` with tokens_bg where keep_bg (q one-hot there, confidence conf_bg), the drafter's elsewhere."""
    def one_hot(q: Array | None, ids: Array) -> Array | None:
        if q is None:
            return None
        return jnp.where(keep_bg[:, :, None], (ids[None, None, :] == tokens_bg[:, :, None]).astype(q.dtype), q)
    conf = None if block.confidence is None else jnp.where(keep_bg, conf_bg, block.confidence)
    q_draft = None if q_ids is None else one_hot(block.q_draft, q_ids)
    return block._replace(tokens=jnp.where(keep_bg, tokens_bg, block.tokens), confidence=conf, q_draft=q_draft,
                          q=one_hot(block.q, jnp.arange(block.q.shape[-1])))


def predict_drafts(rows: RowState, block: Any, q_ids: Array | None, greedy: bool = False) -> Any:
    """A DraftBlock for rows [0:b] whose drafts are each aligned row's next predicted tokens
    (`prediction.drafts`; q one-hot there, confidence the row's record), up to the first one q cannot
    hold (outside the draft vocabulary `q_ids`; any in a `greedy` round, which reads no q) or the
    row's automaton does not allow (a row following one: verification would reject it), then the
    drafter's (confidence PAST_CONFIDENCE in a row that drafted predicted tokens). Any proposal keeps
    verification exact."""
    b, g = block.tokens.shape
    predicted = pr.drafts(rows.pred_sl[:b], rows.pred_ints_4s[0, :b], g)
    held = _holdable(predicted, None if greedy else q_ids)
    if rows.automaton:
        state_b = rows.fsm_state_s[:b]
        path = lr.automaton_path(rows.fsm_next_nv, state_b, predicted)[:, 1:]
        held = held & ((path >= 0) | (state_b[:, None] < 0))
    keep = jnp.cumprod(held, axis=1).astype(bool)
    conf = jnp.broadcast_to(pr.confidence(rows.pred_ints_4s[:, :b])[:, None], keep.shape)
    block = _force(block, predicted, keep, q_ids, conf)
    if block.confidence is None:
        return block
    past = ~keep & keep[:, :1]
    return block._replace(confidence=jnp.where(past, pr.PAST_CONFIDENCE, block.confidence))


def guide_drafts(rows: RowState, block: Any, q_ids: Array | None, greedy: bool = False) -> Any:
    """A DraftBlock for rows [0:b] with the drafts its rows' guided choices force
    (`logit_rules.forced_choice_tokens`; q one-hot there, confidence 0.999), up to the first forced
    token q cannot hold (outside the draft vocabulary `q_ids`; any in a `greedy` round, which reads
    no q); the drafter's beyond. Any proposal keeps verification exact; a forced one is always accepted."""
    b, g = block.tokens.shape
    forced = lr.forced_choice_tokens(rows.choices_scl[:b], rows.alive_sc[:b], rows.pos_s[:b], g)
    keep = jnp.cumprod(_holdable(forced, None if greedy else q_ids), axis=1).astype(bool)
    return _force(block, forced, keep, q_ids, jnp.full(forced.shape, 0.999, jnp.float32))


def prefill_logits(rows: RowState, logits_p1v: Array, tokens_bt: Array, ints_4b: Array, pens_3b: Array,
                   bias_bv: Array, choices_bcl: Array, fsm_start_b: Array, stop_pe: Array) -> tuple[Array, Array | None]:
    """Prefill's first-token logits [P, 1, V] under the rows' bias (no bad word hits an empty output),
    guided choices (their first tokens), automata (from their initial states fsm_start_b [P], -1:
    none) and penalties (from the prompt so far: earlier chunks'
    tokens, none for a row that starts at 0, and this chunk's; no output yet); ints_4b = (n_valid,
    slot, start, -). Returns (logits, the prompt's tokens [P, V] with penalties, else None)."""
    if rows.logit_bias:
        logits_p1v = lr.add_bias(logits_p1v, bias_bv)
    if rows.guided:
        pb = logits_p1v.shape[0]
        logits_p1v = lr.guide_choices(logits_p1v, choices_bcl, choices_bcl[:, :, 0] >= 0, jnp.zeros((pb,), jnp.int32),
                                      jnp.zeros((pb, 0), jnp.int32), stop_pe)
    if rows.automaton:
        logits_p1v = lr.guide_automaton(logits_p1v, rows.fsm_allowed_nw, rows.fsm_final_n, fsm_start_b[:, None],
                                        stop_pe)
    if not rows.penalties:
        return logits_p1v, None
    (pb, plen), v = tokens_bt.shape, logits_p1v.shape[-1]
    n_valid_p, slot_p, start_p = ints_4b[0], ints_4b[1], ints_4b[2]
    old = jnp.take(rows.prompt_sv, slot_p, axis=0, mode="clip") & (start_p > 0)[:, None]
    chunk = jnp.where(jnp.arange(plen)[None, :] < n_valid_p[:, None], tokens_bt, v)
    prompt_pv = old.at[jnp.arange(pb)[:, None], chunk].set(True, mode="drop")
    return lr.penalty(logits_p1v, jnp.zeros((pb, 1, v), jnp.int32), prompt_pv[:, None], pens_3b), prompt_pv


def admit_rules(rows: RowState, slot_p: Array, tok_p: Array, pens_3b: Array, prompt_pv: Array | None,
                bias_bv: Array, words_bwl: Array, choices_bcl: Array, fsm_start_b: Array, pred_bl: Array
                ) -> RowState:
    """The admitted rows' rule state (slots slot_p; an id past the last is dropped): penalties and
    prompt tokens, bias and bad words, choices, automaton states (from fsm_start_b), predicted tokens
    pred_bl [P, L] (-1 padding), and the first token tok_p as the output so far."""
    pb = tok_p.shape[0]
    fresh = RowState.init(pb, rows.counts_sv.shape[-1] if rows.penalties else 0,
                          rows.bias_sv.shape[-1] if rows.logit_bias else 0, rows.guided)
    if rows.guided:
        fresh = fresh._replace(choices_scl=choices_bcl, alive_sc=choices_bcl[:, :, 0] >= 0)
    if rows.predicted:
        fresh = fresh._replace(pred_sl=pred_bl, pred_ints_4s=pr.admit(pred_bl[:, 0] >= 0),
                               pred_last_s=jnp.full((pb,), -1, jnp.int32))
    fresh = record_output(fresh, tok_p[:, None], jnp.ones_like(tok_p))
    if rows.automaton:
        first = lr.advance_automaton(rows.fsm_next_nv, fsm_start_b, tok_p[:, None], jnp.ones_like(tok_p))
        rows = rows._replace(fsm_state_s=rows.fsm_state_s.at[slot_p].set(first, mode="drop"))
    if rows.penalties:
        rows = rows._replace(pens_3s=rows.pens_3s.at[:, slot_p].set(pens_3b, mode="drop"),
                             counts_sv=rows.counts_sv.at[slot_p].set(fresh.counts_sv, mode="drop"),
                             prompt_sv=rows.prompt_sv.at[slot_p].set(prompt_pv, mode="drop"))
    if rows.logit_bias:
        rows = rows._replace(bias_sv=rows.bias_sv.at[slot_p].set(bias_bv, mode="drop"),
                             words_swl=rows.words_swl.at[slot_p].set(words_bwl, mode="drop"),
                             tail_sl=rows.tail_sl.at[slot_p].set(fresh.tail_sl, mode="drop"))
    if rows.guided:
        rows = rows._replace(choices_scl=rows.choices_scl.at[slot_p].set(choices_bcl, mode="drop"),
                             alive_sc=rows.alive_sc.at[slot_p].set(fresh.alive_sc, mode="drop"),
                             pos_s=rows.pos_s.at[slot_p].set(fresh.pos_s, mode="drop"))
    if rows.estimated:  # an admitted row starts at the engine's estimate
        rows = rows._replace(accept_sg=rows.accept_sg.at[slot_p].set(
            jnp.broadcast_to(rows.accept_g, (pb,) + rows.accept_g.shape), mode="drop"))
    if rows.predicted:
        rows = rows._replace(pred_sl=rows.pred_sl.at[slot_p].set(pred_bl, mode="drop"),
                             pred_ints_4s=rows.pred_ints_4s.at[:, slot_p].set(fresh.pred_ints_4s, mode="drop"),
                             pred_last_s=rows.pred_last_s.at[slot_p].set(fresh.pred_last_s, mode="drop"))
    return rows
