"""The shipped drafters (specjax/assets/pystd/drafters/<name>/, trained for the pystd target).

Every shipped drafter must load against its target; speculative decoding with it through
`specjax.LLM` must give exactly the plain greedy tokens (lossless); and its mean acceptance length
on held-out prompts must reach the floor in ACCEPTANCE_FLOORS (a drafter with broken weights falls
below it: the perturbed-weights control). Drafters that are not shipped are skipped by name.

Remeasure the floors after shipping new drafters: `python tests/test_embedded_drafters.py` prints
each drafter's acceptance length with its trained and with perturbed weights.
"""
from __future__ import annotations

import json
import os

import jax
import pytest

from specjax import embedded as emb

PROMPTS = ("def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n", "import os\nimport sys\n\n\ndef main(")
MAX_TOKENS = 8

# Mean acceptance length floors (greedy, gamma 7; mtp1 gamma 1) on the first HELDOUT_PROMPTS held-out
# prompts, HELDOUT_TOKENS tokens each: the measured value less a margin, above what the same drafter
# reaches with perturbed weights. Measured 2026-12-01 on the pystd drafters (trained / perturbed):
# dspark 1.996 / 1.680, dspark-rnn 1.758 / 1.512, dflash 1.729 / 1.426, eagle3 2.081 / 1.638,
# mtp1 1.623 / 1.447, standalone 2.004 / 1.429.
ACCEPTANCE_FLOORS = {"dspark": 1.85, "dspark-rnn": 1.65, "dflash": 1.6, "eagle3": 1.9, "mtp1": 1.55,
                     "standalone": 1.8}
HELDOUT_PROMPTS, HELDOUT_TOKENS = 16, 32

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(emb.target_dir(), "config.json")),
    reason="the embedded target is not built (make embedded)")


def _shipped() -> list[str]:
    return [n for n in emb.DRAFTER_NAMES
            if os.path.exists(os.path.join(emb.drafter_dir(n), "config.json"))]


def _gamma(name: str) -> int:
    return 1 if name == "mtp1" else 7


def _engine_config(gamma: int | None, policy: str, *, slots: int = 2, prefill: int = 32, max_len: int = 64):
    from specjax.decoding.engine import EngineConfig

    tokens = (1,) if gamma is None else (gamma + 1,)
    return EngineConfig(max_slots=slots, max_len=max_len, gamma=gamma, policy=policy, max_prefill=prefill,
                        slots_buckets=(slots,), tokens_buckets=tokens, prefill_buckets=(prefill,),
                        prefill_batch_buckets=(min(slots, 8),))


def _llm(name: str):
    """`specjax.LLM` on the shipped target with the shipped drafter `name` (fixed gamma), with room
    for the held-out prompts in one batch."""
    from specjax.api import LLM

    cfg = _engine_config(_gamma(name), "fixed", slots=HELDOUT_PROMPTS, prefill=256,
                         max_len=256 + HELDOUT_TOKENS + 8)
    return LLM(target=emb.target_dir(), drafter=emb.drafter_dir(name), engine_config=cfg)


def heldout_acceptance(llm) -> float:
    """Mean acceptance length (bonus token included) over all drafting rounds of greedy decoding of
    the first HELDOUT_PROMPTS held-out prompts."""
    from specjax.api import SamplingParams
    from specjax.io import read_jsonl

    prompts = [row["prompt"] for row in read_jsonl(emb.prompts_path("heldout"), objects=True)][:HELDOUT_PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=HELDOUT_TOKENS))
    drafts = sum(o.metrics["num_drafts"] for o in outs)
    assert drafts > 0
    return 1.0 + sum(o.metrics["num_accepted_tokens"] for o in outs) / drafts


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
    llm.engine.d_params = state


@pytest.fixture(scope="module")
def llms():
    """name -> its LLM, built once for the module (each build compiles the engine)."""
    built = {}

    def get(name: str):
        if not os.path.exists(os.path.join(emb.drafter_dir(name), "config.json")):
            pytest.skip(f"drafter {name} is not shipped")
        if name not in built:
            built[name] = _llm(name)
        return built[name]
    return get


@pytest.fixture(scope="module")
def target():
    from specjax import checkpoints

    return checkpoints.load_target(emb.target_dir())


@pytest.fixture(scope="module")
def plain_tokens(target):
    """Greedy continuations by the target's own KV-cache loop (independent of the engine)."""
    from specjax import checkpoints
    from specjax.api import encode_text

    model, tcfg = target
    tok = checkpoints.load_tokenizer(emb.target_dir())
    eos = tok.eos_token_id
    return [emb.greedy_generate(model, encode_text(tok, p), MAX_TOKENS, eos_token_id=eos)
            for p in PROMPTS]


def test_some_drafter_is_shipped():
    assert _shipped(), "no drafter under specjax/assets/pystd/drafters/"


@pytest.mark.parametrize("name", emb.DRAFTER_NAMES)
def test_loads_against_target(name, target):
    from specjax.drafters import registry

    path = emb.drafter_dir(name)
    if not os.path.exists(os.path.join(path, "config.json")):
        pytest.skip(f"drafter {name} is not shipped")
    model, tcfg = target
    drafter = registry.load_drafter(path, target=model)
    assert drafter is not None
    check = getattr(drafter, "check_target", None) or drafter.config.check_target
    check(tcfg)  # raises ConfigError on a vocabulary / width / tap-layer mismatch
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg.get("vocab_size") == tcfg.vocab_size
    if name in ("dspark", "dspark-rnn", "dflash"):
        assert drafter.gamma == 7 and drafter.config.num_draft_layers == 1
        assert drafter.config.mask_token_id == emb.mask_token_id()
        assert tcfg.num_hidden_layers - 1 not in drafter.config.target_layer_ids
    if name == "dspark":
        assert drafter.config.markov_rank == 64 and drafter.confidence_head is not None


@pytest.mark.parametrize("name", emb.DRAFTER_NAMES)
def test_lossless_greedy(name, plain_tokens, llms):
    """`specjax.LLM` with the shipped target and drafter reproduces the plain greedy tokens exactly."""
    from specjax.api import SamplingParams

    llm = llms(name)
    assert llm.drafter is not None and llm.drafter.gamma == _gamma(name)
    outs = llm.generate(list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == plain_tokens
    assert all(o.metrics["num_drafts"] >= 1 for o in outs)


def test_every_drafter_has_a_floor():
    assert set(ACCEPTANCE_FLOORS) == set(emb.DRAFTER_NAMES)


@pytest.mark.parametrize("name", emb.DRAFTER_NAMES)
def test_acceptance_floor_on_heldout_prompts(name, llms):
    """The trained weights reach the floor; the same drafter with perturbed weights does not."""
    llm = llms(name)
    floor = ACCEPTANCE_FLOORS[name]
    tau = heldout_acceptance(llm)
    assert tau >= floor, f"{name}: mean acceptance length {tau:.3f} on held-out prompts < floor {floor}"
    trained = llm.engine.d_params
    try:
        perturb_drafter(llm)
        broken = heldout_acceptance(llm)
    finally:
        llm.engine.d_params = trained
    assert broken < floor, f"{name}: perturbed weights reach {broken:.3f} >= floor {floor}: the floor has no teeth"


if __name__ == "__main__":  # remeasure: trained and perturbed acceptance length per shipped drafter
    for n in _shipped():
        m = _llm(n)
        trained = heldout_acceptance(m)
        perturb_drafter(m)
        print(f"{n}: trained {trained:.3f}  perturbed {heldout_acceptance(m):.3f}", flush=True)
