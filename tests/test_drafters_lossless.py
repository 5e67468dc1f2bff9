"""Every drafter runs in the engine with exact verification (Monte-Carlo chi-square on a tiny target),
and an oracle drafter (a copy of the target) has every greedy draft accepted."""
import jax.numpy as jnp
import pytest
from flax import nnx

from specjax.config import TargetConfig
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.drafters.base import DraftBlock
from specjax.drafters.dspark import BlockDrafterConfig
from specjax.drafters.dspark import make_block_drafter
from specjax.drafters.eagle3 import Eagle3Config, make_eagle3_drafter
from specjax.drafters.mtp import MTPConfig, make_mtp_drafter
from specjax.drafters.ngram import NGramDrafter
from specjax.drafters.standalone import StandaloneDrafter

from engine_fixtures import BigramDrafter, drafter_pvalue, exact_continuations, small_engine, tiny_target

V, GAMMA, PROMPT = 8, 3, [1, 5, 2, 1, 5]
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def model():
    return tiny_target(V, seed=11, layers=3, init_scale=3.0)


@pytest.fixture(scope="module")
def exact(model):
    """The target's distribution of three-token continuations at TEMPERATURE."""
    return exact_continuations(model, PROMPT, 3, temperature=TEMPERATURE)


def make(kind: str, target):
    cfg = target.config
    rngs = nnx.Rngs(4)
    if kind in ("dspark", "dspark-rnn", "dflash", "dspark-bf16"):
        bcfg = BlockDrafterConfig.from_target(
            cfg, target_layer_ids=(0, 1), mask_token_id=V - 1, num_draft_layers=1, block_size=GAMMA,
            markov_rank=0 if kind == "dflash" else 8, markov_head_type="rnn" if kind == "dspark-rnn" else "vanilla",
            confidence_head=kind != "dflash")
        # dspark-bf16: computing in bfloat16, it carries q rounded (sampling.draft_probs) to verify
        dtype = "bfloat16" if kind == "dspark-bf16" else "float32"
        return make_block_drafter(target, cfg, bcfg, rngs, dtype=dtype, param_dtype=dtype)
    if kind == "eagle3":
        return make_eagle3_drafter(target, Eagle3Config.from_target(cfg, target_layer_ids=(0, 1), gamma=GAMMA), rngs)
    if kind == "mtp1":
        return make_mtp_drafter(target, MTPConfig.from_target(cfg), rngs)
    if kind == "standalone":
        small = TargetConfig(vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        return StandaloneDrafter.from_config(small, GAMMA, rngs=rngs)
    if kind == "ngram":
        return NGramDrafter(V, gamma=GAMMA)
    raise ValueError(kind)


class MisreportingDrafter(nnx.Module):
    """Negative control: samples its tokens from the inner drafter's q but reports a flatter q
    (q ** 0.5, renormalised), as a drafter that samples at one temperature and reports another."""

    def __init__(self, inner):
        self.inner = inner
        self.gamma, self.tap_layers, self.needs_hidden = inner.gamma, inner.tap_layers, inner.needs_hidden

    def init_state(self, slots, max_len):
        return self.inner.init_state(slots, max_len)

    def commit(self, state, update):
        return self.inner.commit(state, update)

    def propose(self, state, anchor_b, position_b, sampling, key_b, kv_len=None) -> DraftBlock:
        block = self.inner.propose(state, anchor_b, position_b, sampling, key_b, kv_len)
        flat = jnp.sqrt(block.q)
        return block._replace(q=flat / flat.sum(-1, keepdims=True))


def engine_pvalue(drafter, model, exact, seed0: int = 0) -> float:
    """Chi-square p-value of the engine's first three tokens (T = TEMPERATURE) with this drafter."""
    return drafter_pvalue(model, drafter, PROMPT, exact, temperature=TEMPERATURE, seed0=seed0)


@pytest.mark.parametrize("kind", ["dspark", "dspark-rnn", "dflash", "dspark-bf16", "eagle3", "mtp1", "standalone",
                                  "ngram"])
def test_drafter_in_engine_is_exact(kind, model, exact):
    p = engine_pvalue(make(kind, model), model, exact)
    assert p > 1e-3, f"{kind}: engine output differs from the target distribution (p={p:.2e})"


def test_drafter_misreporting_q_is_caught(model, exact):
    # the bigram test drafter's q is sharp (the random drafters' are nearly uniform), so flattening it matters
    p = engine_pvalue(MisreportingDrafter(BigramDrafter(V, GAMMA, scale=3.0)), model, exact, seed0=10**6)
    assert p < 1e-3, f"a drafter reporting a q it did not sample from passed (p={p:.2e}): the test has no teeth"


def test_oracle_drafter_accepts_every_greedy_draft(model):
    oracle = StandaloneDrafter(nnx.merge(*nnx.split(model)), GAMMA)  # an exact copy of the target
    eng = small_engine(model, oracle, slots=2, max_len=32, prefill=8, gamma=GAMMA, tokens_buckets=(1, GAMMA + 1),
                       variants=("greedy",))
    reqs = [EngineRequest(str(i), p, max_tokens=13, temperature=0.0) for i, p in enumerate([PROMPT, [3, 3, 4]])]
    eng.run(reqs, progress=False)
    for r in reqs:
        m = r.metrics
        assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens
        assert m.mean_acceptance_length == GAMMA + 1


def test_a_bfloat16_drafters_q_crosses_from_draft_to_verify(model):
    """Under a host policy (the draft and verify programs apart, q carried between them) a bfloat16
    drafter's q reaches a verify program compiled for it: greedy outputs equal plain decoding,
    drafts were verified, and a sampled run at TEMPERATURE completes."""
    drafter = make("dspark-bf16", model)
    cfg = EngineConfig(max_slots=2, max_len=32, policy="threshold", threshold=0.0, gamma=GAMMA, slots_buckets=(2,),
                       tokens_buckets=(1, GAMMA + 1), prefill_buckets=(8,), max_prefill=8, prefill_batch_buckets=(2,),
                       sampling_variants=("greedy", "plain"))
    eng = Engine(model, drafter, cfg, progress=False)
    eng.warmup()
    assert eng.runner.q_dtype == jnp.bfloat16
    plain = small_engine(model, None, slots=2, max_len=32, prefill=8, policy="plain")
    prompts = [PROMPT, [3, 3, 4]]

    def run(e, temperature):
        reqs = [EngineRequest(str(i), p, max_tokens=9, temperature=temperature) for i, p in enumerate(prompts)]
        e.run(reqs, progress=False)
        return reqs
    spec = run(eng, 0.0)
    assert [r.output_ids for r in spec] == [r.output_ids for r in run(plain, 0.0)]
    assert sum(r.metrics.num_draft_tokens for r in spec) > 0
    assert "draft" in eng.runner.exes and eng.runner.exes["draft"].keys
    assert all(len(r.output_ids) == 9 for r in run(eng, TEMPERATURE))
