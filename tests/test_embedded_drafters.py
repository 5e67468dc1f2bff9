"""The shipped drafters of the embedded default target (SmolLM2-135M-Instruct), on the real model.

Each shipped drafter (specjax/assets/smollm2/drafters/<name>/, built by `make embedded`) must load
through `LLM(drafter=name)`; decode held-out ShareGPT prompts greedily with the target's own tokens
(every answer token the target's argmax given what precedes it, with drafts verified and accepted)
at an acceptance length no lower than its floor (a perturbed copy of DSpark's weights must fall
below its floor). DSpark and Eagle3 (a block drafter with a sequential head, and a serial one) also
sample at T=1 from exactly the target's distribution (a randomized-PIT chi-square on the tokens the
verifier decided, with a power control that must fail); every drafter kind's sampling is exact on
tiny targets (tests/test_drafters_lossless.py), and these two show it on the real model and its
8,192-token draft vocabulary. The recorded split keeps evaluation prompts out of training. Names
that are not shipped are skipped.

Remeasure the floors after a rebuild: `python tests/test_embedded_drafters.py` prints each
drafter's acceptance length with trained and with perturbed weights.
"""
from __future__ import annotations

import glob
import json
import os

import jax
import numpy as np
import pytest
from scipy import special, stats

from specjax import default_target as dt

from reference_decode import continuation_logits, first_non_greedy, randomized_pit

pytestmark = [pytest.mark.real_target,
              pytest.mark.skipif(not dt.is_installed(), reason=f"{dt.PACKAGE} is not installed (make install)")]

EVAL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "eval")
BUDGET_BYTES = 64 * 2**20
PIT_REQUESTS, PIT_TOKENS, PIT_BINS = 8, 48, 8
PIT_DRAFTERS = ("dspark", "eagle3")
# Mean acceptance length floors (greedy; gamma GAMMA, mtp1 gamma 1) on the first HELDOUT_PROMPTS
# held-out prompts, HELDOUT_TOKENS tokens each: the measured value less a margin, above what the
# drafter reaches with perturbed weights. Remeasure with `python tests/test_embedded_drafters.py`.
# MEASURED = (trained, perturbed), measured 2026-12-02 on the shipped build; the perturbed
# control runs for CONTROLLED. GAMMA is 3, not the drafters' 7: every test verifies half the
# tokens per round, and these drafters' held-out acceptance lengths measured the same at 3 as at 7
# (2026-12-02; only DSpark's perturbed copy moved, 1.303 -> 1.296).
GAMMA = 3
# (standalone: remeasured 2026-12-03 after its rebuild as a 2-layer LM trained on text; its first
# build, 1.034 against 1.062 perturbed, could not be told from broken weights and had no floor.)
MEASURED: dict[str, tuple[float, float]] = {
    "dspark": (1.385, 1.296), "dspark-rnn": (1.236, 1.182), "dflash": (1.331, 1.199),
    "eagle3": (1.339, 1.176), "mtp1": (1.303, 1.223), "standalone": (1.249, 1.126)}
ACCEPTANCE_FLOORS: dict[str, float] = {"dspark": 1.34, "dspark-rnn": 1.21, "dflash": 1.29,
                                       "eagle3": 1.29, "mtp1": 1.27, "standalone": 1.20}
CONTROLLED = ("dspark",)

HELDOUT_PROMPTS, HELDOUT_TOKENS = 8, 32
SLOTS, PREFILL, MAX_LEN = 8, 128, 192
# one engine per drafter serves every test, with one slots bucket (8) and one prompt bucket (128:
# held-out prompts; the short PIT prompt pads to it, which costs less than compiling a second one)
SLOTS_BUCKETS, PREFILL_BUCKETS = (SLOTS,), (PREFILL,)
PIT_MESSAGES = [{"role": "system", "content": ""},
                {"role": "user", "content": "Write a short poem about the sea."}]


# make test runs this module under xdist's loadgroup: each drafter's tests share one worker, so
# its engine (the fixture `llms`) is built and its programs loaded once per run
BY_DRAFTER = [pytest.param(n, marks=pytest.mark.xdist_group(f"drafter-{n}")) for n in dt.DRAFTER_NAMES]
PIT_BY_DRAFTER = [p for p in BY_DRAFTER if p.values[0] in PIT_DRAFTERS]


def _shipped() -> list[str]:
    return dt.available_drafters()


def _gamma(name: str) -> int:
    return 1 if name == "mtp1" else GAMMA


