"""Devices to compile for that this machine does not have: XLA's GPU compiler without a GPU.

    make gpu-compiler                                     # once: the CUDA PJRT plugin into .gpu-compiler/
    python -m bench.round_ops --target h200               # the round programs as an H200 would run them

JAX's CUDA PJRT plugin (the `jax-cuda12-pjrt` wheel of the installed jaxlib's version) holds XLA's
GPU compiler. Given a target description (`bench/gpu_specs/<name>.txtpb`, a GpuTargetConfigProto)
it makes a compile-only topology: programs lowered for its devices compile to the optimised HLO and
kernels an H200 would run (fusion decisions from the compiler's heuristics; no autotuning, which
needs the device), while nothing can execute. The plugin is loaded through
PJRT_NAMES_AND_LIBRARY_PATHS, so the host's own backend (CPU) stays the default.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SPECS_DIR = Path(__file__).resolve().parent / "gpu_specs"
# where `make gpu-compiler` installs the plugin (ignored by git); SPECJAX_CUDA_PJRT names another .so
DEFAULT_PLUGIN = Path(__file__).resolve().parent.parent / ".gpu-compiler" / "jax_plugins" / "xla_cuda12" / "xla_cuda_plugin.so"
HOST = "host"


def targets() -> list[str]:
    """`host` (this machine's default backend) and every GPU described in bench/gpu_specs."""
    return [HOST] + sorted(p.stem for p in SPECS_DIR.glob("*.txtpb"))


def plugin_path() -> Path:
    """The CUDA PJRT plugin library; a clear error when it is not installed."""
    path = Path(os.environ.get("SPECJAX_CUDA_PJRT", DEFAULT_PLUGIN))
    if not path.is_file():
        raise FileNotFoundError(f"the CUDA PJRT plugin {path} is not installed: run `make gpu-compiler` "
                                "(or set SPECJAX_CUDA_PJRT to an xla_cuda_plugin.so of this jaxlib's version)")
    return path


def compile_only_mesh(target: str) -> Any:
    """A one-device serving mesh of a compile-only GPU `target` (a name in bench/gpu_specs), for
    `Runner(..., mesh=...)` with abstract state. Call before any other use of the 'cuda' platform."""
    import jax
    from jax.experimental import topologies

    from specjax import sharding as shd
    spec = SPECS_DIR / f"{target}.txtpb"
    if not spec.is_file():
        raise ValueError(f"unknown compile target {target!r}; choose one of {targets()}")
    entry = f"cuda:{plugin_path()}"
    platforms = jax.config.jax_platforms
    if platforms not in (None, "", "cpu"):
        raise RuntimeError(f"compile targets need JAX_PLATFORMS=cpu (or unset), got {platforms!r}")
    jax.config.update("jax_platforms", "cpu")  # the plugin registers a 'cuda' backend that must not start
    names = os.environ.get("PJRT_NAMES_AND_LIBRARY_PATHS", "")
    if entry not in names.split(","):
        os.environ["PJRT_NAMES_AND_LIBRARY_PATHS"] = ",".join(filter(None, [names, entry]))
    try:
        topo = topologies.get_topology_desc(target, "cuda", target_config=spec.read_text(), topology="1x1x1")
    except NotImplementedError as e:  # plugins are discovered once, when JAX first starts a backend
        raise RuntimeError(f"the CUDA plugin was not loaded: compile_only_mesh({target!r}) must run before "
                           "JAX starts any backend in this process") from e
    return shd.make_mesh((1, 1), shd.SERVE_AXES, devices=topo.devices)
