"""Attention over live lengths: the target attends to a bucket of cache rows covering the longest
participating row, with outputs equal to attending to the whole cache."""
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding import buckets as bk
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest

from engine_fixtures import BigramDrafter, tiny_target

V = 64
MAX_LEN = 64
SMALL = (16, 32, 64)  # the attention buckets under test; the control attends to all 64 rows


@pytest.fixture(scope="module")
def model():
    return tiny_target(V, seed=5, init_scale=2.0)


def make_engine(model, policy: str, attention: tuple[int, ...], mesh=None, **kw) -> Engine:
    drafter = None if policy == "plain" else BigramDrafter(V, 3, confidence=True)
    cfg = EngineConfig(max_slots=4, max_len=MAX_LEN, policy=policy, gamma=None if drafter is None else 3,
                       threshold=0.3 if policy == "threshold" else None, slots_buckets=(4,),
                       tokens_buckets=(1, 4), prefill_buckets=(8,), max_prefill=8, prefill_batch_buckets=(4,),
                       sampling_variants=("plain",), attention_buckets=attention, **kw)
    eng = Engine(model, drafter, cfg, mesh=mesh, progress=False)
    eng.warmup()
    return eng


def requests(temperature: float) -> list[EngineRequest]:
    """Six requests over four slots (the last two take freed slots); prompts of 3..20 tokens (20: a
    chunked prefill) growing by up to 40 tokens, across the 16- and 32-row bucket boundaries."""
    rng = np.random.default_rng(0)
    lens, new = (3, 7, 5, 9, 12, 20), (40, 12, 30, 20, 36, 30)
    return [EngineRequest(str(i), list(rng.integers(0, V, size=n)), max_tokens=m, temperature=temperature,
                          seed=100 + i) for i, (n, m) in enumerate(zip(lens, new))]


def serve(eng: Engine, reqs: list[EngineRequest]) -> tuple[list[list[int]], list[dict]]:
    rounds: list[dict] = []
    eng.on_round = rounds.append
    eng.run(reqs, progress=False)
    return [r.output_ids for r in reqs], rounds


def test_default_attention_buckets_are_few():
    assert bk.attention_buckets(64) == (64,)  # small engines: one bucket, the whole cache
    assert bk.attention_buckets(512) == (512,)
    assert bk.attention_buckets(1024) == (512, 1024)
    assert bk.attention_buckets(8192) == (1024, 2048, 4096, 8192)
    eng = Engine(tiny_target(V), None, EngineConfig(max_slots=1, max_len=48), progress=False)
    assert eng.buckets.attention == (48,)
    with pytest.raises(ValueError, match="attention_buckets must not exceed max_len 64"):
        EngineConfig(max_len=64, attention_buckets=(32, 128))


def test_kv_len_forward_equals_whole_cache(model):
    """The model side: attention over rows [0:kv_len] gives the whole cache's logits when kv_len
    covers lengths + T; a kv_len that cuts a row's context changes them (negative control)."""
    cache = model.init_cache(2, MAX_LEN)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 12)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    cache = model.forward(toks, pos, cache, jnp.array([12, 9], jnp.int32)).cache  # lengths 12, 9
    step, at = jnp.array([[5, 6], [7, 8]], jnp.int32), cache.lengths[:, None] + jnp.arange(2)
    whole = model.forward(step, at, cache).logits
    np.testing.assert_allclose(model.forward(step, at, cache, kv_len=16).logits, whole, rtol=1e-6, atol=1e-6)
    assert not np.allclose(model.forward(step, at, cache, kv_len=8).logits, whole, atol=1e-3)
    with pytest.raises(ValueError, match="kv_len 65"):
        model.forward(step, at, cache, kv_len=65)


@pytest.mark.parametrize("policy", ["plain", "fixed", "threshold"])  # lite; fused; draft + verify
def test_attention_buckets_equal_whole_cache(model, policy):
    """Greedy and seeded sampling give the same tokens with attention buckets as with the whole
    cache; the small buckets really ran (each request crosses a boundary mid-generation), and
    serving compiles nothing."""
    small, whole = make_engine(model, policy, SMALL), make_engine(model, policy, (MAX_LEN,))
    compiled = small.compile_counts()
    for temperature in (0.0, 1.0):
        out_small, rounds = serve(small, requests(temperature))
        out_whole, rounds_whole = serve(whole, requests(temperature))
        assert out_small == out_whole
        assert {r["attention_bucket"] for r in rounds} == set(SMALL)
        assert {r["attention_bucket"] for r in rounds_whole} == {MAX_LEN}
        first = [r["attention_bucket"] for r in rounds if "0" in r["request_ids"]]  # request 0: 3 -> 43 rows
        assert first[0] == 16 and first[-1] == 64
    assert set(small.stats["attention_calls"]) == set(SMALL)  # prefill chunks and rounds
    assert small.compile_counts() == compiled
    assert {k[-2] for f, k in small.warm_keys() if f in ("lite", "fused", "verify")} == set(SMALL)


def test_attention_buckets_on_a_mesh(model):
    """Slots over `data`, heads over `tensor`: the bucketed attention decodes as the whole cache."""
    from specjax import sharding as shd
    mesh = shd.make_mesh((2, 4), ("data", "tensor"))
    out, rounds = serve(make_engine(model, "fixed", SMALL, mesh=mesh), requests(0.0))
    assert out == serve(make_engine(model, "fixed", (MAX_LEN,)), requests(0.0))[0]
    assert {r["attention_bucket"] for r in rounds} == set(SMALL)


