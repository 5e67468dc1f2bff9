"""vLLM's presence, frequency and repetition penalties (an engine with EngineConfig.penalties): every
sampled position's logits are penalised from the row's prompt tokens and its output up to that
position, which in a verified block includes the drafts before it. `logit_rules.penalize` equals a
float64 reference position by position (repeated drafts too); greedy outputs equal a penalised greedy
reference with and without verified drafts, beside an unpenalised request of the same batch; sampled
outputs follow the enumerated penalised law (chi-square). Negative controls: a verifier whose
penalties forget the drafts before each position fails the greedy reference and the law."""
import numpy as np
import pytest

from specjax.api import SamplingParams
from specjax.decoding import logit_rules
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.serving.schema import FieldError, parse_sampling

from engine_fixtures import (BigramDrafter, chain_drafter, chi_square_pvalue, exact_continuations, greedy_beside_free,
                             penalize_logits, ruled_greedy, sampled_with_rules, tiny_target)
from test_engine import greedy_reference

V, GAMMA, N = 64, 3, 14
PROMPT = [5, 17, 42, 8, 33, 5]
PENS = dict(presence_penalty=0.6, frequency_penalty=0.5, repetition_penalty=1.6)
PEN3 = (PENS["presence_penalty"], PENS["frequency_penalty"], PENS["repetition_penalty"])


def test_penalize_equals_the_reference_at_every_position():
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    b, t, v = 3, 5, 12
    logits = rng.normal(size=(b, t, v)) * 2
    prompts = [[1, 2], [3], [4, 4, 5]]
    outputs = [[6, 1], [], [7, 7, 7]]  # committed output, the anchor (last) included
    drafts = np.array([[6, 6, 2, 9], [3, 8, 3, 3], [7, 0, 11, 7]])  # repeats and prompt tokens
    pens = np.array([[0.5, 0.0, -0.3], [0.2, 1.0, 0.4], [1.5, 1.0, 0.7]], np.float32)  # [3, b]
    counts = np.stack([np.bincount(o, minlength=v) for o in outputs]).astype(np.int32)
    in_prompt = np.zeros((b, v), bool)
    for i, p in enumerate(prompts):
        in_prompt[i, p] = True
    toks = np.concatenate([np.array([[o[-1] if o else 0] for o in outputs]), drafts], axis=1)
    got = np.asarray(logit_rules.penalize(jnp.asarray(logits, jnp.float32), jnp.asarray(counts),
                                          jnp.asarray(in_prompt), jnp.asarray(pens), jnp.asarray(toks)))
    for i in range(b):
        for j in range(t):
            want = penalize_logits(logits[i, j], prompts[i], outputs[i] + list(drafts[i, :j]), *pens[:, i])
            np.testing.assert_allclose(got[i, j], want, rtol=1e-5, atol=1e-5, err_msg=f"row {i} position {j}")


