"""vLLM's guided_choice (an engine with EngineConfig.guided_choice): every sampled position allows
only a token that continues a choice the output so far begins (its committed output, then the
drafts before that position), or an eos id where the output is a whole choice, so the answer is one
of the choices, exactly under speculation. `logit_rules.guide_choices` and `advance_choices` equal a
reference position by position; greedy outputs equal the guided greedy reference with and without
verified drafts, beside an unguided request; sampled outputs follow the enumerated guided law
(chi-square). Negative controls: choices that forget the drafts before each position leave the
choices (greedy) and fail the law."""
import dataclasses
from typing import Sequence

import numpy as np
import pytest

from specjax.decoding import logit_rules
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.decoding.logit_rules import CHOICE_TOKENS, ROW_CHOICES

from engine_fixtures import (chain_drafter, chi_square_pvalue, exact_continuations, greedy_beside_free, refused_field,
                             ruled_greedy, sampled_with_rules, tiny_target)
from test_engine import greedy_reference

V, GAMMA, N, EOS = 64, 3, 12, 2
PROMPT = [5, 17, 42, 8, 33, 5]
CHOICES = ((30, 62, 9, 9, 9), (30, 62, 46, 11), (4, 5), (30, 62, 46, 11, 7, 7))  # the unguided greedy: 30 62 46 62


def choice_logits(logits_v: np.ndarray, output: Sequence[int], choices: Sequence[Sequence[int]],
                  eos: Sequence[int]) -> np.ndarray:
    """Reference: -inf but at the next token of each choice `output` begins and at `eos` where
    `output` is a whole choice; unchanged where `output` begins no choice."""
    out, n = tuple(output), len(output)
    alive = [tuple(c) for c in choices if tuple(c[:n]) == out]
    if not alive:
        return logits_v
    keep = {c[n] for c in alive if len(c) > n} | (set(eos) if out in alive else set())
    masked = np.full_like(logits_v, -np.inf)
    masked[list(keep)] = logits_v[list(keep)]
    return masked


def _pad(choices: Sequence[Sequence[int]]) -> np.ndarray:
    out = np.full((ROW_CHOICES, CHOICE_TOKENS), -1, np.int32)
    for i, c in enumerate(choices):
        out[i, :len(c)] = c
    return out


def test_guided_choices_equal_the_reference_at_every_position():
    import jax.numpy as jnp
    rng = np.random.default_rng(2)
    b, t, v, eos = 3, 5, 12, (0, 11)
    logits = rng.normal(size=(b, t, v))
    choices = [((3, 4, 5), (3, 4, 6, 7, 8), (9,)), ((1, 2), (1, 2, 3, 4, 5, 6, 7)), ((5, 5, 5, 5, 5, 5),)]
    outputs = [[3], [], [5, 5]]  # committed output
    drafts = np.array([[4, 6, 7, 2], [1, 2, 3, 9], [5, 5, 1, 5]])
    ch = np.stack([_pad(c) for c in choices])
    alive = np.array([[tuple(c[:len(o)]) == tuple(o) for c in ch_row] for ch_row, o in
                      zip([[tuple(x) for x in c] + [()] * (ROW_CHOICES - len(c)) for c in choices], outputs)])
    alive &= ch[:, :, 0] >= 0
    pos = np.array([len(o) for o in outputs], np.int32)
    stop_be = np.tile(np.array(eos, np.int32), (b, 1))
    got = np.asarray(logit_rules.guide_choices(jnp.asarray(logits, jnp.float32), jnp.asarray(ch), jnp.asarray(alive),
                                               jnp.asarray(pos), jnp.asarray(drafts, jnp.int32), jnp.asarray(stop_be)))
    masked = 0
    for i in range(b):
        for j in range(t):
            want = choice_logits(logits[i, j], outputs[i] + list(drafts[i, :j]), choices[i], eos)
            np.testing.assert_allclose(got[i, j], want, rtol=1e-6, err_msg=f"row {i} position {j}")
            masked += int(np.isinf(want).any())
    assert masked >= 9  # positions inside a choice, at a whole choice (eos kept), and past every choice
    emitted = np.array([3, 2, 4])
    new_alive, new_pos = logit_rules.advance_choices(jnp.asarray(ch), jnp.asarray(alive), jnp.asarray(pos),
                                                     jnp.asarray(drafts, jnp.int32), jnp.asarray(emitted, jnp.int32))
    for i in range(b):
        out = tuple(outputs[i]) + tuple(drafts[i, :emitted[i]])
        want = [k < len(choices[i]) and tuple(choices[i][k][:len(out)]) == out for k in range(ROW_CHOICES)]
        assert np.asarray(new_alive)[i].tolist() == want and int(new_pos[i]) == len(out), i


