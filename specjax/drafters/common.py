"""Parts every drafter kind shares: layer dimensions, frozen target copies, context attention and
the pending-feature pair cache (the block layout of training is `specjax.drafters.block_layout`).

* `LayerDims` / `TapDims`: the layer fields a drafter copies from its target (and, for drafters that
  read hidden taps, `target_layer_ids`), with the checks every kind's config shares.
* `TrainingSection` / `FrozenHeadTraining`: the options every kind's training section shares.
* `Frozen` weights (the target's embedding and lm_head): an optimizer built with `wrt=nnx.Param`
  never sees them, `nnx.grad` returns no gradient for them, and every read goes through
  `stop_gradient`. `drafter_key_map()` is the checkpoint key map of a drafter whose attribute paths
  are its checkpoint names (Param and Frozen variables both stored).
* `attend_context_and_block`: attention over [cached context ; a block] without concatenating K/V.
* `PairCacheDrafter`: one-layer drafters over (feature_j, token_{j+1}) pairs (Eagle3, MTP-1): the
  committed pairs' K/V plus the feature of the last committed position, which waits for its next
  token (write, then mask; see `specjax.drafters.eagle3`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.checkpoints.common import KeyMap
from specjax.config import ConfigError, TargetConfig, check_layer_dims, check_positive, coerce_floats
from specjax.drafters import vocab as dv
from specjax.drafters.base import ContextUpdate, DraftBlock
from specjax.drafters.drafting import DraftGuide, Draw, draft_loop, loop_q, step_outputs
from specjax.models import cache as kvc
from specjax.models.layers import RMSNorm, gqa_attention
from specjax.models.unfused import Attention
from specjax.sampling import SamplingArrays

Array = jax.Array
_INIT_STD = 0.02


# ------------------------------------------------------------------------------------------------
# layer dimensions


def drafter_rope(target: TargetConfig) -> dict[str, Any]:
    """The RoPE fields a drafter's own (Qwen3-style) layers copy from its target.

    The target's theta and linear scaling carry over. Llama 3's frequency smoothing does not: a
    drafter is trained from scratch on positions inside the original context, where llama3 scaling
    leaves the high frequencies unchanged, so its layers use unscaled RoPE with the target's theta.
    """
    if target.rope_type == "llama3":
        return dict(rope_theta=target.rope_theta, rope_type="default", rope_factor=1.0)
    return dict(rope_theta=target.rope_theta, rope_type=target.rope_type,
                rope_factor=target.rope_factor)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerDims:
    """The layer dimensions of a drafter's own (Qwen3-style) layers, copied from its target
    (reference §1), and its draft vocabulary: `draft_vocab_size` N > 0 drafts over N of the
    target's tokens (`specjax.drafters.vocab`); 0 = the full vocabulary."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        check_layer_dims(self)
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"field 'rms_norm_eps' must be > 0, got {self.rms_norm_eps}")
        self.layer_config()  # validates the rope fields
        dv.validate_draft_vocab_size(self.draft_vocab_size, self.vocab_size)

    @property
    def out_vocab_size(self) -> int:
        """Width of the drafter's output head: N, or V without a draft vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    def layer_config(self, num_layers: int = 1) -> TargetConfig:
        """The Qwen3-style layer config the drafter's decoder layer(s) are built from."""
        return TargetConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_type=self.rope_type,
            rope_factor=self.rope_factor, tie_word_embeddings=False)

    @classmethod
    def from_target(cls, target: TargetConfig, **fields: Any):
        """Copy the layer dimensions of `target`; `fields` set the drafter-only fields (and may
        narrow the MLP: `intermediate_size`)."""
        args = dict(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                    intermediate_size=target.intermediate_size,
                    num_attention_heads=target.num_attention_heads,
                    num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                    rms_norm_eps=target.rms_norm_eps, **drafter_rope(target))
        args.update(fields)
        cfg = cls(**args)
        cfg.check_target(target)
        return cfg

    def check_target(self, target: TargetConfig) -> None:
        """Raise ConfigError if the drafter's vocabulary or hidden size differ from the target's."""
        for name in ("vocab_size", "hidden_size"):
            if getattr(self, name) != getattr(target, name):
                raise ConfigError(f"drafter field '{name}' ({getattr(self, name)}) differs from "
                                  f"the target's ({getattr(target, name)})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TapDims(LayerDims):
    """`LayerDims` of a drafter that reads the target's hidden taps: `target_layer_ids` are the
    target layer ids whose raw outputs are concatenated in this order (-1 = embedding output)."""

    target_layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        ids = tuple(self.target_layer_ids)
        if not ids:
            raise ConfigError("field 'target_layer_ids' must name at least one target layer")
        if any(not isinstance(i, int) or isinstance(i, bool) or i < -1 for i in ids):
            raise ConfigError(f"field 'target_layer_ids' must hold ints >= -1, got {ids!r}")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"field 'target_layer_ids' has duplicates: {ids!r}")
        object.__setattr__(self, "target_layer_ids", ids)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def check_target(self, target: TargetConfig) -> None:
        """Raise ConfigError if the widths differ or a tap layer does not exist in `target`."""
        super().check_target(target)
        for i in self.target_layer_ids:
            if not -1 <= i < target.num_hidden_layers:
                raise ConfigError(f"field 'target_layer_ids': layer {i} out of range "
                                  f"[-1, {target.num_hidden_layers})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingSection:
    """Training options every kind's section of a training config (`model:` with its `kind`)
    has: `draft_intermediate_size` is the MLP width of the drafter's own layers (0 = the target's
    intermediate_size); `chunk_anchors` computes vocabulary-sized terms this many anchors (or
    positions) at a time (None = all at once)."""

    draft_intermediate_size: int = 0
    chunk_anchors: int | None = None

    def __post_init__(self) -> None:
        coerce_floats(self)
        check_positive(self, "chunk_anchors")
        v = self.draft_intermediate_size
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"field 'draft_intermediate_size' must be an integer >= 0 (0 = the "
                              f"target's), got {v!r}")

    def width(self) -> dict[str, int]:
        """The `intermediate_size` override of the drafter's layers ({} = the target's)."""
        return {"intermediate_size": self.draft_intermediate_size} \
            if self.draft_intermediate_size else {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrozenHeadTraining(TrainingSection):
    """A section of a kind whose output head is a frozen copy of the target's: `draft_vocab_size`
    N > 0 proposes over the N most frequent tokens of the training data
    (`specjax.drafters.vocab`; 0 = the full vocabulary); `init_norm_from_target` starts the final
    norm before the frozen head at the target's final norm weight instead of one (DeepSpec: one)."""

    draft_vocab_size: int = 0
    init_norm_from_target: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        v = self.draft_vocab_size
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"field 'draft_vocab_size' must be an integer >= 0 (0 = full "
                              f"vocabulary), got {v!r}")
        if not isinstance(self.init_norm_from_target, bool):
            raise ConfigError(f"field 'init_norm_from_target' must be true or false, got "
                              f"{self.init_norm_from_target!r}")

    def init_norm(self, norm: RMSNorm, target_model: Any) -> None:
        """Apply `init_norm_from_target` to the drafter's final norm."""
        if self.init_norm_from_target:
            copy_output_norm_from_target(norm, target_model)