def _heldout_ids(tok, n: int) -> list[list[int]]:
    """The first n held-out prompts that fit the engine's prefill bucket, chat-templated."""
    from specjax.request_builder import encode_chat
    from specjax.io import read_jsonl

    out = []
    for row in read_jsonl(dt.heldout_prompts_path(), objects=True):
        ids = encode_chat(tok, [{"role": "user", "content": row["turns"][0]}])
        if len(ids) <= PREFILL:
            out.append(ids)
        if len(out) == n:
            return out
    raise AssertionError(f"fewer than {n} held-out prompts fit {PREFILL} tokens")


def _engine_config(name: str):
    """The one engine shape every test of drafter `name` uses (so its programs compile once)."""
    from specjax.decoding.engine import EngineConfig

    g = _gamma(name)
    return EngineConfig(max_slots=SLOTS, max_len=MAX_LEN, gamma=g, policy="fixed",
                        max_prefill=PREFILL, slots_buckets=SLOTS_BUCKETS, tokens_buckets=(g + 1,),
                        prefill_buckets=PREFILL_BUCKETS, prefill_batch_buckets=SLOTS_BUCKETS,
                        # greedy rounds, and sampled ones for the T=1 test (none here filters top-k / top-p)
                        sampling_variants=("greedy", "plain") if name in PIT_DRAFTERS else ("greedy",))


def _llm(name: str, target: tuple):
    """The shipped drafter `name` on an already loaded (model, config) of the default target, with
    the buckets above (the `llms` fixture builds them as a user does, `LLM(drafter=name)`)."""
    from specjax.api import LLM

    return LLM(target=target, drafter=dt.drafter_dir(name), tokenizer=dt.gguf_path(),
               engine_config=_engine_config(name))


@pytest.fixture(scope="session")
def llms():
    """name -> `LLM(drafter=name)` (the default target and its shipped drafter of that name, as a user
    builds it) with the buckets above, built once per xdist worker (session scope: tests of other
    modules run in between do not tear it down; a second worker's build of the same engine reads the
    run's compilation cache)."""
    from specjax.api import LLM
    built = {}

    def get(name: str):
        if name not in _shipped():
            pytest.skip(f"drafter {name} is not shipped")
        if name not in built:
            built[name] = LLM(drafter=name, engine_config=_engine_config(name))
        return built[name]
    return get


@pytest.fixture(scope="session")
def target():
    from specjax import checkpoints

    model, tcfg = checkpoints.load_target(dt.gguf_path())
    return model, tcfg, checkpoints.load_tokenizer(dt.gguf_path())


@pytest.fixture(scope="session")
def heldout_prompts(target):
    return _heldout_ids(target[2], HELDOUT_PROMPTS)


@pytest.fixture(scope="session")
def verified_greedy() -> set:
    """Answer sets already checked against the target (every drafter must give the same ones, so
    each worker runs the reference forward once per distinct set)."""
    return set()


def test_shipped_drafters_fit_the_budget():
    names = _shipped()
    assert names, f"no drafter under {dt.asset_dir()}/drafters: run `{dt.BUILD_COMMAND}`"
    sizes = {n: sum(os.path.getsize(f) for f in glob.glob(os.path.join(dt.drafter_dir(n), "*")))
             for n in names}
    assert sum(sizes.values()) <= BUDGET_BYTES, sizes


@pytest.mark.parametrize("name", dt.DRAFTER_NAMES)
def test_loads_against_target(name, target):
    from specjax.drafters import registry

    if name not in _shipped():
        pytest.skip(f"drafter {name} is not shipped")
    model, tcfg, _ = target
    drafter = registry.load_drafter(dt.drafter_dir(name), target=model)
    check = getattr(drafter, "check_target", None) or drafter.config.check_target
    check(tcfg)  # raises ConfigError on a vocabulary / width / tap-layer mismatch
    with open(os.path.join(dt.drafter_dir(name), "config.json")) as f:
        cfg = json.load(f)
    assert cfg["vocab_size"] == tcfg.vocab_size == 49152
    if name != "standalone":
        assert cfg["draft_vocab_size"] == 8192
    if name in ("dspark", "dspark-rnn", "dflash"):
        assert drafter.gamma == 7 and drafter.config.mask_token_id == 16
    if name in ("dspark", "dspark-rnn"):
        assert drafter.confidence_head is not None
        assert len(cfg["confidence_temperatures"]) == 7  # STS-calibrated
    if name == "dspark-rnn":
        assert cfg["markov_head_type"] == "rnn"