def _rule(choices, eos=(EOS,)):
    return lambda logits, out: choice_logits(logits, out, choices, eos)


def _until_eos(tokens: list[int], eos: int = EOS) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def case():
    model = tiny_target(V, seed=5, init_scale=2.0)
    plain = greedy_reference(model, PROMPT, N)
    guided = _until_eos(ruled_greedy(model, PROMPT, N, _rule(CHOICES)))
    assert guided[:-1] in [list(c) for c in CHOICES] and guided[:-1] != plain[:len(guided) - 1], (guided, plain)
    return model, plain, guided


def _engine(model, drafter) -> Engine:
    config = EngineConfig(max_slots=2, max_len=32, policy="plain" if drafter is None else "fixed", gamma=GAMMA,
                          slots_buckets=(2,), tokens_buckets=(1, GAMMA + 1), prefill_buckets=(8,), max_prefill=8,
                          prefill_batch_buckets=(2,), sampling_variants=("greedy",), guided_choice=True)
    eng = Engine(model, drafter, config, eos_token_ids=(EOS,), progress=False)
    eng.warmup()
    return eng


def _greedy_pair(eng: Engine) -> tuple[EngineRequest, EngineRequest]:
    reqs = greedy_beside_free(eng, PROMPT, N, {"guided": dict(guided_choice=CHOICES)})
    return reqs["guided"], reqs["free"]


@pytest.mark.parametrize("drafting", [False, True])
def test_greedy_guided_output_is_the_reference_choice(case, drafting):
    model, plain, guided_ref = case
    # drafts follow the unguided answer: verification must turn them into the choice
    guided, free = _greedy_pair(_engine(model, chain_drafter(V, GAMMA, [PROMPT[-1]] + plain) if drafting else None))
    assert (guided.output_ids, guided.finish_reason) == (guided_ref, "stop") and free.output_ids == plain
    if drafting:
        m = guided.metrics.as_dict()
        assert m["num_draft_tokens"] >= GAMMA and m["num_accepted_tokens"] >= 2  # drafts inside the choice accepted


_GUIDE = logit_rules.guide_choices


def test_negative_control_choices_that_forget_the_drafts(case, monkeypatch):
    model, plain, guided_ref = case
    monkeypatch.setattr(logit_rules, "guide_choices", lambda lg, ch, alive, pos, d, stops: _GUIDE(
        lg, ch, alive, pos, d * 0 - 1, stops))
    guided, _ = _greedy_pair(_engine(model, chain_drafter(V, GAMMA, [PROMPT[-1]] + plain)))
    assert guided.output_ids != guided_ref and guided.output_ids[:-1] not in [list(c) for c in CHOICES]


