"""Test session setup: 8 emulated CPU devices for the sharding tests (set before jax is imported), and
per-run caches shared by the xdist workers: a persistent compilation cache, so engines with
identical shapes compile once per run, and the float32 copies of converted GGUF targets (removed when
the run ends)."""
import os
import shutil
import tempfile
import uuid

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_host_device_count(xla_flags: str | None, n: int = 8) -> str:
    """XLA_FLAGS with the host device count set to n: other flags kept, any other count replaced."""
    kept = [f for f in (xla_flags or "").split() if not f.startswith(DEVICE_COUNT_FLAG + "=")]
    return " ".join(kept + [f"{DEVICE_COUNT_FLAG}={n}"])


os.environ["XLA_FLAGS"] = with_host_device_count(os.environ.get("XLA_FLAGS"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a size limit on the compilation cache (below) turns on JAX's file lock around its reads and writes
# (the workers share the directory); in the environment, so that subprocesses sharing the directory
# (bench.gpu_check's) use the same mode: one without it writes entries without the access times
# the others read
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
RUN_DIR_PREFIXES = ("specjax-gguf-cache-", "specjax-jit-cache-")
_made: list[str] = []  # this process's own run directories (no xdist run id)


def run_dir(prefix: str) -> str:
    """A temporary directory for this test run, the same one in every xdist worker (`prefix`: one of
    RUN_DIR_PREFIXES, so that the run's end removes it)."""
    assert prefix in RUN_DIR_PREFIXES, prefix
    if not _run_id:
        _made.append(tempfile.mkdtemp(prefix=prefix))
        return _made[-1]
    d = os.path.join(tempfile.gettempdir(), f"{prefix}{_run_id}")
    os.makedirs(d, exist_ok=True)
    return d


# converted GGUF targets are cached for the run only (a later load of the same file, in any worker,
# reads it; the copy is renamed into place, so two workers converting at once do not collide)
os.environ.setdefault("SPECJAX_GGUF_CACHE", run_dir("specjax-gguf-cache-"))

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", run_dir("specjax-jit-cache-"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


import pytest  # noqa: E402


TRACED_PACKAGES = ("specjax", "jax", "flax")


def _traced(target) -> bool:
    """Whether a monkeypatch target (an object, or a dotted path) lies in code that programs trace."""
    if isinstance(target, str):
        name = target
    else:
        name = getattr(target, "__name__", "") if isinstance(target, type(os)) else \
            getattr(target, "__module__", None) or type(target).__module__
    return (name or "").split(".")[0] in TRACED_PACKAGES


@pytest.fixture
def monkeypatch(monkeypatch):
    """pytest's monkeypatch, clearing JAX's caches when a test patches code that programs trace
    (specjax, jax, flax) or a mapping: engines of equal contexts share traced programs
    (decoding.runner._jitted), so the patch takes effect, and no patched trace outlives the test.
    Patches of anything else (the environment, the clock, files) keep the run's traces."""
    cleared = []

    def clearing(patch, traced):
        def patched(target, *args, **kwargs):
            if traced(target):
                jax.clear_caches()
                cleared.append(True)
            return patch(target, *args, **kwargs)
        return patched
    monkeypatch.setattr = clearing(monkeypatch.setattr, _traced)
    monkeypatch.delattr = clearing(monkeypatch.delattr, _traced)
    monkeypatch.setitem = clearing(monkeypatch.setitem, lambda target: True)
    monkeypatch.delitem = clearing(monkeypatch.delitem, lambda target: True)
    yield monkeypatch
    if cleared:
        jax.clear_caches()  # before the patches are undone: nothing traces in between


def pytest_configure(config):
    """The xdist controller names the run (its workers' shared directories) unless --testrunuid did."""
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None) \
            and getattr(config.option, "testrunuid", "given") is None:
        config.option.testrunuid = uuid.uuid4().hex


def pytest_unconfigure(config):
    """The run's end (the controller's, or a run without xdist) removes the run's directories."""
    if hasattr(config, "workerinput"):
        return
    uid = getattr(config.option, "testrunuid", None)
    shared = [os.path.join(tempfile.gettempdir(), p + uid) for p in RUN_DIR_PREFIXES] if uid else []
    for d in _made + shared:
        shutil.rmtree(d, ignore_errors=True)
