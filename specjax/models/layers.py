"""Building blocks shared by the target and the drafters.

Parameters carry logical axis names in their `logical_axes` metadata; `specjax.sharding` maps those
names onto a mesh. Weight layouts: `Linear.kernel` is [in, out] (the transpose of a torch Linear),
`Embed.embedding` is [vocab, embed], `RMSNorm.weight` is [dim].
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.pallas_mlp import gated_projection

Array = jax.Array
_INIT_STD = 0.02


def _dtype(name_or_dtype) -> jnp.dtype:
    return jnp.dtype(name_or_dtype)


def init_kernel(rngs: nnx.Rngs, shape: tuple[int, ...], std: float = _INIT_STD) -> Array:
    """A float32 normal(0, std) kernel, one `rngs.params()` draw."""
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out] in `param_dtype`, computed in `dtype`."""

    def __init__(self, in_features: int, out_features: int, *, logical_axes: tuple[str | None, str | None],
                 rngs: nnx.Rngs, use_bias: bool = False, dtype="float32", param_dtype="float32",
                 init_std: float = _INIT_STD):
        self.dtype = _dtype(dtype)
        w = init_kernel(rngs, (in_features, out_features), init_std)
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
        self.folded = False  # weight multiplied into the next projection's kernel (`norm_folding`)

    def __call__(self, x: Array) -> Array:
        if self.folded:
            raise RuntimeError("this norm's weight is folded into the next projection: use factored()")
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(self.dtype)

    def norm_factor(self, sum_square: Array) -> Array:
        """rsqrt(mean(x^2) + eps) of rows given by their sum of squares."""
        return jax.lax.rsqrt(sum_square / self.weight.shape[0] + self.eps)

    def factored(self, x: Array, sum_square: bool = False) -> tuple[Array, Array]:
        """The norm in two factors: x * weight (in the compute dtype) and the per-row factor
        rsqrt(mean(x^2) + eps) [..., 1] (float32), norm(x) = factor * (x * weight). A projection of
        the first scaled by the factor after (`FusedLinear(row_scale=)`) leaves the scaling to the
        matmul's neighbours: one kernel fewer per norm on a GPU. A folded norm's first factor is x
        itself (its weight is in the projection's kernel, `norm_folding`). `sum_square`: the second
        is sum(x^2) [..., 1] instead (float32), for a consumer that takes the factor itself (the
        attention kernel: `norm_factor` of it, computed where it is applied)."""
        xf = x.astype(jnp.float32)
        ss = jnp.sum(xf * xf, axis=-1, keepdims=True)
        factor = ss if sum_square else self.norm_factor(ss)
        if self.folded:
            return x.astype(self.dtype), factor
        return (xf * self.weight[...].astype(jnp.float32)).astype(self.dtype), factor


def _gated_then_down(x: Array, gate_up: Any, row_scale: Array | None, dtype: Any, down_proj: "Linear") -> Array:
    """down_proj of `pallas_mlp.gated_projection` of x [..., H] (rows flattened for the kernel)."""
    lead, h = x.shape[:-1], x.shape[-1]
    scale = None if row_scale is None else row_scale.reshape(-1)
    return down_proj(gated_projection(x.astype(dtype).reshape(-1, h), gate_up, scale).reshape(*lead, -1))


