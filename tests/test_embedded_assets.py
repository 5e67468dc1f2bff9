"""The shipped embedded default (specjax/assets/pystd): target, tokenizer, split and prompts."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from specjax import embedded as emb
from specjax import checkpoints
from specjax.config import ConfigError

MAX_EXPORT_BYTES = 12 * 10**6


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.fixture(scope="module")
def tokenizer():
    tok = checkpoints.load_tokenizer(emb.target_dir())
    assert tok is not None, f"no tokenizer files in {emb.target_dir()}"
    return tok


@pytest.fixture(scope="module")
def target():
    return checkpoints.load_target(emb.target_dir(), dtype="float32")


@pytest.fixture(scope="module")
def split():
    return emb.load_split()


def test_paths_and_names():
    assert emb.target_dir().endswith(os.path.join("assets", "pystd", "target"))
    assert os.path.isfile(os.path.join(emb.target_dir(), "config.json"))
    for name in emb.DRAFTER_NAMES:
        assert emb.drafter_dir(name).endswith(os.path.join("pystd", "drafters", name))
    with pytest.raises(ValueError, match="unknown embedded drafter"):
        emb.drafter_dir("nope")
    with pytest.raises(ValueError, match="prompt set"):
        emb.prompts_path("validation")


def test_target_loads_with_recorded_special_tokens(target, tokenizer):
    model, cfg = target
    ids = emb.special_token_ids()
    assert set(ids) == set(emb.SPECIAL_TOKENS)
    assert cfg.vocab_size == len(tokenizer) == max(ids.values()) + 1
    assert cfg.tie_word_embeddings and model.lm_head is None
    assert cfg.eos_token_ids == (ids[emb.EOS_TOKEN],) == (tokenizer.eos_token_id,)
    assert tokenizer.convert_tokens_to_ids(emb.MASK_TOKEN) == emb.mask_token_id()
    with open(os.path.join(emb.target_dir(), "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == ids[emb.EOS_TOKEN]
    with open(os.path.join(emb.target_dir(), "training.json")) as f:
        record = json.load(f)
    assert record["mask_token_id"] == emb.mask_token_id()
    # trained past the unigram entropy of the corpus (6.36 nats; an untrained model: ln 2048 = 7.6)
    assert record["steps"] > 0 and record["losses"]["heldout"] < 3.0  # the shipped 3000-step run: 2.59
    assert record["params"] == sum(int(np.prod(v.shape)) for v in
                                   jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_tokenizer_round_trips_python_source(tokenizer):
    with open(os.path.join(os.path.dirname(emb.__file__), "config.py"), encoding="utf-8") as f:
        source = f.read()
    samples = [source, "def f(x):\n\tif x:\n\t\treturn 'é' + \"\\u00e9\"  # ünïcode ✓\n",
               "    \n\n  trailing   spaces   \r\n", "x = {'a': [1, 2.5e-3, 0x1F]}  # 数字"]
    first_special = min(emb.special_token_ids().values())
    for text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert max(ids) < first_special  # plain text never maps to a special token
        assert tokenizer.decode(ids) == text
    assert len(tokenizer(source, add_special_tokens=False)["input_ids"]) < len(source) / 2.5
    # special-token strings in text are the special tokens, and decode back
    ids = tokenizer("a<|endoftext|>b", add_special_tokens=False)["input_ids"]
    assert emb.special_token_ids()[emb.EOS_TOKEN] in ids
    assert tokenizer.decode(ids) == "a<|endoftext|>b"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_recorded_split_is_disjoint_and_matches_the_rule(split):
    assert split.train and split.heldout
    assert not set(split.train) & set(split.heldout)
    for m in split.heldout:
        assert emb.rule_is_heldout(m)
    for m in split.train:
        assert not emb.rule_is_heldout(m)
    frac = len(split.heldout) / (len(split.train) + len(split.heldout))
    assert 0.03 <= frac <= 0.10
    with pytest.raises(ConfigError, match="in both"):
        emb.Split(("os", "json"), ("json",), "3.11.7")


def test_split_applies_by_module_name(split):
    # recorded lists win over the rule; unknown modules fall back to it
    held = split.heldout[0]
    swapped = emb.Split(split.train + (held,), split.heldout[1:], split.python_version)
    assert swapped.side(held) == "train" and split.side(held) == "heldout"
    assert split.side("a_module_no_python_has") == (
        "heldout" if emb.rule_is_heldout("a_module_no_python_has") else "train")
    files = [emb.SourceFile(held, f"{held}.py", "x = 1\n"),
             emb.SourceFile(split.train[0], f"{split.train[0]}.py", "y = 2\n")]
    train_files, held_files = emb.split_files(files, split)
    assert [f.module for f in held_files] == [held]
    assert [f.module for f in train_files] == [split.train[0]]


def test_corpus_modules_split_like_the_record(split):
    files = emb.collect_corpus()
    assert files, "no standard-library sources found"
    assert not any(part in ("test", "tests", "idlelib", "turtledemo", "site-packages")
                   for f in files for part in f.path.split("/")[:-1])
    assert "pydoc_data/topics.py" not in {f.path for f in files}
    if split.python_version == emb.python_version():
        assert emb.make_split(files).heldout == split.heldout


def test_prompts_come_from_their_split(split, tokenizer):
    held = emb.load_prompts("heldout")
    train = emb.load_prompts("train")
    assert 100 <= len(held) <= 200 and len(train) >= 500
    for rec in held:
        assert rec["module"] in split.heldout, rec["module"]
    for rec in train:
        assert rec["module"] in split.train, rec["module"]
    held_texts = {r["prompt"] for r in held}
    assert not held_texts & {r["prompt"] for r in train}
    lengths = [len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in held]
    assert max(lengths) <= 200 and min(lengths) > 0


def test_greedy_completion_of_a_heldout_prompt(target, tokenizer):
    model, cfg = target
    prompt = next(r["prompt"] for r in emb.load_prompts("heldout") if r.get("kind") == "def")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out = emb.greedy_generate(model, ids, 24, eos_token_id=cfg.eos_token_ids[0])
    assert 0 < len(out) <= 24 and all(0 <= t < cfg.vocab_size for t in out)
    text = tokenizer.decode(out, skip_special_tokens=True)
    assert text.strip(), f"empty completion of {prompt!r}"
    assert "\ufffd" not in text  # whole UTF-8 characters
    # the cached decode is the greedy choice of a plain forward over prompt + completion
    full = np.asarray([ids + out[:-1]], np.int32)
    logits = np.asarray(model(full))[0, len(ids) - 1:]  # [len(out), V]
    chosen = logits[np.arange(len(out)), out]
    np.testing.assert_array_less(logits.max(axis=-1) - chosen, 1e-3)


def test_asset_sizes():
    target = _dir_bytes(emb.target_dir())
    prompts = sum(os.path.getsize(emb.prompts_path(w)) for w in emb.PROMPT_SETS)
    assert target <= MAX_EXPORT_BYTES
    assert target + prompts + os.path.getsize(emb.split_path()) <= MAX_EXPORT_BYTES


# ------------------------------------------------------------------------------------------------
# the library pieces behind the build (no assets needed)


def test_pack_documents_joins_with_eos_and_drops_the_tail():
    docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 24)]  # 5 + 3 + 4 tokens, + 3 EOS
    rows = emb.pack_documents(docs, 4, eos_id=99)
    assert rows.dtype == np.int32 and rows.shape == (3, 4)
    assert rows.ravel().tolist() == [1, 2, 3, 4, 5, 99, 10, 11, 12, 99, 20, 21]
    with pytest.raises(ValueError, match="fewer than one row"):
        emb.pack_documents([np.arange(3)], 8, eos_id=0)


def test_extract_and_select_prompts(tmp_path):
    src = ('"""Module doc."""\nimport os\n\n\ndef area(w, h):\n    """Area of a w x h box."""\n'
           '    return w * h\n\n\nclass Box:\n    def grow(self, k):\n        """Grow by k."""\n'
           '        self.k = k\n\n    def nodoc(self):\n        return 1\n\n\n'
           'def only_doc():\n    """Nothing else."""\n\n\nx = [1, 2, 3]\n' + "y = 1\n" * 20)
    files = [emb.SourceFile("box", "box.py", src)]
    n_chars = len  # a stand-in token counter
    got = {(p.kind, p.name): p for p in emb.extract_prompts(files, n_chars, min_tokens=1,
                                                            max_tokens=500, head_tokens=40)}
    assert got[("def", "area")].prompt == 'def area(w, h):\n    """Area of a w x h box."""\n'
    assert got[("def", "Box.grow")].prompt == (
        'class Box:\n    def grow(self, k):\n        """Grow by k."""\n')
    assert ("def", "Box.nodoc") not in got and ("def", "only_doc") not in got
    head = got[("file_head", "")].prompt
    assert src.startswith(head) and head.endswith("\n") and len(head) < len(src)
    assert all(p.module == "box" for p in got.values())
    cands = [emb.Prompt(f"p{i}", f"m{i % 3}", f"m{i % 3}/f{i % 6}.py", "def", f"n{i}")
             for i in range(60)]
    a = emb.select_prompts(cands, 20, per_file=2)
    b = emb.select_prompts(list(reversed(cands)), 20, per_file=2)
    assert [p.prompt for p in a] == [p.prompt for p in b]  # independent of input order
    assert len(a) == 20 and len({p.prompt for p in a}) == 20
    assert len(emb.select_prompts(cands[:5], 20)) == 5


def test_pretrain_config_validation(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("learning_rate: 3e-3\nmodel:\n  num_hidden_layers: 2\n")
    cfg = emb.load_pretrain_config(path, {"total_steps": 7})
    assert cfg.learning_rate == 3e-3 and cfg.model.num_hidden_layers == 2 and cfg.total_steps == 7
    tc = cfg.target_config(2048, 2044)
    assert tc.tie_word_embeddings and tc.eos_token_ids == (2044,) and tc.vocab_size == 2048
    for bad, match in (("seq_len: 4096\n", "max_position_embeddings"),
                       ("learning_rate: fast\n", "learning_rate"),
                       ("compute_dtype: int8\n", "compute_dtype"), ("stepz: 3\n", "unknown")):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=match):
            emb.load_pretrain_config(path)
