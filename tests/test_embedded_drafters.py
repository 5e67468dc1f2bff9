"""The shipped drafters of the embedded default (specjax/assets/pystd/drafters/<name>/).

Every shipped drafter must load against the shipped target, and speculative decoding with it
through `specjax.LLM(drafter=name)` must give exactly the plain greedy tokens (lossless) with a
mean acceptance length of at least 1. Drafters that are not shipped are skipped by name.
"""
from __future__ import annotations

import json
import os

import pytest

from specjax import embedded as emb

PROMPTS = ("def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n", "import os\nimport sys\n\n\ndef main(")
MAX_TOKENS = 8

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(emb.target_dir(), "config.json")),
    reason="the embedded target is not built (make embedded)")


def _shipped() -> list[str]:
    return [n for n in emb.DRAFTER_NAMES
            if os.path.exists(os.path.join(emb.drafter_dir(n), "config.json"))]


def _engine_config(gamma: int | None, policy: str):
    from specjax.decoding.engine import EngineConfig

    tokens = (1,) if gamma is None else (gamma + 1,)
    return EngineConfig(max_slots=2, max_len=64, gamma=gamma, policy=policy, max_prefill=32,
                        slots_buckets=(2,), tokens_buckets=tokens, prefill_buckets=(32,),
                        prefill_batch_buckets=(2,))


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
def test_lossless_greedy(name, plain_tokens):
    """`specjax.LLM(drafter=name)` (embedded target, name resolved to the shipped directory)
    reproduces the plain greedy tokens exactly, with at least one token per round."""
    from specjax.api import LLM, SamplingParams

    if not os.path.exists(os.path.join(emb.drafter_dir(name), "config.json")):
        pytest.skip(f"drafter {name} is not shipped")
    gamma = 1 if name == "mtp1" else 7
    llm = LLM(drafter=name, engine_config=_engine_config(gamma, "fixed"))
    assert llm.drafter is not None and llm.drafter.gamma == gamma
    outs = llm.generate(list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == plain_tokens
    for o in outs:
        assert o.metrics["num_drafts"] >= 1
        assert o.metrics["mean_acceptance_length"] >= 1.0
