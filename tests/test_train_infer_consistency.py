"""Inference equals training: the engine's greedy rounds replayed from each drafter's training forward.

For the shipped DSpark (block drafter with a sequential head and confidences), Eagle3 and MTP-1 on
the real SmolLM2 target: the engine decodes held-out prompts at T=0 under fixed verification; on
the same greedy text, `specjax.eval.consistency.simulate_greedy_rounds` replays every round from
the drafter's training forward (`train_forward` / `ttt_forward`) over the target's features of the
text, and must give the engine's accepted count in every round (so the same tau). Negative
controls: the same replay with the features shifted by one position, or with every tap layer one
layer off (MTP-1: the final norm over the second-to-last layer), must not.
"""
from __future__ import annotations

import numpy as np
import pytest

from specjax import default_target as dt
from specjax.eval.consistency import GreedyRounds, pooled_tau, walk_rounds

NAMES = ("dspark", "eagle3", "mtp1")
PROMPTS, TOKENS = 4, 32
TAU_TOLERANCE = 0.01

needs_target = [pytest.mark.real_target,
                pytest.mark.skipif(not dt.is_installed(), reason=f"{dt.PACKAGE} is not installed (make install)")]


# ------------------------------------------------------------------------------------------------
# the round walk (no model)


def test_walk_follows_the_engine_round_rules():
    """Rounds from anchor a verify min(gamma, cache room, wanted - 1) drafts, accept the prefix
    equal to the text (never past its end) and commit n + 1; ell = 0 rounds are not drafting."""
    prompt = [5, 6]
    text = prompt + [10, 11, 12, 13, 14, 15]  # answer of 6 tokens; last position 7
    drafts = np.full((len(text), 3), -1)
    drafts[2] = [11, 12, 99]  # anchor 2: two accepted, bonus 13 at position 5
    drafts[5] = [14, 15, 16]  # anchor 5: room for min(3, 6 - 4 - 1) = 1 draft: 14 accepted
    r = walk_rounds(2, text, drafts, gamma=3, max_tokens=6, max_len=64)
    assert r == GreedyRounds((3, 1), (2, 1))  # then anchor 7 = the last token: done
    assert r.tau == pytest.approx(2.5)
    # an answer that ended on eos before max_tokens: drafts never count past the text's end
    drafts[5] = [14, 15, 15]
    assert walk_rounds(2, text, drafts, gamma=3, max_tokens=50, max_len=64) == GreedyRounds((3, 3), (2, 2))
    # the cache's room caps the rounds too (anchor 5 may verify 8 - 1 - 5 = 2)
    assert walk_rounds(2, text, drafts, gamma=3, max_tokens=50, max_len=8) == GreedyRounds((3, 2), (2, 2))
    assert pooled_tau([r, GreedyRounds((3,), (0,))]) == pytest.approx(1 + 3 / 3)
    with pytest.raises(ValueError, match="max_tokens"):
        walk_rounds(2, text, drafts, gamma=3, max_tokens=5, max_len=64)


# ------------------------------------------------------------------------------------------------
# the shipped drafters on the real target


@pytest.fixture(scope="module")
def target():
    from specjax import checkpoints

    model, tcfg = checkpoints.load_target(dt.gguf_path())
    return model, tcfg, checkpoints.load_tokenizer(dt.gguf_path())


@pytest.mark.parametrize("name", [pytest.param(n, marks=[*needs_target, pytest.mark.xdist_group(f"drafter-{n}")])
                                  for n in NAMES])
def test_engine_rounds_equal_the_training_forward_replay(name, target):
    """The engine is test_embedded_drafters' (its shape, hence its compiled programs in make test:
    gamma 3, mtp1 1; the replay caps its proposals the same way)."""
    from specjax.eval.consistency import engine_greedy_rounds, simulate_greedy_rounds, text_features
    from test_embedded_drafters import MAX_LEN, _heldout_ids, _llm

    if name not in dt.available_drafters():
        pytest.skip(f"drafter {name} is not shipped")
    model = target[0]
    llm = _llm(name, target[:2])
    prompts = _heldout_ids(target[2], PROMPTS)
    answers, engine = engine_greedy_rounds(llm, prompts, TOKENS)
    assert sum(r.num_drafts for r in engine) > 0 and sum(sum(r.accepted) for r in engine) > 0, engine
    features = text_features(model, [p + a for p, a in zip(prompts, answers)])

    def replay(**control) -> list[GreedyRounds]:
        return simulate_greedy_rounds(model, llm.drafter, prompts, answers, max_tokens=TOKENS,
                                      max_len=MAX_LEN, gamma=llm.engine.gamma, features=features,
                                      **control)

    sim = replay()
    tau_engine, tau_sim = pooled_tau(engine), pooled_tau(sim)
    print(f"{name}: engine tau {tau_engine:.4f}, training-forward replay {tau_sim:.4f} "
          f"over {sum(r.num_drafts for r in engine)} drafting rounds")
    assert abs(tau_engine - tau_sim) <= TAU_TOLERANCE, (tau_engine, tau_sim)
    assert sim == engine, [(e, s) for e, s in zip(engine, sim) if e != s]
    for control in ({"tap_shift": 1}, {"layer_offset": 1 if name != "mtp1" else -1}):
        broken = replay(**control)
        print(f"{name}: replay with {control}: tau {pooled_tau(broken):.4f}")
        assert broken != engine, f"{name}: features misaligned by {control} replay the same rounds"
