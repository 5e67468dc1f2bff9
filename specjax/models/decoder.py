"""The dense decoder of the Qwen3, Llama and Qwen2 families in Flax NNX (HF attribute names).

One module, switched by config fields: `qk_norm` adds Qwen3's per-head q/k RMSNorm (otherwise
`q_norm`/`k_norm` are None), `attention_bias` gives q/k/v projections a bias (Qwen2), and the RoPE
scaling (default, linear, llama3) comes from the config.

Kernels per layer are few: q/k/v are one fused projection (`self_attn.qkv_proj`, [H, nkv,
q_per_kv + 2, hd], see `layers.fuse_qkv`) and gate/up one (`mlp.gate_up_proj`, [H, 2, F]); the
checkpoint loaders fuse the stored tensors on load and split them on export. RoPE tables are
computed once per forward, each layer writes its new keys and values in one scatter and attends over
the cache in its stored heads-major layout (`cache.KVCache`, `layers.attend`).

One forward serves prefill, decode and multi-token verification:
tokens [B,T] + positions [B,T] (+ optional KVCache with per-row lengths) -> logits [B,T,V], hidden taps
at the requested layer ids (raw decoder-layer outputs, -1 = embedding output), the final-normed hidden
state, and the updated cache (new K/V written at each row's length; `lengths` advanced by the row's
valid token count).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import TargetConfig
from specjax.models import cache as kvc
from specjax.models.pallas_attention import ATTENTION_IMPLEMENTATIONS, cached_attention
from specjax.models.pallas_mlp import MLP_IMPLEMENTATIONS
from specjax.models.layers import (Embed, FusedLinear, FusedSwiGLU, Linear, RMSNorm, attend, fuse_qkv,
                                   init_decoder_layer, init_kernel, rope_tables, rotate)

Array = jax.Array


class ForwardOut(NamedTuple):
    logits: Array | None  # [B, T, V] ("all"), [B, 1, V] ("last") or None ("none"); float32
    taps: tuple[Array, ...]  # per requested layer id: [B, T, H]
    hidden: Array  # final-normed hidden state [B, T, H]
    cache: kvc.KVCache | None


class LayerInputs(NamedTuple):
    """What every layer of one forward shares, computed once."""

    cos: Array  # [B, T, 1, 1, hd/2] RoPE tables (float32)
    sin: Array
    mask: Array  # [B, T, S] keys each query sees (S = kv_len or max_len with a cache, else T)
    lengths: Array | None  # [B] cache row where each row's first new token goes (None: no cache)
    rows: Array | None  # [B] cache slots of the rows (None: slots [0:B])
    kv_len: int | None  # attention reads cache rows [0:kv_len] (None: all)
    kernel: bool = False  # attention and the cache write by the Pallas kernel (`pallas_attention`)
    mlp_kernel: bool = False  # the MLP's gate/up product and SiLU gate by the Pallas kernel (`pallas_mlp`)


class Attention(nnx.Module):
    """GQA self-attention with one fused q/k/v projection, rotate-half RoPE (and per-head q/k
    RMSNorm when `cfg.qk_norm`)."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, k, v = (init_kernel(rngs, (h, n * hd)) for n in (nh, nkv, nkv))  # as separate Linears
        bias = None
        if cfg.attention_bias:
            bias = fuse_qkv(jnp.zeros((nh * hd,)), jnp.zeros((nkv * hd,)), jnp.zeros((nkv * hd,)), nkv)
        self.qkv_proj = FusedLinear(fuse_qkv(q, k, v, nkv), bias=bias, dtype=dtype, param_dtype=param_dtype,
                                    logical_axes=("embed", "kv_heads", None, "head_dim"))
        self.o_proj = Linear(nh * hd, h, logical_axes=("q_heads", "embed"), rngs=rngs, dtype=dtype,
                             param_dtype=param_dtype)
        norm = lambda: RMSNorm(hd, eps=cfg.rms_norm_eps, logical_axis="head_dim", dtype=dtype,  # noqa: E731
                               param_dtype=param_dtype)
        self.q_norm = norm() if cfg.qk_norm else None
        self.k_norm = norm() if cfg.qk_norm else None

    @staticmethod
    def _norm(norm: RMSNorm | None, x: Array) -> Array:
        return x if norm is None else norm(x)

    def project(self, x_bth: Array, cos: Array, sin: Array, row_scale: Array | None = None
                ) -> tuple[Array, Array, Array]:
        """Normed, rotated queries [B, T, nkv, g, hd] and keys, values [B, T, nkv, hd] of x, from
        one matmul (its rows scaled by `row_scale` [B, T, 1], `RMSNorm.factored`); cos/sin: RoPE
        tables [B, T, 1, 1, hd/2] (`LayerInputs`)."""
        qkv = self.qkv_proj(x_bth, row_scale)  # [B, T, nkv, g + 2, hd]
        g = qkv.shape[3] - 2
        q = rotate(self._norm(self.q_norm, qkv[:, :, :, :g]), cos, sin)
        k = rotate(self._norm(self.k_norm, qkv[:, :, :, g]), cos[:, :, :, 0], sin[:, :, :, 0])
        return q, k, qkv[:, :, :, g + 1]

    def __call__(self, x_bth: Array, li: LayerInputs, kv_2skmd: Array | None, input_norm: RMSNorm,
                 row_ss: Array) -> tuple[Array, Array | None]:
        """Attention output [B, T, H] and the layer's key/value buffer with this call's keys and
        values written (one scatter, or in place by the kernel; None without a cache). The rows of
        x's projection are scaled by `input_norm`'s factor of their sums of squares `row_ss`
        [B, T, 1] (`RMSNorm.factored(sum_square=True)`), by the kernel itself where it can."""
        b, t, _ = x_bth.shape
        if li.kernel:  # the kernel norms and rotates queries and keys and writes the cache itself
            weight = lambda norm: None if norm is None else norm.weight[...]  # noqa: E731
            in_kernel = self.qkv_proj.bias is None  # a bias is added after the rows' scaling
            out, new_kv = cached_attention(
                self.qkv_proj(x_bth, None if in_kernel else input_norm.norm_factor(row_ss)), kv_2skmd, li.lengths,
                li.cos[:, :, 0, 0], li.sin[:, :, 0, 0], q_norm=weight(self.q_norm), k_norm=weight(self.k_norm),
                eps=0.0 if self.q_norm is None else self.q_norm.eps,
                row_sum_square_bt=row_ss[..., 0] if in_kernel else None,
                row_norm=(input_norm.weight.shape[0], input_norm.eps), kv_len=li.kv_len)
            return self.o_proj(out.reshape(b, t, -1)), new_kv
        q, k, v = self.project(x_bth, li.cos, li.sin, input_norm.norm_factor(row_ss))
        if kv_2skmd is None:
            new_kv = None
            k_all, v_all = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        else:
            new_kv = kvc.write_kv(kv_2skmd, k, v, li.lengths, li.rows)
            k_all, v_all = kvc.read_kv(new_kv, b, li.rows, li.kv_len)
        out = attend(q, k_all, v_all, li.mask)
        return self.o_proj(out.reshape(b, t, -1)), new_kv


