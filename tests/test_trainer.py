"""Trainer: schedule and AdamW, exact resume, sharded step, NaN stop, frozen variables, gradient
accumulation, the DSpark objective, and SIGTERM checkpointing of the train_draft program."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import sharding as shd
from specjax.drafters.common import Frozen
from specjax.models.layers import Linear
from specjax.training.config import CheckpointConfig, LoggingConfig, OptimizerConfig
from specjax.training.data import EpochBatches
from specjax.training.step import lr_schedule, make_optimizer
from specjax.training.trainer import NonFiniteLossError, Trainer

from engine_fixtures import SUBPROCESS_XLA_FLAGS

V, H = 32, 16
POISON = V - 1  # a batch containing this token makes the toy loss NaN
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Toy(nnx.Module):
    """Tiny next-token model: frozen embedding and head, one trainable residual MLP."""

    def __init__(self, seed: int = 0):
        r = nnx.Rngs(seed)
        self.emb = Frozen(0.5 * jax.random.normal(r.params(), (V, H)),
                          logical_axes=("vocab", "embed"))
        self.up = Linear(H, 32, logical_axes=("embed", "mlp"), rngs=r, init_std=0.3)
        self.down = Linear(32, H, logical_axes=("mlp", "embed"), rngs=r, init_std=0.3)
        self.head = Frozen(0.5 * jax.random.normal(r.params(), (H, V)),
                           logical_axes=("embed", "vocab"))

    def __call__(self, ids):
        x = jnp.take(self.emb[...], ids, axis=0)
        x = x + self.down(jax.nn.gelu(self.up(x)))
        return x @ self.head[...]


def toy_loss(model, batch, rng, aux):
    del aux
    logits = model(batch["x"])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)[..., 0]
    # rng dependence (a random token weighting) makes the per-step key part of exact resume.
    w = 1.0 + 0.1 * jax.random.uniform(rng, nll.shape)
    loss = jnp.sum(w * nll) / jnp.sum(w)
    loss = jnp.where(jnp.any(batch["x"] == POISON), jnp.nan, loss)
    return loss, {"nll": jnp.mean(nll)}


class ToyData:
    def __init__(self, n: int = 64, poison_at: int | None = None):
        rng = np.random.default_rng(0)
        self.x = rng.integers(0, V - 1, (n, 8)).astype(np.int32)
        if poison_at is not None:
            self.x[poison_at, 0] = POISON

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": ((self.x[i] * 3 + 1) % V).astype(np.int32)}


def collate(items):
    return {k: np.stack([it[k] for it in items]) for k in items[0]}


OPT = OptimizerConfig(learning_rate=3e-2, warmup_ratio=0.25)


def plain_loss(model, batch, rng, aux):
    """Unweighted mean next-token CE (no rng use)."""
    del rng, aux
    logits = model(batch["x"])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)[..., 0]
    return jnp.mean(nll), {"nll": jnp.mean(nll)}


def _trainer(tmp_path=None, *, total=8, save_every=2, mesh=None, accum=1, async_save=True,
             loss=toy_loss):
    ck = None if tmp_path is None else CheckpointConfig(
        directory=str(tmp_path / "ckpt"), save_every=save_every, keep=3, async_save=async_save)
    return Trainer(Toy(), loss, optimizer=OPT, total_steps=total, mesh=mesh, checkpoint=ck,
                   grad_accum_steps=accum, seed=7,
                   logging=LoggingConfig(directory=str(tmp_path / "logs"), every=1,
                                         progress=False) if tmp_path is not None else None)


def _params(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


def _data(poison_at=None, shuffle=True):
    return EpochBatches(ToyData(poison_at=poison_at), 8, seed=3, collate=collate, shuffle=shuffle)


# ------------------------------------------------------------------------------------------------


def test_lr_schedule_matches_reference():
    peak, total = 6e-4, 100
    sched = lr_schedule(peak, total, 0.04)  # W = int(0.04 * 100) = 4
    lr = lambda s: float(sched(s - 1))  # optimizer step s is optax count s - 1
    np.testing.assert_allclose([lr(1), lr(2), lr(4)], [peak / 4, peak / 2, peak], rtol=1e-6)
    assert lr(5) == pytest.approx(peak, rel=1e-6)  # hand-off returns the peak
    for m in (1, 10, 48, 95):
        want = peak * 0.5 * (1 + math.cos(math.pi * m / (total - 4)))
        assert lr(5 + m) == pytest.approx(want, rel=1e-5, abs=peak * 1e-6)
    assert lr(total) < peak * 1e-3
    # T = 24k steps, ratio 0.04 -> 960 warmup steps (reference §6.3 scale)
    big = lr_schedule(peak, 24000, 0.04)
    assert float(big(959)) == pytest.approx(peak) and float(big(958)) < peak
    zero = lr_schedule(peak, 10, 0.0)
    assert float(zero(0)) == pytest.approx(peak)


def test_adamw_clip_matches_torch_formula():
    tx, sched = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_ratio=0.0,
                                               weight_decay=0.1, max_grad_norm=1.0), 10)
    p = {"w": jnp.asarray([1.0, -2.0, 3.0])}
    g = {"w": jnp.asarray([3.0, 4.0, 0.0])}  # norm 5 -> clipped to 1
    upd, _ = tx.update(g, tx.init(p), p)
    gc = np.array([0.6, 0.8, 0.0])
    m_hat, v_hat = gc, gc ** 2  # after bias correction at step 1
    lr = 1e-2
    want = -lr * (m_hat / (np.sqrt(v_hat) + 1e-8) + 0.1 * np.array([1.0, -2.0, 3.0]))
    np.testing.assert_allclose(np.asarray(upd["w"]), want, rtol=1e-5)


def test_exact_resume_and_same_next_batch(tmp_path):
    n = 6
    full_tr = _trainer(tmp_path / "a", total=n, save_every=100)
    full_data = _data()
    full = full_tr.fit(full_data)
    full_tr.close()
    assert full.step == n and full.status == "completed"

    part_tr = _trainer(tmp_path / "b", total=n, save_every=n // 2)
    part_data = _data()
    half = part_tr.fit(part_data, total_steps=n // 2)
    part_tr.close()
    assert half.step == n // 2
    resumed_tr = _trainer(tmp_path / "b", total=n, save_every=n // 2)
    resumed_data = _data()
    resumed = resumed_tr.fit(resumed_data)  # restores step 3 and the data position
    resumed_tr.close()
    assert resumed.step == n
    for a, b in zip(_params(full.state), _params(resumed.state)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(full.state.opt_state),
                    jax.tree.leaves(resumed.state.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert full_data.position() == resumed_data.position()
    nxt_a, nxt_b = next(full_data), next(resumed_data)
    np.testing.assert_array_equal(nxt_a["x"], nxt_b["x"])
    # the params did move, and the metrics files were written
    assert any(np.abs(a - b).max() > 0 for a, b in zip(_params(full.state),
                                                       _params(full_tr.init_state())))
    lines = (tmp_path / "a" / "logs" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == n and "lr" in json.loads(lines[-1])
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "a" / "logs"))


def test_deadline_saves_and_a_rerun_continues_exactly(tmp_path):
    """A run past its deadline stops after the step it is in, saving that step (status
    "time_limit"); the rerun continues to the same parameters as one uninterrupted run."""
    import time

    n = 5
    full_tr = _trainer(tmp_path / "a", total=n, save_every=100)
    full = full_tr.fit(_data())
    full_tr.close()
    cut_tr = _trainer(tmp_path / "b", total=n, save_every=100)
    cut = cut_tr.fit(_data(), deadline=time.monotonic())  # already past: one step, then stop
    cut_tr.close()
    assert (cut.step, cut.status) == (1, "time_limit")
    again_tr = _trainer(tmp_path / "b", total=n, save_every=100)
    assert again_tr.latest_checkpoint() == 1
    again = again_tr.fit(_data(), deadline=time.monotonic() + 3600)
    again_tr.close()
    assert (again.step, again.status) == (n, "completed")
    for a, b in zip(_params(full.state), _params(again.state)):
        np.testing.assert_array_equal(a, b)


def test_data_positions_cross_epochs():
    d = _data()
    assert d.steps_per_epoch == 8
    seen = [next(d)["x"] for _ in range(8)]
    assert d.position() == {"epoch": 0, "index": 64}
    first_next = next(d)["x"]  # epoch 1, a fresh permutation seeded by seed + 1
    assert d.position() == {"epoch": 1, "index": 8}
    order1 = np.random.default_rng(3 + 1).permutation(64)[:8]
    np.testing.assert_array_equal(first_next, ToyData().x[order1])
    np.testing.assert_array_equal(np.sort(np.concatenate(seen).ravel()),
                                  np.sort(ToyData().x.ravel()))
    d2 = _data()
    d2.restore({"epoch": 0, "index": 64})
    np.testing.assert_array_equal(next(d2)["x"], first_next)
    with pytest.raises(ValueError, match="position"):
        d2.restore({"epoch": 0, "index": 999})


def test_sharded_step_equals_single_device():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (emulated) devices")
    mesh = shd.train_mesh(data=2, fsdp=4, tensor=1)
    single, multi = _trainer(total=4), _trainer(total=4, mesh=mesh)
    s1, s8 = single.init_state(), multi.init_state()
    assert "fsdp" in str(jax.tree.leaves(s8.params)[0].sharding.spec)
    d1, d8 = _data(), _data()
    for _ in range(3):
        s1, m1 = single.step(s1, next(d1))
        s8, m8 = multi.step(s8, next(d8))
        assert float(m1["loss"]) == pytest.approx(float(m8["loss"]), abs=1e-5)
    assert len(jax.tree.leaves(s8.params)[0].sharding.device_set) == 8
    for a, b in zip(_params(s1), _params(s8)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    batch = multi.put_batch(next(d8))
    assert batch["x"].sharding.spec[0] == ("data", "fsdp")


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    # shuffle off: sample 36 is in batch 5 (samples 32..39), so optimizer step 5 is non-finite.
    tr = _trainer(tmp_path, total=8, save_every=2, async_save=True)
    with pytest.raises(NonFiniteLossError, match=r"optimizer step 5\b.*last good checkpoint is "
                                                 r"step 4") as err:
        tr.fit(_data(poison_at=36, shuffle=False))
    assert err.value.step == 5 and err.value.last_checkpoint == 4
    assert tr.manager.all_steps() == [2, 4]
    state, pos = tr.restore()
    assert int(state.step) == 4 and pos == {"epoch": 0, "index": 32}
    assert all(np.isfinite(p).all() for p in _params(state))
    tr.close()


def test_frozen_variables_unchanged_and_not_in_optimizer(tmp_path):
    tr = _trainer(total=4)
    model0 = Toy()
    state = tr.init_state()
    assert len(jax.tree.leaves(state.params)) == 2  # only up/down kernels are trained
    d = _data()
    for _ in range(3):
        state, _ = tr.step(state, next(d))
    m = tr.model(state)
    np.testing.assert_array_equal(np.asarray(m.emb[...]), np.asarray(model0.emb[...]))
    np.testing.assert_array_equal(np.asarray(m.head[...]), np.asarray(model0.head[...]))
    assert np.abs(np.asarray(m.up.kernel[...]) - np.asarray(model0.up.kernel[...])).max() > 1e-4
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


def test_grad_accumulation_equals_full_batch():
    whole = _trainer(total=4, loss=plain_loss)
    accum = _trainer(total=4, accum=2, loss=plain_loss)
    d = _data()
    sa, sb = whole.init_state(), accum.init_state()
    for _ in range(2):
        batch = next(d)
        sa, ma = whole.step(sa, batch)
        sb, mb = accum.step(sb, batch)  # 2 micro-batches of 4: mean of equal-size means
        assert float(ma["loss"]) == pytest.approx(float(mb["loss"]), abs=1e-6)
    assert int(sb.step) == 2
    for a, b in zip(_params(sa), _params(sb)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="grad_accum_steps"):
        accum.put_batch({"x": np.zeros((3, 8), np.int32)})


# ------------------------------------------------------------------------------------------------
# the DSpark objective and the train_draft program


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    from specjax.config import TargetConfig
    from specjax.checkpoints import export_target
    from specjax.models.decoder import CausalLM

    cfg = TargetConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                       rope_theta=10000.0)
    out = tmp_path_factory.mktemp("tiny") / "target"
    return export_target(CausalLM(cfg, rngs=nnx.Rngs(0)), cfg, out)


def _tiny_run_yaml(tmp_path, target_dir, *, total_steps=10**6, save_every=10**6, mode="online"):
    rng = np.random.default_rng(0)
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:
        for _ in range(8):
            s = int(rng.integers(12, 30))
            ids = rng.integers(0, 47, s).tolist()
            mask = [0] * 4 + [1] * (s - 4)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    cfg = {
        "name": "tiny", "seed": 1,
        "model": {"kind": "dspark", "target": str(target_dir), "mask_token_id": 47,
                  "target_layer_ids": [-1, 1], "num_draft_layers": 1, "block_size": 3,
                  "markov_rank": 4, "confidence_head": True, "num_anchors": 4,
                  "compute_dtype": "float32", "target_dtype": "float32", "chunk_anchors": 2},
        "optimizer": {"learning_rate": 1e-3},
        "schedule": {"total_steps": total_steps},
        "data": {"mode": mode, "train_jsonl": [str(data)], "max_length": 32,
                 "min_loss_tokens": 1, "batch_size": 2, "length_buckets": [32]},
        "checkpoint": {"directory": str(tmp_path / "ckpt"), "save_every": save_every},
        "logging": {"directory": str(tmp_path / "logs"), "every": 1, "progress": False,
                    "tensorboard": False},
    }
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dspark_objective_online_chunked_equals_offline_plain(tmp_path, tiny_target_dir):
    from specjax.training.config import load_train_config
    from specjax.training.features import target_features_jit
    from specjax.drafters.dspark_kind import block_drafter_loss
    from specjax.training.objectives import trainer_loss
    from specjax.training.run import build

    run = build(load_train_config(_tiny_run_yaml(tmp_path, tiny_target_dir, total_steps=3)))
    assert run.drafter_config.variant == "dspark" and run.trainer.total_steps == 3
    tr = run.trainer
    batch = tr.put_batch(next(run.data))
    key = jax.random.PRNGKey(5)
    rest, aux = tr.frozen
    params = tr.init_state().params
    # train_draft's loss (online target features, vocabulary terms 2 anchors at a time) equals
    # the unchunked loss on precomputed (cache-style) features.
    taps, hid = target_features_jit(aux, run.target_graphdef, batch["input_ids"], batch["valid"],
                                    tap_layers=run.tap_layers)
    plain_fn = trainer_loss(block_drafter_loss(num_anchors=4))

    @jax.jit
    def both(p, b, k):
        model = nnx.merge(tr.graphdef, p, rest)
        return (tr.loss_fn(model, b, k, aux),
                plain_fn(model, dict(b, taps=taps, hidden=hid), k, None))

    online, offline = both(params, batch, key)
    assert float(online[0]) == pytest.approx(float(offline[0]), rel=1e-5)
    for k in ("ce", "tv", "conf", "tau_probabilistic", "accept_rate@1", "tokens_per_block"):
        assert float(online[1][k]) == pytest.approx(float(offline[1][k]), rel=1e-5, abs=1e-6)
    assert float(online[1]["sampled_anchors_per_seq"]) == 4.0
    assert float(online[1]["supervised_slots"]) > 0
    # the frozen embedding / lm_head copies are outside the optimizer
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(params)}
    assert "fc.kernel" in names and not any("lm_head" in n or "embed_tokens" in n for n in names)


def test_sigterm_saves_checkpoint_and_exits_cleanly(tmp_path, tiny_target_dir):
    cfg_path = _tiny_run_yaml(tmp_path, tiny_target_dir)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    proc = subprocess.Popen([sys.executable, "-m", "train.train_draft", "--config", str(cfg_path)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    metrics = tmp_path / "logs" / "metrics.jsonl"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and metrics.read_text().count("\n") >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "received SIGTERM" in out and "preempted at step" in out
    steps = sorted(int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit())
    assert len(steps) == 1 and 2 <= steps[0] < 10**6  # saved only because of the signal
    assert (tmp_path / "ckpt" / "train_config.yaml").exists()
    from specjax.training.config import load_train_config
    from specjax.training.run import build

    run = build(load_train_config(cfg_path))
    state, pos = run.trainer.restore()
    assert int(state.step) == steps[0] and pos["index"] > 0
    run.trainer.close()


def test_train_configs_load_and_validate(tmp_path):
    from specjax.config import ConfigError
    from specjax.training.config import load_train_config

    ds = load_train_config(os.path.join(ROOT, "configs/train/dspark.yaml"))
    df = load_train_config(os.path.join(ROOT, "configs/train/dflash.yaml"))
    assert (ds.model.section.alpha_ce, ds.model.section.alpha_tv,
            ds.model.section.alpha_conf) == (0.1, 0.9, 1.0)
    assert (df.model.section.alpha_ce, df.model.section.alpha_tv,
            df.model.section.markov_rank) == (1.0, 0.0, 0)
    assert ds.optimizer.learning_rate == 6e-4 and ds.data.batch_size == 512
    assert ds.data.grad_accum_steps == 64 and df.data.mode == "online"
    over = load_train_config(os.path.join(ROOT, "configs/train/dspark.yaml"),
                             ["optimizer.learning_rate=1e-3", "schedule.total_steps=7"])
    assert over.optimizer.learning_rate == 1e-3 and over.schedule.resolve_total_steps(1) == 7
    assert ds.schedule.resolve_total_steps(2400) == 24000
    bad = [("optimizer.learning_rate=abc", "learning_rate"), ("data.batch_size=100", "batch_size"),
           ("model.kind=eagle", "kind"), ("optimizer.nope=1", "nope")]
    for item, field in bad:
        with pytest.raises(ConfigError, match=field):
            load_train_config(os.path.join(ROOT, "configs/train/dspark.yaml"), [item])
    with pytest.raises(ConfigError, match="dflash"):
        load_train_config(os.path.join(ROOT, "configs/train/dflash.yaml"), ["model.markov_rank=4"])
