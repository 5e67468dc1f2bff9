"""Prefix caching (`decoding.prefix_cache`): a request whose prompt begins with what a freed slot's
cache rows hold goes to that slot and prefills only the rest, restarting on the last shared token;
every drafter's state is cut back to the restart (`restart`). A request whose prompt begins with a
busy slot's prompt starts from a copy of its rows.

The engine tests run a conversation: request A; then two identical requests B whose prompt is A's
prompt, A's answer and a new turn, side by side: one reuses A's slot, the other prefills whole in the
other slot; then two Cs whose prompt is B's with the start of B's answer edited and a new turn (a
prefix shorter than what the slot holds). For plain decoding and each kind of restart (KINDS) each
pair decodes the same greedy tokens (the target's), accepts the same drafts round by round, ends with
the same target cache rows and proposes the same next block; a request arriving while another of the
same system prompt runs (Eagle3) does all this as it does alone in an engine without prefix caching.
Negative controls: a drafter whose restart keeps its old state, a restart on the first token not
shared (no re-read: a pair-cache drafter then pairs a feature with the token the slot held there), a
slot's record left stale after a later request wrote its rows, and a missing copy each make the two
differ."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding.engine import EngineRequest
from specjax.decoding.prefix_cache import SlotPrefixes, shared_prefix
from specjax.drafters import dspark
from specjax.models import cache as kvc
from specjax.sampling import SamplingArrays

from engine_fixtures import small_engine, tiny_target
from test_drafters_lossless import V, make
from test_engine import greedy_reference

# the restarts: dspark's (DFlash's, DSpark-RNN's) and the standalone LM's cut K/V rows (kvc.cut_rows), the n-gram
# history, and Eagle3's (MTP-1's) pair cache
KINDS = [None, "ngram", "dspark", "eagle3"]
PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]
TURN, EDIT = [3, 4, 5], [6, 6]
N_A, N_B, KEEP = 6, 8, 3  # tokens of A, of each B and C; of B's answer C keeps


def test_choice_takes_the_longest_shared_prefix_and_restarts_on_its_last_token():
    assert shared_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert shared_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert shared_prefix(np.array([], np.int64), np.array([1])) == 0
    p = SlotPrefixes(5)
    assert p.choose([1, 2, 3], [2, 3]) == (2, 0, None)  # nothing kept: the first free slot
    p.keep(1, [1, 2, 3, 4, 9], rows=4)  # the last token's row was never written: not kept
    p.keep(2, [1, 2, 7], rows=3)
    p.keep(3, [1, 2, 3, 4, 5], rows=5)
    assert p.choose([1, 2, 3, 4, 9, 9], [0, 1, 2]) == (1, 3, None)  # 4 shared, restart on the 4th
    assert p.choose([1, 2, 3, 4, 5, 6], [0, 1, 2, 3]) == (3, 4, None)
    assert p.choose([1, 2, 3, 4, 5], [1, 3]) == (3, 4, None)  # a whole prompt kept: its last token prefills
    assert p.choose([1, 2, 8], [1, 2]) == (1, 1, None)  # a tie: the first free slot
    assert p.choose([5], [1, 2, 3]) == (1, 0, None)
    # a busy slot's prompt: copied into the first free slot when it gives more than the margin
    # slot 4 given to a request whose prefill is not dispatched yet: no source
    assert p.choose([1, 2, 3, 4, 5, 6, 7, 8], [0, 1]) == (1, 3, None)
    p.hold(4, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert p.choose([1, 2, 3, 4, 5, 6, 7, 8, 1], [0, 1]) == (0, 7, 4)
    assert p.choose([1, 2, 3, 4, 5, 6, 7, 8, 1], [0, 1], copy_margin=4) == (1, 3, None)  # 7 <= 3 + 4
    assert p.choose([1, 2, 3, 4, 5, 6, 7, 8, 1], [0, 3], copy_margin=4) == (3, 4, None)
    # slot 3 given to a request: its free record is neither free nor a source
    assert p.choose([1, 2, 3, 4, 5, 6], [0]) == (0, 5, 4)  # slot 3 gone; slot 4 holds the whole prompt
    p.forget_all()
    assert p.choose([1, 2, 3, 4, 5, 6], [1, 3]) == (1, 0, None)


def test_a_prompt_that_reuses_nothing_evicts_the_least_recently_used_slot_within_the_bucket():
    p = SlotPrefixes(8)
    for slot, tokens in ((2, [1, 2, 3]), (0, [4, 5, 6]), (1, [7, 8, 9])):  # freed in this order
        p.keep(slot, tokens, rows=3)
    assert p.choose([9, 9, 9], [0, 1, 2, 3]) == (3, 0, None)  # an empty slot first
    assert p.choose([9, 9, 9], [0, 1, 2]) == (2, 0, None)  # then the one freed longest ago
    p.keep(2, [1, 2, 3], rows=3)
    assert p.evict([0, 1, 2]) == 0
    # the slots bucket stays the one the lowest free slot runs in: below the bucket of the highest taken slot
    buckets = (1, 2, 4, 8)
    assert p.evict([0, 1, 2], buckets) == 0  # 3..7 taken: bucket 8
    assert p.evict([0, 1, 2, 5, 6, 7], buckets) == 5  # 3, 4 taken: bucket 8, an empty slot in it
    assert p.evict([0, 1, 2, 4, 5, 6, 7], buckets) == 0  # 3 taken: bucket 4
    p.keep(3, [5, 5, 5], rows=3)
    assert p.evict(list(range(8)), buckets) == 0  # nothing taken: bucket 1
    assert p.evict([1, 2, 3, 5, 6, 7], buckets) == 5  # 0, 4 taken: bucket 8
    assert p.evict([1, 2, 3], buckets) == 1  # 0 and 4..7 taken
    assert p.evict([2, 3], (1, 2, 4, 8)) == 2 and p.evict([1, 3], (1, 2, 4, 8)) == 1
    # a copy goes to the evicted slot too
    p.keep(0, [4, 5, 6], rows=3)
    p.hold(4, [6, 6, 6, 6, 6, 6, 6, 6])
    assert p.choose([6, 6, 6, 6, 6, 6, 6, 6, 1], [0, 1, 2, 3], slots_buckets=buckets) == (1, 7, 4)


def test_a_prompt_waits_for_the_next_batch_only_when_a_batch_prompt_gives_a_longer_copy():
    p, prompt = SlotPrefixes(4), [1, 2, 3, 4, 5, 6, 7, 8]
    assert p.copies_from(prompt, [prompt[:6] + [0, 0]], [1, 2, 3], copy_margin=3)  # restart 5 > 0 + 3
    assert not p.copies_from(prompt, [prompt[:4] + [0]], [1, 2, 3], copy_margin=3)  # 3: not more than the margin
    assert not p.copies_from(prompt, [[9, 9]], [1, 2, 3], copy_margin=0) and not p.copies_from(prompt, [], [1])
    p.hold(0, prompt[:6] + [0])  # a dispatched request already gives restart 5: no reason to wait
    assert not p.copies_from(prompt, [prompt[:6] + [0, 0]], [1, 2, 3], copy_margin=3)
    assert p.copies_from(prompt, [prompt + [0]], [1, 2, 3], copy_margin=1)  # 7 > 5 + 1


def test_a_large_batch_of_prompts_is_not_compared_pair_by_pair():
    """Admitting n prompts asks `copies_from` about each against the batch so far: it compares only
    batch prompts that start with the prompt's two tokens and could pass the margin, and stops at a
    whole-prompt match (control: the same question answered over every pair, as it was, compares
    them all and agrees)."""
    from specjax.decoding import prefix_cache

    calls = []
    counted = lambda a, b: calls.append(1) or shared_prefix(a, b)  # noqa: E731
    prompt = list(range(1, 13))
    batch = [[7, 7] + prompt] * 300 + [prompt[:3]] * 300 + [prompt] * 300  # other start, too short, whole
    free = [0, 1, 2, 3]
    prefix_cache.shared_prefix = counted
    try:
        assert SlotPrefixes(4).copies_from(prompt, batch, free, copy_margin=4)
        assert len(calls) == 1
        assert not SlotPrefixes(4).copies_from(prompt[:5], batch, free, copy_margin=4) and len(calls) == 1
        naive = max(counted(np.asarray(b), np.asarray(prompt)) - 1 for b in batch)
    finally:
        prefix_cache.shared_prefix = shared_prefix
    assert len(calls) == 1 + len(batch) and naive == len(prompt) - 1


@pytest.mark.parametrize("slots_buckets", [(2,), (1, 2)])
def test_a_conversation_keeps_its_slot_across_an_unrelated_request(target, slots_buckets):
    # A, then an unrelated request alone, then A's next turn: with one slots bucket the unrelated request
    # takes the empty slot and A's rows stay; control: with buckets (1, 2) it runs in bucket 1 (slot 0)
    engine = _engine(target, None, slots_buckets=slots_buckets)
    a = EngineRequest("a", PROMPT, max_tokens=N_A, temperature=0.0)
    engine.run([a], progress=False)
    other = EngineRequest("other", [6, 5, 7, 6, 5], max_tokens=N_A, temperature=0.0)
    engine.run([other], progress=False)
    b = EngineRequest("b", PROMPT + a.output_ids + TURN, max_tokens=N_B, temperature=0.0)
    engine.run([b], progress=False)
    assert b.output_ids == greedy_reference(target, b.prompt_ids, N_B)
    if slots_buckets == (2,):
        assert (a.slot, other.slot, b.slot) == (0, 1, 0) and b.metrics.cached_tokens == len(PROMPT) + N_A - 2
    else:
        assert (a.slot, other.slot) == (0, 0) and b.metrics.cached_tokens == 0


@pytest.fixture(scope="module")
def target():
    return tiny_target(V, seed=3)


def _engine(target, kind, slots=2, **config):
    """Greedy rounds of one width (gamma + 1: fewer programs to compile)."""
    drafter = None if kind is None else make(kind, target)
    return small_engine(target, drafter, slots=slots, max_len=64, policy="plain" if drafter is None else "fixed",
                        prefill=8, tokens_buckets=(1 if drafter is None else drafter.gamma + 1,),
                        variants=("greedy",), config=config or None)


def _proposal(engine, slot: int):
    """The block the drafter proposes from `slot`'s state and anchor (T = 1, a fixed key)."""
    state = jax.tree.map(lambda x, a: jnp.take(x, jnp.array([slot]), axis=a), engine.runner.dstate,
                         kvc.slot_axes(engine.runner.dstate))
    anchor = engine.runner.anchors[slot:slot + 1]
    position = jnp.array([engine.lengths[slot]], jnp.int32)
    block = engine.drafter.propose(state, anchor, position, SamplingArrays.broadcast(1, temperature=1.0),
                                   jax.random.split(jax.random.key(5), 1))
    return np.asarray(block.tokens), np.asarray(block.q)