def test_wrong_bucket_changes_outputs(model, monkeypatch):
    """Negative control: a host that always picks the smallest bucket (rows past 16 lose context)
    decodes other tokens."""
    eng = make_engine(model, "plain", SMALL)
    right, _ = serve(eng, requests(0.0))
    monkeypatch.setattr(eng, "_attention_bucket", lambda rows: SMALL[0])
    wrong, _ = serve(eng, requests(0.0))
    assert right != wrong
    assert [o[:8] for o in right][:3] == [o[:8] for o in wrong][:3]  # rows within 16: unchanged


def test_overflow_is_refused_before_dispatch(model):
    """A call needing more rows than the largest attention bucket raises an error naming the
    parameter and the limit, and no executable runs with it."""
    eng = make_engine(model, "plain", (16,))
    calls = []
    run = eng.runner.run
    eng.runner.run = lambda family, key, **kw: (calls.append(key), run(family, key, **kw))[1]
    with pytest.raises(ValueError, match=r"attention length 17 .*largest of EngineConfig.attention_buckets, 16"):
        eng.run([EngineRequest("a", [1, 2, 3, 4], max_tokens=30, temperature=0.0)], progress=False)
    assert calls and all(16 in key for key in calls)
    assert int(eng.lengths.max()) == 16  # the last round that ran filled the bucket exactly
    long = make_engine(model, "plain", (16,))
    with pytest.raises(ValueError, match=r"attention length 20 .*attention_buckets, 16"):
        long.run([EngineRequest("b", list(range(20)), max_tokens=2, temperature=0.0)], progress=False)


DRAFTER_KINDS = ["dspark", "eagle3", "mtp1", "standalone", "ngram"]


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_drafter_reads_its_context_within_the_bucket(model, kind):
    """Every drafter kind proposes the same block (tokens and q) from context rows [0:kv_len) as from
    its whole state when kv_len covers every row's committed context; for the kinds that attend to
    their context, a kv_len that cuts a row's context changes q (negative control)."""
    import jax
    from flax import nnx

    from specjax.config import TargetConfig
    from specjax.drafters.base import ContextUpdate
    from specjax.drafters.dspark import BlockDrafterConfig, make_block_drafter
    from specjax.drafters.eagle3 import Eagle3Config, make_eagle3_drafter
    from specjax.drafters.mtp import MTPConfig, make_mtp_drafter
    from specjax.drafters.ngram import NGramDrafter
    from specjax.drafters.standalone import StandaloneDrafter
    from specjax.sampling import SamplingArrays
    cfg, rngs, gamma = model.config, nnx.Rngs(4), 3
    drafter = {
        "dspark": lambda: make_block_drafter(model, cfg, BlockDrafterConfig.from_target(
            cfg, target_layer_ids=(0, 1), mask_token_id=V - 1, num_draft_layers=1, block_size=gamma,
            markov_rank=8, confidence_head=True), rngs),
        "eagle3": lambda: make_eagle3_drafter(model, Eagle3Config.from_target(
            cfg, target_layer_ids=(0, 1), gamma=gamma), rngs),
        "mtp1": lambda: make_mtp_drafter(model, MTPConfig.from_target(cfg), rngs),
        "standalone": lambda: StandaloneDrafter.from_config(TargetConfig(
            vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16), gamma, rngs=rngs),
        "ngram": lambda: NGramDrafter(V, gamma=gamma, max_ngram=2),
    }[kind]()
    rng = np.random.default_rng(2)
    toks = np.tile(rng.integers(0, V, (2, 6)), (1, 2))  # a repeated 6-gram: the n-gram drafter matches
    n_valid = jnp.array([12, 9], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    out = model.forward(jnp.asarray(toks, jnp.int32), pos, valid_b=n_valid, tap_layers=drafter.tap_layers)
    taps = jnp.concatenate(out.taps, axis=-1) if drafter.tap_layers else None
    state = drafter.commit(drafter.init_state(2, MAX_LEN), ContextUpdate(
        jnp.asarray(toks, jnp.int32), pos, taps, out.hidden, n_valid))
    anchor = jnp.asarray(toks[:, 0], jnp.int32)
    sa, keys = SamplingArrays.broadcast(2, 1.0), jax.random.split(jax.random.key(0), 2)
    propose = lambda kv_len: drafter.propose(state, anchor, n_valid, sa, keys, kv_len=kv_len)  # noqa: E731
    whole, bucket = propose(None), propose(16)
    np.testing.assert_array_equal(bucket.tokens, whole.tokens)
    np.testing.assert_allclose(bucket.q, whole.q, rtol=1e-6, atol=1e-7)
    if kind != "ngram":
        assert not np.allclose(propose(8).q, whole.q, atol=1e-4)  # row 0's context (12) cut at 8


def test_draft_calls_take_the_context_bucket(model):
    """The draft-then-verify path (threshold policy) keys its draft calls by the attention bucket too:
    small buckets ran for both families, outputs equal the whole cache's."""
    small, whole = make_engine(model, "threshold", SMALL), make_engine(model, "threshold", (MAX_LEN,))
    keys = []
    run = small.runner.run
    small.runner.run = lambda family, key, **kw: (keys.append((family, key)), run(family, key, **kw))[1]
    assert serve(small, requests(0.0))[0] == serve(whole, requests(0.0))[0]
    draft_attn = {key[1] for family, key in keys if family == "draft"}
    assert {16, 32} <= draft_attn <= set(SMALL)
