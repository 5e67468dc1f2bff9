"""The n-gram (prompt lookup) drafter: what it proposes from its own history and, with `cross_slot`,
from the other slots' histories (other requests' text, freed slots' kept rows); exactness in the
engine and a speed-up from another request's answer, with the own-history search as the control."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ConfigError
from specjax.decoding.engine import EngineRequest
from specjax.drafters import registry
from specjax.drafters.base import ContextUpdate
from specjax.drafters.ngram import NGramDrafter
from specjax.sampling import SamplingArrays

from engine_fixtures import small_engine, tiny_target
from test_engine import greedy_reference

V = 16


def _propose(drafter, histories, anchors, kv_len=None, temperature=0.0):
    """The tokens proposed for rows of `histories` (each committed whole) with their `anchors`."""
    b, m = len(histories), 12
    state = drafter.init_state(b, m)
    width = max(len(h) for h in histories)
    tokens = np.zeros((b, width), np.int32)
    for r, h in enumerate(histories):
        tokens[r, :len(h)] = h
    n_valid = jnp.array([len(h) for h in histories], jnp.int32)
    state = drafter.commit(state, ContextUpdate(jnp.asarray(tokens), None, None, None, n_valid))
    block = drafter.propose(state, jnp.array(anchors, jnp.int32), n_valid, SamplingArrays.broadcast(b, temperature=temperature),
                            jax.random.split(jax.random.key(0), b), kv_len=kv_len)
    return np.asarray(block.tokens).tolist()


def test_own_history_lookup_continues_the_latest_longest_match():
    d = NGramDrafter(V, gamma=3)
    # suffix (2, 3) with anchor 3: its latest earlier match ends at index 2, continued by 4, 5, then the anchor
    assert _propose(d, [[1, 2, 3, 4, 5, 2]], [3]) == [[4, 5, 2]]
    # no match: the anchor repeated (a draft the target will reject, never a wrong distribution)
    assert _propose(d, [[1, 2, 4]], [6]) == [[6, 6, 6]]


def test_cross_slot_lookup_reads_other_rows_and_prefers_longer_then_own_matches():
    own, cross = NGramDrafter(V, gamma=3), NGramDrafter(V, gamma=3, cross_slot=True)
    rows = [[9, 9, 1, 2, 3, 4, 5], [7, 1, 2]]  # row 1's suffix (1, 2, 3) only row 0 holds
    assert _propose(own, rows, [8, 3])[1] == [3, 3, 3]  # control: its own history has no 3 before the anchor
    # row 0's text after (1, 2, 3): 4, 5, and a continuation stops at row 0's last history token (not its anchor)
    assert _propose(cross, rows, [8, 3])[1] == [4, 5, 5]
    assert _propose(cross, rows, [8, 3])[0] == _propose(own, rows, [8, 3])[0]  # nothing for row 0 in row 1
    # equal lengths: the own match wins (row 1 holds (3, 6) itself; row 0 holds (2, 3) -> 4 too but n = 2 ties)
    assert _propose(cross, [[1, 2, 3, 4, 5], [2, 3, 6, 2]], [8, 3])[1] == [6, 2, 3]
    # a longer match in another row beats a shorter own one: (1, 2, 3) in row 0 over (2, 3) in row 1
    assert _propose(cross, [[1, 2, 3, 4, 5], [2, 3, 6, 1, 2]], [8, 3])[1] == [4, 5, 5]
    # the highest other slot at equal length
    assert _propose(cross, [[5, 1, 2], [5, 1, 3], [0, 0, 4]], [0, 0, 5])[2] == [1, 3, 3]
    # a sampled row reads its own history only (a seeded request's tokens must not depend on other requests)
    assert _propose(cross, rows, [8, 3], temperature=1.0)[1] == [3, 3, 3]
    # another row's text past the attention bucket (here 6 rows) is not read
    assert _propose(cross, [[9, 9, 1, 2, 3, 4, 5], [7, 1, 2]], [8, 3], kv_len=6)[1] == [4, 4, 4]


def test_cross_slot_round_trips_through_config_json(tmp_path):
    d = NGramDrafter(V, gamma=3, cross_slot=True)
    registry.save_drafter(d, str(tmp_path / "d"))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["cross_slot"] is True
    assert registry.load_drafter(str(tmp_path / "d"), target=None).cross_slot is True
    cfg["cross_slot"] = "yes"
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="field 'cross_slot' must be true or false"):
        registry.load_drafter(str(tmp_path / "d"), target=None)


@pytest.fixture(scope="module")
def target():
    return tiny_target(V, seed=5)


def _second_request(target, cross_slot: bool):
    """A runs; three rounds later B, of the same prompt (another user asking the same, an n > 1 at T=0),
    joins in the other slot: its greedy answer is A's, which A's row holds ahead of it."""
    engine = small_engine(target, NGramDrafter(V, gamma=3, cross_slot=cross_slot), slots=2, max_len=64,
                          policy="fixed", prefill=16, tokens_buckets=(4,), variants=("greedy",))
    a, b = (EngineRequest(rid, [1, 2, 3, 4, 5, 6], max_tokens=24, temperature=0.0) for rid in "ab")
    engine.add_request(a)
    for _ in range(3):
        engine.step()
    engine.add_request(b)
    while engine.has_work():
        engine.step()
    assert (a.slot, b.slot) == (0, 1) and a.finish_reason == b.finish_reason == "length"
    return a, b


def test_cross_slot_drafts_another_request_s_answer_exactly(target):
    _, b_own = _second_request(target, cross_slot=False)
    a, b = _second_request(target, cross_slot=True)
    assert b.output_ids == b_own.output_ids == a.output_ids == greedy_reference(target, b.prompt_ids, 24)
    # drafts copied from A's row are accepted beyond what B's own history gives (control: own history only)
    assert b.metrics.num_accepted_tokens > b_own.metrics.num_accepted_tokens
    assert b.metrics.num_rounds < b_own.metrics.num_rounds


def _asked_again(target, prefix_caching: bool):
    """One slot: A, then B of A's prompt; with prefix caching B restarts in A's rows and its history's
    stale tail is A's answer."""
    engine = small_engine(target, NGramDrafter(V, gamma=3), slots=1, max_len=64, policy="fixed", prefill=16,
                          tokens_buckets=(4,), variants=("greedy",), config={"prefix_caching": prefix_caching})
    a, b = (EngineRequest(rid, [1, 2, 3, 4, 5, 6], max_tokens=24, temperature=0.0) for rid in "ab")
    for r in (a, b):
        engine.run([r], progress=False)
    return a, b