def _pair(engine, prompt):
    """(reusing, whole-prefill) requests of `prompt` run side by side: slot 0 and slot 1."""
    if engine.prefixes is not None:  # one batch: the twin does not wait to copy the first one's rows
        engine.prefixes.copies_from = lambda *args: False
    reqs = [EngineRequest(f"r{i}", prompt, max_tokens=N_B, temperature=0.0) for i in range(2)]
    engine.run(reqs, progress=False)
    return sorted(reqs, key=lambda r: r.slot)


def _conversation(engine):
    """[(B reusing, B whole), (C reusing, C whole)] after A; each pair with its differences."""
    a = EngineRequest("a", PROMPT, max_tokens=N_A, temperature=0.0)
    engine.run([a], progress=False)
    assert a.slot == 0
    b = _pair(engine, PROMPT + a.output_ids + TURN)
    b_diff = _differences(engine, *b)
    engine.prefixes.keep(1, [], rows=0)  # slot 1 forgets its B: the second C prefills whole
    c = _pair(engine, b[0].prompt_ids + b[0].output_ids[:KEEP] + EDIT)
    return [(b, b_diff), (c, _differences(engine, *c))]


def _differences(engine, reused, whole, other=None) -> list[str]:
    """What differs between two requests of one prompt: tokens, accepted drafts per round, the target's
    cache rows of their slots, the drafter's proposals from them (`other`: the engine `whole` ran in)."""
    other = other or engine
    out = []
    if reused.output_ids != whole.output_ids:
        out.append("tokens")
    if reused.metrics.per_step_accepted != whole.metrics.per_step_accepted:
        out.append("accepted")
    n, i, j = int(engine.lengths[reused.slot]), reused.slot, whole.slot
    if n != int(other.lengths[j]) or not all(np.allclose(a[:, i, :, :n], b[:, j, :, :n], atol=1e-4)
                                             for a, b in zip(engine.runner.cache.kv, other.runner.cache.kv)):
        out.append("cache rows")
    if engine.drafter is not None:
        (t0, q0), (t1, q1) = _proposal(engine, i), _proposal(other, j)
        if not (np.array_equal(t0, t1) and np.allclose(q0, q1, atol=1e-4)):
            out.append("proposal")
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_reused_prefix_decodes_and_drafts_as_a_whole_prefill(target, kind):
    engine = _engine(target, kind)
    (b, b_diff), (c, c_diff) = _conversation(engine)
    assert [r.slot for r in b + c] == [0, 1, 0, 1]
    # B: A's rows are its prompt and answer but the last token (never fed back): restart on the last
    # of them; C: B's rows up to the edit, restart on the last token before it
    assert [r.metrics.cached_tokens for r in b] == [len(PROMPT) + N_A - 2, 0]
    assert [r.metrics.cached_tokens for r in c] == [len(b[0].prompt_ids) + KEEP - 1, 0]
    for reused, _ in (b, c):
        assert reused.output_ids == greedy_reference(target, reused.prompt_ids, N_B)
    # the n-gram drafter of C's reused slot also reads B's text past the restart (its stale tail): other drafts
    assert b_diff == [] and c_diff == (["accepted"] if kind == "ngram" else [])
    if kind is not None:  # drafts were verified (what the restarted state proposes decides them)
        assert min(r.metrics.num_draft_tokens for r in b + c) > 0


