"""DSpark heads on the block backbone: a sequential (Markov / RNN) logit bias and a confidence head.

* `MarkovHead` (reference §3.2): z_k = U_k + W2 W1[x_{k-1}] with W1 a [V, r] table and W2 a bias-free
  Linear r -> V; x_0 is the anchor.
* `RNNHead` (§3.4): state s_0 = 0; from [s_{k-1}; W1[x_{k-1}]; h_k] one Linear (2r+H) -> 3r (with
  bias) gives gate g, candidate c, output o; s_k = g*s_{k-1} + (1-g)*c; bias = W2 tanh(o).
* `ConfidenceHead` (§3.5): logit = w . [h_k; W1[x_{k-1}]] + b (or w . h_k + b without the Markov
  table); c_k = sigmoid(logit / T_k) at inference with STS temperatures T_k
  (`confidence_temperatures`, ones until calibrated).

Previous tokens: teacher-forced in training (prev = [anchor, labels[:K-1]]), the sampled draft
tokens at inference (prev = [anchor, sampled[:-1]]).

With a draft vocabulary of N tokens the heads read and write draft indices: W1 has N + 1 rows (row
N stands for every target token outside the subset, e.g. an anchor the drafter could not have
proposed) and W2 maps r -> N.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import TargetConfig
from specjax.drafters.block import (BlockBackbone, BlockDrafterConfig, Calibration,
                                    copy_frozen_from_target)
from specjax.drafters.vocab import install_draft_vocab
from specjax.models.layers import Embed, Linear

Array = jax.Array


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


class DSparkDrafter(BlockBackbone):
    """Block backbone + optional sequential head (`markov_head`) + optional `confidence_head`.

    With markov_rank 0 and no confidence head this is the DFlash drafter. See `BlockBackbone` for
    `train_forward`, `init_state`, `commit`, `propose`.
    """

    def __init__(self, cfg: BlockDrafterConfig, *, rngs: nnx.Rngs | None = None, dtype="float32",
                 param_dtype="float32"):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        super().__init__(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        if cfg.markov_rank > 0:
            n = cfg.draft_vocab_size
            rows = n + 1 if n else cfg.vocab_size  # + the "outside the draft vocabulary" row
            kw["out_vocab"] = cfg.out_vocab_size
            if cfg.markov_head_type == "vanilla":
                self.markov_head = MarkovHead(rows, cfg.markov_rank, **kw)
            else:
                self.markov_head = RNNHead(rows, cfg.markov_rank, cfg.hidden_size, **kw)
            del kw["out_vocab"]
        if cfg.confidence_head:
            extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(cfg.hidden_size + extra, **kw)
            self.confidence_temperatures = Calibration(jnp.ones((cfg.block_size,), jnp.float32),
                                                       logical_axes=(None,))

    def set_confidence_temperatures(self, temps) -> None:
        """Set the STS temperatures [gamma] (finite, > 0) that divide confidence logits at inference."""
        if self.confidence_head is None:
            raise ValueError("this drafter has no confidence head (confidence_head: false)")
        t = np.asarray(temps, np.float32)
        if t.shape != (self.gamma,) or not np.all(np.isfinite(t)) or np.any(t <= 0):
            raise ValueError(f"confidence_temperatures must be [{self.gamma}] finite values > 0, "
                             f"got {temps!r}")
        self.confidence_temperatures[...] = jnp.asarray(t)


DFlashDrafter = DSparkDrafter


def make_block_drafter(target_model, target_config: TargetConfig, cfg: BlockDrafterConfig,
                       rngs: nnx.Rngs | None = None, *, dtype="float32", param_dtype="float32",
                       draft_ids=None) -> DSparkDrafter:
    """Build a DSpark/DFlash drafter and copy the target's embedding and lm_head into its frozen
    copies (a tied target's lm_head is its embedding transposed). `draft_ids`: the target ids of
    the draft vocabulary ([draft_vocab_size], e.g. from `vocab.build_draft_vocab`), required
    exactly when cfg.draft_vocab_size > 0."""
    cfg.check_target(target_config)
    drafter = DSparkDrafter(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    install_draft_vocab(drafter, cfg.draft_vocab_size, draft_ids)
    copy_frozen_from_target(drafter.embed_tokens, drafter.lm_head, target_model,
                            drafter.draft_vocab)
    return drafter


__all__ = ["ConfidenceHead", "DFlashDrafter", "DSparkDrafter", "MarkovHead", "RNNHead",
           "make_block_drafter"]
