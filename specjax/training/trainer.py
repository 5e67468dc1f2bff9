"""Generic drafter trainer: optax AdamW, one sharded donated jitted step, orbax checkpoints.

The model is split once (`nnx.split(model, trainable, ...)`) into a graph definition, the
trainable parameters and everything else ("rest": frozen embedding / lm_head copies, calibration
values). The step is a pure function of explicit pytrees:

    train_step(frozen, state, batch, rng) -> (state, metrics)

with `frozen = (rest, aux)` (aux: any extra frozen pytree the loss reads, e.g. the target's
parameters in online-feature mode; never differentiated, not donated) and
`state = TrainState(step, params, opt_state, rng)` (donated). `Trainer.step(state, batch, rng)`
binds `frozen`. Master weights are float32 in the state; the module computes in its own `dtype`
(e.g. bfloat16), casting the weights at use, so gradients arrive in float32. A step whose loss or
gradient norm is not finite leaves the state unchanged and the host loop stops with
`NonFiniteLossError`.

A loss function has the signature `loss_fn(model, batch, rng, aux) -> (loss, metrics)`;
`block_drafter_loss` is the DSpark / DFlash objective (reference §5.1) over offline or online
target features.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from specjax import sharding as shd
from specjax.training.config import CheckpointConfig, LoggingConfig, OptimizerConfig

Array = jax.Array
LossFn = Callable[[nnx.Module, Any, Array, Any], tuple[Array, Mapping[str, Array]]]


class NonFiniteLossError(RuntimeError):
    """Training stopped on a NaN / inf loss or gradient norm (the state was not updated)."""

    def __init__(self, message: str, step: int, last_checkpoint: int | None):
        super().__init__(message)
        self.step = step
        self.last_checkpoint = last_checkpoint


# ------------------------------------------------------------------------------------------------
# optimizer and schedule (reference §6.4)


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return int(warmup_ratio * total_steps)


def lr_schedule(peak_lr: float, total_steps: int, warmup_ratio: float) -> optax.Schedule:
    """Learning rate by optax update count c (0-indexed; optimizer step s = c + 1).

    With W = int(warmup_ratio * T): lr_s = peak * s / W for s <= W, then cosine to 0:
    lr_{W+1+m} = peak * (1 + cos(pi * m / (T - W))) / 2 (so lr_{W+1} = peak).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    w = warmup_steps(total_steps, warmup_ratio)
    decay = max(total_steps - w, 1)

    def schedule(count: Array) -> Array:
        s = jnp.asarray(count, jnp.float32) + 1.0
        warm = peak_lr * s / max(w, 1)
        m = jnp.maximum(s - (w + 1), 0.0)
        cos = peak_lr * 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.minimum(m, decay) / decay))
        return jnp.where(s <= w, warm, cos)

    return schedule


def make_optimizer(cfg: OptimizerConfig, total_steps: int,
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """clip_by_global_norm(max_grad_norm) -> AdamW(schedule, b1, b2, eps, weight_decay)."""
    schedule = lr_schedule(cfg.learning_rate, total_steps, cfg.warmup_ratio)
    parts = []
    if cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay))
    return optax.chain(*parts), schedule


# ------------------------------------------------------------------------------------------------
# state and the pure step


class TrainState(NamedTuple):
    step: Array  # int32 []: optimizer steps done
    params: Any  # trainable parameters (float32 masters), an nnx.State
    opt_state: Any
    rng: Array  # uint32 [2]: base key; step n uses fold_in(rng, n)