def default_target_layer_ids(num_layers: int, num_taps: int = 5) -> tuple[int, ...]:
    """Evenly spaced tap layers from 1 to num_layers-3 (Qwen3 36 -> (1, 9, 17, 25, 33))."""
    hi = num_layers - 3
    if num_taps < 1 or hi - 1 < num_taps - 1:
        raise ConfigError(f"cannot place {num_taps} distinct tap layers in 1..{hi} "
                          f"(target has {num_layers} layers); give target_layer_ids explicitly")
    if num_taps == 1:
        return (1,)
    return tuple(int(round(1 + k * (hi - 1) / (num_taps - 1))) for k in range(num_taps))



# ------------------------------------------------------------------------------------------------
# frozen target copies


class Frozen(nnx.Variable):
    """A weight copied from the target and never trained (embedding, lm_head).

    Exclude it from optimizers with `wrt=nnx.Param` (it is not a Param subclass); it is still part
    of `nnx.state(model)` so checkpoints carry it.
    """


class Calibration(nnx.Variable):
    """A non-trained inference-time calibration value (e.g. STS confidence temperatures)."""





def drafter_key_map() -> KeyMap:
    """The key map of a drafter whose attribute paths are its checkpoint names (trainable Params
    and the Frozen target copies both stored)."""
    return KeyMap(variable_types=(nnx.Param, Frozen))


