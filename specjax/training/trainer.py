"""Generic drafter trainer: optax AdamW, one sharded donated jitted step, orbax checkpoints.

The model is split once (`nnx.split(model, trainable, ...)`) into a graph definition, the
trainable parameters and everything else ("rest": frozen embedding / lm_head copies, calibration
values). The step (`specjax.training.step`) is a pure function of explicit pytrees:

    train_step(frozen, state, batch, rng) -> (state, metrics)

with `frozen = (rest, aux)` (aux: any extra frozen pytree the loss reads, e.g. the target's
parameters in online-feature mode; never differentiated, not donated) and
`state = TrainState(step, params, opt_state, rng)` (donated). `Trainer.step(state, batch, rng)`
binds `frozen`. Master weights are float32 in the state; the module computes in its own `dtype`
(e.g. bfloat16), casting the weights at use, so gradients arrive in float32. A step whose loss or
gradient norm is not finite leaves the state unchanged and the host loop stops with
`NonFiniteLossError`.

A loss function has the signature `loss_fn(model, batch, rng, aux) -> (loss, metrics)`
(`specjax.training.objectives` makes one for every drafter kind).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from specjax import sharding as shd
from specjax.training.config import CheckpointConfig, LoggingConfig, OptimizerConfig
from specjax.training.step import LossFn, TrainState, as_float32, make_optimizer, make_train_step

Array = jax.Array


class NonFiniteLossError(RuntimeError):
    """Training stopped on a NaN / inf loss or gradient norm (the state was not updated)."""

    def __init__(self, message: str, step: int, last_checkpoint: int | None):
        super().__init__(message)
        self.step = step
        self.last_checkpoint = last_checkpoint


# ------------------------------------------------------------------------------------------------
# resumable data


class ResumableIterator(Protocol):
    """Batches with a resumable position: after `restore(p)` the next batch is the one that
    followed when `position()` returned p."""

    def __next__(self) -> Any: ...

    def position(self) -> dict[str, int]: ...

    def restore(self, position: Mapping[str, int]) -> None: ...


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
    status: str  # "completed" | "preempted" | "time_limit"
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
        params = as_float32(params)
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
            deadline: float | None = None) -> FitResult:
        """Train until `total_steps` (default the schedule's T) optimizer steps are done.

        Resumes from the latest checkpoint when `state` is None. Saves every `save_every` steps
        and at the end. SIGTERM / SIGINT: finish the current step, save, return status
        "preempted". A non-finite loss raises NonFiniteLossError naming the step (the last good
        checkpoint stays; the bad state is never saved). With several processes, SIGTERM is left
        to JAX's preemption service: a notice reaching any process stops every process after the
        same step (`multihost_utils.reached_preemption_sync_point`), which all save together.
        `deadline` (a `time.monotonic()` value): after the first step that ends past it, save and
        return status "time_limit" (several processes stop at the step process 0 decides).
        """
        total = self.total_steps if total_steps is None else int(total_steps)
        state = self.restore_or_init(data) if state is None else state
        step = start = int(jax.device_get(state.step))
        log_cfg, ck = self.logging_cfg, self.checkpoint_cfg
        every = log_cfg.every if log_cfg is not None else 0
        global_batch_size = getattr(data, "global_batch_size", None)
        logger, bar = self._progress(total, step)
        status, last = "completed", {}
        saved_at = self.latest_checkpoint() if self.manager is not None else None
        t0 = time.time()
        restore_signals = self._catch_signals()
        try:
            while step < total:
                batch = next(data)
                position = data.position() if hasattr(data, "position") else {}
                state, metrics = self.step(state, batch, global_batch_size=global_batch_size)
                if not bool(jax.device_get(metrics["finite"])):
                    self._raise_non_finite(step + 1, metrics)
                step += 1
                if on_step is not None:
                    on_step(step, state, metrics)
                if every and (step % every == 0 or step == total):
                    last = self._log(step, metrics, step - start, t0, logger, bar)
                bar.update(1)
                if ck is not None and (step % ck.save_every == 0 or step == total):
                    self.save(state, position, step=step)
                    saved_at = step
                if self._stop_requested(step):
                    self._stop(state, position, step, saved_at, bar)
                    status = "preempted"
                    break
                if step < total and self._past(deadline):
                    self._stop_at_deadline(state, position, step, saved_at, bar)
                    status = "time_limit"
                    break
            if step > start and not last:
                last = _host_metrics(metrics)
        finally:
            restore_signals()
            bar.close()
            if logger is not None:
                logger.close()
            self.wait()
        return FitResult(state, step, status, last)

    def _log(self, step: int, metrics: dict[str, Array], steps_done: int, t0: float, logger: MetricsLogger | None,
             bar: Any) -> dict[str, Any]:
        """Host metrics of `step` (elapsed time since t0, steps/s of the `steps_done` since then) to the
        metrics log and the progress bar."""
        last = _host_metrics(metrics)
        dt = time.time() - t0
        last["elapsed_s"] = dt
        last["steps_per_s"] = steps_done / dt if dt > 0 else 0.0
        if logger is not None:
            logger.log(step, last)
        bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last.get('lr', 0.0):.2e}")
        return last

    def _stop_at_deadline(self, state: TrainState, position: dict[str, Any], step: int, saved_at: int | None,
                          bar: Any) -> None:
        """The time limit: save unless this step is saved already."""
        if self.checkpoint_cfg is not None and saved_at != step:
            self.save(state, position, step=step)
        bar.write(f"time limit: stopped at step {step}")

    def _progress(self, total: int, step: int) -> tuple[MetricsLogger | None, Any]:
        """The metrics logger and progress bar of `fit` (process 0 alone logs and shows them)."""
        from tqdm import tqdm

        log_cfg = self.logging_cfg
        primary = jax.process_index() == 0
        logger = None
        if primary and log_cfg is not None and (log_cfg.jsonl or log_cfg.tensorboard):
            logger = MetricsLogger(log_cfg.directory, jsonl=log_cfg.jsonl,
                                   tensorboard=log_cfg.tensorboard)
        bar = tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (primary and log_cfg is not None and log_cfg.progress))
        return logger, bar

    def _catch_signals(self) -> Callable[[], None]:
        """Route SIGINT (and SIGTERM on one process) to a clean stop; returns the restorer."""
        old_handlers = {}
        self._stop_signal = None
        if threading.current_thread() is threading.main_thread():
            multi = jax.process_count() > 1
            for sig in (signal.SIGINT,) if multi else (signal.SIGTERM, signal.SIGINT):
                old_handlers[sig] = signal.signal(sig, self._on_signal)

        def restore() -> None:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)

        return restore

    def _raise_non_finite(self, step: int, metrics: Mapping[str, Array]) -> None:
        self.wait()
        good = self.latest_checkpoint()
        loss = float(jax.device_get(metrics["loss"]))
        gn = float(jax.device_get(metrics["grad_norm"]))
        where = (f"the last good checkpoint is step {good} in {self.checkpoint_cfg.directory}"
                 if good is not None else "no checkpoint was saved")
        raise NonFiniteLossError(
            f"non-finite loss at optimizer step {step} (loss={loss}, grad_norm={gn}); training "
            f"stopped without applying that update; {where}", step, good)

    @staticmethod
    def _past(deadline: float | None) -> bool:
        """Whether `deadline` has passed (process 0's clock decides for every process)."""
        if deadline is None:
            return False
        past = time.monotonic() >= deadline
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            past = bool(multihost_utils.broadcast_one_to_all(np.asarray(past)))
        return past

    def _stop_requested(self, step: int) -> bool:
        """A signal reached this process, or (several processes) a preemption notice any."""
        if jax.process_count() > 1 and self._stop_signal is None and _preemption_reached(step):
            self._stop_signal = signal.SIGTERM
        return self._stop_signal is not None

    def _stop(self, state: TrainState, position: Mapping[str, int], step: int,
              saved_at: int | None, bar: Any) -> None:
        """Save the state of `step` (unless just saved) and say why training stopped."""
        ck = self.checkpoint_cfg
        if ck is not None and saved_at != step:
            self.save(state, position, step=step)
        self.wait()
        name = signal.Signals(self._stop_signal).name
        bar.write(f"received {name}: stopped at step {step}"
                  + (f", checkpoint saved in {ck.directory}" if ck else ""))


def _host_metrics(metrics: Mapping[str, Array]) -> dict[str, float]:
    """A step's metrics as host floats (without `finite`)."""
    return {k: float(v) for k, v in jax.device_get(metrics).items() if k != "finite"}


# ------------------------------------------------------------------------------------------------
# DSpark / DFlash objective


__all__ = ["FitResult", "MetricsLogger", "NonFiniteLossError", "ResumableIterator", "Trainer"]