def _as_float32(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def make_train_step(graphdef: Any, loss_fn: LossFn, tx: optax.GradientTransformation,
                    schedule: optax.Schedule | None = None, *, grad_accum_steps: int = 1,
                    ) -> Callable[..., tuple[TrainState, dict[str, Array]]]:
    """The pure step `(frozen=(rest, aux), state, batch, rng) -> (state, metrics)`.

    With `grad_accum_steps` M > 1 every batch leaf has a leading micro-step axis [M, ...]; the
    gradient is the mean over micro-steps (each micro loss / M, reference §6.3). `rng` None
    means fold_in(state.rng, state.step). Metrics: the loss function's (mean over micro-steps),
    plus loss, grad_norm (before clipping), lr (of this update) and finite (bool).
    """
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")

    def loss_of(params, rest, aux, batch, key):
        model = nnx.merge(graphdef, params, rest)
        loss, metrics = loss_fn(model, batch, key, aux)
        return loss, dict(metrics)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def train_step(frozen, state: TrainState, batch, rng=None):
        rest, aux = frozen
        key = jax.random.fold_in(state.rng, state.step) if rng is None else rng
        if grad_accum_steps == 1:
            (loss, metrics), grads = grad_fn(state.params, rest, aux, batch, key)
        else:
            keys = jax.random.split(key, grad_accum_steps)

            def micro(carry, xs):
                mb, k = xs
                (l, m), g = grad_fn(state.params, rest, aux, mb, k)
                g_acc, l_acc, m_acc = carry
                return (jax.tree.map(jnp.add, g_acc, g), l_acc + l,
                        jax.tree.map(jnp.add, m_acc, m)), None

            (_, m_shape), _ = jax.eval_shape(
                grad_fn, state.params, rest, aux, jax.tree.map(lambda x: x[0], batch), keys[0])
            zeros_m = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), m_shape)
            zeros_g = jax.tree.map(jnp.zeros_like, state.params)
            (g_sum, l_sum, m_sum), _ = jax.lax.scan(
                micro, (zeros_g, jnp.zeros((), jnp.float32), zeros_m), (batch, keys))
            inv = 1.0 / grad_accum_steps
            grads = jax.tree.map(lambda g: g * inv, g_sum)
            loss = l_sum * inv
            metrics = jax.tree.map(lambda m: m * inv, m_sum)
        gnorm = optax.tree.norm(grads)
        updates, new_opt = tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        new_state = TrainState(state.step + 1, new_params, new_opt, state.rng)
        out = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, state)
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        metrics["loss"] = jnp.asarray(loss, jnp.float32)
        metrics["grad_norm"] = gnorm.astype(jnp.float32)
        if schedule is not None:
            metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
        metrics["finite"] = ok
        return out, metrics

    return train_step


# ------------------------------------------------------------------------------------------------
# resumable data


class ResumableIterator(Protocol):
    """Batches with a resumable position: after `restore(p)` the next batch is the one that
    followed when `position()` returned p."""

    def __next__(self) -> Any: ...

    def position(self) -> dict[str, int]: ...

    def restore(self, position: Mapping[str, int]) -> None: ...