class FrozenEmbed(nnx.Module):
    """The target's input embedding table [V, H], frozen."""

    def __init__(self, vocab: int, hidden: int, *, rngs: nnx.Rngs, dtype="float32",
                 param_dtype="float32"):
        self.dtype = jnp.dtype(dtype)
        w = _INIT_STD * jax.random.normal(rngs.params(), (vocab, hidden), jnp.float32)
        self.embedding = Frozen(w.astype(param_dtype), logical_axes=("vocab", "embed"))

    def __call__(self, ids: Array) -> Array:
        table = jax.lax.stop_gradient(self.embedding[...])
        return jnp.take(table, ids, axis=0).astype(self.dtype)


class FrozenLMHead(nnx.Module):
    """The target's output projection, kernel [H, V] (Linear layout), frozen; float32 logits (or
    `out_dtype`'s: the compute dtype's keep the matmul's output as it is)."""

    def __init__(self, hidden: int, vocab: int, *, rngs: nnx.Rngs, dtype="float32",
                 param_dtype="float32"):
        self.dtype = jnp.dtype(dtype)
        w = _INIT_STD * jax.random.normal(rngs.params(), (hidden, vocab), jnp.float32)
        self.kernel = Frozen(w.astype(param_dtype), logical_axes=("embed", "vocab"))

    def __call__(self, h: Array, out_dtype: Any = jnp.float32) -> Array:
        w = jax.lax.stop_gradient(self.kernel[...]).astype(self.dtype)
        return jnp.dot(h.astype(self.dtype), w).astype(out_dtype)


def copy_frozen_from_target(embed: FrozenEmbed, head: FrozenLMHead, target_model: Any,
                            vocab: dv.DraftVocab | None = None) -> None:
    """Copy a CausalLM's input embedding and output head into frozen copies, in place (a tied
    target's lm_head is its embedding transposed); with a draft vocabulary the head gets only
    the columns of its tokens."""
    emb_vh = target_model.model.embed_tokens.embedding[...]
    want = embed.embedding[...].shape
    if emb_vh.shape != want:
        raise ConfigError(f"target embedding shape {emb_vh.shape} does not match the drafter's "
                          f"[vocab_size, hidden_size] = {want}")
    head_hv = emb_vh.T if target_model.lm_head is None else target_model.lm_head.kernel[...]
    embed.embedding[...] = jnp.asarray(emb_vh, embed.embedding[...].dtype)
    head.kernel[...] = jnp.asarray(dv.head_columns(head_hv, vocab), head.kernel[...].dtype)


def copy_output_norm_from_target(norm: RMSNorm, target_model: Any) -> None:
    """Start a drafter's trainable final norm (the one feeding the frozen lm_head) at the target's
    final norm weight, in place, so its first logits have the target's scale. The norm stays
    trainable; DeepSpec starts it at one (this is a training option, `init_norm_from_target`)."""
    w = target_model.model.norm.weight[...]
    want = norm.weight[...].shape
    if w.shape != want:
        raise ConfigError(f"target final norm shape {w.shape} does not match the drafter's "
                          f"output norm {want}")
    norm.weight[...] = jnp.asarray(w, norm.weight[...].dtype)


