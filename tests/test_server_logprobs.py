"""Log-probabilities: each output token's log-probability and its top alternatives come from the target's
distribution after the request's temperature / top-k / top-p (temperature 0 read as 1), so they equal a
cache-free teacher-forced reference within 1e-5, with or without speculation, greedy or sampled; and
the server answers them in OpenAI's chat and completions formats (streamed or not). Completions' `echo`
adds the prompt tokens' entries (the engine's `score` program), checked against the same reference."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

try:
    from tests.engine_fixtures import tiny_target
    from tests.reference_decode import continuation_logits
    from tests.serving_fixtures import http_json, shared_tiny_llm, tiny_chat_tokenizer
except ImportError:  # tests/ itself on sys.path
    from engine_fixtures import tiny_target
    from reference_decode import continuation_logits
    from serving_fixtures import http_json, shared_tiny_llm, tiny_chat_tokenizer

from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.drafters.ngram import NGramDrafter
from specjax.sampling import SamplingArrays, probs_from_logits

VOCAB, K = 48, 5
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10], [3, 4, 5, 6, 7, 8, 3, 4]]
SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, top_k=20, top_p=0.9, seed=3),
            dict(temperature=1.3, min_p=0.5, seed=4)]  # min_p 0.5 drops tokens of this flat target


@pytest.fixture(scope="module")
def engines():
    model = tiny_target(VOCAB, init_scale=3.0)

    def make(drafter, policy, tokens):
        cfg = EngineConfig(max_slots=4, max_len=64, policy=policy, slots_buckets=(4,), tokens_buckets=tokens,
                           prefill_buckets=(16,), max_prefill=16, prefill_batch_buckets=(4,), max_logprobs=K)
        eng = Engine(model, drafter, cfg, progress=False)
        eng.warmup()
        return eng
    return model, {"plain": make(None, "plain", (1,)), "spec": make(NGramDrafter(VOCAB, gamma=3), "fixed", (1, 4))}


def _run(eng: Engine, logprobs: int = K) -> list[EngineRequest]:
    reqs = [EngineRequest(request_id=str(i), prompt_ids=p, max_tokens=12, logprobs=logprobs, **sp)
            for i, (p, sp) in enumerate((p, sp) for p in PROMPTS for sp in SAMPLING)]
    return eng.run(reqs)


def _reference(model, req: EngineRequest) -> np.ndarray:
    """log p(token | prefix) over the vocabulary for each output token: [n, V]."""
    return _reference_at(model, req.prompt_ids + req.output_ids, len(req.prompt_ids),
                         dict(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p))


def _reference_at(model, seq: list[int], start: int, sampling: dict) -> np.ndarray:
    """log p(seq[j] | seq[:j]) over the vocabulary for j >= start, after `sampling`'s temperature (0 read
    as 1), top-k and top-p: [n, V] (outside the top-k / top-p set: -inf)."""
    logits = continuation_logits(model, [seq], start)[0]
    t = sampling.get("temperature", 1.0) or 1.0
    sa = SamplingArrays.broadcast(1, t, sampling.get("top_k", 0), sampling.get("top_p", 1.0),
                                  sampling.get("min_p", 0.0))
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(probs_from_logits(jnp.asarray(logits, jnp.float32)[None], sa))[0])


def _check_entries(ref: np.ndarray, tokens: list[int], entries, k: int) -> None:
    """Engine log-probability entries (token's, top ids, top values) against reference rows [n, V]."""
    assert len(entries) == len(tokens) == len(ref)
    np.testing.assert_allclose([e[0] for e in entries], ref[np.arange(len(tokens)), tokens], atol=1e-5)
    for j, (_, ids, lps) in enumerate(entries):
        assert len(ids) == k and lps == sorted(lps, reverse=True)
        finite = np.isfinite(lps)
        np.testing.assert_allclose(np.array(lps)[finite], ref[j, ids][finite], atol=1e-5)
        np.testing.assert_allclose(np.array(lps)[finite], np.sort(ref[j])[::-1][:k][finite], atol=1e-5)


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_logprobs_equal_the_teacher_forced_target_distribution(engines, kind):
    model, engs = engines
    reqs = _run(engs[kind])
    if kind == "spec":
        assert sum(r.metrics.num_accepted_tokens for r in reqs) > 0  # multi-token rounds were exercised
    for r in reqs:
        assert len(r.output_logprobs) == len(r.output_ids) > 0
        _check_entries(_reference(model, r), r.output_ids, r.output_logprobs, K)
        # every emitted token is inside the request's top-k / top-p set
        assert np.all(np.isfinite([lp for lp, _, _ in r.output_logprobs]))


def test_greedy_logprobs_are_the_same_with_and_without_speculation(engines):
    _, engs = engines
    spec = {r.request_id: r for r in _run(engs["spec"])}
    for a in _run(engs["plain"]):
        b = spec[a.request_id]
        if a.temperature == 0:
            assert a.output_ids == b.output_ids
            np.testing.assert_allclose([x[0] for x in a.output_logprobs], [x[0] for x in b.output_logprobs],
                                       atol=1e-5)
            assert [x[1] for x in a.output_logprobs] == [x[1] for x in b.output_logprobs]


def test_logprobs_are_opt_in_and_bounded(engines):
    _, engs = engines
    reqs = _run(engs["spec"], logprobs=None)
    assert all(r.output_logprobs == [] for r in reqs)
    with pytest.raises(ValueError, match="logprobs must be in"):
        engs["spec"].add_request(EngineRequest(request_id="x", prompt_ids=[5], max_tokens=2, logprobs=K + 1))
    bare = Engine(engines[0], None, EngineConfig(max_slots=1, max_len=16), progress=False)  # max_logprobs 0
    with pytest.raises(ValueError, match="max_logprobs = 0"):  # refused at admission, not a failure mid-round
        bare.add_request(EngineRequest(request_id="y", prompt_ids=[5], max_tokens=2, logprobs=0))


def test_rounds_compute_logprobs_only_when_a_row_asks(engines):
    """`logprobs` is a static field of a round's bucket key: a round where no row asked runs the lean
    program (no log-softmax, no top-N outputs) in its narrowest variant; a round with such a row runs
    the widest compiled variant, the only one compiled with log-probabilities (same tokens)."""
    from specjax.decoding.runner import FAMILIES
    from specjax.sampling import VARIANTS
    _, engs = engines
    eng = engs["spec"]
    fused = FAMILIES["fused"].bucket
    idx = [fused.index(name) for name in ("tokens", "logprobs", "variant")]
    assert {tuple(k[i] for i in idx) for f, k in eng.warm_keys() if f == "fused"} == (
        {(t, False, v) for t in (1, 4) for v in VARIANTS} | {(t, True, "filtered") for t in (1, 4)})
    warmed, seen, run = eng.compile_counts(), [], eng.runner.run

    def spy(family, k, **kw):
        out = run(family, k, **kw)
        if family != "prefill":
            seen.append((k[fused.index("logprobs")], k[fused.index("variant")], "logprob" in out))
        return out
    eng.runner.run = spy
    try:
        lean = eng.run([EngineRequest(request_id="a", prompt_ids=PROMPTS[0], max_tokens=8, temperature=0.0)])
        assert seen and set(seen) == {(False, "greedy", False)}, seen
        seen.clear()
        asked = eng.run([EngineRequest(request_id="b", prompt_ids=PROMPTS[0], max_tokens=8, temperature=0.0,
                                       logprobs=2)])
        assert seen and set(seen) == {(True, "filtered", True)}, seen
    finally:
        eng.runner.run = run
    assert asked[0].output_ids == lean[0].output_ids and len(asked[0].output_logprobs) == 8
    assert eng.compile_counts() == warmed  # both kinds of round were compiled at warm-up


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_prompt_scores_equal_the_teacher_forced_target_distribution(engines, kind):
    """Echo's prompt log-likelihoods (the `score` program), greedy and sampled, with and without a drafter."""
    model, engs = engines
    eng = engs[kind]
    before = eng.runner.compile_counts()["score"]
    for p in PROMPTS:
        for sp in SAMPLING:
            req = EngineRequest(request_id="s", prompt_ids=p, max_tokens=1, logprobs=K, **sp)
            ref = _reference_at(model, p, 1, sp)
            entries, ranks = eng.score(req)
            _check_entries(ref, p[1:], entries, K)
            own = ref[np.arange(len(p) - 1), p[1:]]
            assert ranks == (1 + (ref > own[:, None]).sum(axis=1)).tolist()  # 1: the most likely
    assert eng.runner.compile_counts()["score"] == before  # warmed at start: scoring never compiles
    with pytest.raises(ValueError, match="largest bucket"):
        eng.score(EngineRequest(request_id="s", prompt_ids=[5] * 17, max_tokens=1, logprobs=K))


@pytest.fixture(scope="module")
def served():
    from specjax.serving.http_server import ServerThread
    from specjax.serving.openai_api import OpenAIApp
    llm = shared_tiny_llm()
    api = OpenAIApp.from_llm(llm, model_name="tiny", tokenizer=tiny_chat_tokenizer())
    server = ServerThread(api)
    try:
        yield llm, server.url
    finally:
        server.stop()
        api.engine.drain(60)
        api.engine.shutdown()


@pytest.mark.parametrize("sampling", [dict(temperature=0.0),
                                      dict(temperature=0.9, top_k=30, top_p=0.95, min_p=0.5, seed=7)])
def test_echo_returns_the_prompt_with_its_logprobs(served, sampling):
    llm, url = served
    prompt = [5, 6, 7, 9, 5, 6, 7, 9, 11]
    tok = tiny_chat_tokenizer()
    text = tok.decode(prompt)
    body = {"prompt": text, "max_tokens": 4, **sampling}
    _, plain = http_json(url + "/v1/completions", "POST", {**body, "logprobs": 3})
    status, echo = http_json(url + "/v1/completions", "POST", {**body, "echo": True, "logprobs": 3})
    assert status == 200, echo
    c, p = echo["choices"][0], plain["choices"][0]
    assert c["token_ids"] == p["token_ids"] and c["text"] == text + p["text"]  # greedy or seeded: the same
    lp, n = c["logprobs"], len(prompt)
    assert lp["tokens"][:n] == [tok.decode([t]) for t in prompt] and len(lp["tokens"]) == n + len(c["token_ids"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offsets = np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1].tolist()
    assert lp["text_offset"] == offsets
    ref = _reference_at(llm.model, prompt, 1, sampling)
    ref = np.maximum(ref, -9999.0)
    np.testing.assert_allclose(lp["token_logprobs"][1:n], ref[np.arange(n - 1), prompt[1:]], atol=1e-5)
    for j in range(1, n):
        top = lp["top_logprobs"][j]
        assert len(top) == 3
        np.testing.assert_allclose(sorted(top.values(), reverse=True), np.sort(ref[j - 1])[::-1][:3], atol=1e-5)
    np.testing.assert_allclose(lp["token_logprobs"][n:], p["logprobs"]["token_logprobs"], atol=1e-5)
    # without logprobs: the text only; max_tokens 0: the prompt alone (with its logprobs)
    status, bare = http_json(url + "/v1/completions", "POST", {**body, "echo": True})
    assert status == 200 and bare["choices"][0]["logprobs"] is None and bare["choices"][0]["text"].startswith(text)
    status, only = http_json(url + "/v1/completions", "POST", {**body, "echo": True, "logprobs": 3, "max_tokens": 0,
                                                               "n": 2})
    assert status == 200, only
    assert [ch["text"] for ch in only["choices"]] == [text, text] and only["usage"]["completion_tokens"] == 0
    assert only["choices"][1]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]


def test_echo_refusals(served):
    _, url = served
    for body, param, words in [({"prompt": [5, 6], "max_tokens": 0}, "max_tokens", "only with 'echo'"),
                               ({"prompt": [5, 6], "echo": True, "stream": True}, "echo", "stream"),
                               ({"prompt": [5] * 33, "echo": True, "logprobs": 1}, "prompt", "at most 32"),
                               ({"prompt": [5, 6], "max_tokens": -1, "echo": True}, "max_tokens", "positive")]:
        status, r = http_json(url + "/v1/completions", "POST", body)
        assert status == 400 and r["error"]["param"] == param and words in r["error"]["message"], r


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.7, top_k=30, seed=2)])
def test_prompt_logprobs_equal_the_reference_with_their_ranks(served, sampling):
    """vLLM's `prompt_logprobs` k: per prompt token after the first, the token's own log-probability
    and rank and the top k (ranks 1..k) under the request's sampling; completions put them in each
    choice, chat at the top of the answer."""
    llm, url = served
    prompt = [5, 6, 7, 9, 5, 6, 7, 9, 11]
    status, r = http_json(url + "/v1/completions", "POST", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3,
                                                            "n": 2, **sampling})
    assert status == 200, r
    plp = r["choices"][0]["prompt_logprobs"]
    assert r["choices"][1]["prompt_logprobs"] == plp and plp[0] is None and len(plp) == len(prompt)
    ref = np.maximum(_reference_at(llm.model, prompt, 1, sampling), -9999.0)
    for j in range(1, len(prompt)):
        row, t = ref[j - 1], prompt[j]
        own = plp[j][str(t)]
        assert own["rank"] == 1 + int((row > row[t]).sum()) and own["decoded_token"] == tiny_chat_tokenizer().decode([t])
        np.testing.assert_allclose(own["logprob"], row[t], atol=1e-5)
        top = sorted((v["rank"], v["logprob"]) for u, v in plp[j].items() if v["rank"] <= 3)
        assert [k for k, _ in top][:3] == [1, 2, 3]
        np.testing.assert_allclose([v for _, v in top][:3], np.sort(row)[::-1][:3], atol=1e-5)
        assert len(plp[j]) in (3, 4)  # the top 3, and the prompt's token when it is not among them
    chat = {"messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 2, "prompt_logprobs": 0}
    status, c = http_json(url + "/v1/chat/completions", "POST", chat)
    assert status == 200 and "prompt_logprobs" not in c["choices"][0], c
    assert c["prompt_logprobs"][0] is None and all(len(d) == 1 for d in c["prompt_logprobs"][1:])
    for body, words in [({"prompt_logprobs": 21}, "[0, 20]"), ({"prompt_logprobs": 1, "stream": True}, "stream"),
                        ({"prompt_logprobs": 1, "prompt": [5] * 33}, "at most 32")]:
        status, e = http_json(url + "/v1/completions", "POST", {"prompt": [5, 6], **body})
        assert status == 400 and words in e["error"]["message"], e
        assert e["error"]["param"] == ("prompt" if "prompt" in body else "prompt_logprobs"), e