class SwiGLU(nnx.Module):
    """Qwen3 MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Linear(hidden, inner, logical_axes=("embed", "mlp"), **kw)
        self.up_proj = Linear(hidden, inner, logical_axes=("embed", "mlp"), **kw)
        self.down_proj = Linear(inner, hidden, logical_axes=("mlp", "embed"), **kw)

    def __call__(self, x: Array, kernel: bool = False) -> Array:
        """x [..., H] -> [..., H]; `kernel`: the gate and up products and the SiLU gate in one Pallas
        kernel (`pallas_mlp.gated_projection`)."""
        if not kernel:
            return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.gate_proj.bias is not None or self.up_proj.bias is not None:
            raise ValueError("mlp 'pallas' takes gate and up projections without a bias")
        return _gated_then_down(x, (self.gate_proj.kernel[...], self.up_proj.kernel[...]), None, self.gate_proj.dtype,
                                self.down_proj)


class FusedLinear(nnx.Module):
    """Several projections of one input in one matmul: y [..., *out] = x [..., in] @ kernel
    [in, *out] (+ bias [*out]). `logical_axes` names the kernel's axes (the bias takes the out ones).
    The target's fused q/k/v ([in, kv_heads, q_per_kv + 2, head_dim], see `fuse_qkv`) and gate/up
    ([in, 2, mlp], see `fuse_gate_up`) projections; checkpoints store the parts separately."""

    def __init__(self, kernel: Array, *, logical_axes: tuple[str | None, ...], bias: Array | None = None,
                 dtype="float32", param_dtype="float32"):
        self.dtype = _dtype(dtype)
        self.kernel = nnx.Param(kernel.astype(param_dtype), logical_axes=logical_axes)
        self.bias = None if bias is None else nnx.Param(bias.astype(param_dtype),
                                                        logical_axes=logical_axes[1:])

    def __call__(self, x: Array, row_scale: Array | None = None) -> Array:
        """x [..., in] -> [..., *out]; `row_scale` [..., 1] (float32) multiplies each row's product
        before the bias (see `RMSNorm.factored`)."""
        y = jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), axes=1)
        if row_scale is not None:
            y = (y * row_scale.reshape(row_scale.shape + (1,) * (y.ndim - row_scale.ndim))).astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def _xp(x: Any) -> Any:
    return jnp if isinstance(x, jax.Array) else np


def fuse_qkv(q: Any, k: Any, v: Any, kv_heads: int) -> Any:
    """q [..., heads * hd], k and v [..., kv_heads * hd] (kernels [in, out] or biases [out]) ->
    [..., kv_heads, q_per_kv + 2, hd]: kv group j holds its q heads j * q_per_kv + i (i < q_per_kv,
    the heads that attend to it), then its key, then its value. numpy or jax arrays, either way."""
    lead, hd = q.shape[:-1], k.shape[-1] // kv_heads
    parts = [q.reshape(*lead, kv_heads, -1, hd), k.reshape(*lead, kv_heads, 1, hd),
             v.reshape(*lead, kv_heads, 1, hd)]
    return _xp(q).concatenate(parts, axis=-2)


def split_qkv(fused: Any) -> tuple[Any, Any, Any]:
    """The inverse of `fuse_qkv`: (q [..., heads * hd], k, v [..., kv_heads * hd])."""
    lead, g = fused.shape[:-3], fused.shape[-2] - 2
    flat = lambda a: a.reshape(*lead, -1)  # noqa: E731
    return flat(fused[..., :g, :]), flat(fused[..., g, :]), flat(fused[..., g + 1, :])


def fuse_gate_up(gate: Any, up: Any) -> Any:
    """gate and up kernels [in, mlp] -> [in, 2, mlp] (gate first)."""
    return _xp(gate).stack([gate, up], axis=-2)


def split_gate_up(fused: Any) -> tuple[Any, Any]:
    """The inverse of `fuse_gate_up`: (gate, up) [in, mlp]."""
    return fused[..., 0, :], fused[..., 1, :]


class FusedSwiGLU(nnx.Module):
    """The target's MLP: down(silu(gate(x)) * up(x)) with gate and up in one kernel [H, 2, F]
    (initialised as `SwiGLU` would be: the same draws, fused)."""

    def __init__(self, hidden: int, inner: int, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        gate_up = fuse_gate_up(init_kernel(rngs, (hidden, inner)), init_kernel(rngs, (hidden, inner)))
        self.gate_up_proj = FusedLinear(gate_up, logical_axes=("embed", None, "mlp"), dtype=dtype,
                                        param_dtype=param_dtype)
        self.down_proj = Linear(inner, hidden, logical_axes=("mlp", "embed"), rngs=rngs, dtype=dtype,
                                param_dtype=param_dtype)

    def __call__(self, x: Array, row_scale: Array | None = None, kernel: bool = False) -> Array:
        """x [..., H] -> [..., H]; `row_scale` [..., 1] as `FusedLinear`'s. `kernel`: the gate/up
        product and the SiLU gate in one Pallas kernel (`pallas_mlp.gated_projection`)."""
        if not kernel:
            y = self.gate_up_proj(x, row_scale)
            return self.down_proj(jax.nn.silu(y[..., 0, :]) * y[..., 1, :])
        if self.gate_up_proj.bias is not None:
            raise ValueError("mlp 'pallas' takes a gate/up projection without a bias")
        return _gated_then_down(x, self.gate_up_proj.kernel[...], row_scale, self.gate_up_proj.dtype, self.down_proj)


def init_decoder_layer(layer: nnx.Module, cfg: Any, attention: type, mlp: type, *, rngs: nnx.Rngs,
                       dtype="float32", param_dtype="float32") -> None:
    """Give `layer` the parts of a pre-norm decoder layer under their Hugging Face names, in draw
    order: input_layernorm, self_attn = attention(cfg), post_attention_layernorm and
    mlp = mlp(hidden_size, intermediate_size). `cfg` is a `TargetConfig`; the attention and MLP
    classes choose the fused (target) or the separate (drafter checkpoint) weight layout."""
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    layer.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
    layer.self_attn = attention(cfg, rngs=rngs, **kw)
    layer.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
    layer.mlp = mlp(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, **kw)


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


def rope_tables(positions_bt: Array, head_dim: int, *, theta: float, rope_type: str = "default",
                factor: float = 1.0, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                original_max_position: int = 8192) -> tuple[Array, Array]:
    """cos and sin [B, T, head_dim/2] (float32) of the rotate-half RoPE at integer positions [B, T]."""
    inv_freq = rope_inv_freq_scaled(head_dim, theta=theta, rope_type=rope_type, factor=factor,
                                    low_freq_factor=low_freq_factor,
                                    high_freq_factor=high_freq_factor,
                                    original_max_position=original_max_position)
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half RoPE of x [..., head_dim] by tables cos/sin [..., head_dim/2] (broadcast
    against x's leading axes), computed in float32 and returned in x's dtype."""
    # [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] as one elementwise op over x viewed as
    # [..., 2, hd/2] (a reversal of the size-2 axis, no concatenation)
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    sin_pm = jnp.stack([-sin, sin], axis=-2)
    out = xf * cos[..., None, :] + xf[..., ::-1, :] * sin_pm
    return out.reshape(x.shape).astype(x.dtype)


