"""Streaming detokenization (tokenizers' DecodeStream) and stop strings on it, with a byte-level BPE
tokenizer trained here (so emoji and CJK characters are split across several byte tokens)."""
from __future__ import annotations

import random

import pytest

from specjax.serving.detokenize import StopStringChecker, StreamDetokenizer

TEXT = "hello 世界! 😀 naïve 🇯🇵 fox — the quick 你好 brown 🧪🧪 world"


@pytest.fixture(scope="module")
def tok():
    """A transformers fast tokenizer over a small byte-level BPE (most non-ASCII bytes stay single tokens)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|end|>"], show_progress=False)
    t.train_from_iterator(["hello world the quick brown fox"] * 20 + ["世界 你好"] * 3, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|end|>")


def _ids(tok, text=TEXT):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_streamed_text_equals_the_final_decode_across_split_characters(tok):
    ids = _ids(tok)
    assert tok.decode(ids) == TEXT
    # the property is only tested if characters really are split across tokens
    split = [i for i in ids if tok.decode([i]) == "\ufffd"]
    assert len(split) >= 8
    for sizes in ([1], [2], [3, 1, 4], [len(ids)]):  # deltas of different sizes, as rounds deliver them
        d = StreamDetokenizer(tok)
        pieces, k, j = [], 0, 0
        while k < len(ids):
            n = sizes[j % len(sizes)]
            pieces.append(d.push(ids[k:k + n]))
            k, j = k + n, j + 1
        assert "".join(pieces) == TEXT == tok.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in p for p in pieces)  # never a partial character on the wire
        assert d.length == len(TEXT) and len(d.ends) == len(ids) and d.ends[-1] == len(TEXT)
        assert sum(e is None for e in d.ends) >= len(split) // 2  # tokens ending inside a character


def test_negative_control_naive_delta_decoding_breaks_characters(tok):
    """Decoding each delta on its own (what a streaming server must not do) garbles split characters:
    the comparison above would catch it."""
    ids = _ids(tok)
    naive = "".join(tok.decode(ids[k:k + 2]) for k in range(0, len(ids), 2))
    assert naive != TEXT and "\ufffd" in naive


def test_special_tokens_are_skipped_like_the_final_decode(tok):
    end = tok.convert_tokens_to_ids("<|end|>")
    ids = _ids(tok, "fox 😀") + [end] + _ids(tok, " world")
    d = StreamDetokenizer(tok)
    assert "".join(d.push([i]) for i in ids) == tok.decode(ids, skip_special_tokens=True) == "fox 😀 world"


def _reference(tok, ids, stops, include=False):
    """The quadratic definition: at the first stop string (by where it begins), the shortest token
    prefix whose decoded text holds it (ending on a whole character), and the text up to the stop
    string's start (its end with `include`)."""
    text = tok.decode(ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return None
    at, s = min(hits)
    keep = next(k for k in range(len(ids) + 1)
                if len(tok.decode(ids[:k])) >= at + len(s) and not tok.decode(ids[:k]).endswith("\ufffd"))
    return keep, text[:at + len(s) if include else at], s


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["世界", "😀", "fox", "🧪🧪", "ve 🇯", "quick 你", "zzz", "ick"])
def test_stop_checker_matches_the_quadratic_definition(tok, stop, include):
    """Found as the engine calls it (the whole output after each round): the tokens through the one
    completing the stop string, the text exactly up to it (vLLM's; with include_stop_str_in_output,
    through it). "ick" begins inside the token " quick": its " qu" stays in the text."""
    ids = _ids(tok)
    rng = random.Random(stop)
    check, k, got = StopStringChecker(tok, [stop], include=include), 0, None
    while k < len(ids) and got is None:
        k = min(len(ids), k + rng.randint(1, 4))
        got = check(ids[:k])
    assert got == _reference(tok, ids[:k], [stop], include)
    if stop in TEXT:
        keep, text, hit = got
        assert hit == stop and text == TEXT[:TEXT.index(stop) + (len(stop) if include else 0)]
        assert tok.decode(ids[:keep]).startswith(TEXT[:TEXT.index(stop) + len(stop)])
    else:
        assert got is None


