"""Drafting under the rows' token automata (guided_regex / guided_json, `drafting.DraftGuide`): every
drafter draws only the tokens its row's automaton allows after the drafts before (a stop id where it
accepts), from its q renormalised over them, and carries that q to verification; a row without an
automaton, or whose state allows none of the drafter's columns, drafts as before. In the engine a
drafter whose favourite token is never allowed has every draft accepted (none without the guide), the
output unchanged; sampled output keeps the guided law (chi-square). Negative controls: free drafts
(`guided_drafts=False`) are all rejected; a q that forgets the automaton fails the law."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.decoding.automata import pack_allowed
from specjax.drafters import drafting
from specjax.drafters.base import ContextUpdate
from specjax.drafters.drafting import DraftGuide
from specjax.drafters.dspark import BlockDrafterConfig, make_block_drafter
from specjax.sampling import SamplingArrays, draft_probs

from engine_fixtures import BigramDrafter, chi_square_pvalue
from test_drafters_lossless import make
from test_guided_regex import GAMMA, PROMPT, SIX, V, _engine, _law, _sampled, automaton, guided_case, small_target

KINDS = ["dspark", "dspark-vocab", "dspark-rnn", "dflash", "eagle3", "mtp1", "standalone"]
# over 8 tokens, stop id 0: 0 -{3,4}-> 1 -{2,6}-> 2 (accepting) -{5}-> 2; state 3 allows only 4
GUIDE_A = automaton({0: {3: 1, 4: 1}, 1: {2: 2, 6: 2}, 2: {5: 2}, 3: {4: 2}}, {2}, 8, "guide")
DRAFT_IDS = np.array([0, 1, 2, 3, 5, 6, 7])  # dspark-vocab's draft vocabulary: no 4 (state 3 allows none of it)
STATES = np.array([0, -1, 2, 3], np.int32)  # rows: start, no automaton, accepting, nothing in the columns


def _drafter(kind: str, target):
    if kind != "dspark-vocab":
        return make(kind, target)
    cfg = BlockDrafterConfig.from_target(target.config, target_layer_ids=(0, 1), mask_token_id=7, num_draft_layers=1,
                                         block_size=GAMMA, markov_rank=8, confidence_head=True,
                                         draft_vocab_size=len(DRAFT_IDS))
    return make_block_drafter(target, target.config, cfg, nnx.Rngs(4), draft_ids=DRAFT_IDS)


@pytest.fixture(scope="module")
def case():
    return guided_case()


@pytest.fixture(scope="module")
def small():
    return small_target()


@pytest.fixture(scope="module")
def target():
    from engine_fixtures import tiny_target
    return tiny_target(8, seed=11, layers=3, init_scale=3.0)


def _proposals(kind: str, target, sa: SamplingArrays):
    """(guided block, free block, free logits [B, G, V]) for four rows in STATES."""
    drafter = _drafter(kind, target)
    b = len(STATES)
    toks = jnp.asarray(np.random.default_rng(2).integers(1, 8, (b, 10)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (b, 10))
    n_valid = jnp.array([10, 9, 10, 8], jnp.int32)
    out = target.forward(toks, pos, valid_b=n_valid, tap_layers=drafter.tap_layers)
    taps = jnp.concatenate(out.taps, -1) if out.taps else None
    state = drafter.commit(drafter.init_state(b, 32), ContextUpdate(toks, pos, taps, out.hidden, n_valid))
    keys = jax.random.split(jax.random.key(7), b)
    anchor = toks[jnp.arange(b), n_valid - 1]
    guide = DraftGuide(jnp.asarray(GUIDE_A.next_nv), jnp.asarray(pack_allowed(GUIDE_A.next_nv)),
                       jnp.asarray(GUIDE_A.final_n), jnp.zeros((b, 1), jnp.int32),
                       jnp.asarray(STATES))
    guided = drafter.propose(state, anchor, n_valid, sa, keys, guide=guide)
    free, z = drafter.propose_with_logits(state, anchor, n_valid, sa, keys)
    return guided, free, np.asarray(z, np.float64)


def _allowed(s: int, cols: np.ndarray) -> np.ndarray:
    """The columns (target ids `cols`) state s allows: its tokens, the stop id 0 where it accepts; all
    of them without a state or where it allows none."""
    ok = np.array([GUIDE_A.next_nv[s, c] >= 0 or (c == 0 and GUIDE_A.final_n[s]) for c in cols]) if s >= 0 \
        else np.ones(len(cols), bool)
    return ok if ok.any() else np.ones(len(cols), bool)


@pytest.mark.parametrize("kind", KINDS)
def test_each_drafter_draws_what_its_rows_automata_allow_from_its_q_renormalised(kind, target):
    sa = SamplingArrays.broadcast(len(STATES), temperature=1.0)
    guided, free, z = _proposals(kind, target, sa)
    cols = DRAFT_IDS if kind == "dspark-vocab" else np.arange(8)
    tokens, q = np.asarray(guided.tokens), np.asarray(guided.q, np.float64)
    parallel = kind == "dflash"  # no sequential head: its logits do not depend on the drafts before
    for i, s0 in enumerate(STATES):
        s = int(s0)
        for k in range(tokens.shape[1]):  # MTP-1 drafts one
            ok = _allowed(s, cols)
            assert ok[list(cols).index(tokens[i, k])], (kind, i, k, s, tokens[i])
            assert np.all(q[i, k, cols[~ok]] == 0) and np.all(q[i, k, np.setdiff1d(np.arange(8), cols)] == 0)
            if k == 0 or parallel:  # same logits as the free proposal: q is its q renormalised over `ok`
                want = np.exp(z[i, k, cols] - z[i, k, cols][ok].max()) * ok
                np.testing.assert_allclose(q[i, k, cols], want / want.sum(), rtol=2e-5, atol=1e-6,
                                           err_msg=f"{kind} row {i} step {k}")
            s = int(GUIDE_A.next_nv[s, tokens[i, k]]) if s >= 0 else -1
    np.testing.assert_array_equal(tokens[1], np.asarray(free.tokens)[1])  # no automaton: as without a guide
    if kind == "dspark-vocab":  # state 3 allows none of its columns: as without a guide
        np.testing.assert_array_equal(tokens[3], np.asarray(free.tokens)[3])


@pytest.mark.parametrize("kind", ["dspark-vocab", "eagle3"])
def test_greedy_drafts_are_the_best_allowed_token(kind, target):
    sa = SamplingArrays.broadcast(len(STATES), temperature=0.0)
    guided, free, z = _proposals(kind, target, sa)
    cols = DRAFT_IDS if kind == "dspark-vocab" else np.arange(8)
    best = [cols[np.argmax(np.where(_allowed(int(s), cols), z[i, 0, cols], -np.inf))] for i, s in enumerate(STATES)]
    np.testing.assert_array_equal(np.asarray(guided.tokens)[:, 0], best)
    assert not np.array_equal(np.asarray(free.tokens)[:, 0], best)  # the guide changed some draw


# ---------------------------------------------------------------------------- in the engine
def _decoy_drafter(guided_ref: list[int]) -> BigramDrafter:
    """A bigram drafter whose favourite successor of every token is 61 (never allowed by SIX), then
    the token's successors in the guided reference in their order there (the automaton's state tells
    which is next: e.g. 30 is followed by 30 five times, then by 51, which is where 30 is not allowed)."""
    table = np.zeros((V, V), np.float32)
    table[:, 61] = 30.0
    chain = [PROMPT[-1]] + guided_ref
    for a in set(chain):
        successors = list(dict.fromkeys(b for x, b in zip(chain, chain[1:]) if x == a))
        table[a, successors] = 20.0 - np.arange(len(successors))
    drafter = BigramDrafter(V, GAMMA)
    drafter.table[...] = table
    return drafter


@pytest.mark.parametrize("guided_drafts", [True, False])
def test_guided_drafts_are_accepted_where_free_ones_never_are(case, guided_drafts):
    from specjax.decoding.engine import EngineRequest
    model, plain, guided_ref = case
    eng = _engine(model, _decoy_drafter(guided_ref), guided_drafts=guided_drafts)
    guided = EngineRequest("g", PROMPT, max_tokens=len(guided_ref) + 2, temperature=0.0, automaton=SIX)
    free = EngineRequest("f", PROMPT, max_tokens=6, temperature=0.0)
    eng.run([guided, free], progress=False)
    assert guided.output_ids == guided_ref and free.output_ids == plain[:6]
    m = guided.metrics
    assert m.num_draft_tokens >= GAMMA
    if guided_drafts:
        assert m.num_accepted_tokens == m.num_draft_tokens, m.as_dict()
    else:  # the negative control: the decoy is drafted and never accepted
        assert m.num_accepted_tokens == 0, m.as_dict()
    assert free.metrics.num_accepted_tokens == 0  # the unguided row drafted the decoy either way


def _q_forgets_the_automaton(key, z_bn, sa, dtype):
    """The planted bug: draws under the automaton, but the q reported gives its masked tokens their
    free mass (logit 0 here)."""
    d, q = _draft_draw(key, z_bn, sa, dtype)
    return d, draft_probs(jnp.where(jnp.isneginf(z_bn), 0.0, z_bn), sa, dtype)


_draft_draw = drafting.draft_draw


def test_sampled_outputs_with_guided_drafts_follow_the_law_and_a_q_that_forgets_the_automaton_does_not(
        small, monkeypatch):
    """The law test of test_guided_regex runs with guided drafts (the engine's default); here its
    control: a drafter reporting q without the automaton's mask biases the output."""
    monkeypatch.setattr(drafting, "draft_draw", _q_forgets_the_automaton)
    assert chi_square_pvalue([tuple(o[:3]) for o in _sampled(small, 1500, 2 * 10**6)], _law(small)) < 1e-3