def apply_rope(x_bthd: Array, positions_bt: Array, **rope_kwargs) -> Array:
    """Rotate-half RoPE on x [B, T, heads, head_dim] at integer positions [B, T] (`rope_kwargs`:
    those of `rope_tables`, e.g. `TargetConfig.rope_kwargs`)."""
    cos, sin = rope_tables(positions_bt, x_bthd.shape[-1], **rope_kwargs)
    return rotate(x_bthd, cos[:, :, None, :], sin[:, :, None, :])


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


def attend(q_btkgd: Array, k_bksd: Array, v_bksd: Array, mask_bts: Array) -> Array:
    """Grouped-query attention over keys/values stored heads-major (the KV cache's layout, read
    without transposes). q [B, T, nkv, g, hd], k/v [B, nkv, S, hd], mask [B, T, S] (True = visible)
    -> [B, T, nkv * g, hd] in q's dtype. Softmax in float32, normalised after the value product.
    Every query must see at least one key (a causal or cached mask always does)."""
    b, t, nkv, g, hd = q_btkgd.shape
    scores = jnp.einsum("bkgtd,bksd->bkgts", q_btkgd.transpose(0, 2, 3, 1, 4), k_bksd,
                        preferred_element_type=jnp.float32) * (hd ** -0.5)
    scores = jnp.where(mask_bts[:, None, None], scores, jnp.finfo(jnp.float32).min)
    e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    out = jnp.einsum("bkgts,bksd->bkgtd", e.astype(v_bksd.dtype), v_bksd,
                     preferred_element_type=jnp.float32) / jnp.sum(e, axis=-1, keepdims=True)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nkv * g, hd).astype(q_btkgd.dtype)


def concat_taps(taps: Sequence[Array]) -> Array:
    """Concatenate per-layer hidden taps [B,T,H] x L along features -> [B,T,L*H]."""
    return jnp.concatenate(list(taps), axis=-1)
