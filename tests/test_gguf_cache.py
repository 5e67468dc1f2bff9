"""The float32 copy of a loaded GGUF target in the user cache: stored once, read by later loads
(without parsing the GGUF again), keyed by the file's identity, and off when asked."""
from __future__ import annotations

import os

import numpy as np
import pytest
from flax import nnx

from specjax import checkpoints
from specjax.checkpoints import gguf as gguf_mod
from specjax.checkpoints import targets


@pytest.fixture
def tiny_gguf(tmp_path):
    """A tiny random Llama written as GGUF (F32, llama.cpp names and Q/K permutation)."""
    from hf_fixtures import make_tiny_lm
    from test_gguf import write_gguf
    src = make_tiny_lm(tmp_path / "src", "llama", vocab=128, hidden=32, heads=4, kv_heads=2, head_dim=8,
                       intermediate=64, seed=3)
    model, cfg = checkpoints.load_target(src)
    return str(write_gguf(tmp_path / "tiny.gguf", checkpoints.module_to_hf_tensors(model), cfg))


def _params(model):
    return {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model))}


def test_second_load_reads_the_cached_copy(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv(targets.GGUF_CACHE_ENV, str(tmp_path / "cache"))
    m1, c1 = checkpoints.load_target(tiny_gguf)
    d = targets.gguf_conversion_dir(tiny_gguf)
    assert os.path.isfile(os.path.join(d, "config.json"))

    def no_parse(*a, **k):
        raise AssertionError("the GGUF was parsed again")
    monkeypatch.setattr(gguf_mod, "GGUFFile", no_parse)
    monkeypatch.setattr(targets, "open_gguf_target", no_parse)
    m2, c2 = checkpoints.load_target(tiny_gguf)
    assert c2 == c1
    p1, p2 = _params(m1), _params(m2)
    assert p1.keys() == p2.keys() and all(np.array_equal(p1[k], p2[k]) for k in p1)


def test_changed_file_is_not_served_from_the_cache(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv(targets.GGUF_CACHE_ENV, str(tmp_path / "cache"))
    checkpoints.load_target(tiny_gguf)
    before = targets.gguf_conversion_dir(tiny_gguf)
    st = os.stat(tiny_gguf)
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "rewritten"
    assert targets.gguf_conversion_dir(tiny_gguf) != before
    assert targets._cached_conversion(str(tiny_gguf)) is None


def test_cache_off(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv(targets.GGUF_CACHE_ENV, "off")
    assert targets.gguf_cache_root() is None
    checkpoints.load_target(tiny_gguf)
    assert targets.gguf_conversion_dir(tiny_gguf) is None


def test_losing_a_concurrent_store_is_silent_and_keeps_the_winners_copy(tiny_gguf, tmp_path, monkeypatch):
    """Two processes converting the same file at once: the second rename fails because the first
    copy is in place; that is not a failure (no warning), and the first copy is left as it was.
    Control: a rename failing with no copy in place still warns."""
    import warnings

    monkeypatch.setenv(targets.GGUF_CACHE_ENV, str(tmp_path / "cache"))
    model, cfg = checkpoints.load_target(tiny_gguf)
    d = targets.gguf_conversion_dir(tiny_gguf)
    winner = sorted(os.listdir(d))
    real_isdir = os.path.isdir
    seen = []

    def not_yet(path):  # the pre-check runs before the winner's rename lands
        if path == d and not seen:
            seen.append(path)
            return False
        return real_isdir(path)
    monkeypatch.setattr(targets.os.path, "isdir", not_yet)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        targets._store_conversion(str(tiny_gguf), model, cfg)
    assert seen and sorted(os.listdir(d)) == winner
    assert not [p for p in os.listdir(os.path.dirname(d)) if ".tmp" in p]  # the loser's copy is gone
    monkeypatch.setattr(targets.os, "rename", lambda a, b: (_ for _ in ()).throw(OSError("disk full")))
    monkeypatch.setattr(targets.os.path, "isdir", lambda p: False if p == d else real_isdir(p))
    with pytest.warns(UserWarning, match="could not cache"):
        targets._store_conversion(str(tiny_gguf), model, cfg)
