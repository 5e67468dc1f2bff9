"""The dense decoder of the Qwen3, Llama and Qwen2 families in Flax NNX (HF attribute names).

One module, switched by config fields: `qk_norm` adds Qwen3's per-head q/k RMSNorm (otherwise
`q_norm`/`k_norm` are None), `attention_bias` gives q/k/v projections a bias (Qwen2), and the RoPE
scaling (default, linear, llama3) comes from the config.

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
from specjax.models.layers import Embed, Linear, RMSNorm, SwiGLU, apply_rope, gqa_attention

Array = jax.Array


class ForwardOut(NamedTuple):
    logits: Array | None  # [B, T, V] ("all"), [B, 1, V] ("last") or None ("none"); float32
    taps: tuple[Array, ...]  # per requested layer id: [B, T, H]
    hidden: Array  # final-normed hidden state [B, T, H]
    cache: kvc.KVCache | None


class Attention(nnx.Module):
    """GQA self-attention with rotate-half RoPE (and per-head q/k RMSNorm when `cfg.qk_norm`)."""

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

    def __call__(self, x_bth: Array, positions_bt: Array, mask: Array,
                 kv_cache: tuple[Array, Array] | None, lengths_b: Array | None,
                 rows_b: Array | None = None):
        q = self.queries(x_bth, positions_bt)
        k, v = self.keys_values(x_bth, positions_bt)
        new_kv = None
        if kv_cache is not None:
            b = x_bth.shape[0]
            k_all = kvc.write(kv_cache[0], k, lengths_b, rows_b)
            v_all = kvc.write(kv_cache[1], v, lengths_b, rows_b)
            new_kv = (k_all, v_all)
            s = mask.shape[-1]  # attended cache rows [0:s] (the forward's kv_len)
            k, v = kvc.read_rows(k_all, b, rows_b)[:, :s], kvc.read_rows(v_all, b, rows_b)[:, :s]
        return self.output(gqa_attention(q, k, v, mask)), new_kv


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, **kw)

    def __call__(self, x, positions, mask, kv_cache=None, lengths=None, rows=None):
        a, new_kv = self.self_attn(self.input_layernorm(x), positions, mask, kv_cache, lengths, rows)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_kv


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
                tap_layers: Sequence[int] = (), logits: str = "all", kv_len: int | None = None) -> ForwardOut:
        """Run the decoder. `valid_b` [B] is each row's count of real tokens (default T).

        With a cache, token t of row b is written at cache row lengths[b] + t and sees cache rows
        <= lengths[b] + t; the returned cache has lengths + valid. The cache may hold more slots than
        B: rows [0:B] take part (or the slots `rows_b` [B], distinct; an id >= slots marks a padding row
        whose writes are dropped) and the others are untouched. `logits` is "all", "last" (at the
        last valid token of each row) or "none". `kv_len` (static): attention reads cache rows
        [0:kv_len] only (writes still reach the whole cache); the caller guarantees
        lengths + T <= kv_len for every row whose outputs it uses.
        """
        cfg = self.config
        b, t = tokens_bt.shape
        if valid_b is None:
            valid_b = jnp.full((b,), t, jnp.int32)
        for lid in tap_layers:
            if not -1 <= lid < cfg.num_hidden_layers:
                raise ValueError(f"tap layer id {lid} out of range [-1, {cfg.num_hidden_layers})")
        if cache is None:
            mask = kvc.causal_mask(t, valid_b)
            lengths = None
        else:  # rows [0:B] (or rows_b) of a cache with >= B slots take part
            if kv_len is not None and not 1 <= kv_len <= cache.max_len:
                raise ValueError(f"kv_len {kv_len} outside [1, cache max_len {cache.max_len}]")
            lengths = cache.lengths[:b] if rows_b is None else jnp.take(cache.lengths, rows_b, mode="clip")
            mask = kvc.cached_mask(lengths, t, cache.max_len if kv_len is None else kv_len)
        x = self.model.embed_tokens(tokens_bt)
        taps: dict[int, Array] = {}
        if -1 in tap_layers:
            taps[-1] = x
        new_k, new_v = [], []
        for i, layer in enumerate(self.model.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x, new_kv = layer(x, positions_bt, mask, kv, lengths, rows_b)
            if new_kv is not None:
                new_k.append(new_kv[0])
                new_v.append(new_kv[1])
            if i in tap_layers:
                taps[i] = x
        hidden = self.model.norm(x)
        if logits == "all":
            out_logits = self.logits(hidden)
        elif logits == "last":
            last = jnp.clip(valid_b - 1, 0, t - 1)
            h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
            out_logits = self.logits(h_last)
        elif logits == "none":
            out_logits = None
        else:
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
        new_cache = None
        if cache is not None:
            rows = jnp.arange(b) if rows_b is None else rows_b
            new_cache = kvc.KVCache(k=tuple(new_k), v=tuple(new_v),
                                    lengths=cache.lengths.at[rows].add(valid_b.astype(jnp.int32), mode="drop"))
        return ForwardOut(out_logits, tuple(taps[i] for i in tap_layers), hidden, new_cache)

    def __call__(self, tokens_bt: Array, positions_bt: Array | None = None) -> Array:
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        return self.forward(tokens_bt, positions_bt).logits

    def init_cache(self, slots: int, max_len: int, dtype=None) -> kvc.KVCache:
        cfg = self.config
        dtype = dtype or self.model.embed_tokens.embedding[...].dtype
        return kvc.KVCache.init(num_layers=cfg.num_hidden_layers, slots=slots, max_len=max_len,
                                kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=dtype)