def test_a_restart_that_keeps_the_old_state_drafts_otherwise(target, monkeypatch):
    # control: the DSpark drafter's context not cut back (its prefill then appends after the old rows)
    monkeypatch.setattr(dspark.DSparkDrafter, "restart", lambda self, state, start_b: state)
    (b, b_diff), (c, c_diff) = _conversation(_engine(target, "dspark"))
    assert b[0].metrics.cached_tokens > 0 and "proposal" in b_diff and "proposal" in c_diff


def test_a_restart_on_the_first_unshared_token_breaks_a_pair_cache(target, monkeypatch):
    # control: no re-read of the last shared token: Eagle3 pairs the feature before the restart with the
    # token the slot held at it (C's edit)
    real = SlotPrefixes.choose

    def one_later(self, prompt_ids, free, copy_margin=0, slots_buckets=None):
        slot, start, source = real(self, prompt_ids, free, copy_margin, slots_buckets)
        return slot, start + (start > 0), source
    monkeypatch.setattr(SlotPrefixes, "choose", one_later)
    (_, b_diff), (c, c_diff) = _conversation(_engine(target, "eagle3"))
    assert b_diff == [] and "proposal" in c_diff  # B continues A whole: its pending feature is still right


def test_a_stale_record_changes_the_target(target, monkeypatch):
    # control: a slot's record kept from its first request while a later one wrote its rows
    real, calls = SlotPrefixes.keep, []

    def first_only(self, slot, tokens, rows):
        calls.append(slot)
        if len(calls) == 1:
            real(self, slot, tokens, rows)
    monkeypatch.setattr(SlotPrefixes, "keep", first_only)
    monkeypatch.setattr(SlotPrefixes, "hold", lambda self, *args: None)  # nor does the later owner's prefill
    engine = _engine(target, None, slots_buckets=(1, 2))  # x alone runs in bucket 1: slot 0
    a = EngineRequest("a", PROMPT, max_tokens=N_A, temperature=0.0)
    x = EngineRequest("x", [V - 1] * len(PROMPT), max_tokens=N_A, temperature=0.0)
    for r in (a, x):
        engine.run([r], progress=False)
    assert a.slot == x.slot == 0
    b = _pair(engine, PROMPT + a.output_ids + TURN)
    assert b[0].metrics.cached_tokens > 0 and "cache rows" in _differences(engine, *b)


