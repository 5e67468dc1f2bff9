"""Engine behaviour: greedy equality, no recompiles, sharded serving, bad input, full caches."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.api import LLM, SamplingParams
from specjax.decoding.runner import UnwarmedBucketError
from specjax.decoding.engine import EngineRequest
from specjax.decoding.requests import RequestMetrics
from specjax.drafters.ngram import NGramDrafter
from specjax.sampling import VARIANTS

from engine_fixtures import BigramDrafter, small_engine, tiny_target

V = 64


@pytest.fixture(scope="module")
def model():
    return tiny_target(V, seed=5, init_scale=2.0)


def greedy_reference(model, prompt, n):
    from flax import nnx
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))
    seq = list(prompt) + [0] * n
    for i in range(n):  # fixed shape: one compile; causal attention ignores the zero padding after i
        seq[len(prompt) + i] = int(jnp.argmax(fwd(state, jnp.array([seq]))[0, len(prompt) + i - 1]))
    return seq[len(prompt):]


def prompts():
    rng = np.random.default_rng(0)
    ps = [list(rng.integers(0, V, size=n)) for n in (3, 7, 12, 20, 5)]
    ps.append([7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8])  # repetitive: the n-gram drafter gets accepted drafts
    return ps


def run_greedy(engine, ps, n=12):
    reqs = [EngineRequest(str(i), p, max_tokens=n, temperature=0.0) for i, p in enumerate(ps)]
    engine.run(reqs, progress=False)
    return [r.output_ids for r in reqs], reqs


def test_greedy_speculative_equals_plain_and_reference(model):
    ps = prompts()
    plain = small_engine(model, None, slots=4, max_len=48, policy="plain", prefill=8, variants=("greedy",))
    bigram = small_engine(model, BigramDrafter(V, 3), slots=4, max_len=48, prefill=8, tokens_buckets=(1, 4),
                          variants=("greedy",))
    out_plain, _ = run_greedy(plain, ps)
    out_bigram, reqs = run_greedy(bigram, ps)
    for p, a, c in zip(ps, out_plain, out_bigram):
        assert a == greedy_reference(model, p, 12)  # 6 prompts, 4 slots: slots are reused; 20 > 8: chunked prefill
        assert c == a
    assert sum(r.metrics.num_draft_tokens for r in reqs) > 0


def test_engines_of_equal_contexts_share_their_compiled_programs(model):
    """A second engine of the same model, drafter configuration and shapes runs the executables the
    first compiled (one trace, lowering and compilation per bucket in a process); an engine whose
    context differs (here only its verifier function) compiles its own (control)."""
    import functools

    from specjax.decoding.verify import verify_chain

    def runtime(eng):
        return {(f, k): e.compiled(k).runtime_executable() for f, e in eng.runner.exes.items() for k in e.keys}
    a, b = (small_engine(model, NGramDrafter(V, gamma=3), slots=2, max_len=24, prefill=8, tokens_buckets=(1, 4))
            for _ in range(2))
    c = small_engine(model, NGramDrafter(V, gamma=3), slots=2, max_len=24, prefill=8, tokens_buckets=(1, 4),
                     verifier=functools.partial(verify_chain))
    ra, rb, rc = runtime(a), runtime(b), runtime(c)
    assert len(ra) >= 4 and ra.keys() == rb.keys() == rc.keys()
    assert all(rb[k] is ra[k] for k in ra)
    assert not any(rc[k] is ra[k] for k in ra)


def test_greedy_ngram_equals_reference(llm, model):
    ps = [p for p in prompts() if len(p) < 16]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=10))
    for p, o in zip(ps, outs):
        assert o.token_ids == greedy_reference(model, p, 10)
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0, "n-gram drafts were never accepted"


def test_no_recompiles_after_warmup_and_unwarmed_key_is_an_error(model):
    eng = small_engine(model, NGramDrafter(V, gamma=3), slots=4, max_len=40, prefill=8, tokens_buckets=(1, 2, 4),
                       variants=VARIANTS)
    keys_before = {n: list(e.keys) for n, e in eng.runner.exes.items()}
    counts_before = eng.compile_counts()
    rng = np.random.default_rng(1)
    reqs = [EngineRequest(str(i), list(rng.integers(0, V, size=int(rng.integers(1, 20)))),
                          max_tokens=int(rng.integers(1, 15)), temperature=float(rng.choice([0.0, 0.7, 1.0])),
                          top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])),
                          max_draft_tokens=int(rng.integers(0, 4)), seed=i) for i in range(10)]
    eng.run(reqs, progress=False)
    assert all(r.finish_reason for r in reqs)
    assert eng.compile_counts() == counts_before
    assert {n: list(e.keys) for n, e in eng.runner.exes.items()} == keys_before
    with pytest.raises(UnwarmedBucketError, match="not compiled at warm-up"):
        eng.runner.run("fused", (3, 3), ell_b=None)


def test_sharded_engine_matches_single_device(model):
    from specjax import sharding as shd
    assert len(jax.devices()) >= 8
    mesh = shd.make_mesh((2, 4), ("data", "tensor"))
    ps = prompts()[:4]
    single = small_engine(model, NGramDrafter(V, gamma=3), slots=4, max_len=40, prefill=16, tokens_buckets=(1, 4),
                          variants=("greedy",))
    sharded = small_engine(model, NGramDrafter(V, gamma=3), slots=4, max_len=40, prefill=16, tokens_buckets=(1, 4),
                           mesh=mesh, variants=("greedy",))
    a, _ = run_greedy(single, ps, 10)
    b, _ = run_greedy(sharded, ps, 10)
    assert a == b
    # state stays sharded across calls: cache slots over `data`, weights over `tensor`
    k0 = sharded.runner.cache.kv[0]
    assert k0.sharding.spec[1] == "data" and len(k0.sharding.device_set) == 8
    assert sharded.runner.dstate.history.sharding.spec[0] == "data"
    gu = sharded.runner.t_params["model"]["layers"][0]["mlp"]["gate_up_proj"]["kernel"][...]
    assert gu.sharding.spec[2] == "tensor"
    assert {s.data.shape for s in gu.addressable_shards} == {(gu.shape[0], 2, gu.shape[2] // 4)}


@pytest.fixture(scope="module")
def llm(model):
    from specjax.decoding.engine import EngineConfig
    cfg = EngineConfig(max_slots=2, max_len=32, gamma=3, policy="fixed", slots_buckets=(2,), tokens_buckets=(1, 4),
                       prefill_buckets=(16,), prefill_batch_buckets=(2,))
    return LLM(target=(model, model.config), drafter="ngram", engine_config=cfg, num_speculative_tokens=3)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"), (dict(seed=True), "seed"), (dict(seed=-1), "seed"),
    (dict(num_speculative_tokens=2.5), "num_speculative_tokens"), (dict(logprobs="5"), "logprobs"),
    (dict(logprobs=True), "logprobs"), (dict(stop=123), "stop"), (dict(stop=["a", 3]), "stop"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids="ab"), "stop_token_ids"),
    (dict(stop_token_ids=[2, -3]), r"stop_token_ids\[1\]"), (dict(stop_token_ids=[1.0]), r"stop_token_ids\[0\]")])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_good_sampling_params_are_normalised():
    sp = SamplingParams(stop="x", stop_token_ids=[np.int64(3), 4], seed=np.int32(1))
    assert sp.stop == ("x",) and sp.stop_token_ids == (3, 4) and type(sp.stop_token_ids[0]) is int


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"prompts\[0\] must be a string or a list"):
        llm.generate([1.5], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"prompts\[1\]\[1\] must be an int"):
        llm.generate([[1], [2, 3.0]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, -1]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_len 32"):
        llm.generate([list(range(40))], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], SamplingParams(max_tokens=2))


def test_unknown_drafter_name_lists_the_choices(model):
    with pytest.raises(ValueError, match="'dsparkk' is not a drafter directory nor a name.*ngram, dspark"):
        LLM(target=(model, model.config), drafter="dsparkk")


def test_full_cache_finishes_with_length_and_others_unaffected(llm, model):
    long_prompt = list(np.random.default_rng(3).integers(0, V, size=28))
    short = [1, 2, 3]
    alone = llm.generate([short], SamplingParams(temperature=0, max_tokens=10))[0]
    both = llm.generate([long_prompt, short], SamplingParams(temperature=0, max_tokens=10))
    assert both[0].finish_reason == "length"
    assert len(long_prompt) + len(both[0].token_ids) <= 32 + 1  # the last token needs no cache row
    assert both[1].token_ids == alone.token_ids
    assert both[1].token_ids == greedy_reference(model, short, 10)


def test_seeded_sampling_is_reproducible(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=8, seed=1234)
    a = llm.generate([[4, 5, 6]], sp)[0].token_ids
    b = llm.generate([[4, 5, 6], [9, 9]], [sp, SamplingParams(temperature=1.0, max_tokens=8, seed=1)])[0].token_ids
    assert a == b


def test_metrics_follow_vllm_definitions(llm):
    out = llm.generate([[7, 8, 9, 7, 8, 9, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12))[0]
    m = out.metrics
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] >= m["num_accepted_tokens"]
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    assert sum(m["num_accepted_tokens_per_pos"]) == m["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(m["num_accepted_tokens_per_pos"], m["num_accepted_tokens_per_pos"][1:]))
    sd = m["speculative_decoding"]  # vLLM's per-request block, from every round's (drafted, accepted)
    steps = list(zip(sd["per_step_drafted"], sd["per_step_accepted"]))
    assert len(steps) == sd["num_spec_steps"] == m["num_drafts"] and sd["num_spec_tokens"] == 3
    assert sum(a for _, a in steps) == m["num_accepted_tokens"] and sum(k for k, _ in steps) == m["num_draft_tokens"]
    hist = sd["acceptance_histogram"]
    assert hist == [sum(a == j for _, a in steps) for j in range(4)]
    assert [sum(hist[k + 1:]) for k in range(3)] == m["num_accepted_tokens_per_pos"]  # another counter's view
    assert sd["acceptance_histogram_by_draft_length"] == {
        str(k): [sum(1 for d, a in steps if d == k and a == j) for j in range(k + 1)] for k in sorted({d for d, _ in steps})}
    with pytest.raises(ValueError, match="more than num_spec_tokens 2"):  # a cap the rounds exceeded
        dataclasses.replace(RequestMetrics(), per_step_drafted=[3], per_step_accepted=[1]).speculative_decoding(2)


def test_block_drafter_verified_below_its_block_reports_gamma_confidences():
    """A block-5 DSpark drafter verified at gamma 2 (fused fixed rounds): every round reports gamma
    confidences per request, so round logs stay rectangular (a block-wide row broke evaluation)."""
    from flax import nnx
    from specjax.drafters.dspark import BlockDrafterConfig
    from specjax.drafters.dspark import make_block_drafter
    model = tiny_target(16, seed=3)
    dcfg = BlockDrafterConfig.from_target(model.config, target_layer_ids=(0, 1), mask_token_id=15,
                                          num_draft_layers=1, block_size=5, markov_rank=4, confidence_head=True)
    drafter = make_block_drafter(model, model.config, dcfg, nnx.Rngs(0))
    eng = small_engine(model, drafter, slots=2, gamma=2)
    widths = []
    eng.on_round = lambda info: widths.extend(len(row) for row in info["confidence"])
    eng.run([EngineRequest("a", [1, 2, 3], max_tokens=9, temperature=0.0),
             EngineRequest("b", [4, 5], max_tokens=7, temperature=1.0, seed=1)])
    assert widths and set(widths) == {2}


def test_threaded_warmup_compiles_every_key_and_decodes_exactly(model):
    from specjax.decoding.engine import Engine, EngineConfig
    cfg = EngineConfig(max_slots=2, max_len=40, policy="fixed", slots_buckets=(2,), tokens_buckets=(1, 2, 4),
                       prefill_buckets=(8,), max_prefill=8, prefill_batch_buckets=(2,))
    eng = Engine(model, BigramDrafter(V, 3), cfg, progress=False)
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        eng.warmup(threads=0)
    eng.warmup(threads=4)
    compiled = {(n, k) for n, e in eng.runner.exes.items() for k in e.keys}
    # prefill, release (the host ending a row), copy (prefix caching), and 3 fused tokens buckets per sampling variant
    assert compiled == set(eng.warm_keys()) and len(compiled) == 3 + 3 * len(cfg.sampling_variants)
    ps = prompts()[:3]
    out, _ = run_greedy(eng, ps, n=8)
    assert out == [greedy_reference(model, p, 8) for p in ps]