def penalized_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The greedy continuation under PENS (float64 penalties on the target's logits)."""
    return ruled_greedy(model, prompt, n, lambda logits, out: penalize_logits(logits, prompt, out, *PEN3))


@pytest.fixture(scope="module")
def case():
    model = tiny_target(V, seed=5, init_scale=2.0)
    plain, pen = greedy_reference(model, PROMPT, N), penalized_greedy(model, PROMPT, N)
    assert plain != pen, "the penalties change nothing here: pick other values"
    return model, plain, pen


def _oracle(chain_tokens: list[int]) -> BigramDrafter:
    """A bigram drafter whose greedy draws follow `chain_tokens` after PROMPT."""
    return chain_drafter(V, GAMMA, [PROMPT[-1]] + chain_tokens)


def _engine(model, drafter, variants=("greedy",), slots=2, **cfg) -> Engine:
    config = EngineConfig(max_slots=slots, max_len=32, policy="plain" if drafter is None else "fixed", gamma=GAMMA,
                          slots_buckets=(slots,), tokens_buckets=(1, GAMMA + 1), prefill_buckets=(8,), max_prefill=8,
                          prefill_batch_buckets=(min(slots, 8),), sampling_variants=variants, penalties=True, **cfg)
    eng = Engine(model, drafter, config, progress=False)
    eng.warmup()
    return eng


def _greedy_pair(eng: Engine) -> tuple[EngineRequest, EngineRequest]:
    reqs = greedy_beside_free(eng, PROMPT, N, {"pen": PENS})
    return reqs["pen"], reqs["free"]


@pytest.mark.parametrize("drafting", [False, True])
def test_greedy_penalised_output_equals_the_reference(case, drafting):
    model, plain, pen_ref = case
    pen, free = _greedy_pair(_engine(model, _oracle(pen_ref) if drafting else None))
    assert pen.output_ids == pen_ref and free.output_ids == plain
    if drafting:
        m = pen.metrics.as_dict()
        assert m["num_accepted_tokens"] >= 2 * GAMMA  # whole blocks of penalised drafts were accepted


def test_a_prompt_prefilled_in_chunks_is_penalised_whole(case):
    """Prefill chunks of 8: the repetition penalty reads the tokens of every chunk of the prompt."""
    model, _, _ = case
    long = [54, 19, 56, 51, 9, 52, 60, 15] + [30, 32, 48, 60, 2]  # the first chunk's tokens steer the answer
    eng = _engine(model, None)
    req = EngineRequest("long", long, max_tokens=8, temperature=0.0, **PENS)
    eng.run([req], progress=False)
    assert len(long) > eng.cfg.max_prefill  # two chunks
    assert req.output_ids == penalized_greedy(model, long, 8)


_PENALIZE = logit_rules.penalize


def _forgetting_drafts(logits, counts, prompt, pens, toks):
    return _PENALIZE(logits, counts, prompt, pens, toks.at[:, 1:].set(-1))  # the committed output only


def test_negative_control_penalties_that_forget_the_drafts(case, monkeypatch):
    model, _, pen_ref = case
    monkeypatch.setattr(logit_rules, "penalize", _forgetting_drafts)
    pen, _ = _greedy_pair(_engine(model, _oracle(pen_ref)))
    assert pen.output_ids != pen_ref


@pytest.fixture(scope="module")
def small():
    return tiny_target(8, seed=3, init_scale=3.0)


SMALL_PENS = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=2.0)


def _sampled(model, n: int, seed0: int) -> list[tuple[int, ...]]:
    reqs = sampled_with_rules(model, n, seed0, SMALL_PENS, dict(penalties=True), gamma=GAMMA)
    return [tuple(r.output_ids[:3]) for r in reqs]


def _law(model):
    pens = tuple(SMALL_PENS.values())
    return exact_continuations(model, [1, 5, 2], 3,
                               rule=lambda logits, out: penalize_logits(logits, [1, 5, 2], out, *pens))


def test_sampled_outputs_follow_the_penalised_law(small):
    law, free = _law(small), exact_continuations(small, [1, 5, 2], 3)
    assert sum(abs(law[k] - free[k]) for k in law) > 0.2  # the penalties change the law
    p = chi_square_pvalue(_sampled(small, 6000, 0), law)
    assert p > 1e-3, f"penalised output differs from the penalised law (chi-square p={p:.2e})"


def test_negative_control_forgetting_the_drafts_fails_the_law(small, monkeypatch):
    monkeypatch.setattr(logit_rules, "penalize", _forgetting_drafts)
    assert chi_square_pvalue(_sampled(small, 6000, 10**6), _law(small)) < 1e-3


def test_penalties_are_checked_and_refused_without_the_engine_option(case):
    with pytest.raises(ValueError, match="presence_penalty must be in"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0.0)
    assert parse_sampling({"frequency_penalty": -1.5}, SamplingParams()).frequency_penalty == -1.5
    with pytest.raises(FieldError, match="frequency_penalty") as e:
        parse_sampling({"frequency_penalty": "1"}, SamplingParams())
    assert e.value.field == "frequency_penalty"
    eng = Engine(case[0], None, EngineConfig(max_slots=2, max_len=32, policy="plain"), progress=False)
    with pytest.raises(ValueError, match="repetition_penalty needs an engine with penalties"):
        eng.add_request(EngineRequest("a", PROMPT, max_tokens=4, repetition_penalty=1.2))


def test_the_python_api_serves_penalties(case):
    """LLM(penalties=True) with SamplingParams' penalties gives the penalised greedy answer; the
    default LLM refuses them naming the option."""
    from specjax.api import LLM
    model, _, pen_ref = case
    llm = LLM(target=(model, model.config), max_num_seqs=2, max_model_len=32, max_prefill=8, penalties=True,
              sampling_variants=("greedy",))
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=N, **PENS))[0]
    assert out.token_ids == pen_ref
    plain = LLM(target=(model, model.config), max_num_seqs=2, max_model_len=32, max_prefill=8,
                sampling_variants=("greedy",))
    with pytest.raises(ValueError, match="presence_penalty needs an engine with penalties"):
        plain.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, presence_penalty=0.5))
