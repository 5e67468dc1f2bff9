"""Multi-host runs on JAX's own distributed runtime: one process per host, `jax.distributed`.

Every multi-host program (`train.train_draft`, `train.regenerate`, `train.build_cache`,
`serve.batch`) takes `--coordinator-address HOST:PORT`, `--num-processes N`, `--process-id I`
and `--distributed auto|on|off` (`add_distributed_args`), and calls `initialize_from_args` before
anything else touches jax. Each setting falls back to the environment:

- `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` (explicit, any cluster);
- on SLURM (`srun`, one task per host) and Open MPI (`mpirun`) JAX reads the scheduler's own
  variables; on a Cloud TPU pod slice it asks the TPU metadata server (`--distributed on`).

`auto` (the default) initializes when more than one process is configured: N > 1 from the flags
or `JAX_NUM_PROCESSES`, or a SLURM / Open MPI job of more than one task, or
`TPU_WORKER_HOSTNAMES` / `TPU_PROCESS_ADDRESSES` naming more than one host. A single-process run
is left untouched (no coordinator, no port). `on` always initializes (JAX detects what is not
given); `off` never does. CPU processes exchange collectives over gloo (JAX's CPU default).

Data-parallel helpers: `process_rows` (which rows of a global batch this process feeds, for
`jax.make_array_from_process_local_data`) and `process_shard` (this process's index and count).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Mapping, Sequence

import numpy as np

MODES = ("auto", "on", "off")
ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Resolved multi-host settings; `enabled` False means a plain single-process run."""

    enabled: bool
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    source: str = "single process"  # where the settings came from, for messages


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """The multi-host flags shared by every program that can run one process per host."""
    g = p.add_argument_group("multi-host (jax.distributed; one process per host)")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help=f"process 0's address and a free port (env {ENV_ADDRESS})")
    g.add_argument("--num-processes", type=int, default=None,
                   help=f"number of processes, one per host (env {ENV_COUNT})")
    g.add_argument("--process-id", type=int, default=None,
                   help=f"this process's id, 0..num-processes-1 (env {ENV_ID})")
    g.add_argument("--distributed", choices=MODES, default="auto",
                   help="auto: initialize when more than one process is configured (flags, "
                        "env, SLURM, Open MPI, TPU hosts); on: always (a TPU pod slice's "
                        "settings come from its metadata server); off: never")


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {text!r}") from None


def _cluster_processes(env: Mapping[str, str]) -> tuple[int, str] | None:
    """(process count, scheduler) of a multi-process job JAX can bootstrap from, if any."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in env for k in slurm):
        return _env_int(env, "SLURM_NTASKS") or 1, "SLURM"
    if "OMPI_COMM_WORLD_SIZE" in env:
        return _env_int(env, "OMPI_COMM_WORLD_SIZE") or 1, "Open MPI"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
    if hosts:
        return len([h for h in hosts.split(",") if h.strip()]), "TPU hosts"
    return None


def resolve(*, coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, mode: str = "auto",
            env: Mapping[str, str] | None = None) -> DistributedSettings:
    """Flags over environment over cluster detection; ValueError names the bad setting."""
    if mode not in MODES:
        raise ValueError(f"--distributed must be one of {MODES}, got {mode!r}")
    env = os.environ if env is None else env
    address = coordinator_address or env.get(ENV_ADDRESS) or None
    count = num_processes if num_processes is not None else _env_int(env, ENV_COUNT)
    pid = process_id if process_id is not None else _env_int(env, ENV_ID)
    if count is not None and count < 1:
        raise ValueError(f"--num-processes ({ENV_COUNT}) must be >= 1, got {count}")
    if pid is not None and count is not None and not 0 <= pid < count:
        raise ValueError(f"--process-id ({ENV_ID}) must be in [0, {count}), got {pid}")
    if pid is not None and pid < 0:
        raise ValueError(f"--process-id ({ENV_ID}) must be >= 0, got {pid}")
    if mode == "off":
        return DistributedSettings(False, source="--distributed off")
    if count is not None:  # explicit settings
        if count == 1 and mode == "auto":
            return DistributedSettings(False, source="one process")
        if address is None and count > 1 and _cluster_processes(env) is None and mode == "auto":
            raise ValueError(f"{count} processes need --coordinator-address HOST:PORT "
                             f"(or {ENV_ADDRESS}): process 0's address and a free port")
        if pid is None and _cluster_processes(env) is None and mode == "auto":
            raise ValueError(f"{count} processes need --process-id (or {ENV_ID}) on each process")
        return DistributedSettings(True, address, count, pid, source="flags / environment")
    if mode == "on":
        return DistributedSettings(True, address, None, pid, source="jax auto-detection")
    cluster = _cluster_processes(env)
    if cluster is not None and cluster[0] > 1:
        return DistributedSettings(True, address, None, pid, source=cluster[1])
    return DistributedSettings(False)


def initialize(settings: DistributedSettings) -> DistributedSettings:
    """Call `jax.distributed.initialize` once for enabled settings (a no-op when disabled or when
    this process is already initialized). Must run before any other jax call."""
    if not settings.enabled:
        return settings
    import jax

    if jax.distributed.is_initialized():
        return settings
    jax.distributed.initialize(coordinator_address=settings.coordinator_address,
                               num_processes=settings.num_processes,
                               process_id=settings.process_id)
    return settings


def initialize_from_args(args: argparse.Namespace) -> DistributedSettings:
    """`resolve` the `add_distributed_args` flags and `initialize`."""
    return initialize(resolve(coordinator_address=args.coordinator_address,
                              num_processes=args.num_processes, process_id=args.process_id,
                              mode=args.distributed))


def process_shard() -> tuple[int, int]:
    """(jax.process_index(), jax.process_count())."""
    import jax

    return jax.process_index(), jax.process_count()


def is_primary() -> bool:
    """True on process 0: the one that writes shared files (logs, configs, exports)."""
    import jax

    return jax.process_index() == 0


def process_rows(sharding: Any, global_shape: Sequence[int], axis: int = 0) -> np.ndarray:
    """Sorted indices along `axis` of a `global_shape` array that this process's devices hold
    under `sharding`: the rows it feeds to `jax.make_array_from_process_local_data` (in this
    order). Processes holding replicas of the same rows get the same indices."""
    size = int(global_shape[axis])
    keep = np.zeros(size, bool)
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        keep[index[axis]] = True
    return np.flatnonzero(keep)


__all__ = ["DistributedSettings", "MODES", "add_distributed_args", "initialize",
           "initialize_from_args", "is_primary", "process_rows", "process_shard", "resolve"]
