"""The decoder layer in the Hugging Face parameter layout (separate q/k/v and gate/up projections),
for the drafters whose checkpoints name those tensors (DSpark/DFlash layers, Eagle3, MTP).

The target (`specjax.models.decoder`) holds the same weights fused; these layers project with the
same math: `queries` / `keys_values` give normed (Qwen3's per-head q/k RMSNorm when `cfg.qk_norm`),
rotated q [B, T, nh, hd] and k, v [B, T, nkv, hd]; `output` applies o_proj.
"""
from __future__ import annotations

import jax
from flax import nnx

from specjax.config import TargetConfig
from specjax.models.layers import Linear, RMSNorm, SwiGLU, apply_rope, init_decoder_layer

Array = jax.Array


class Attention(nnx.Module):
    """GQA self-attention projections with rotate-half RoPE (and per-head q/k RMSNorm when
    `cfg.qk_norm`, q/k/v biases when `cfg.attention_bias`)."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        self.cfg = cfg
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(h, nh * hd, logical_axes=("embed", "q_heads"), use_bias=bias, **kw)
        self.k_proj = Linear(h, nkv * hd, logical_axes=("embed", "kv_heads"), use_bias=bias, **kw)
        self.v_proj = Linear(h, nkv * hd, logical_axes=("embed", "kv_heads"), use_bias=bias, **kw)
        self.o_proj = Linear(nh * hd, h, logical_axes=("q_heads", "embed"), **kw)
        norm = lambda: RMSNorm(hd, eps=cfg.rms_norm_eps, logical_axis="head_dim", dtype=dtype,  # noqa: E731
                               param_dtype=param_dtype)
        self.q_norm = norm() if cfg.qk_norm else None
        self.k_norm = norm() if cfg.qk_norm else None

    def rope(self, x: Array, positions: Array) -> Array:
        return apply_rope(x, positions, **self.cfg.rope_kwargs)

    @staticmethod
    def _norm(norm: RMSNorm | None, x: Array) -> Array:
        return x if norm is None else norm(x)

    def queries(self, x_bth: Array, positions_bt: Array) -> Array:
        b, t, _ = x_bth.shape
        q = self.q_proj(x_bth).reshape(b, t, self.cfg.num_attention_heads, self.cfg.head_dim)
        return self.rope(self._norm(self.q_norm, q), positions_bt)

    def keys_values(self, x_bth: Array, positions_bt: Array) -> tuple[Array, Array]:
        """Normed, rotated keys and values [B, T, nkv, hd] of inputs x at positions."""
        b, t, _ = x_bth.shape
        nkv, hd = self.cfg.num_key_value_heads, self.cfg.head_dim
        k = self.rope(self._norm(self.k_norm, self.k_proj(x_bth).reshape(b, t, nkv, hd)), positions_bt)
        v = self.v_proj(x_bth).reshape(b, t, nkv, hd)
        return k, v

    def output(self, attn_bthd: Array) -> Array:
        b, t = attn_bthd.shape[:2]
        return self.o_proj(attn_bthd.reshape(b, t, -1))


class DecoderLayer(nnx.Module):
    """input_layernorm, `Attention`, post_attention_layernorm, `SwiGLU` (Hugging Face names)."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        init_decoder_layer(self, cfg, Attention, SwiGLU, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
