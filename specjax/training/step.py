"""The pure training step: optimizer, learning-rate schedule, state, and the step function.

`make_train_step` returns `train_step(frozen=(rest, aux), state, batch, rng) -> (state, metrics)`,
a pure function of explicit pytrees that `specjax.training.trainer.Trainer` jits, shards and
donates. A loss function has the signature `loss_fn(model, batch, rng, aux) -> (loss, metrics)`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from specjax.training.config import OptimizerConfig

Array = jax.Array
LossFn = Callable[[nnx.Module, Any, Array, Any], tuple[Array, Mapping[str, Array]]]


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


def as_float32(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _accumulated(grad_fn: Callable[..., Any], params: Any, frozen: tuple[Any, Any], batch: Any,
                 key: Array, m: int) -> tuple[Array, Any, Any]:
    """(loss, metrics, grads) averaged over the M micro-steps of `batch` (leaves [M, ...])."""
    rest, aux = frozen
    keys = jax.random.split(key, m)

    def micro(carry, xs):
        mb, k = xs
        (l, met), g = grad_fn(params, rest, aux, mb, k)
        g_acc, l_acc, m_acc = carry
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + l,
                jax.tree.map(jnp.add, m_acc, met)), None

    (_, m_shape), _ = jax.eval_shape(
        grad_fn, params, rest, aux, jax.tree.map(lambda x: x[0], batch), keys[0])
    zeros_m = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), m_shape)
    zeros_g = jax.tree.map(jnp.zeros_like, params)
    (g_sum, l_sum, m_sum), _ = jax.lax.scan(
        micro, (zeros_g, jnp.zeros((), jnp.float32), zeros_m), (batch, keys))
    inv = 1.0 / m
    return (l_sum * inv, jax.tree.map(lambda x: x * inv, m_sum),
            jax.tree.map(lambda g: g * inv, g_sum))


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
            loss, metrics, grads = _accumulated(grad_fn, state.params, frozen, batch, key,
                                                grad_accum_steps)
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


__all__ = ["LossFn", "TrainState", "as_float32", "lr_schedule", "make_optimizer", "make_train_step",
           "warmup_steps"]
