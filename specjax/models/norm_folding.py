"""The target's pre-norm weights folded into the projection that reads the normed activations.

RMSNorm(x) @ W = (rsqrt(mean(x^2) + eps) * x * w) @ W = rsqrt(...) * (x @ (w[:, None] * W)): with
`w` multiplied into the rows of the fused QKV and gate/up kernels once, at load, a layer's norm is
only its per-row factor (`RMSNorm.factored` returns the residual itself). The compiler then fuses
the residual add with the sum of squares and the products read the residual directly: on an H200
the verify program at 64 rows has two kernels and one bfloat16 copy of the activations fewer per
norm (docs/EXPERIMENTS.md). The norm modules keep their weights and are marked `folded`; checkpoint
writers divide them back out (`unfolded`), and a norm with a zero weight is left unfolded, so no
stored tensor is lost. Only the frozen target is folded (`checkpoints.load_target`); modules that
train keep the plain form.
"""
from __future__ import annotations

from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.decoder import DecoderLayer
from specjax.models.layers import FusedLinear, RMSNorm

Array = jax.Array


def _pairs(module: nnx.Module) -> Iterator[tuple[RMSNorm, FusedLinear]]:
    """(norm, the fused projection reading its output) for every target `DecoderLayer` in `module`."""
    for _, layer in nnx.iter_modules(module):
        if isinstance(layer, DecoderLayer):
            yield layer.input_layernorm, layer.self_attn.qkv_proj
            yield layer.post_attention_layernorm, layer.mlp.gate_up_proj


def _rows_scaled(kernel: Array, w: Array, inverse: bool) -> Array:
    """kernel [in, ...] with row i multiplied (or divided) by w[i], in float32, in the kernel's dtype."""
    scale = w.astype(jnp.float32).reshape((-1,) + (1,) * (kernel.ndim - 1))
    k = kernel.astype(jnp.float32)
    return ((k / scale) if inverse else (k * scale)).astype(kernel.dtype)


def _apply(kernel: Array, w: Array, inverse: bool) -> Array:
    """`_rows_scaled` keeping a mesh-placed kernel's sharding (an unplaced one stays unplaced)."""
    sharding = getattr(kernel, "sharding", None)
    if isinstance(kernel, jax.core.Tracer) or not isinstance(sharding, jax.sharding.NamedSharding):
        return _rows_scaled(kernel, w, inverse)
    return jax.jit(_rows_scaled, static_argnums=2, out_shardings=sharding)(kernel, w, inverse)


def _nonzero(w: Array) -> bool:
    ok = jnp.all(w != 0)
    return True if isinstance(ok, jax.core.Tracer) else bool(ok)


def fold_norm_weights(model: nnx.Module) -> int:
    """Fold the input and post-attention norm weights of every target layer in `model` (a
    `CausalLM`) into its QKV and gate/up kernels, in place (shardings kept); returns how many norms
    were folded."""
    n = 0
    for norm, proj in _pairs(model):
        w = norm.weight[...]
        if norm.folded or not _nonzero(w):
            continue
        proj.kernel.set_value(_apply(proj.kernel[...], w, inverse=False))
        norm.folded = True
        n += 1
    return n


def is_folded(module: nnx.Module) -> bool:
    """Whether any target layer of `module` has a norm weight folded into the next projection."""
    return any(norm.folded for norm, _ in _pairs(module))


def unfolded(model: nnx.Module) -> nnx.Module:
    """`model` itself when nothing is folded, else a copy whose kernels have the norm weights divided
    back out (the form checkpoints store; exact up to float rounding). The original is unchanged."""
    if not is_folded(model):
        return model
    copy = nnx.clone(model)
    for norm, proj in _pairs(copy):
        if norm.folded:
            proj.kernel.set_value(_apply(proj.kernel[...], norm.weight[...], inverse=True))
            norm.folded = False
    return copy


def unfolded_kernel(norm: RMSNorm, kernel: Array) -> np.ndarray:
    """A projection kernel [in, ...] as stored (float32 host array), whether or not `norm` is folded
    into it."""
    k = jnp.asarray(kernel, jnp.float32)
    return np.asarray(_rows_scaled(k, norm.weight[...], inverse=True) if norm.folded else k)