def test_a_prompt_asked_again_drafts_the_stale_tail_of_its_slot(target):
    a, b = _asked_again(target, prefix_caching=True)
    _, b_whole = _asked_again(target, prefix_caching=False)  # control: a whole prefill, no stale tail
    assert b.metrics.cached_tokens == 5 and b_whole.metrics.cached_tokens == 0
    assert b.output_ids == b_whole.output_ids == a.output_ids == greedy_reference(target, a.prompt_ids, 24)
    # A's answer drafted whole: every round accepts all 3 drafts (the last one: what max_tokens leaves)
    assert set(b.metrics.per_step_accepted[:-1]) == {3}
    assert b.metrics.num_accepted_tokens > b_whole.metrics.num_accepted_tokens
    assert b.metrics.num_rounds < b_whole.metrics.num_rounds


def test_restart_keeps_what_the_row_held_past_it_as_a_stale_tail():
    d = NGramDrafter(V, gamma=3)
    state = d.init_state(2, 12)
    toks = jnp.array([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 0, 0, 0, 0]], jnp.int32)
    state = d.commit(state, ContextUpdate(toks, None, None, None, jnp.array([7, 3], jnp.int32)))
    state = d.restart(state, jnp.array([2, 1], jnp.int32))
    assert state.lengths.tolist() == [2, 1] and state.stale_end.tolist() == [7, 3]

    def propose(temperature):
        block = d.propose(state, jnp.array([3, 9], jnp.int32), state.lengths,
                          SamplingArrays.broadcast(2, temperature=temperature), jax.random.split(jax.random.key(0), 2))
        return np.asarray(block.tokens).tolist()
    # row 0: (2, 3) held at index 2 past the restart: 4, 5, 6 follow; row 1: 9 nowhere, the anchor repeated
    assert propose(0.0) == [[4, 5, 6], [9, 9, 9]]
    assert propose(1.0) == [[3, 3, 3], [9, 9, 9]]  # sampled rows: their own history only