class EpochBatches:
    """Global batches of `batch_size` samples over a deterministic per-epoch permutation.

    Epoch e uses `np.random.default_rng(seed + e).permutation(N)` (or 0..N-1 without shuffle) and
    yields floor(N / batch_size) batches (the remainder is dropped), then streams into epoch e+1.
    Position = {"epoch", "index"}: the next sample index into epoch e's order. `dataset` needs
    `__len__` and `__getitem__` (or `read(indices) -> list`); `collate(list) -> batch`.

    Data-parallel over processes: `rows` (`Trainer.process_rows(batch_size)`) are the positions of
    each global batch that this process reads and feeds; every process walks the same order. When
    the dataset has `lengths` (tokens per sample), the collate is called as
    `collate(items, longest=L)` with L the longest sample of the whole global batch, so that every
    process pads to the same shape. `global_batch_size` is then `batch_size` (None otherwise).
    """

    def __init__(self, dataset: Any, batch_size: int, *, seed: int = 42,
                 collate: Callable[..., Any] | None = None, shuffle: bool = True,
                 rows: Sequence[int] | None = None):
        n = len(dataset)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if n < batch_size:
            raise ValueError(f"the data set has {n} samples, fewer than one batch ({batch_size})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.collate = collate or (lambda xs: xs)
        self.steps_per_epoch = n // batch_size
        self.epoch = 0
        self.index = 0
        self._order: np.ndarray | None = None
        self._order_epoch = -1
        self.rows: np.ndarray | None = None
        self.global_batch_size: int | None = None
        self._lengths: np.ndarray | None = None
        if rows is not None:
            self.rows = np.asarray(rows, np.int64)
            if self.rows.ndim == 1 and not len(self.rows):
                raise ValueError("this process feeds no row of the global batch: the training "
                                 "mesh holds none of its devices (mesh sizes vs devices per host)")
            if self.rows.ndim != 1 or self.rows.min() < 0 or self.rows.max() >= batch_size:
                raise ValueError(f"rows must be positions in a batch of {batch_size}, got "
                                 f"{self.rows.tolist()}")
            self.global_batch_size = batch_size
            lengths = getattr(dataset, "lengths", None)
            self._lengths = None if lengths is None else np.asarray(lengths, np.int64)

    def order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = len(self.dataset)
            self._order = (np.random.default_rng(self.seed + epoch).permutation(n)
                           if self.shuffle else np.arange(n))
            self._order_epoch = epoch
        return self._order

    def position(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "index": int(self.index)}

    def restore(self, position: Mapping[str, int]) -> None:
        epoch, index = int(position["epoch"]), int(position["index"])
        if epoch < 0 or not 0 <= index <= self.steps_per_epoch * self.batch_size:
            raise ValueError(f"invalid data position {dict(position)}")
        self.epoch, self.index = epoch, index

    def next_indices(self) -> np.ndarray:
        if self.index + self.batch_size > self.steps_per_epoch * self.batch_size:
            self.epoch += 1
            self.index = 0
        idx = self.order(self.epoch)[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        return idx

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        idx = self.next_indices()
        mine = idx if self.rows is None else idx[self.rows]
        read = getattr(self.dataset, "read", None)
        items = read(list(mine)) if callable(read) else [self.dataset[int(i)] for i in mine]
        if self._lengths is not None:
            return self.collate(items, longest=int(self._lengths[idx].max()))
        return self.collate(items)


# ------------------------------------------------------------------------------------------------
# logging


class MetricsLogger:
    """Scalar metrics to `<dir>/metrics.jsonl` and TensorBoard event files in `<dir>`."""

    def __init__(self, directory: str, *, jsonl: bool = True, tensorboard: bool = True):
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self._jsonl = open(os.path.join(directory, "metrics.jsonl"), "a") if jsonl else None
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=directory)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._jsonl is not None:
            row = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(f"train/{k}", float(v), step)
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


# ------------------------------------------------------------------------------------------------
# the trainer


def _preemption_reached(step: int) -> bool:
    """True on every process at the same step once any process got a preemption notice
    (SIGTERM), when JAX's distributed preemption service runs."""
    from jax.experimental import multihost_utils

    try:
        return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # the preemption service is disabled (jax_enable_preemption_service)
        return False


@dataclasses.dataclass
class FitResult:
    state: TrainState
    step: int
    status: str  # "completed" | "preempted"
    metrics: dict[str, float]


def _tree_shardings(tree: Any, mesh: Mesh, rules: Any) -> Any:
    """NamedShardings from Variable `logical_axes` metadata (replicated elsewhere); works on
    concrete and abstract (ShapeDtypeStruct) trees such as optimizer states."""
    def one(v: Any) -> Any:
        if isinstance(v, nnx.Variable):
            axes = v.get_metadata().get("logical_axes")
            return v.replace(shd.named_sharding(mesh, axes, np.shape(v.get_value()), rules))
        return shd.replicated(mesh)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


class Trainer:
    """Trains the `trainable` variables of `model` with `loss_fn` on a TRAIN-preset mesh.

    Args:
      model: an nnx module; variables outside `trainable` (default `nnx.Param`) stay frozen.
      loss_fn: `(model, batch, rng, aux) -> (loss, metrics)`, jittable.
      optimizer / total_steps: AdamW + warmup-cosine schedule over `total_steps` updates.
      mesh: a (data, fsdp, tensor) mesh (default: one device). Parameters are placed by their
        logical axes with `rules`; batch leaves are split over data+fsdp on their batch axis.
      aux: extra frozen pytree handed to `loss_fn` (an nnx.State is sharded by its logical axes).
      checkpoint / logging: orbax checkpointing and metrics output (None disables).
    """

    def __init__(self, model: nnx.Module, loss_fn: LossFn, *, optimizer: OptimizerConfig,
                 total_steps: int, mesh: Mesh | None = None, rules: Any = "train",
                 trainable: Any = nnx.Param, aux: Any = None, grad_accum_steps: int = 1,
                 seed: int = 0, checkpoint: CheckpointConfig | None = None,
                 logging: LoggingConfig | None = None):
        self.mesh = mesh if mesh is not None else shd.make_mesh(
            (1, 1, 1), shd.TRAIN_AXES, devices=jax.devices()[:1])
        self.rules = rules
        self.total_steps = int(total_steps)
        self.grad_accum_steps = int(grad_accum_steps)
        self.seed = int(seed)
        self.checkpoint_cfg = checkpoint
        self.logging_cfg = logging
        self.loss_fn = loss_fn
        self.graphdef, params, rest = nnx.split(model, trainable, ...)
        if not jax.tree.leaves(params):
            raise ValueError("the model has no trainable variables for the given filter")
        params = _as_float32(params)
        self.params_shardings = _tree_shardings(params, self.mesh, rules)
        self.params0 = jax.device_put(params, self.params_shardings)
        rest = jax.device_put(rest, _tree_shardings(rest, self.mesh, rules))
        if isinstance(aux, nnx.State):
            aux = jax.device_put(aux, _tree_shardings(aux, self.mesh, rules))
        elif aux is not None:
            aux = jax.device_put(aux, shd.replicated(self.mesh))
        self.frozen = (rest, aux)
        self.tx, self.schedule = make_optimizer(optimizer, self.total_steps)

        def init_fn(p):
            return TrainState(jnp.zeros((), jnp.int32), p, self.tx.init(p),
                              jax.random.PRNGKey(self.seed))

        abstract = jax.eval_shape(init_fn, self.params0)
        self.state_shardings = TrainState(
            shd.replicated(self.mesh), self.params_shardings,
            _tree_shardings(abstract.opt_state, self.mesh, rules), shd.replicated(self.mesh))
        self.abstract_state = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract,
            self.state_shardings)
        self._init = jax.jit(init_fn, out_shardings=self.state_shardings)
        step_fn = make_train_step(self.graphdef, loss_fn, self.tx, self.schedule,
                                  grad_accum_steps=self.grad_accum_steps)
        self._step = jax.jit(step_fn, donate_argnums=(1,),
                             out_shardings=(self.state_shardings, shd.replicated(self.mesh)))
        self._manager: ocp.CheckpointManager | None = None
        self._stop_signal: int | None = None

    # -------------------------------------------------------------------------- state
    def init_state(self) -> TrainState:
        """A fresh state: step 0, the model's parameters (float32), zero Adam moments."""
        return self._init(self.params0)

    def model(self, state: TrainState) -> nnx.Module:
        """The module with `state`'s parameters (and the frozen variables)."""
        return nnx.merge(self.graphdef, state.params, self.frozen[0])

    def batch_sharding(self, shape: Sequence[int]) -> NamedSharding:
        """The sharding of a global batch leaf of `shape` ([M, B, ...] when accumulating)."""
        lead = 1 if self.grad_accum_steps > 1 else 0
        axes = (None,) * lead + ("batch",) + (None,) * (len(shape) - lead - 1)
        return shd.named_sharding(self.mesh, axes, tuple(shape), self.rules)

    def _accum_shape(self, rows: int, rest: Sequence[int]) -> tuple[int, ...]:
        m = self.grad_accum_steps
        if rows % m:
            raise ValueError(f"batch leaf with {rows} rows is not divisible by "
                             f"grad_accum_steps={m}")
        return ((m, rows // m) if m > 1 else (rows,)) + tuple(rest)

    def process_rows(self, global_batch_size: int) -> np.ndarray:
        """Positions in a global batch of `global_batch_size` rows (all micro-steps) that this
        process feeds to `put_batch`, in order: all of them on one process, a slice per process
        under data parallelism (processes holding replicas feed the same rows)."""
        from specjax.distributed import process_rows

        shape = self._accum_shape(global_batch_size, ())
        axis = len(shape) - 1
        local = process_rows(self.batch_sharding(shape), shape, axis=axis)
        per_micro = shape[axis]
        return np.concatenate([m * per_micro + local for m in range(self.grad_accum_steps)])

    def put_batch(self, batch: Any, global_batch_size: int | None = None) -> Any:
        """Host batch -> global device arrays split over data+fsdp (leading [M] axis when
        accumulating: leaves of B*M rows are reshaped to [M, B, ...]).

        `global_batch_size` None: `batch` is the whole global batch (identical on every process).
        Otherwise `batch` holds only this process's `process_rows(global_batch_size)` rows and
        the global arrays are assembled with `jax.make_array_from_process_local_data`."""
        def put(x):
            x = x if isinstance(x, jax.Array) else np.asarray(x)
            rows = x.shape[0] if global_batch_size is None else global_batch_size
            shape = self._accum_shape(rows, x.shape[1:])
            sharding = self.batch_sharding(shape)
            if global_batch_size is None:
                return jax.device_put(x.reshape(shape), sharding)
            want = len(self.process_rows(global_batch_size))
            if x.shape[0] != want:
                raise ValueError(f"this process feeds {want} of the {global_batch_size} rows of "
                                 f"each global batch, got a batch leaf of {x.shape[0]} rows")
            local = x.reshape(self._accum_shape(x.shape[0], x.shape[1:]))
            return jax.make_array_from_process_local_data(sharding, local, shape)

        return jax.tree.map(put, batch)

    def step(self, state: TrainState, batch: Any, rng: Array | None = None, *,
             global_batch_size: int | None = None) -> tuple[TrainState, dict[str, Array]]:
        """One optimizer step (jitted; `state` is donated). `rng` None: fold_in(state.rng, step).
        `global_batch_size`: see `put_batch` (None: `batch` is the whole global batch)."""
        return self._step(self.frozen, state, self.put_batch(batch, global_batch_size), rng)

    # -------------------------------------------------------------------------- checkpoints
    @property
    def manager(self) -> ocp.CheckpointManager | None:
        if self._manager is None and self.checkpoint_cfg is not None:
            c = self.checkpoint_cfg
            opts = ocp.CheckpointManagerOptions(max_to_keep=c.keep, create=True,
                                                enable_async_checkpointing=c.async_save)
            self._manager = ocp.CheckpointManager(os.path.abspath(c.directory), options=opts,
                                                  item_names=("state", "data"))
        return self._manager

    def latest_checkpoint(self) -> int | None:
        m = self.manager
        return None if m is None else m.latest_step()

    def save(self, state: TrainState, data_position: Mapping[str, int] | None, *,
             step: int | None = None) -> None:
        """Save (asynchronously when configured) params, optimizer, step, RNG, data position."""
        m = self.manager
        if m is None:
            raise ValueError("no checkpoint directory configured")
        step = int(jax.device_get(state.step)) if step is None else step
        m.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state._asdict()),
            data=ocp.args.JsonSave({"position": dict(data_position or {}), "step": step})),
            force=True)

    def restore(self, step: int | None = None) -> tuple[TrainState, dict[str, int]]:
        """(state, data position) from checkpoint `step` (default latest), sharded as training."""
        m = self.manager
        if m is None:
            raise ValueError("no checkpoint directory configured")
        step = m.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.checkpoint_cfg.directory}")
        got = m.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(self.abstract_state._asdict()),
            data=ocp.args.JsonRestore()))
        return TrainState(**got.state), dict(got.data.get("position", {}))

    def restore_or_init(self, data: ResumableIterator | None = None) -> TrainState:
        """Resume from the latest checkpoint (moving `data` to its position) or start fresh."""
        c = self.checkpoint_cfg
        if c is not None and c.resume and self.latest_checkpoint() is not None:
            state, pos = self.restore()
            if data is not None and pos:
                data.restore(pos)
            return state
        return self.init_state()

    def wait(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    # -------------------------------------------------------------------------- loop
    def _on_signal(self, signum: int, frame: Any) -> None:
        del frame
        self._stop_signal = signum

    def fit(self, data: ResumableIterator, *, state: TrainState | None = None,
            total_steps: int | None = None,
            on_step: Callable[[int, TrainState, dict[str, Array]], None] | None = None,
            ) -> FitResult:
        """Train until `total_steps` (default the schedule's T) optimizer steps are done.

        Resumes from the latest checkpoint when `state` is None. Saves every `save_every` steps
        and at the end. SIGTERM / SIGINT: finish the current step, save, return status
        "preempted". A non-finite loss raises NonFiniteLossError naming the step (the last good
        checkpoint stays; the bad state is never saved). With several processes, SIGTERM is left
        to JAX's preemption service: a notice reaching any process stops every process after the
        same step (`multihost_utils.reached_preemption_sync_point`), which all save together.
        """
        total = self.total_steps if total_steps is None else int(total_steps)
        state = self.restore_or_init(data) if state is None else state
        step = start = int(jax.device_get(state.step))
        log_cfg, ck = self.logging_cfg, self.checkpoint_cfg
        primary = jax.process_index() == 0  # the one process that logs and shows progress
        global_batch_size = getattr(data, "global_batch_size", None)
        logger = None
        if primary and log_cfg is not None and (log_cfg.jsonl or log_cfg.tensorboard):
            logger = MetricsLogger(log_cfg.directory, jsonl=log_cfg.jsonl,
                                   tensorboard=log_cfg.tensorboard)
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (primary and log_cfg is not None and log_cfg.progress))
        old_handlers = {}
        self._stop_signal = None
        multi = jax.process_count() > 1
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT,) if multi else (signal.SIGTERM, signal.SIGINT):
                old_handlers[sig] = signal.signal(sig, self._on_signal)
        status = "completed"
        last: dict[str, float] = {}
        saved_at = self.latest_checkpoint() if self.manager is not None else None
        t0 = time.time()
        try:
            while step < total:
                batch = next(data)
                position = data.position() if hasattr(data, "position") else {}
                state, metrics = self.step(state, batch, global_batch_size=global_batch_size)
                if not bool(jax.device_get(metrics["finite"])):
                    self.wait()
                    good = self.latest_checkpoint()
                    loss = float(jax.device_get(metrics["loss"]))
                    gn = float(jax.device_get(metrics["grad_norm"]))
                    where = (f"the last good checkpoint is step {good} in "
                             f"{ck.directory}" if good is not None else "no checkpoint was saved")
                    raise NonFiniteLossError(
                        f"non-finite loss at optimizer step {step + 1} (loss={loss}, "
                        f"grad_norm={gn}); training stopped without applying that update; "
                        f"{where}", step + 1, good)
                step += 1
                if on_step is not None:
                    on_step(step, state, metrics)
                every = log_cfg.every if log_cfg is not None else 0
                if every and (step % every == 0 or step == total):
                    last = {k: float(v) for k, v in jax.device_get(metrics).items()
                            if k != "finite"}
                    dt = time.time() - t0
                    last["elapsed_s"] = dt
                    last["steps_per_s"] = (step - start) / dt if dt > 0 else 0.0
                    if logger is not None:
                        logger.log(step, last)
                    bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last.get('lr', 0.0):.2e}")
                bar.update(1)
                if ck is not None and (step % ck.save_every == 0 or step == total):
                    self.save(state, position, step=step)
                    saved_at = step
                if multi and self._stop_signal is None and _preemption_reached(step):
                    self._stop_signal = signal.SIGTERM
                if self._stop_signal is not None:
                    if ck is not None and saved_at != step:
                        self.save(state, position, step=step)
                        saved_at = step
                    self.wait()
                    name = signal.Signals(self._stop_signal).name
                    bar.write(f"received {name}: stopped at step {step}"
                              + (f", checkpoint saved in {ck.directory}" if ck else ""))
                    status = "preempted"
                    break
            if step > start and not last:
                last = {k: float(v) for k, v in jax.device_get(metrics).items() if k != "finite"}
        finally:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            bar.close()
            if logger is not None:
                logger.close()
            self.wait()
        return FitResult(state, step, status, last)


