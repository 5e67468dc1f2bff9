"""JAX's persistent compilation cache, so that a second start reuses the serving executables.

A 30-layer target compiles each bucket's executable in several seconds on a small CPU; with the
cache on, a restart loads them from disk instead. The directory is, in order of precedence: the
`path` argument, `$SPECJAX_COMPILATION_CACHE`, a directory the user already gave JAX
(`jax_compilation_cache_dir`), or `$XDG_CACHE_HOME/specjax/jax` (default `~/.cache/specjax/jax`).
`SPECJAX_COMPILATION_CACHE=off` turns it off. JAX keys every entry by the computation, the
compiler flags, the backend and the jax/jaxlib versions, so a stale entry is never reused.
"""
from __future__ import annotations

import os

import jax

ENV_VAR = "SPECJAX_COMPILATION_CACHE"
OFF_VALUES = ("off", "0", "false", "none", "")


def default_dir() -> str:
    """`$XDG_CACHE_HOME/specjax/jax`, or `~/.cache/specjax/jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specjax", "jax")


def resolve_dir(path: str | os.PathLike | None = None) -> str | None:
    """The cache directory that `enable(path)` would use, or None when the cache is off."""
    if path is not None:
        return os.fspath(path)
    env = os.environ.get(ENV_VAR)
    if env is not None:
        return None if env.strip().lower() in OFF_VALUES else env
    return jax.config.jax_compilation_cache_dir or default_dir()


def enable(path: str | os.PathLike | None = None) -> str | None:
    """Turn JAX's persistent compilation cache on (idempotent); returns its directory or None."""
    cache_dir = resolve_dir(path)
    if cache_dir is None:
        return None
    if jax.config.jax_compilation_cache_dir != cache_dir:
        from jax.experimental.compilation_cache import compilation_cache as jcc
        os.makedirs(cache_dir, exist_ok=True)
        jcc.set_cache_dir(cache_dir)
        jcc.reset_cache()  # JAX opens its cache once: a new directory needs a fresh start
    return cache_dir
