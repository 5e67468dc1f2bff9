"""The layers of a DSpark / DFlash drafter: draft decoder layers that also attend to injected
context, and the DSpark heads (reference §3).

* `DraftDecoderLayer`: a Qwen3 decoder layer (same parameters and names) whose attention also sees
  context keys/values (projected by the layer's own k_proj/v_proj/k_norm at the context positions).
* `MarkovHead` (§3.2): z_k = U_k + W2 W1[x_{k-1}] with W1 a [V, r] table and W2 a bias-free
  Linear r -> V; x_0 is the anchor.
* `RNNHead` (§3.4): state s_0 = 0; from [s_{k-1}; W1[x_{k-1}]; h_k] one Linear (2r+H) -> 3r (with
  bias) gives gate g, candidate c, output o; s_k = g*s_{k-1} + (1-g)*c; bias = W2 tanh(o).
* `ConfidenceHead` (§3.5): logit = w . [h_k; W1[x_{k-1}]] + b (or w . h_k + b without the Markov
  table); c_k = sigmoid(logit / T_k) at inference with STS temperatures T_k.

With a draft vocabulary of N tokens the heads read and write draft indices: W1 has N + 1 rows (row
N stands for every target token outside the subset, e.g. an anchor the drafter could not have
proposed) and W2 maps r -> N.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.common import attend_context_and_block
from specjax.models import cache as kvc
from specjax.models.layers import Embed, Linear, gqa_attention
from specjax.models.pallas_attention import context_block_attention
from specjax.models.unfused import DecoderLayer

Array = jax.Array


class DraftDecoderLayer(DecoderLayer):
    """A Qwen3 decoder layer (same parameters and names) whose attention also sees injected context
    keys/values."""

    def context_kv(self, ctx_bsh: Array, positions_bs: Array) -> tuple[Array, Array]:
        """Normed, rotated context keys and values [B, S, nkv, hd] (same k/v projections)."""
        return self.self_attn.keys_values(ctx_bsh, positions_bs)

    def _mlp(self, x: Array, attn_bthd: Array, mlp: str = "xla") -> Array:
        x = x + self.self_attn.output(attn_bthd)
        return x + self.mlp(self.post_attention_layernorm(x), kernel=mlp == "pallas")

    def train_block(self, x_bth: Array, positions_bt: Array, ctx_bsh: Array, ctx_positions_bs: Array,
                    mask_bt_s_plus_t: Array) -> Array:
        """Blocks attend to [context ; blocks] under the dense block-sparse mask [B, T, S + T]."""
        xn = self.input_layernorm(x_bth)
        q = self.self_attn.queries(xn, positions_bt)
        k_blk, v_blk = self.self_attn.keys_values(xn, positions_bt)
        k_ctx, v_ctx = self.context_kv(ctx_bsh, ctx_positions_bs)
        k = jnp.concatenate([k_ctx, k_blk.astype(k_ctx.dtype)], axis=1)
        v = jnp.concatenate([v_ctx, v_blk.astype(v_ctx.dtype)], axis=1)
        return self._mlp(x_bth, gqa_attention(q, k, v, mask_bt_s_plus_t))

    def cached_block(self, x_bth: Array, positions_bt: Array, kv_2skmd: Array, lengths_b: Array,
                     kv_len: int | None = None, attention: str = "xla", mlp: str = "xla") -> Array:
        """One block per row [0:B] attends to its whole block and to its cached context, rows
        [0:lengths[b]) of the layer's key/value buffer [2, slots, nkv, max_len, hd] (read within
        [0:kv_len)): with XLA's ops ("xla") or in one Pallas kernel ("pallas",
        `pallas_attention.context_block_attention`); its MLP's gate and up products and SiLU gate
        with XLA's ops or in one kernel (`mlp` "pallas", `pallas_mlp.gated_projection`)."""
        b, t, _ = x_bth.shape
        xn = self.input_layernorm(x_bth)
        q = self.self_attn.queries(xn, positions_bt)
        k_blk, v_blk = self.self_attn.keys_values(xn, positions_bt)
        if attention == "pallas":
            return self._mlp(x_bth, context_block_attention(q, kv_2skmd, lengths_b, k_blk, v_blk, kv_len=kv_len), mlp)
        k_ctx, v_ctx = kvc.read_kv(kv_2skmd, b, kv_len=kv_len)
        mask_ctx = jnp.broadcast_to(jnp.arange(k_ctx.shape[2])[None, None, :] < lengths_b[:, None, None],
                                    (b, t, k_ctx.shape[2]))
        attn = attend_context_and_block(q, k_ctx, v_ctx, mask_ctx, k_blk.astype(k_ctx.dtype),
                                        v_blk.astype(v_ctx.dtype), jnp.ones((b, t, t), bool))
        return self._mlp(x_bth, attn, mlp)