class DecoderLayer(nnx.Module):
    """The target's layer: fused `Attention` and `FusedSwiGLU` (`layers.init_decoder_layer`)."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        init_decoder_layer(self, cfg, Attention, FusedSwiGLU, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x: Array, li: LayerInputs, kv_cache: Array | None = None):
        # each norm's per-row factor scales its projection's output (RMSNorm.factored)
        xw, ss = self.input_layernorm.factored(x, sum_square=True)
        a, new_kv = self.self_attn(xw, li, kv_cache, self.input_layernorm, ss)
        x = x + a
        return x + self.mlp(*self.post_attention_layernorm.factored(x), kernel=li.mlp_kernel), new_kv


class DecoderStack(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs, **kw)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, **kw) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)


class CausalLM(nnx.Module):
    """The target model. `model(tokens, positions)` returns logits; `forward` returns everything."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs | None = None, dtype="float32",
                 param_dtype="float32"):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.model = DecoderStack(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, logical_axes=("embed", "vocab"), rngs=rngs, dtype=dtype,
            param_dtype=param_dtype)

    def logits(self, hidden: Array) -> Array:
        """Output logits in float32 from final-normed hidden states."""
        if self.lm_head is None:
            return self.model.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def embed(self, tokens: Array) -> Array:
        return self.model.embed_tokens(tokens)

    def forward(self, tokens_bt: Array, positions_bt: Array, cache: kvc.KVCache | None = None,
                valid_b: Array | None = None, *, rows_b: Array | None = None,
                tap_layers: Sequence[int] = (), logits: str = "all", kv_len: int | None = None,
                attention: str = "xla", mlp: str = "xla") -> ForwardOut:
        """Run the decoder. `valid_b` [B] is each row's count of real tokens (default T).

        With a cache, token t of row b is written at cache row lengths[b] + t and sees cache rows
        <= lengths[b] + t; the returned cache has lengths + valid. The cache may hold more slots than
        B: rows [0:B] take part (or the slots `rows_b` [B], distinct; an id >= slots marks a padding row
        whose writes are dropped) and the others are untouched. `kv_len` (static) limits attention
        to cache rows [0:kv_len] (writes still go to the whole cache; the caller guarantees
        lengths + T <= kv_len for every row whose outputs it uses). `logits` is "all", "last" (at
        the last valid token of each row) or "none". `attention` "pallas" attends over the cache of
        rows [0:B] in one kernel per layer (`pallas_attention`; other calls use XLA's ops, "xla").
        `mlp` "pallas" computes each MLP's gate/up product and SiLU gate in one kernel (`pallas_mlp`).
        """
        cfg = self.config
        b, t = tokens_bt.shape
        if valid_b is None:
            valid_b = jnp.full((b,), t, jnp.int32)
        for lid in tap_layers:
            if not -1 <= lid < cfg.num_hidden_layers:
                raise ValueError(f"tap layer id {lid} out of range [-1, {cfg.num_hidden_layers})")
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {attention!r}")
        if mlp not in MLP_IMPLEMENTATIONS:
            raise ValueError(f"mlp must be one of {MLP_IMPLEMENTATIONS}, got {mlp!r}")
        li = self._layer_inputs(positions_bt, valid_b, cache, rows_b, kv_len)._replace(mlp_kernel=mlp == "pallas")
        if attention == "pallas" and cache is not None and rows_b is None:
            li = li._replace(kernel=True)
        x = self.model.embed_tokens(tokens_bt)
        taps: dict[int, Array] = {-1: x}
        new_kv = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, li, None if cache is None else cache.kv[i])
            new_kv.append(kv)
            taps[i] = x
        hidden = self.model.norm(x)
        new_cache = None
        if cache is not None:
            rows = jnp.arange(b) if rows_b is None else rows_b
            lengths = cache.lengths.at[rows].add(valid_b.astype(jnp.int32), mode="drop")
            new_cache = kvc.KVCache(kv=tuple(new_kv), lengths=lengths)
        return ForwardOut(self._output_logits(hidden, valid_b, logits), tuple(taps[i] for i in tap_layers),
                          hidden, new_cache)

    def _layer_inputs(self, positions_bt: Array, valid_b: Array, cache: kvc.KVCache | None,
                      rows_b: Array | None, kv_len: int | None) -> LayerInputs:
        """RoPE tables and the attention mask of one forward, shared by every layer."""
        b, t = positions_bt.shape
        cos, sin = rope_tables(positions_bt, self.config.head_dim, **self.config.rope_kwargs)
        cos, sin = cos[:, :, None, None, :], sin[:, :, None, None, :]
        if cache is None:
            if kv_len is not None:
                raise ValueError("kv_len needs a cache")
            return LayerInputs(cos, sin, kvc.causal_mask(t, valid_b), None, None, None)
        if kv_len is not None and not 0 < kv_len <= cache.max_len:
            raise ValueError(f"kv_len {kv_len} outside [1, cache max_len {cache.max_len}]")
        # rows [0:B] (or rows_b) of a cache with >= B slots take part
        lengths = cache.lengths[:b] if rows_b is None else jnp.take(cache.lengths, rows_b, mode="clip")
        mask = kvc.cached_mask(lengths, t, cache.max_len if kv_len is None else kv_len)
        return LayerInputs(cos, sin, mask, lengths, rows_b, kv_len)

    def _output_logits(self, hidden: Array, valid_b: Array, mode: str) -> Array | None:
        if mode == "all":
            return self.logits(hidden)
        if mode == "last":
            last = jnp.clip(valid_b - 1, 0, hidden.shape[1] - 1)
            return self.logits(jnp.take_along_axis(hidden, last[:, None, None], axis=1))
        if mode == "none":
            return None
        raise ValueError(f"logits must be 'all', 'last' or 'none', got {mode!r}")

    def __call__(self, tokens_bt: Array, positions_bt: Array | None = None) -> Array:
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        return self.forward(tokens_bt, positions_bt).logits

    def init_cache(self, slots: int, max_len: int, dtype=None) -> kvc.KVCache:
        cfg = self.config
        dtype = dtype or self.model.embed_tokens.embedding[...].dtype
        return kvc.KVCache.init(num_layers=cfg.num_hidden_layers, slots=slots, max_len=max_len,
                                kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=dtype)