def _shared_system_prompt(target, kind):
    """B (system prompt S, question Q2) arrives while L (S, Q1) runs: (engine, L, B), and B run alone in
    an engine without prefix caching (engine, B)."""
    system, q1, q2 = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5], [6, 2], [3, 6, 1]
    engine = _engine(target, kind, slots=3)
    long = EngineRequest("l", system + q1, max_tokens=30, temperature=0.0)
    engine.add_request(long)
    engine.step()
    b = EngineRequest("b", system + q2, max_tokens=N_B, temperature=0.0)
    engine.run([b], progress=False)
    engine.run([], progress=False)
    if kind not in _ALONE:  # the reference run, shared by a kind's tests
        alone = _engine(target, kind, prefix_caching=False)
        ref = EngineRequest("b", system + q2, max_tokens=N_B, temperature=0.0)
        alone.run([ref], progress=False)
        _ALONE[kind] = alone, ref
    return (engine, long, b, *_ALONE[kind])


_ALONE: dict = {}


def test_a_prompt_starts_from_a_copy_of_a_busy_slot_s_rows(target):
    engine, long, b, alone, ref = _shared_system_prompt(target, "eagle3")
    assert (long.slot, b.slot) == (0, 1) and b.metrics.cached_tokens == 12 - 1  # S shared; re-read its last
    assert engine.stats["prefix_copies"] == 1
    assert b.output_ids == greedy_reference(target, b.prompt_ids, N_B) and b.metrics.num_draft_tokens > 0
    assert _differences(engine, b, ref, alone) == []