@pytest.mark.xdist_group("drafter-mtp1")
def test_llm_takes_a_shipped_drafter_by_name(llms):
    """`LLM(drafter="mtp1")` (the `llms` fixture's build) loads the default target, its tokenizer and
    the shipped drafter of that name, and decodes with it."""
    from specjax.api import SamplingParams

    llm = llms("mtp1")
    assert type(llm.drafter).__name__ == "MTPDrafter" and llm.tokenizer is not None, type(llm.drafter)
    out = llm.generate("Name a color.", SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert len(out.token_ids) == 6 and out.metrics["num_drafts"] >= 1


def _pit_pvalue(u: np.ndarray) -> float:
    counts = np.bincount(np.minimum((u * PIT_BINS).astype(int), PIT_BINS - 1), minlength=PIT_BINS)
    return float(stats.chisquare(counts).pvalue)


@pytest.mark.parametrize("name", PIT_BY_DRAFTER)
def test_t1_tokens_follow_the_target_distribution(name, target, llms):
    """At T=1 every token after the first of an answer (each one decided by a verification) is
    drawn from the target's p(. | prompt, the answer before it): their randomized PITs (the
    Rosenblatt transform) are i.i.d. uniform, checked by a chi-square. Power control: the same
    tokens judged against the target at T=0.85 must fail."""
    from specjax.api import SamplingParams

    from specjax.request_builder import encode_chat

    model, _, tok = target
    llm = llms(name)
    prompt = encode_chat(tok, PIT_MESSAGES)
    sps = [SamplingParams(temperature=1.0, max_tokens=PIT_TOKENS, seed=i) for i in range(PIT_REQUESTS)]
    outs = [o for o in llm.generate([prompt] * PIT_REQUESTS, sps) if len(o.token_ids) > 1]
    start = len(prompt) + 1  # the first answer token comes from the prefill, not a verification
    logits = continuation_logits(model, [prompt + o.token_ids for o in outs], start)  # one forward
    tokens = [t for o in outs for t in o.token_ids[1:]]
    assert len(tokens) >= PIT_REQUESTS * PIT_TOKENS // 2, len(tokens)
    for temp, should_pass in ((1.0, True), (0.85, False)):
        probs = special.softmax(np.concatenate(logits) / temp, axis=-1)
        pv = _pit_pvalue(randomized_pit(tokens, probs))
        print(f"{name}: PIT chi-square p-value at T={temp} over {len(tokens)} tokens: {pv:.3g}")
        if should_pass:
            assert pv > 1e-3, f"{name}: T=1 samples are not the target's (p = {pv:.2e})"
        else:
            assert pv < 1e-3, f"{name}: the PIT test cannot tell T=0.85 from T=1 (p = {pv:.2e})"
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert accepted >= len(tokens) // 20, f"{name}: only {accepted} draft tokens accepted"


def heldout_greedy(llm, tok, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Greedy answers (HELDOUT_TOKENS each, or fewer ending in eos) to the held-out `prompts`,
    decoded together, and the mean acceptance length (bonus token included) over all drafting
    rounds."""
    from specjax.api import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=HELDOUT_TOKENS))
    for o in outs:
        assert len(o.token_ids) == HELDOUT_TOKENS or o.token_ids[-1] == tok.eos_token_id, o.token_ids
    drafts = sum(o.metrics["num_drafts"] for o in outs)
    assert drafts > 0
    return [o.token_ids for o in outs], 1.0 + sum(o.metrics["num_accepted_tokens"] for o in outs) / drafts


def perturb_drafter(llm, seed: int = 0) -> None:
    """Replace the engine's drafter weights: every trainable parameter gets Gaussian noise of its
    own standard deviation (the frozen target copies stay). Same shapes, so nothing recompiles."""
    from flax import nnx

    graph, params, rest = nnx.split(llm.drafter, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + jax.random.normal(k, x.shape, x.dtype) * (x.std() if x.size > 1 else 1.0)
             for k, x in zip(keys, leaves)]
    _, state = nnx.split(nnx.merge(graph, jax.tree.unflatten(treedef, noisy), rest))
    llm.engine.runner.d_params = state


@pytest.mark.parametrize("name", BY_DRAFTER)
def test_greedy_is_the_targets_and_reaches_the_floor(name, target, llms, heldout_prompts, verified_greedy):
    """Speculative greedy decoding of held-out prompts with the shipped drafter gives the target's
    own greedy tokens (each the target's argmax given the prompt and the answer before it; control:
    an answer with one token changed is caught there), with drafts accepted at no less than the
    drafter's floor; for CONTROLLED, the same drafter with perturbed weights falls below it."""
    llm, (model, tcfg, tok), prompts = llms(name), target, heldout_prompts
    answers, tau = heldout_greedy(llm, tok, prompts)
    if tuple(map(tuple, answers)) not in verified_greedy:
        k = len(answers[0]) // 2
        changed = answers[0][:k] + [(answers[0][k] + 1) % tcfg.vocab_size] + answers[0][k + 1:]
        assert first_non_greedy(model, prompts + prompts[:1], answers + [changed]) == [None] * len(answers) + [k]
        verified_greedy.add(tuple(map(tuple, answers)))
    assert tau > 1.0, f"{name}: no draft token was accepted"
    if name not in ACCEPTANCE_FLOORS:
        return
    floor = ACCEPTANCE_FLOORS[name]
    assert tau >= floor, f"{name}: acceptance length {tau:.3f} on held-out prompts < floor {floor}"
    if name not in CONTROLLED:
        return
    trained = llm.engine.runner.d_params
    try:
        perturb_drafter(llm)
        broken = heldout_greedy(llm, tok, prompts)[1]
    finally:
        llm.engine.runner.d_params = trained
    assert broken < floor, f"{name}: perturbed weights reach {broken:.3f} >= floor {floor}"


def test_floors_lie_between_the_measured_trained_and_perturbed_values():
    """Every floor is at or below what the trained drafter measured and above its perturbed copy,
    so the floor test passes on the shipped weights and would fail on broken ones."""
    for name, floor in ACCEPTANCE_FLOORS.items():
        trained, perturbed = MEASURED[name]
        assert perturbed < floor <= trained, (name, MEASURED[name], floor)


def split_leaks(split: dict, eval_dir: str) -> list[str]:
    """Evaluation prompts the recorded split would train on or hold out (should be none), plus
    evaluation files the split did not exclude."""
    from specjax.training.sharegpt import eval_prompt_keys, normalize, prompt_digest

    files = sorted(glob.glob(os.path.join(eval_dir, "*.jsonl")))
    problems = [f"not excluded: {os.path.basename(f)}" for f in files
                if os.path.basename(f) not in split["excluded_eval_files"]]
    keys = eval_prompt_keys(files)
    digests = {prompt_digest(k) for k in keys}
    problems += [f"trained on {d}" for d in sorted(digests & set(split["train_prompt_digests"]))]
    from specjax.io import read_jsonl

    problems += [f"held out {r['id']}" for r in read_jsonl(dt.heldout_prompts_path(), objects=True)
                 if normalize(r["turns"][0]) in keys]
    return problems


def test_recorded_split_excludes_evaluation_prompts():
    if not os.path.isfile(dt.split_path()):
        pytest.skip(f"no recorded split: run `{dt.BUILD_COMMAND}`")
    if not glob.glob(os.path.join(EVAL_DIR, "*.jsonl")):  # with no sets, no leak could be seen
        pytest.skip(f"no evaluation prompt sets under {os.path.normpath(EVAL_DIR)} (the shared eval sets)")
    with open(dt.split_path()) as f:
        split = json.load(f)
    assert len(split["train_prompt_digests"]) >= 100 and split["heldout_ids"]
    assert split_leaks(split, EVAL_DIR) == []
    # negative control: an evaluation prompt slipped into the training digests is caught
    from specjax.training.sharegpt import eval_prompt_keys, prompt_digest

    one = sorted(eval_prompt_keys([sorted(glob.glob(os.path.join(EVAL_DIR, "*.jsonl")))[0]]))[0]
    bad = dict(split, train_prompt_digests=split["train_prompt_digests"] + [prompt_digest(one)])
    assert len(split_leaks(bad, EVAL_DIR)) == 1


if __name__ == "__main__":  # remeasure: trained and perturbed acceptance length per drafter
    from specjax import checkpoints

    tk = checkpoints.load_tokenizer(dt.gguf_path())
    loaded = checkpoints.load_target(dt.gguf_path())
    held = _heldout_ids(tk, HELDOUT_PROMPTS)
    for n in _shipped():
        m = _llm(n, loaded)
        trained_tau = heldout_greedy(m, tk, held)[1]
        perturb_drafter(m)
        print(f'"{n}": ({trained_tau:.3f}, {heldout_greedy(m, tk, held)[1]:.3f}),', flush=True)
