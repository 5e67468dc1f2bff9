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