def test_stop_checker_finds_a_stop_string_spanning_two_calls_and_restarts_on_a_new_output(tok):
    ids = _ids(tok, "abc the quick brown fox")
    check = StopStringChecker(tok, ["quick brown"])
    cut = len(_ids(tok, "abc the quick"))  # "quick" in the first call, " brown" in the next
    assert check(ids[:cut]) is None
    keep, text, hit = check(ids)
    assert hit == "quick brown" and text == "abc the " and tok.decode(ids[:keep]) == "abc the quick brown"  # " quick" carries the space
    assert check(ids[:2]) is None  # a shorter list: a different output, searched afresh
    with pytest.raises(ValueError, match="non-empty"):
        StopStringChecker(tok, [""])


def test_stop_checker_passes_over_stops_that_would_keep_fewer_than_min_tokens(tok):
    """min_tokens: an occurrence completed within fewer tokens is passed over; a later one (or a later
    overlapping one) ends the output; without min_keep the first ends it (control)."""
    text = "fox the fox the quick fox"
    ids = _ids(tok, text)
    pieces = [tok.decode([t]) for t in ids]
    assert pieces == ["fo", "x", " the", " fox", " the", " quick", " fox"], pieces  # the test's token boundaries
    assert StopStringChecker(tok, ["fox"])(ids) == (2, "", "fox")
    check = StopStringChecker(tok, ["fox"])
    assert check(ids[:3], 3) is None  # only the first occurrence so far, completed by 2 tokens
    assert check(ids, 3) == (4, "fox the ", "fox")  # the second
    assert StopStringChecker(tok, ["fox"])(ids, 5) == (7, "fox the fox the quick ", "fox")  # the third
    assert StopStringChecker(tok, ["fox"])(ids, len(ids) + 1) is None


@pytest.mark.parametrize("reaches_max_tokens", [True, False])
def test_a_round_that_emits_a_stop_string_and_reaches_max_tokens_stops_at_the_string(tok, reaches_max_tokens):
    """A speculative round appends several tokens at once: a stop string among them ends the output
    there even when the same round reaches max_tokens (control: the last token's "length" alone would
    keep the stop string and what follows)."""
    from specjax.decoding.requests import EngineRequest, append_output
    ids = _ids(tok, "hello world the quick brown fox")
    req = EngineRequest("r", [1], max_tokens=len(ids) if reaches_max_tokens else 100, temperature=0.0, stop_check=StopStringChecker(tok, ["quick"]))
    append_output(req, ids[:2], eos_token_ids=[])
    assert req.finish_reason is None
    append_output(req, ids[2:], eos_token_ids=[])  # one round: " the quick brown fox" (max_tokens reached)
    assert req.finish_reason == "stop" and req.output_text == "hello world the " and req.stop_reason == "quick"
    assert tok.decode(req.output_ids) == "hello world the quick"


def test_sampling_params_stop_inclusion_and_prompt_truncation_are_checked_and_applied():
    from specjax.api import SamplingParams
    from specjax.request_builder import truncate_prompt
    assert truncate_prompt(range(10), SamplingParams(truncate_prompt_tokens=3), 100) == [7, 8, 9]
    assert truncate_prompt(range(10), SamplingParams(truncate_prompt_tokens=-1), 4) == [6, 7, 8, 9]
    assert truncate_prompt(range(10), SamplingParams(), 4) == list(range(10))  # off: the engine refuses
    with pytest.raises(ValueError, match="truncate_prompt_tokens is 5; it must be at most max_model_len"):
        truncate_prompt(range(10), SamplingParams(truncate_prompt_tokens=5), 4)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="include_stop_str_in_output must be a bool"):
        SamplingParams(include_stop_str_in_output=1)


def test_stop_reason_names_the_stop_id_or_string_and_is_none_for_eos_and_length():
    """vLLM's stop_reason: a stop_token_ids entry (also one equal to eos under ignore_eos), None when eos
    (checked first) or max_tokens ends the output."""
    from specjax.decoding.requests import EngineRequest, append_output

    def end(toks, **kw):
        req = EngineRequest("r", [1], max_tokens=3, temperature=0.0, **kw)
        append_output(req, toks, eos_token_ids=[2])
        return req.finish_reason, req.stop_reason
    assert end([5, 7, 9], stop_token_ids=(7,)) == ("stop", 7)
    assert end([5, 2, 9], stop_token_ids=(7,)) == ("stop", None)  # eos
    assert end([5, 2, 9], stop_token_ids=(2,)) == ("stop", None)  # eos first, as vLLM checks it
    assert end([5, 2, 9], stop_token_ids=(2,), ignore_eos=True) == ("stop", 2)
    assert end([5, 6, 9], stop_token_ids=(7,)) == ("length", None)
