"""Training data: chat loss masks, anchors, labels, eval mask, positions, attention mask, batching."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specjax.drafters import block_layout as BL
from specjax.training import data as D

SIMPLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# renders the last assistant turn with an empty think block (like Qwen3), and the generation prompt
# gets one only when thinking is disabled: prefixes of a conversation are not prefixes of the whole
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                   "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["hello there, how are you today?", "I am fine, thank you very much.",
                           "user assistant system think", "What is two plus two? It is four."],
                          trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>")
    fast.chat_template = SIMPLE_TEMPLATE
    return fast


CONV = [{"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "I am fine, thank you."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four."}]


def _masked_text(tok, ids, mask):
    return tok.decode(ids[mask.astype(bool)].tolist(), skip_special_tokens=False)


def test_chat_mask_covers_assistant_content_and_end_marker(tok):
    ids, mask = D.assistant_loss_mask(tok, CONV)
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and ids.shape == mask.shape
    full = tok.decode(ids.tolist(), skip_special_tokens=False)
    assert full == tok.apply_chat_template(CONV, tokenize=False)
    assert _masked_text(tok, ids, mask) == "I am fine, thank you.<|im_end|>\nIt is four.<|im_end|>\n"
    # the mask is two contiguous runs; the token before each run ends the assistant header
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    starts, ends = edges[::2], edges[1::2]
    assert len(starts) == 2
    for s in starts:
        assert tok.decode(ids[:s].tolist(), skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert ends[-1] == len(ids)


def test_chat_mask_with_turn_dependent_template(tok):
    tok2 = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<|endoftext|>")
    tok2.chat_template = THINK_TEMPLATE
    ids, mask = D.assistant_loss_mask(tok2, CONV)
    # thinking on: the generation prompt is the bare header, so the final think block is supervised
    assert _masked_text(tok2, ids, mask) == ("I am fine, thank you.<|im_end|>\n"
                                             "<think></think>It is four.<|im_end|>\n")
    ids, mask = D.assistant_loss_mask(tok2, CONV, enable_thinking=False)
    # thinking off: the empty think block is part of the prompt, not of the answer
    assert _masked_text(tok2, ids, mask) == "I am fine, thank you.<|im_end|>\nIt is four.<|im_end|>\n"
    assert "<think></think>" in tok2.decode(ids.tolist(), skip_special_tokens=False)


def test_chat_mask_system_prompt_and_truncation(tok):
    ids, mask = D.assistant_loss_mask(tok, CONV[:2], system_prompt="You are helpful.")
    text = tok.decode(ids.tolist(), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are helpful.<|im_end|>\n")
    assert _masked_text(tok, ids, mask) == "I am fine, thank you.<|im_end|>\n"
    ids2, mask2 = D.assistant_loss_mask(tok, CONV[:2], max_length=7)
    assert len(ids2) == len(mask2) == 7
    ids3, mask3 = D.assistant_loss_mask(tok, CONV[:1])
    assert mask3.sum() == 0 and len(ids3) > 0


def test_chat_mask_bad_input(tok):
    with pytest.raises(ValueError, match=r"conversation\[1\]\.content"):
        D.assistant_loss_mask(tok, [{"role": "user", "content": "hi"}, {"role": "assistant"}])
    with pytest.raises(ValueError, match="conversation"):
        D.assistant_loss_mask(tok, "hello")
    plain = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<|endoftext|>")
    with pytest.raises(ValueError, match="chat_template"):
        D.assistant_loss_mask(plain, CONV)


def test_completion_loss_mask(tok):
    ids, mask = D.completion_loss_mask(tok, "What is two plus two?", " It is four.")
    assert _masked_text(tok, ids, mask) == " It is four.<|endoftext|>"
    assert tok.decode(ids[~mask.astype(bool)].tolist()) == "What is two plus two?"
    ids, mask = D.completion_loss_mask(tok, "hello", " there", add_eos=False)
    assert _masked_text(tok, ids, mask) == " there"


# ------------------------------------------------------------------------------------------------
# anchors and block layout (reference §12)


def test_anchor_candidates():
    lm = np.array([[0, 0, 1, 1, 1, 0, 1, 1, 0, 1]])
    cand = np.asarray(BL.anchor_candidates(lm))
    assert np.flatnonzero(cand[0]).tolist() == [2, 3, 6]
    # the last position is never a candidate
    assert not np.asarray(BL.anchor_candidates(np.ones((1, 4))))[0, -1]


def _check_anchor_draw(anchors, keep, cand, num):
    for b in range(anchors.shape[0]):
        kept = anchors[b][keep[b]]
        n_c = int(cand[b].sum())
        assert len(kept) == min(num, n_c)
        assert np.all(cand[b][kept])
        assert np.all(np.diff(kept) > 0)  # unique and sorted ascending
        assert keep[b][:len(kept)].all() and not keep[b][len(kept):].any()  # dummies last
        assert np.all(anchors[b][~keep[b]] == 0)


def test_sample_anchors_jax_and_numpy():
    lm = np.array([[0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 0],
                   [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    cand = np.asarray(BL.anchor_candidates(lm))
    draw = jax.jit(BL.sample_anchors, static_argnums=2)
    for seed in range(3):
        for num in (2, 4, 20):
            a, k = draw(jax.random.key(seed), jnp.asarray(lm), num)
            assert a.shape == (2, num) and a.dtype == jnp.int32 and k.dtype == jnp.bool_
            _check_anchor_draw(np.asarray(a), np.asarray(k), cand, num)
            a, k = BL.sample_anchors(np.random.default_rng(seed), lm, num)
            assert isinstance(a, np.ndarray) and a.shape == (2, num)
            _check_anchor_draw(a, k, cand, num)


def test_sample_anchors_is_uniform():
    lm = np.array([[1, 1, 0, 1, 1, 0, 1, 1]])  # candidates 0, 3, 6
    keys = jax.random.split(jax.random.key(0), 3000)
    a, _ = jax.jit(jax.vmap(lambda kk: BL.sample_anchors(kk, lm, 1)))(keys)
    counts = np.bincount(np.asarray(a)[:, 0, 0], minlength=8)[[0, 3, 6]]
    assert counts.sum() == 3000
    np.testing.assert_allclose(counts / 3000, 1 / 3, atol=0.04)
    rng = np.random.default_rng(0)
    pairs = [tuple(BL.sample_anchors(rng, lm, 2)[0][0]) for _ in range(1500)]
    freq = {p: pairs.count(p) / 1500 for p in set(pairs)}
    assert set(freq) == {(0, 3), (0, 6), (3, 6)}
    np.testing.assert_allclose(list(freq.values()), 1 / 3, atol=0.05)


ANCHORS = np.array([[5, 9, 0]], np.int32)
KEEP = np.array([[True, True, False]])


def test_block_attention_mask_reference_case():
    s, k = 12, 3
    m = np.asarray(BL.block_attention_mask(ANCHORS, KEEP, s, k))
    assert m.shape == (1, 9, s + 9) and m.dtype == bool
    for q in range(3):  # block 0 (anchor 5): context 0..4 and its own block
        assert np.flatnonzero(m[0, q]).tolist() == [0, 1, 2, 3, 4, 12, 13, 14]
    for q in range(3, 6):  # block 1 (anchor 9): context 0..8 and its own block
        assert np.flatnonzero(m[0, q]).tolist() == list(range(9)) + [15, 16, 17]
    assert not m[0, 6:].any()  # dummy block sees nothing


def test_block_positions_and_labels():
    pos = np.asarray(BL.block_positions(ANCHORS, 3))
    assert pos.tolist() == [[5, 6, 7, 9, 10, 11, 0, 1, 2]]
    ids = np.arange(100, 112)[None]
    lab = np.asarray(BL.block_labels(ids, ANCHORS, KEEP, 3))
    assert lab.tolist() == [[[106, 107, 108], [110, 111, 111], [0, 0, 0]]]


def test_eval_mask_cumprod_hole_and_bounds():
    s = 12
    lm = np.ones((1, s), np.int32)
    lm[0, :3] = 0
    em = np.asarray(BL.eval_mask(lm, ANCHORS, KEEP, 3))
    # anchor 9: labels 10, 11, 12 (past the end) -> last slot invalid; dummy -> nothing
    assert em.tolist() == [[[True, True, True], [True, True, False], [False, False, False]]]
    # a hole at label a+3 (slot 2) zeroes slots 2..K-1 even though later labels are valid
    k = 5
    lm2 = np.ones((1, 20), np.int32)
    lm2[0, 5 + 3] = 0
    em2 = np.asarray(BL.eval_mask(lm2, np.array([[5]]), np.array([[True]]), k))
    assert em2.tolist() == [[[True, True, False, False, False]]]


def test_bucket_and_pad():
    assert D.bucket_length(5, [4, 8, 16]) == 8
    assert D.bucket_length(8, [16, 8]) == 8
    with pytest.raises(ValueError, match="exceeds"):
        D.bucket_length(17, [4, 8, 16])
    out = D.pad_batch([np.array([1, 2, 3]), np.array([4])], 4, rows=3)
    assert out.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"seqs\[0\]"):
        D.pad_batch([np.arange(5)], 4)