def test_forced_drafts_equal_the_reference():
    import jax.numpy as jnp
    choices = [((3, 4, 5), (3, 4, 6), (3, 9)), ((1, 2, 3, 4, 5, 6),), ((7, 7), (7, 7, 8)), ()]
    outputs = [[3], [1], [], []]
    ch = np.stack([_pad(c) for c in choices])
    alive = np.array([[k < len(c) and tuple(c[k][:len(o)]) == tuple(o) for k in range(ROW_CHOICES)]
                      for c, o in zip(choices, outputs)])
    got = np.asarray(logit_rules.forced_choice_tokens(jnp.asarray(ch), jnp.asarray(alive),
                                                      jnp.asarray([len(o) for o in outputs], jnp.int32), 4))
    # row 0: 4 vs 9 disagree; row 1: the rest of its one choice; row 2: 7 7 then one ends; row 3: no choices
    assert got.tolist() == [[-1, -1, -1, -1], [2, 3, 4, 5], [7, 7, -1, -1], [-1, -1, -1, -1]]


def _one_choice_run(model, plain) -> EngineRequest:
    """A greedy request whose one choice differs from the answer the drafter's drafts follow."""
    eng = _engine(model, chain_drafter(V, GAMMA, [PROMPT[-1]] + plain))
    req = EngineRequest("one", PROMPT, max_tokens=N, temperature=0.0, guided_choice=((4, 5, 6, 7, 8, 9),))
    eng.run([req], progress=False)
    assert (req.output_ids, req.finish_reason) == ([4, 5, 6, 7, 8, 9, EOS], "stop")
    return req


def test_the_drafts_a_choice_forces_are_accepted(case):
    """Prefill draws 4; round 1 verifies the forced 5 6 7 (bonus 8), round 2 the forced 9 and the
    drafter's next drafts (eos is the only token allowed there)."""
    model, plain, _ = case
    m = _one_choice_run(model, plain).metrics.as_dict()
    assert m["num_rounds"] == 2 and m["num_accepted_tokens"] == GAMMA + 1, m


def test_negative_control_drafts_left_to_the_drafter(case, monkeypatch):
    from specjax.decoding import row_state
    monkeypatch.setattr(row_state, "guide_drafts", lambda rows, block, q_ids, greedy=False: block)
    model, plain, _ = case
    assert _one_choice_run(model, plain).metrics.as_dict()["num_accepted_tokens"] < GAMMA + 1


@pytest.fixture(scope="module")
def small():
    return tiny_target(8, seed=3, init_scale=3.0)


SMALL = ((3, 4, 5), (3, 5, 6), (7, 1, 2), (7, 1, 4), (2, 2, 2))  # eos: token 0


def _law(model):
    return exact_continuations(model, [1, 5, 2], 3, rule=_rule(SMALL, (0,)))


def _sampled(model, n: int, seed0: int, drafter=None) -> tuple[list[tuple[int, ...]], list[list[int]]]:
    reqs = sampled_with_rules(model, n, seed0, dict(guided_choice=SMALL), dict(guided_choice=True), gamma=GAMMA,
                              full_share=50, drafter=drafter, eos_token_ids=(0,))
    return [tuple(r.output_ids[:3]) for r in reqs], [r.output_ids for r in reqs]


def test_sampled_outputs_follow_the_guided_law(small):
    law = _law(small)
    assert sum(law[c] for c in SMALL) == pytest.approx(1.0, abs=1e-5)
    firsts, outputs = _sampled(small, 3000, 0)
    assert all(tuple(o[:-1]) in SMALL and o[-1] == 0 for o in outputs)  # a whole choice, then eos
    p = chi_square_pvalue(firsts, law)
    assert p > 1e-3, f"guided output differs from the guided law (chi-square p={p:.2e})"


def test_forced_drafts_of_a_drafter_with_a_draft_vocabulary_follow_the_law(small):
    """The forced drafts' q is one-hot over the drafter's draft vocabulary; forcing stops at a
    token outside it (3 and 7 here)."""
    from test_draft_vocab import make
    firsts, outputs = _sampled(small, 3000, 7 * 10**5, drafter=make("dspark", small))
    assert all(tuple(o[:-1]) in SMALL and o[-1] == 0 for o in outputs)
    p = chi_square_pvalue(firsts, _law(small))
    assert p > 1e-3, f"guided output with a draft-vocabulary drafter differs from the law (p={p:.2e})"


