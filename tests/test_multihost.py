"""Multi-host on JAX's distributed runtime: settings from flags / environment / schedulers, and real
2-process runs on loopback (one CPU device per process, gloo collectives): a data-parallel
training step equals the single-process step on the same global batch, and a SIGTERM to one
process stops both after the same step with a checkpoint; a batch job writes
disjoint per-process shards, and after one process is SIGKILLed a rerun finishes its shard without
duplicates. The 2-process tests start real programs (`train.train_draft`, `serve.batch`): about
20-40 s each on 2 cores, mostly two interpreters importing jax and compiling in parallel."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from specjax import distributed as dist

try:
    from tests.engine_fixtures import SUBPROCESS_XLA_FLAGS
    from tests.serving_fixtures import export_tiny_target, read_jsonl, write_jsonl
except ImportError:  # tests/ itself on sys.path
    from engine_fixtures import SUBPROCESS_XLA_FLAGS
    from serving_fixtures import export_tiny_target, read_jsonl, write_jsonl

REPO = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache_dir: pathlib.Path) -> dict[str, str]:
    """One CPU device per process; a compilation cache shared by the processes and reruns."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "TPU_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false",
               XLA_FLAGS=SUBPROCESS_XLA_FLAGS,
               JAX_COMPILATION_CACHE_DIR=str(cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    for k in (dist.ENV_ADDRESS, dist.ENV_COUNT, dist.ENV_ID):
        env.pop(k, None)
    return env


def _launch(module: str, args: list[str], n: int, env: dict[str, str], logs: pathlib.Path,
            ) -> list[subprocess.Popen]:
    """`n` processes of `python -m module args` joined on a fresh loopback coordinator."""
    addr = f"127.0.0.1:{_free_port()}"
    procs = []
    for i in range(n):
        out = open(logs / f"{module}.{i}.{addr.rsplit(':', 1)[1]}.log", "wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", module, *args, "--coordinator-address", addr,
             "--num-processes", str(n), "--process-id", str(i)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
        procs[-1].log_path = out.name  # type: ignore[attr-defined]
        out.close()
    return procs


def _log(p: subprocess.Popen) -> str:
    return pathlib.Path(p.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{_log(p)[-4000:]}"


# ------------------------------------------------------------------------------------------------
# settings


def test_settings_from_flags_environment_and_schedulers():
    r = dist.resolve
    assert not r(env={}).enabled  # a plain run stays single-process
    s = r(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3, env={})
    assert (s.enabled, s.coordinator_address, s.num_processes, s.process_id) == (True, "10.0.0.1:1234", 4, 3)
    env = {"JAX_COORDINATOR_ADDRESS": "h0:99", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert r(env=env) == dist.DistributedSettings(True, "h0:99", 2, 1, "flags / environment")
    assert r(process_id=0, env=env).process_id == 0  # a flag wins over the environment
    assert not r(num_processes=1, env={}).enabled and not r(env=env, mode="off").enabled
    # schedulers: JAX reads their variables itself (no explicit values passed on)
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    assert r(env=slurm) == dist.DistributedSettings(True, None, None, None, "SLURM")
    assert not r(env=dict(slurm, SLURM_NTASKS="1")).enabled  # a one-task job stays single
    assert r(env={"TPU_WORKER_HOSTNAMES": "a,b,c,d"}).source == "TPU hosts"
    assert not r(env={"TPU_WORKER_HOSTNAMES": "a"}).enabled
    assert r(env={}, mode="on") == dist.DistributedSettings(True, None, None, None, "jax auto-detection")
    # bad settings name the flag and its variable
    with pytest.raises(ValueError, match="--coordinator-address"):
        r(num_processes=2, process_id=0, env={})
    with pytest.raises(ValueError, match="--process-id"):
        r(coordinator_address="h:1", num_processes=2, env={})
    with pytest.raises(ValueError, match=r"--process-id \(JAX_PROCESS_ID\) must be in \[0, 2\)"):
        r(coordinator_address="h:1", num_processes=2, process_id=2, env={})
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES must be an integer"):
        r(env={"JAX_NUM_PROCESSES": "two"})
    # initialize() leaves a disabled run alone (this test process is not distributed)
    assert not dist.initialize(r(env={})).enabled and not jax.distributed.is_initialized()


class _Held:
    """A sharding stand-in whose addressable devices hold the given index tuples."""

    def __init__(self, *indices):
        self.indices = indices

    def addressable_devices_indices_map(self, shape):
        return {f"dev{k}": ix for k, ix in enumerate(self.indices)}


def test_process_rows_follow_the_batch_sharding(monkeypatch):
    from jax.sharding import NamedSharding, PartitionSpec
    from flax import nnx

    from specjax import sharding as shd
    from specjax.training.config import OptimizerConfig
    from specjax.training.trainer import Trainer

    # the rows this process's devices hold, sorted, replicas counted once
    held = _Held((slice(4, 6), slice(None)), (slice(0, 2), slice(None)), (slice(4, 6), slice(None)))
    assert dist.process_rows(held, (8, 3)).tolist() == [0, 1, 4, 5]
    assert dist.process_rows(_Held((slice(None), slice(2, 4))), (2, 6), axis=1).tolist() == [2, 3]
    if len(jax.devices()) >= 8:  # one process holds every device: all rows, in order
        mesh = shd.make_mesh((2, 4), ("data", "fsdp"))
        rows = dist.process_rows(NamedSharding(mesh, PartitionSpec(("data", "fsdp"))), (16, 3))
        assert rows.tolist() == list(range(16))

    class Tiny(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.ones((3,), np.float32))

    def loss_fn(model, batch, rng, aux):
        return (batch["x"] @ model.w[...]).mean(), {}

    tr = Trainer(Tiny(), loss_fn, optimizer=OptimizerConfig(), total_steps=2, grad_accum_steps=2)
    assert tr.process_rows(8).tolist() == list(range(8))  # one process feeds everything
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    put = tr.put_batch({"x": x}, global_batch_size=8)["x"]
    np.testing.assert_array_equal(np.asarray(put), x.reshape(2, 4, 3))  # [M, B, ...]
    with pytest.raises(ValueError, match="feeds 8 of the 8 rows of each global batch, got .* 6 rows"):
        tr.put_batch({"x": x[:6]}, global_batch_size=8)
    # with accumulation, a process feeding rows 1 and 3 of each micro-batch feeds them in every one
    monkeypatch.setattr(dist, "process_rows", lambda sharding, shape, axis=0: np.array([1, 3]))
    assert tr.process_rows(8).tolist() == [1, 3, 5, 7]


def test_epoch_batches_read_a_slice_padded_like_the_global_batch():
    import functools

    from specjax.training.data import EpochBatches, collate_block_batch

    class Samples:
        def __init__(self, lengths):
            self.lengths = lengths

        def __len__(self):
            return len(self.lengths)

        def __getitem__(self, i):
            return {"input_ids": np.full(self.lengths[i], i), "loss_mask": np.ones(self.lengths[i])}

    data = Samples([5, 20, 6, 7])
    collate = functools.partial(collate_block_batch, buckets=(8, 32))
    got = [next(EpochBatches(data, 2, collate=collate, shuffle=False, rows=[r])) for r in (0, 1)]
    # each process reads only its own sample, padded to the bucket of the batch's longest (20)
    assert [g["input_ids"][0, 0] for g in got] == [0, 1] and [g["valid"][0] for g in got] == [5, 20]
    assert got[0]["input_ids"].shape == got[1]["input_ids"].shape == (1, 32)
    alone = collate([data[0]])  # negative control: padded on its own it would be shorter
    assert alone["input_ids"].shape == (1, 8)


# ------------------------------------------------------------------------------------------------
# two processes


def _tiny_run(tmp_path: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    rng = np.random.default_rng(3)
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:
        for _ in range(8):
            s = int(rng.integers(10, 30))
            ids = rng.integers(3, 63, s).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 3 + [1] * (s - 3)}) + "\n")
    cfg = {
        "name": "mh", "seed": 1,
        "model": {"kind": "dspark", "target": str(target), "mask_token_id": 63,
                  "target_layer_ids": [-1, 1], "num_draft_layers": 1, "block_size": 3,
                  "markov_rank": 4, "confidence_head": True, "num_anchors": 4,
                  "compute_dtype": "float32", "target_dtype": "float32"},
        "optimizer": {"learning_rate": 3e-3, "warmup_ratio": 0.0},
        "schedule": {"total_steps": 10**6},
        "data": {"mode": "online", "train_jsonl": [str(data)], "max_length": 32,
                 "min_loss_tokens": 1, "batch_size": 4, "length_buckets": [16, 32]},
        "checkpoint": {"directory": str(tmp_path / "ckpt"), "save_every": 1, "keep": 1000},
        "logging": {"directory": str(tmp_path / "logs"), "every": 1, "progress": False,
                    "tensorboard": False},
    }
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _head(log: str) -> dict:
    return next(json.loads(x) for x in log.splitlines() if x.startswith('{"run"'))


def test_two_process_data_parallel_step_equals_single_process_and_sigterm_stops_both(tmp_path):
    from specjax import sharding as shd
    from specjax.training.config import load_train_config
    from specjax.training.run import build

    target = export_tiny_target(tmp_path / "target")
    cfg_path = _tiny_run(tmp_path, target)
    metrics_log = tmp_path / "logs" / "metrics.jsonl"
    procs = _launch("train.train_draft", ["--config", str(cfg_path)], 2, _env(tmp_path / "jit"),
                    tmp_path)
    try:  # meanwhile, the same step on this one process over the whole global batch
        mesh = shd.make_mesh((1, 1, 1), shd.TRAIN_AXES, devices=jax.devices()[:1])
        run = build(load_train_config(cfg_path), mesh=mesh)
        tr = run.trainer
        assert run.data.rows.tolist() == [0, 1, 2, 3]
        batch = next(run.data)
        state, metrics = tr.step(tr.init_state(), batch, global_batch_size=4)
        jax.block_until_ready(state)
        # a preemption notice (SIGTERM) to one process stops both after the same step
        deadline = time.time() + 240
        while time.time() < deadline and all(p.poll() is None for p in procs) and (
                not metrics_log.exists() or metrics_log.read_text().count("\n") < 2):
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGTERM)
    finally:
        _wait_all(procs, timeout=240)
    logs = [_log(p) for p in procs]
    h0, h1 = (_head(x) for x in logs)
    # the processes shared one mesh of 2 devices and fed different halves of the global batch
    assert (h0["process"], h1["process"], h0["devices"]) == ("0/2", "1/2", 2)
    assert h0["batch_rows"] == [0, 1] and h1["batch_rows"] == [2, 3]
    stops = [int(x.split("preempted at step ")[1].split(";")[0]) for x in logs]
    assert stops[0] == stops[1] >= 2 and "received SIGTERM" in logs[0]
    assert str(stops[0]) in os.listdir(tmp_path / "ckpt")
    # only process 0 logs: one line per step
    rows = [json.loads(x) for x in metrics_log.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, stops[0] + 1))
    m0 = rows[0]
    assert float(metrics["loss"]) == pytest.approx(m0["loss"], abs=1e-5)
    assert float(metrics["grad_norm"]) == pytest.approx(m0["grad_norm"], rel=1e-5)
    multi, _ = tr.restore(1)  # the checkpoint the two processes saved together
    assert int(multi.step) == 1
    moved = 0.0
    for a, b, p0 in zip(jax.tree.leaves(state.params), jax.tree.leaves(multi.params),
                        jax.tree.leaves(tr.params0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
        moved = max(moved, float(np.max(np.abs(np.asarray(a) - np.asarray(p0)))))
    assert moved > 1e-4  # the step really changed the parameters
    # negative control: had both processes fed the first half, the loss would differ
    half = {k: np.concatenate([v[:2], v[:2]]) for k, v in batch.items()}
    _, wrong = tr.step(tr.init_state(), half, global_batch_size=4)
    assert abs(float(wrong["loss"]) - m0["loss"]) > 1e-3
    tr.close()


def _lines(path: pathlib.Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_two_process_batch_job_shards_and_kill_rerun(tmp_path):
    target = export_tiny_target(tmp_path / "target")
    n = 40
    rows = [{"id": f"m{i}", "prompt": [3 + (i * 7 + k) % 50 for k in range(3 + i % 5)]}
            for i in range(n)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, rows)
    args = [str(inp), "-o", str(out), "--target", str(target), "--max-num-seqs", "2",
            "--max-model-len", "128", "--max-prefill", "32", "--slots-buckets", "2",
            "--tokens-buckets", "1", "--prefill-buckets", "32", "--max-tokens", "48",
            "--temperature", "0", "--no-progress"]
    env = _env(tmp_path / "jit")
    shard = [tmp_path / f"out.shard-{i}-of-2.jsonl" for i in range(2)]
    p0, p1 = _launch("serve.batch", args, 2, env, tmp_path)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and p1.poll() is None and _lines(shard[1]) < 2:
            time.sleep(0.005)
        p1.send_signal(signal.SIGKILL)  # one host dies mid-job
        p1.wait(30)
        partial = _lines(shard[1])
        # the other process finishes its own shard (then waits for its peer at shutdown)
        while time.time() < deadline and p0.poll() is None and _lines(shard[0]) < n // 2:
            time.sleep(0.05)
        assert _lines(shard[0]) == n // 2, _log(p0)[-3000:]
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert p1.returncode == -signal.SIGKILL
    assert 2 <= partial < n // 2, f"the kill should land mid-shard ({partial} rows written)"

    # rerun the same command on every process: each finishes only what its shard lacks
    procs = _launch("serve.batch", args, 2, env, tmp_path)
    _wait_all(procs, timeout=240)
    s0, s1 = (json.loads(_log(p).strip().splitlines()[-1]) for p in procs)
    assert (s0["shard"], s0["skipped_done"], s0["completed"]) == ("0/2", n // 2, 0)
    assert (s1["shard"], s1["skipped_done"], s1["completed"]) == ("1/2", partial, n // 2 - partial)
    got = [[r["id"] for r in read_jsonl(p)] for p in shard]
    assert got[0] == [f"m{i}" for i in range(0, n, 2)]  # process i took lines i, i+2, ...
    assert sorted(got[1]) == sorted(f"m{i}" for i in range(1, n, 2))
    assert sorted(got[0] + got[1]) == sorted(f"m{i}" for i in range(n))  # every row exactly once
    assert all(r["token_ids"] for p in shard for r in read_jsonl(p))
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# target cache built by several processes


def test_build_cache_parts_read_as_one_cache(tmp_path, monkeypatch):
    from specjax.config import ConfigError
    from specjax.training import cache_parts
    from train import build_cache

    target = export_tiny_target(tmp_path / "target")
    rng = np.random.default_rng(5)
    rows = []
    for _ in range(5):
        s = int(rng.integers(6, 20))
        rows.append({"input_ids": rng.integers(3, 63, s).tolist(), "loss_mask": [0] + [1] * (s - 1)})
    write_jsonl(tmp_path / "d.jsonl", rows)
    args = ["--target", str(target), "--data", str(tmp_path / "d.jsonl"), "--layers=-1,1",
            "--min-loss-tokens", "1", "--dtype", "float32", "--batch-size", "2", "--quiet"]
    assert build_cache.main(args + ["--out", str(tmp_path / "one")]) == 0
    for i in (1, 0):  # process i of 2, as jax.process_index() / process_count() report it
        monkeypatch.setattr(dist, "process_shard", lambda i=i: (i, 2))
        assert build_cache.main(args + ["--out", str(tmp_path / "two")]) == 0
        if i == 1:  # one part alone is not a cache yet
            with pytest.raises(ConfigError, match=r"parts \['part-0-of-2'\] of 2 are missing"):
                cache_parts.open_target_cache(tmp_path / "two")
    assert sorted(os.listdir(tmp_path / "two")) == ["part-0-of-2", "part-1-of-2"]
    assert cache_parts.part_range(5, 0, 2) == (0, 2) and cache_parts.part_range(5, 1, 2) == (2, 5)
    one = cache_parts.open_target_cache(tmp_path / "one", expect_layers=(-1, 1))
    two = cache_parts.open_target_cache(tmp_path / "two", expect_layers=(-1, 1))
    assert isinstance(two, cache_parts.PartedTargetCache) and len(two) == len(one) == 5
    assert two.lengths.tolist() == one.lengths.tolist() == [len(r["input_ids"]) for r in rows]
    order = [4, 0, 3, 1, 2]  # across both parts, in the order asked
    for a, b, k in zip(one.read(order), two.read(order), order):
        assert a["input_ids"].tolist() == b["input_ids"].tolist() == rows[k]["input_ids"]
        for name in ("taps", "hidden"):
            np.testing.assert_allclose(np.asarray(a[name], np.float32), np.asarray(b[name], np.float32),
                                       rtol=2e-2, atol=2e-2)
    with pytest.raises(IndexError, match="out of range"):
        two.read([5])
    # several caches in a row read as one data set: the first's samples, then the second's
    both = cache_parts.open_target_caches([tmp_path / "one", tmp_path / "two"], expect_layers=(-1, 1))
    assert len(both) == 10 and both.lengths.tolist() == one.lengths.tolist() * 2
    got = both.read([7, 2])
    assert [g["input_ids"].tolist() for g in got] == [rows[2]["input_ids"], rows[2]["input_ids"]]
    assert type(cache_parts.open_target_caches([tmp_path / "one"])) is type(one)
    from specjax.training.config import DataConfig

    with pytest.raises(ConfigError, match="field 'extra_cache_dirs' needs data.mode 'cache'"):
        DataConfig(mode="online", train_jsonl=("x.jsonl",), extra_cache_dirs=("c",))