def attend_context_and_block(q_bthd: Array, k_ctx_bkshd: Array, v_ctx_bkshd: Array,
                             mask_ctx_bts: Array, k_blk_bthd: Array, v_blk_bthd: Array,
                             mask_blk_btt: Array) -> Array:
    """GQA attention over [context keys ; block keys] without concatenating K/V.

    The context K/V are heads-major [B, nkv, S, hd] (a `KVCache` layer, read without transposes),
    the block's [B, T, nkv, hd]. Equal to `gqa_attention(q, concat(k_ctx, k_blk), concat(v_ctx,
    v_blk), concat(masks))` (context transposed to [B, S, nkv, hd]; same float32 softmax, rows with
    no visible key give zeros) but never copies the context cache.
    """
    b, t, nh, hd = q_bthd.shape
    nkv = k_ctx_bkshd.shape[1]
    # batch dims (b, k) lead every product: XLA:CPU's dot thunk rejects bf16 x bf16 -> f32 otherwise
    q = q_bthd.reshape(b, t, nkv, nh // nkv, hd).transpose(0, 2, 3, 1, 4)  # [B, nkv, g, T, hd]
    low, scale = jnp.finfo(jnp.float32).min, hd ** -0.5
    # one softmax over both parts without concatenating them: a shared maximum and denominator
    m_ctx, m_blk = mask_ctx_bts[:, None, None], mask_blk_btt[:, None, None]
    s_ctx = jnp.where(m_ctx, jnp.einsum("bkgtd,bksd->bkgts", q, k_ctx_bkshd, preferred_element_type=jnp.float32)
                      * scale, low)
    # the block's own copy of q: XLA's dot merger would otherwise join the two products into one over
    # [context ; block] keys, copying (and transposing) the whole context cache every call
    q_blk = jax.lax.optimization_barrier(q)
    s_blk = jnp.where(m_blk, jnp.einsum("bkgtd,bskd->bkgts", q_blk, k_blk_bthd, preferred_element_type=jnp.float32)
                      * scale, low)
    top = jnp.maximum(jnp.max(s_ctx, axis=-1, keepdims=True), jnp.max(s_blk, axis=-1, keepdims=True))
    e_ctx, e_blk = jnp.exp(s_ctx - top), jnp.exp(s_blk - top)  # masked keys: exp(low - top) = 0
    total = jnp.sum(e_ctx, axis=-1, keepdims=True) + jnp.sum(e_blk, axis=-1, keepdims=True)
    norm = jnp.where(top > low, 1.0 / total, 0.0)  # a row with no visible key (top = low): zeros
    # normalised after the value products (as `layers.attend`): the context's weights are rounded
    # to the cache's dtype in the pass that sums them, not in one more pass over the scores
    out = (jnp.einsum("bkgts,bksd->bkgtd", e_ctx.astype(v_ctx_bkshd.dtype), v_ctx_bkshd,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("bkgts,bskd->bkgtd", e_blk.astype(v_blk_bthd.dtype), v_blk_bthd,
                        preferred_element_type=jnp.float32)) * norm
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nh, hd).astype(q_bthd.dtype)


# ------------------------------------------------------------------------------------------------
# the pending-feature pair cache (Eagle3, MTP-1)


class PairCacheState(NamedTuple):
    """Per-slot drafter state (slot axes: `kvc.slot_axes`)."""

    cache: kvc.KVCache  # one layer: normed, rotated keys and values of committed pairs; lengths [slots] =
    # committed pairs (= position of the pending feature)
    pending: Array  # [slots, H] feature of the last committed position (awaits its next token)
    has_pending: Array  # [slots] bool

    @property
    def lengths(self) -> Array:
        return self.cache.lengths


def shift_left(x_bs: Array, k: int, fill: Any = 0) -> Array:
    """x[:, t + k] at t (`fill` past the end); for [B, S] and [B, S, ...]."""
    if k == 0:
        return x_bs
    k = min(k, x_bs.shape[1])
    pad = [(0, 0), (0, k)] + [(0, 0)] * (x_bs.ndim - 2)
    return jnp.pad(x_bs[:, k:], pad, constant_values=fill)


class PairCacheDrafter(nnx.Module):
    """Shared machinery of one-layer drafters over (feature_j, token_{j+1}) pairs.

    Subclasses define `_features(update)` ([B, T, H] per committed position), `_attn_input(feat,
    tok)` -> (attention input, residual), `_attention()` (the Attention module), `_finish(residual,
    attn_out)` (layer output, H wide, before the final norm), `_logits(out)` (float32 [.., N]) and
    the attributes `gamma`, `hidden_size`, `num_kv_heads`, `head_dim`, `dtype`, `draft_vocab`
    (a `vocab.DraftVocab` of N tokens, or None: N = V).
    """

    gamma: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int

    # hooks -------------------------------------------------------------------------------------
    def _features(self, update: ContextUpdate) -> Array:
        raise NotImplementedError

    def _attn_input(self, feat_bth: Array, tok_bt: Array) -> tuple[Array, Array]:
        raise NotImplementedError

    def _attention(self) -> Attention:
        raise NotImplementedError

    def _finish(self, residual_bth: Array, attn_bthd: Array) -> Array:
        raise NotImplementedError

    def _logits(self, out_xh: Array) -> Array:
        raise NotImplementedError

    # training ----------------------------------------------------------------------------------
    def step0_layer(self, feats_bsh: Array, input_ids_bs: Array) -> Array:
        """Layer output [B, S, H] of pairs (feats[t], ids[t+1]) at positions t, causal attention
        (the last position is paired with token 0 and has no target)."""
        b, s = input_ids_bs.shape
        toks = shift_left(input_ids_bs.astype(jnp.int32), 1)
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        x_in, res = self._attn_input(feats_bsh, toks)
        attn = self._attention()
        q = attn.queries(x_in, pos)
        k, v = attn.keys_values(x_in, pos)
        return self._finish(res, gqa_attention(q, k, v, kvc.causal_mask(s)))

    # inference ---------------------------------------------------------------------------------
    def init_state(self, slots: int, max_len: int) -> PairCacheState:
        """Empty pair cache [2, slots, nkv, max_len, hd], no pending feature."""
        return PairCacheState(kvc.KVCache.init(num_layers=1, slots=slots, max_len=max_len, kv_heads=self.num_kv_heads,
                                               head_dim=self.head_dim, dtype=self.dtype),
                              pending=jnp.zeros((slots, self.hidden_size), self.dtype),
                              has_pending=jnp.zeros((slots,), bool))

    def commit(self, state: PairCacheState, update: ContextUpdate) -> PairCacheState:
        """Append the pairs that the committed positions of rows [0:B] complete (module docstring)."""
        b, t = update.tokens.shape
        feats = self._features(update).astype(self.dtype)  # [B, T, H]
        if feats.shape[:2] != (b, t):
            raise ValueError(f"features {feats.shape} must be [B={b}, T={t}, H]")
        n = jnp.clip(update.n_valid.astype(jnp.int32), 0, t)
        has = state.has_pending[:b]
        pos = update.positions.astype(jnp.int32)
        f_all = jnp.concatenate([state.pending[:b, None, :], feats], axis=1)  # [B, T+1, H]
        p_all = jnp.concatenate([pos[:, :1] - 1, pos], axis=1)  # pending sits just before P
        # pair i = (f_all[i], tokens[i]); without a pending feature the first pair is (f_P, x_{P+1})
        idx = jnp.arange(t, dtype=jnp.int32)[None, :] + jnp.where(has, 0, 1)[:, None]
        idx_f = jnp.clip(idx, 0, t)
        f_pair = jnp.take_along_axis(f_all, idx_f[..., None], axis=1)
        p_pair = jnp.take_along_axis(p_all, idx_f, axis=1)
        t_pair = jnp.take_along_axis(update.tokens.astype(jnp.int32), jnp.clip(idx, 0, t - 1), axis=1)
        n_pairs = jnp.where(has, n, jnp.maximum(n - 1, 0))
        x_in, _ = self._attn_input(f_pair, t_pair)
        k, v = self._attention().keys_values(x_in, p_pair)
        lengths = state.lengths[:b]
        new_kv = kvc.write_kv(state.cache.kv[0], k, v, lengths)
        last = jnp.take_along_axis(feats, jnp.clip(n - 1, 0, t - 1)[:, None, None], axis=1)[:, 0]
        pending = jnp.where((n > 0)[:, None], last, state.pending[:b])
        return PairCacheState(kvc.KVCache(kv=(new_kv,), lengths=state.lengths.at[:b].add(n_pairs)),
                              pending=state.pending.at[:b].set(pending),
                              has_pending=state.has_pending.at[:b].set(has | (n > 0)))

    def restart(self, state: PairCacheState, start_b: Array) -> PairCacheState:
        """Rows [0:B] set to continue with a prefill chunk at position start_b (prefix caching): a row
        whose last commit ended just there (start_b - 1 pairs, the feature of start_b - 1 pending) is
        kept; any other keeps its first start_b pairs and no pending feature (the chunk's first position
        starts the next pair): valid where the token at start_b is the one the row committed there."""
        b = start_b.shape[0]
        start = start_b.astype(jnp.int32)
        kept = state.has_pending[:b] & (state.lengths[:b] == start - 1)
        count = jnp.where(kept, start - 1, start)
        return PairCacheState(kvc.cut_rows(state.cache, count), pending=state.pending,
                              has_pending=state.has_pending.at[:b].set(kept))

    def propose_with_logits(self, state: PairCacheState, anchor_b: Array, position_b: Array,
                            sampling: SamplingArrays, key_b: Array,
                            kv_len: int | None = None) -> tuple[DraftBlock, Array]:
        """`propose`, also returning the draft logits [B, gamma, V] (float32) each q came from
        (-inf outside a draft vocabulary)."""
        return self._draft(state, anchor_b, position_b, sampling, key_b, kv_len, None, with_logits=True)

    def _draft(self, state: PairCacheState, anchor_b: Array, position_b: Array, sampling: SamplingArrays,
               key_b: Array, kv_len: int | None, guide: DraftGuide | None, *,
               with_logits: bool) -> tuple[DraftBlock, Array | None]:
        b = anchor_b.shape[0]
        vocab = self.draft_vocab
        g = self.gamma
        lengths = state.lengths[:b]
        k_ctx, v_ctx = kvc.read_kv(state.cache.kv[0], b, kv_len=kv_len)
        m = k_ctx.shape[2]
        mask_ctx = (jnp.arange(m, dtype=jnp.int32)[None, :] < lengths[:, None])[:, None, :]  # [B,1,M]
        base_pos = position_b.astype(jnp.int32) - 1  # the pending feature's position
        attn = self._attention()
        buf = jnp.zeros((b, g, self.num_kv_heads, self.head_dim), k_ctx.dtype)

        def step(k: Array, carry: tuple[Array, Array, Array, Array], draw: Draw) -> tuple[tuple, Array, dict]:
            feat_bh, tok_b, dk, dv_ = carry
            pos = (base_pos + k)[:, None]
            x_in, res = self._attn_input(feat_bh[:, None, :], tok_b[:, None])
            q = attn.queries(x_in, pos)
            kk, vv = attn.keys_values(x_in, pos)
            dk = jax.lax.dynamic_update_slice_in_dim(dk, kk.astype(dk.dtype), k, axis=1)
            dv_ = jax.lax.dynamic_update_slice_in_dim(dv_, vv.astype(dv_.dtype), k, axis=1)
            mask_blk = jnp.broadcast_to((jnp.arange(g) <= k)[None, None, :], (b, 1, g))
            a = attend_context_and_block(q, k_ctx, v_ctx, mask_ctx, dk, dv_, mask_blk)
            out = self._finish(res, a)  # [B, 1, H]
            z = self._logits(out)[:, 0]  # [B, N] float32
            d, q_bn = draw(z)
            carry = (out[:, 0].astype(feat_bh.dtype), dv.target_ids(vocab, d), dk, dv_)
            return carry, d, step_outputs(q_bn, z, with_logits)

        carry0 = (state.pending[:b], anchor_b.astype(jnp.int32), buf, buf)
        _, d_bg, outs = draft_loop(step, carry0, g, sampling, key_b, self.dtype, guide,
                                   None if vocab is None else vocab.d2t[...])
        tokens = dv.target_ids(vocab, d_bg)
        q_bgn = loop_q(outs, d_bg, self.config.out_vocab_size, self.dtype)
        block = DraftBlock(tokens=tokens, q=dv.full_probs(vocab, q_bgn), confidence=None,
                           q_draft=None if vocab is None else q_bgn)
        return block, (dv.full_logits(vocab, outs["z"]) if with_logits else None)

    def propose(self, state: PairCacheState, anchor_b: Array, position_b: Array,
                sampling: SamplingArrays, key_b: Array, kv_len: int | None = None,
                guide: DraftGuide | None = None) -> DraftBlock:
        """Propose gamma tokens for rows [0:B] (anchor at position_b), sampled from the q returned
        (under the rows' automata with a `guide`: `drafting.draft_loop`); committed pairs are read from
        rows [0:kv_len) when given."""
        return self._draft(state, anchor_b, position_b, sampling, key_b, kv_len, guide, with_logits=False)[0]