# ------------------------------------------------------------------------------------------------
# DSpark / DFlash objective


def collate_block_batch(samples: Sequence[Mapping[str, Any]], buckets: Sequence[int], *,
                        max_length: int | None = None, longest: int | None = None,
                        ) -> dict[str, np.ndarray]:
    """Right-pad samples (dicts with input_ids, loss_mask and, from a cache, taps and hidden)
    to the smallest bucket that fits the longest -> input_ids int32 [B,S], loss_mask uint8 [B,S],
    valid int32 [B] (+ taps [B,S,L*H], hidden [B,S,H] in their stored dtype). Padding has
    loss_mask 0, so it is never an anchor or a label (reference §6.3). `longest`: the longest
    sample of the global batch when these samples are one process's slice of it (all processes
    then pad to the same bucket)."""
    from specjax.training.data import bucket_length

    if not samples:
        raise ValueError("cannot collate an empty batch")
    cut = (lambda a: a[:max_length]) if max_length else (lambda a: a)
    ids = [cut(np.asarray(s["input_ids"])) for s in samples]
    n = max(len(a) for a in ids)
    if longest is not None:
        n = max(n, min(longest, max_length) if max_length else longest)
    s_pad = bucket_length(n, buckets)
    out = {"input_ids": np.zeros((len(ids), s_pad), np.int32),
           "loss_mask": np.zeros((len(ids), s_pad), np.uint8),
           "valid": np.asarray([len(a) for a in ids], np.int32)}
    for r, smp in enumerate(samples):
        k = len(ids[r])
        out["input_ids"][r, :k] = ids[r]
        out["loss_mask"][r, :k] = cut(np.asarray(smp["loss_mask"]))
    for name in ("taps", "hidden"):
        if name in samples[0]:
            first = np.asarray(samples[0][name])
            arr = np.zeros((len(ids), s_pad, first.shape[-1]), first.dtype)
            for r, smp in enumerate(samples):
                arr[r, :len(ids[r])] = cut(np.asarray(smp[name]))
            out[name] = arr
    return out


