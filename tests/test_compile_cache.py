"""JAX's persistent compilation cache: directory precedence, off switch, entries really written."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

from specjax.decoding import compile_cache


@pytest.fixture
def restore_jax_cache_config():
    old_dir = jax.config.jax_compilation_cache_dir
    old_min = jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    from jax.experimental.compilation_cache import compilation_cache as jcc
    jax.config.update("jax_compilation_cache_dir", old_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old_min)
    jcc.reset_cache()


def test_resolve_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve_dir("/x/y") == "/x/y"
    if jax.config.jax_compilation_cache_dir is None:
        assert compile_cache.resolve_dir() == str(tmp_path / "xdg" / "specjax" / "jax")
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.resolve_dir() == str(tmp_path / "env")
    for off in ("off", "0", "false", ""):
        monkeypatch.setenv(compile_cache.ENV_VAR, off)
        assert compile_cache.resolve_dir() is None
        assert compile_cache.enable() is None


def test_enable_writes_entries_that_a_recompile_reads(tmp_path, restore_jax_cache_config):
    jax.jit(lambda x: x * 2.0).lower(jnp.ones(3)).compile()  # JAX's cache already in use (old dir)
    d = compile_cache.enable(tmp_path / "cache")
    assert d == str(tmp_path / "cache") and jax.config.jax_compilation_cache_dir == d
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    f = jax.jit(lambda x: jnp.tanh(x) @ x.T + 3.0)
    f.lower(jnp.ones((8, 8))).compile()
    entries = os.listdir(d)
    assert entries, "no executable was written to the persistent cache"
    hits = []
    listener = lambda event, **kw: hits.append(event)  # noqa: E731
    jax.monitoring.register_event_listener(listener)
    try:  # the same computation again (a new jit object): served from the on-disk cache
        jax.jit(lambda x: jnp.tanh(x) @ x.T + 3.0).lower(jnp.ones((8, 8))).compile()
    finally:
        from jax._src import monitoring
        monitoring.unregister_event_listener(listener)
    assert "/jax/compilation_cache/cache_hits" in hits
    assert sorted(os.listdir(d)) == sorted(entries)
