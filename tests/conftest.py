"""Test session setup: 8 emulated CPU devices for the sharding tests (set before jax is imported) and a
per-session persistent compilation cache, so engines with identical shapes compile once."""
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# converted GGUF targets are cached for the session only (a later load of the same file reads it)
os.environ.setdefault("SPECJAX_GGUF_CACHE", tempfile.mkdtemp(prefix="specjax-gguf-cache-"))

import jax  # noqa: E402

_cache_dir = tempfile.mkdtemp(prefix="specjax-jit-cache-")
jax.config.update("jax_compilation_cache_dir", _cache_dir)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