@pytest.mark.parametrize("caching", [True, False])
def test_identical_prompts_admitted_together_prefill_once_and_copy(target, caching):
    # three requests of one prompt queued at once: the first prefills, the others wait for the next batch
    # of the same admission and start from copies of its rows (control: without prefix caching, three
    # whole prefills in one batch)
    engine = _engine(target, "eagle3", slots=4, prefix_caching=caching)
    reqs = [EngineRequest(f"r{i}", PROMPT, max_tokens=N_B, temperature=0.0) for i in range(3)]
    engine.run(reqs, progress=False)
    assert all(r.output_ids == greedy_reference(target, PROMPT, N_B) for r in reqs)
    assert min(r.metrics.num_draft_tokens for r in reqs) > 0
    copied = len(PROMPT) - 1  # restart on the prompt's last token
    assert engine.stats["prefix_copies"] == (2 if caching else 0)
    assert sorted(r.metrics.cached_tokens for r in reqs) == ([0, copied, copied] if caching else [0, 0, 0])


def test_a_missing_copy_changes_the_target(target, monkeypatch):
    # control: the copy program not run (B's slot keeps whatever it held)
    from specjax.decoding.runner import Runner
    real = Runner.run
    monkeypatch.setattr(Runner, "run", lambda self, family, *a, **kw: None if family == "copy" else
                        real(self, family, *a, **kw))
    engine, _, b, alone, ref = _shared_system_prompt(target, "eagle3")
    assert b.metrics.cached_tokens == 12 - 1 and "cache rows" in _differences(engine, b, ref, alone)


def test_prefix_caching_skips_requests_under_a_repetition_penalty(target):
    engine = small_engine(target, None, slots=2, max_len=64, policy="plain", prefill=8, tokens_buckets=(1,),
                          variants=("greedy",), config={"penalties": True})
    a = EngineRequest("a", PROMPT, max_tokens=N_A, temperature=0.0)
    engine.run([a], progress=False)
    prompt = PROMPT + a.output_ids + TURN
    b = [EngineRequest("b", prompt, max_tokens=2, temperature=0.0, repetition_penalty=1.3),
         EngineRequest("c", prompt, max_tokens=2, temperature=0.0, presence_penalty=0.5)]
    for r in b:  # one at a time: each finds A's (then b's) rows free in slot 0
        engine.run([r], progress=False)
    assert [r.slot for r in b] == [0, 0] and b[0].metrics.cached_tokens == 0 and b[1].metrics.cached_tokens > 0


def test_profiling_forgets_what_slots_hold(target):
    from specjax.decoding.profiling import measure_plain_seconds
    engine = _engine(target, None)
    a = EngineRequest("a", PROMPT, max_tokens=N_A, temperature=0.0)
    engine.run([a], progress=False)
    measure_plain_seconds(engine, repeats=1, warmup=0)
    b = EngineRequest("b", PROMPT + a.output_ids, max_tokens=2, temperature=0.0)
    engine.run([b], progress=False)
    assert b.metrics.cached_tokens == 0