def _chunked_over_anchors(fn: Callable[..., tuple[Array, ...]], arrays: tuple[Array, ...],
                          chunk: int | None) -> tuple[Array, ...]:
    """fn over slices of axis 1 (anchors) in rematerialised chunks; outputs concatenated back."""
    a = arrays[0].shape[1]
    if chunk is None or chunk >= a:
        return fn(*arrays)
    n = -(-a // chunk)
    pad = n * chunk - a

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((x.shape[0], n, chunk) + x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    body = jax.checkpoint(lambda xs: fn(*xs))
    outs = jax.lax.map(body, tuple(split(x) for x in arrays))

    def join(o):
        o = jnp.moveaxis(o, 0, 1)
        return o.reshape((o.shape[0], n * chunk) + o.shape[3:])[:, :a]

    return tuple(join(o) for o in outs)


def gather_positions(x_bsh: Array, idx_bak: Array) -> Array:
    """x[b, clip(idx[b, a, k], 0, S-1)] -> [B, A, K, H]."""
    b, s = x_bsh.shape[:2]
    idx = jnp.clip(idx_bak, 0, s - 1)
    flat = jnp.take_along_axis(x_bsh, idx.reshape(b, -1)[..., None], axis=1)
    return flat.reshape(idx.shape + x_bsh.shape[2:])


def block_drafter_loss(*, num_anchors: int, alpha_ce: float = 0.1, alpha_tv: float = 0.9,
                       alpha_conf: float = 1.0, decay: float = 4.0,
                       chunk_anchors: int | None = None, target_graphdef: Any = None,
                       tap_layers: Sequence[int] | None = None, feature_dtype: Any = jnp.bfloat16,
                       ) -> LossFn:
    """The DSpark / DFlash loss function for `Trainer` (reference §5.1, §6.2).

    Batch: input_ids [B,S], loss_mask [B,S], valid [B], and either taps [B,S,L*H] + hidden
    [B,S,H] (offline cache) or nothing more (online: `aux` holds the target's parameters, run
    through `target_graphdef` at `tap_layers`). Per step: up to `num_anchors` anchors per row
    sampled from `rng`; the drafter (`specjax.drafters.dspark.DSparkDrafter`) gives draft logits
    with teacher-forced previous tokens; target logits = frozen lm_head(target hidden at a+j)
    (with a draft vocabulary: restricted to its tokens, and labels outside it leave the CE out;
    `specjax.training.losses`). Vocabulary-sized work runs `chunk_anchors` anchors at a time.
    """
    from specjax.training import data as tdata
    from specjax.training import losses
    from specjax.training.features import target_features

    online = target_graphdef is not None
    if online and not tap_layers:
        raise ValueError("online features need tap_layers")

    def loss_fn(model: Any, batch: Mapping[str, Array], rng: Array, aux: Any):
        ids = jnp.asarray(batch["input_ids"], jnp.int32)
        lm = batch["loss_mask"]
        if "taps" in batch:
            taps, hid = batch["taps"], batch["hidden"]
        elif online:
            taps, hid = target_features(aux, target_graphdef, ids, batch.get("valid"),
                                        tap_layers=tuple(tap_layers), dtype=feature_dtype)
        else:
            raise ValueError("batch has no 'taps'/'hidden' and no online target was configured")
        kk = model.gamma
        anchors, keep = tdata.sample_anchors(rng, lm, num_anchors)
        labels = model.draft_labels(tdata.block_labels(ids, anchors, keep, kk))  # -1: not draftable
        emask = tdata.eval_mask(lm, anchors, keep, kk)
        h = model.backbone_hidden(taps, ids, anchors, keep)  # [B, A, K, H]
        prev = model.teacher_prev_tokens(ids, anchors)  # [B, A, K]
        conf = model.confidence_logits(h, prev)
        t_idx = anchors[..., None] + jnp.arange(kk, dtype=jnp.int32)
        t_hidden = gather_positions(hid, t_idx)  # target hidden at a + j

        def terms(h_c, prev_c, th_c, lab_c):
            z = model.draft_logits(h_c, prev_c)
            t = model.lm_logits(th_c)
            return losses.dspark_slot_terms(z, t, lab_c)

        ce, l1 = _chunked_over_anchors(terms, (h, prev, t_hidden, labels), chunk_anchors)
        loss, metrics = losses.dspark_loss_from_terms(
            ce, l1, emask, conf if alpha_conf > 0 else None, alpha_ce=alpha_ce,
            alpha_tv=alpha_tv, alpha_conf=alpha_conf, decay=decay, ce_mask_bak=labels >= 0)
        metrics = dict(metrics)
        keep_f = keep.astype(jnp.float32)
        cand = tdata.anchor_candidates(lm).astype(jnp.float32)
        metrics["valid_anchors_per_seq"] = jnp.mean(jnp.sum(cand, axis=1))
        metrics["sampled_anchors_per_seq"] = jnp.mean(jnp.sum(keep_f, axis=1))
        metrics["tokens_per_block"] = jnp.sum(emask) / jnp.maximum(jnp.sum(keep_f), 1.0)
        return loss, metrics

    return loss_fn


__all__ = ["EpochBatches", "FitResult", "LossFn", "MetricsLogger", "NonFiniteLossError",
           "ResumableIterator", "TrainState", "Trainer", "block_drafter_loss",
           "collate_block_batch", "gather_positions", "lr_schedule", "make_optimizer",
           "make_train_step", "warmup_steps"]