def _markov_tables(vocab: int, rank: int, out_vocab: int | None, *, rngs: nnx.Rngs, dtype,
                   param_dtype) -> tuple[Embed, Linear]:
    w1 = Embed(vocab, rank, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    w1.embedding = nnx.Param(w1.embedding[...], logical_axes=("vocab", "rank"))
    w2 = Linear(rank, out_vocab or vocab, logical_axes=("rank", "vocab"), rngs=rngs, dtype=dtype,
                param_dtype=param_dtype)
    return w1, w2


class MarkovHead(nnx.Module):
    """Vanilla rank-r Markov transition bias W2 W1[x_{k-1}] (reference §3.2); W1 has `vocab`
    rows, W2 `out_vocab` (default `vocab`) outputs."""

    def __init__(self, vocab: int, rank: int, *, rngs: nnx.Rngs, dtype="float32",
                 param_dtype="float32", out_vocab: int | None = None):
        self.rank = rank
        self.markov_w1, self.markov_w2 = _markov_tables(vocab, rank, out_vocab, rngs=rngs,
                                                        dtype=dtype, param_dtype=param_dtype)

    def embed_prev(self, prev: Array) -> Array:
        """W1[prev] [..., r]."""
        return self.markov_w1(prev)

    def bias_sequence(self, h_xkh: Array, prev_xk: Array) -> Array:
        """Biases [..., K, V] (float32) for all slots at once (teacher-forced prev tokens)."""
        del h_xkh
        return self.markov_w2(self.markov_w1(prev_xk)).astype(jnp.float32)

    def init_carry(self, batch_shape: tuple[int, ...], dtype) -> tuple:
        del batch_shape, dtype
        return ()

    def step(self, carry: tuple, h_bh: Array, prev_b: Array) -> tuple[tuple, Array]:
        """One slot: (carry, bias [B, V] float32)."""
        del h_bh
        return carry, self.markov_w2(self.markov_w1(prev_b)).astype(jnp.float32)


class RNNHead(nnx.Module):
    """Gated recurrent transition bias (reference §3.4, paper Eq. 6)."""

    def __init__(self, vocab: int, rank: int, hidden: int, *, rngs: nnx.Rngs, dtype="float32",
                 param_dtype="float32", out_vocab: int | None = None):
        self.rank = rank
        self.markov_w1, self.markov_w2 = _markov_tables(vocab, rank, out_vocab, rngs=rngs,
                                                        dtype=dtype, param_dtype=param_dtype)
        self.joint_proj = Linear(2 * rank + hidden, 3 * rank, logical_axes=("features", "rank"),
                                 use_bias=True, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def embed_prev(self, prev: Array) -> Array:
        return self.markov_w1(prev)

    def init_carry(self, batch_shape: tuple[int, ...], dtype) -> Array:
        """s_0 = 0 [..., r]."""
        return jnp.zeros(tuple(batch_shape) + (self.rank,), dtype)

    def step(self, s: Array, h_xh: Array, prev_x: Array) -> tuple[Array, Array]:
        """(s_k, bias_k [..., V] float32) from s_{k-1}, h_k and x_{k-1}; the bias uses z_k
        (the pre-update state)."""
        z = jnp.concatenate([s.astype(h_xh.dtype), self.markov_w1(prev_x).astype(h_xh.dtype), h_xh],
                            axis=-1)
        g, c, o = jnp.split(self.joint_proj(z), 3, axis=-1)
        g = jax.nn.sigmoid(g)
        s_new = g * s + (1.0 - g) * jnp.tanh(c)
        bias = self.markov_w2(jnp.tanh(o)).astype(jnp.float32)
        return s_new.astype(s.dtype), bias

    def bias_sequence(self, h_xkh: Array, prev_xk: Array) -> Array:
        """Unrolls the recurrence over the K slots (teacher-forced prev) -> [..., K, V] float32."""
        kk = h_xkh.shape[-2]
        s = self.init_carry(h_xkh.shape[:-2], h_xkh.dtype)
        out = []
        for k in range(kk):
            s, bias = self.step(s, h_xkh[..., k, :], prev_xk[..., k])
            out.append(bias)
        return jnp.stack(out, axis=-2)


class ConfidenceHead(nnx.Module):
    """Per-slot acceptance logit w . [h_k (; W1[x_{k-1}])] + b (reference §3.5), float32."""

    def __init__(self, in_features: int, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        self.proj = Linear(in_features, 1, logical_axes=("features", None), use_bias=True,
                           rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, h_xh: Array, extra_xr: Array | None = None) -> Array:
        x = h_xh if extra_xr is None else jnp.concatenate([h_xh, extra_xr.astype(h_xh.dtype)], -1)
        return self.proj(x)[..., 0].astype(jnp.float32)



__all__ = ["ConfidenceHead", "DraftDecoderLayer", "MarkovHead", "RNNHead"]