def test_negative_control_forgetting_the_drafts_fails_the_law(small, monkeypatch):
    monkeypatch.setattr(logit_rules, "guide_choices", lambda lg, ch, alive, pos, d, stops: _GUIDE(
        lg, ch, alive, pos, d * 0 - 1, stops))
    assert chi_square_pvalue(_sampled(small, 1000, 10**6)[0], _law(small)) < 1e-3


@pytest.mark.parametrize("kw, field, message", [
    (dict(guided_choice=tuple((3, t) for t in range(ROW_CHOICES + 1))), "guided_choice", f"at most {ROW_CHOICES}"),
    (dict(guided_choice=((3,) * (CHOICE_TOKENS + 1),)), "guided_choice", r"guided_choice\[0\] must be 1 to"),
    (dict(guided_choice=((3, 64),)), "guided_choice", r"in \[0, 64\)"),
    (dict(guided_choice=((3,),), ignore_eos=True), "ignore_eos", "not with ignore_eos"),
    (dict(guided_choice=((3,),), min_tokens=1), "min_tokens", "not served with guided_choice"),
])
def test_bad_choices_are_refused_naming_the_field(case, kw, field, message):
    assert refused_field(case[0], dict(guided_choice=True), PROMPT, kw, message, (EOS,)) == field
    assert refused_field(case[0], {}, PROMPT, dict(guided_choice=((3,),)),
                         "guided_choice needs an engine with guided choices") == "guided_choice"


def test_the_python_api_and_the_server_serve_guided_choice(case):
    """LLM(guided_choice=True) answers one of SamplingParams.guided_choice's texts (the guided greedy
    reference's); the OpenAI server over it answers the same to `guided_choice` and to vLLM's
    `structured_outputs: {"choice": ...}`, and names the field of a bad value."""
    from specjax.api import LLM, SamplingParams
    from specjax.serving.http_server import ServerThread
    from specjax.serving.openai_api import OpenAIApp
    from serving_fixtures import http_json, tiny_chat_tokenizer
    model, _, guided_ref = case
    tok = tiny_chat_tokenizer()
    texts = [" ".join(f"w{t}" for t in c) for c in CHOICES]
    config = dataclasses.replace(model.config, eos_token_ids=(EOS,))  # the tiny tokenizer's "</s>"
    llm = LLM(target=(model, config), max_num_seqs=2, max_model_len=32, max_prefill=8, guided_choice=True,
              sampling_variants=("greedy",))
    llm.tokenizer = tok
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=N, guided_choice=texts))[0]
    assert out.token_ids == guided_ref and out.text in texts and out.finish_reason == "stop", out
    api = OpenAIApp.from_llm(llm, model_name="tiny", tokenizer=tok)
    server = ServerThread(api)
    try:
        status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": PROMPT, "max_tokens": N,
                                                                        "temperature": 0, "guided_choice": texts})
        assert status == 200 and r["choices"][0]["token_ids"] == guided_ref, r
        status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": PROMPT, "max_tokens": N,
                                                                        "temperature": 0,
                                                                        "structured_outputs": {"choice": texts}})
        assert status == 200 and r["choices"][0]["token_ids"] == guided_ref, r  # vLLM's newer spelling
        for bad, param, fragment in [({"guided_choice": "w5"}, "guided_choice", "list of strings"),
                                     ({"guided_choice": []}, "guided_choice", "non-empty list"),
                                     ({"structured_outputs": {"grammar": "x"}}, "structured_outputs",
                                      "grammar not supported"),
                                     ({"structured_outputs": {"json": {}}}, "structured_outputs",
                                      "--guided-regex")]:
            status, r = http_json(server.url + "/v1/completions", "POST", {"prompt": PROMPT, **bad})
            assert status == 400 and r["error"]["param"] == param and fragment in r["error"]["message"], r
    finally:
        server.stop()
        api.engine.drain(60)
        api.engine.shutdown()