def test_the_api_and_the_server_report_cached_prompt_tokens():
    """`Output.num_cached_tokens`, OpenAI's usage.prompt_tokens_details.cached_tokens (a server with vLLM's
    --enable-prompt-tokens-details) and vLLM's prefix cache counters, over a conversation of token prompts."""
    import re
    from specjax.api import SamplingParams
    from specjax.serving.http_server import ServerThread
    from specjax.serving.openai_api import OpenAIApp
    from serving_fixtures import http_json, http_request, shared_tiny_llm
    llm = shared_tiny_llm()
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = [int(t) for t in np.random.default_rng(42).integers(3, llm.config.vocab_size, 20)]
    first = llm.generate([prompt], sp)[0]
    second = llm.generate([prompt + first.token_ids + [5, 6]], sp)[0]
    assert second.num_cached_tokens == len(prompt) + len(first.token_ids) - 2
    assert llm.reset_prefix_cache() is True  # vLLM's: no free slot's rows are reused after it
    assert llm.generate([second.prompt_token_ids], sp)[0].num_cached_tokens == 0
    assert llm.generate([second.prompt_token_ids], sp)[0].num_cached_tokens == len(second.prompt_token_ids) - 1
    third = second.prompt_token_ids + second.token_ids + [7]
    api = OpenAIApp.from_llm(llm, model_name="tiny", prompt_tokens_details=True)
    server = ServerThread(api)
    try:
        status, r = http_json(server.url + "/v1/completions", "POST",
                              {"prompt": third, "max_tokens": 4, "temperature": 0})
        cached = len(second.prompt_token_ids) + len(second.token_ids) - 2
        assert status == 200 and r["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}, r["usage"]
        api.prompt_tokens_details = False  # the default: OpenAI's three counts only
        status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": third, "max_tokens": 1})
        assert status == 200 and "prompt_tokens_details" not in r["usage"], r["usage"]
        api.prompt_tokens_details = True
        status, r = http_json(server.url + "/v1/completions", "POST",  # a prompt no slot holds
                              {"prompt": [4] * 9, "max_tokens": 2, "temperature": 0})
        assert status == 200 and r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}, r["usage"]
        text = http_request(server.url + "/metrics")[2].decode()
        hits = re.search(r'^vllm:prefix_cache_hits_total\{model_name="tiny"\} (\S+)$', text, re.M)
        queries = re.search(r'^vllm:prefix_cache_queries_total\{model_name="tiny"\} (\S+)$', text, re.M)
        assert float(hits.group(1)) == cached + len(third) - 1 and float(queries.group(1)) == 2 * len(third) + 9
        status, r = http_json(server.url + "/v1/completions", "POST",  # n answers of one fresh prompt
                              {"prompt": [6, 9] * 20, "max_tokens": 2, "temperature": 0, "n": 3})
        # the later answers copied the first's rows; usage counts the prompt once, so its cached tokens too
        assert status == 200 and r["usage"]["prompt_tokens"] == 40, r["usage"]
        assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}, r["usage"]
        text = http_request(server.url + "/metrics")[2].decode()
        hits2 = re.search(r'^vllm:prefix_cache_hits_total\{model_name="tiny"\} (\S+)$', text, re.M)
        assert float(hits2.group(1)) == float(hits.group(1)) + 2 * 39
    finally:
        server.stop()
        api.engine.drain(60)
        api.engine.shutdown()


def test_prefix_caching_is_off_when_asked_or_for_a_drafter_without_restart(target):
    from specjax.decoding.engine import Engine, EngineConfig
    from test_drafters_lossless import MisreportingDrafter
    cfg = EngineConfig(max_slots=2, max_len=32)
    assert Engine(target, None, cfg, progress=False).prefixes is not None
    assert Engine(target, None, dataclasses.replace(cfg, prefix_caching=False), progress=False).prefixes is None
    assert Engine(target, MisreportingDrafter(make("dspark", target)), cfg, progress=False).prefixes is None
