"""Building blocks shared by the target and the drafters.

Parameters carry logical axis names in their `logical_axes` metadata; `specjax.sharding` maps those
names onto a mesh. Weight layouts: `Linear.kernel` is [in, out] (the transpose of a torch Linear),
`Embed.embedding` is [vocab, embed], `RMSNorm.weight` is [dim].
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
_INIT_STD = 0.02


def _dtype(name_or_dtype) -> jnp.dtype:
    return jnp.dtype(name_or_dtype)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out] in `param_dtype`, computed in `dtype`."""

    def __init__(self, in_features: int, out_features: int, *, logical_axes: tuple[str | None, str | None],
                 rngs: nnx.Rngs, use_bias: bool = False, dtype="float32", param_dtype="float32",
                 init_std: float = _INIT_STD):
        self.dtype = _dtype(dtype)
        w = init_std * jax.random.normal(rngs.params(), (in_features, out_features), jnp.float32)
        self.kernel = nnx.Param(w.astype(param_dtype), logical_axes=logical_axes)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype),
                              logical_axes=(logical_axes[1],)) if use_bias else None

    def __call__(self, x: Array) -> Array:
        y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Embed(nnx.Module):
    """Token embedding table [vocab, embed]; `attend` gives tied output logits."""

    def __init__(self, num_embeddings: int, features: int, *, rngs: nnx.Rngs, dtype="float32",
                 param_dtype="float32"):
        self.dtype = _dtype(dtype)
        w = _INIT_STD * jax.random.normal(rngs.params(), (num_embeddings, features), jnp.float32)
        self.embedding = nnx.Param(w.astype(param_dtype), logical_axes=("vocab", "embed"))

    def __call__(self, ids: Array) -> Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

    def attend(self, x: Array) -> Array:
        return jnp.dot(x.astype(self.dtype), self.embedding[...].astype(self.dtype).T)


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in float32, scaled by `weight` (initialised to one)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, logical_axis: str = "embed", dtype="float32",
                 param_dtype="float32"):
        self.eps = eps
        self.dtype = _dtype(dtype)
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(logical_axis,))

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(self.dtype)


class SwiGLU(nnx.Module):
    """Qwen3 MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Linear(hidden, inner, logical_axes=("embed", "mlp"), **kw)
        self.up_proj = Linear(hidden, inner, logical_axes=("embed", "mlp"), **kw)
        self.down_proj = Linear(inner, hidden, logical_axes=("mlp", "embed"), **kw)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(head_dim: int, theta: float) -> Array:
    """Inverse frequencies [head_dim/2] of the rotate-half RoPE."""
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def rope_inv_freq_scaled(head_dim: int, *, theta: float, rope_type: str = "default",
                         factor: float = 1.0, low_freq_factor: float = 1.0,
                         high_freq_factor: float = 4.0, original_max_position: int = 8192) -> Array:
    """Inverse frequencies [head_dim/2] after RoPE scaling (default, linear or llama3).

    llama3: wavelengths longer than original_max_position / low_freq_factor are divided by
    `factor`, those shorter than original_max_position / high_freq_factor are kept, and the band
    between is interpolated smoothly (Llama 3.1's rule)."""
    inv = rope_inv_freq(head_dim, theta)
    if rope_type in ("default", "linear"):
        return inv if rope_type == "default" else inv / factor
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r}")
    wavelen = 2 * jnp.pi / inv
    low_wavelen = original_max_position / low_freq_factor
    high_wavelen = original_max_position / high_freq_factor
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return jnp.where(wavelen > low_wavelen, inv / factor, jnp.where(wavelen < high_wavelen, inv, mid))


def apply_rope(x_bthd: Array, positions_bt: Array, *, theta: float, rope_type: str = "default",
               factor: float = 1.0, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
               original_max_position: int = 8192) -> Array:
    """Rotate-half RoPE on x [B, T, heads, head_dim] at integer positions [B, T]."""
    hd = x_bthd.shape[-1]
    inv_freq = rope_inv_freq_scaled(hd, theta=theta, rope_type=rope_type, factor=factor,
                                    low_freq_factor=low_freq_factor,
                                    high_freq_factor=high_freq_factor,
                                    original_max_position=original_max_position)
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x_bthd.astype(jnp.float32)
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthd.dtype)


def gqa_attention(q_bthd: Array, k_bshd: Array, v_bshd: Array, mask_bts: Array) -> Array:
    """Grouped-query attention. q [B,T,nh,hd], k/v [B,S,nkv,hd], mask [B,T,S] (True = visible).

    Softmax in float32; rows with no visible key return zeros (never NaN).
    """
    b, t, nh, hd = q_bthd.shape
    nkv = k_bshd.shape[2]
    g = nh // nkv
    q = q_bthd.reshape(b, t, nkv, g, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_bshd, preferred_element_type=jnp.float32)
    scores = scores * (hd ** -0.5)
    m = mask_bts[:, None, None, :, :]
    scores = jnp.where(m, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(m, probs, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_bshd.dtype), v_bshd,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, nh, hd).astype(q_bthd.dtype)


def concat_taps(taps: Sequence[Array]) -> Array:
    """Concatenate per-layer hidden taps [B,T,H] x L along features -> [B,T,L*H]."""
    return jnp.concatenate(list(taps), axis=-1)
