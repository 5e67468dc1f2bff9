"""DFlash-style block backbone: a parallel drafter over the target's hidden taps.

Context features `ctx = hidden_norm(fc(concat_l taps_l))` are injected into every draft layer as
extra keys/values (projected by the layer's own k_proj/v_proj/k_norm, rotated at the context
positions). A block of `gamma` inputs (the anchor + gamma-1 mask tokens, slot j at position a+j)
attends to the context strictly before the anchor and to its own block bidirectionally, and yields
gamma logits: slot j predicts the token at a+j+1 (anchor as first prediction, reference §3.1).

The same module trains (`train_forward`: A anchors per sequence in one call, block-sparse mask) and
serves (the `Drafter` protocol of `specjax.drafters.base`: a per-slot context K/V cache that
`commit` appends to and `propose` reads). Embedding and lm_head are frozen copies of the target's,
stored as `Frozen` variables: an optimizer built with `wrt=nnx.Param` never sees them, `nnx.grad`
(which differentiates `nnx.Param` by default) returns no gradient for them, and every read goes
through `stop_gradient`, so even a gradient w.r.t. all variables is zero there.

The sequential (Markov / RNN) head and the confidence head live in `specjax.drafters.dspark`;
`BlockBackbone` alone is the DFlash drafter (no heads), `dspark.DSparkDrafter` adds them.
Attribute names mirror the Hugging Face / DeepSpec checkpoint names (reference §2.6).

Draft vocabulary (`draft_vocab_size` N > 0, an extension of ours: DeepSpec has none, and a config
without the field is the full vocabulary): the lm_head holds the target head's columns of the N
draft tokens, the sequential head is N wide, tokens are sampled as draft indices and proposed as
target ids, and the q handed to verification is zero outside the subset (`specjax.drafters.vocab`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.sampling import SamplingArrays, probs_from_logits, round_key, sample
from specjax.drafters import vocab as dv
from specjax.drafters.base import ContextUpdate, DraftBlock
from specjax.drafters.dims import (check_same_width, check_tap_layers, layer_config, target_dims,
                                   validate_layer_dims, validate_tap_layer_ids)
from specjax.models import cache as kvc
from specjax.models.layers import Linear, RMSNorm, gqa_attention
from specjax.models.decoder import DecoderLayer
from specjax.training.data import block_attention_mask, block_positions

Array = jax.Array
_INIT_STD = 0.02
MARKOV_HEAD_TYPES = ("vanilla", "rnn")


class Frozen(nnx.Variable):
    """A weight copied from the target and never trained (embedding, lm_head).

    Exclude it from optimizers with `wrt=nnx.Param` (it is not a Param subclass); it is still part
    of `nnx.state(model)` so checkpoints carry it.
    """


class Calibration(nnx.Variable):
    """A non-trained inference-time calibration value (e.g. STS confidence temperatures)."""


@dataclasses.dataclass(frozen=True)
class BlockDrafterConfig:
    """A DFlash / DSpark block drafter. Layer dimensions are copied from the target (reference §1).

    `target_layer_ids`: target layer ids whose raw outputs are the context taps (-1 = embedding
    output), concatenated in this order. `block_size` is gamma (slots per block = draft tokens per
    proposal). `markov_rank` 0 means no sequential head (DFlash); `markov_head_type` is "vanilla"
    (W2 W1[x_{k-1}]) or "rnn". `confidence_head_with_markov` feeds W1[x_{k-1}] to the confidence
    head as well as the backbone hidden state (needs markov_rank > 0). `draft_vocab_size` N > 0
    drafts over N of the target's tokens (module docstring); 0 = the full vocabulary.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_draft_layers: int = 5
    block_size: int = 7
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_head_with_markov: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        validate_layer_dims(self)
        dv.validate_draft_vocab_size(self.draft_vocab_size, self.vocab_size)
        for name in ("num_draft_layers", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"field '{name}' must be an integer > 0, got {v!r}")
        object.__setattr__(self, "target_layer_ids", validate_tap_layer_ids(self.target_layer_ids))
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"field 'mask_token_id' must be in [0, vocab_size={self.vocab_size}), "
                              f"got {self.mask_token_id!r}")
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ConfigError(f"field 'markov_rank' must be an integer >= 0, got {self.markov_rank!r}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"field 'markov_head_type' must be one of {MARKOV_HEAD_TYPES}, "
                              f"got {self.markov_head_type!r}")
        if self.confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ConfigError("field 'confidence_head_with_markov' needs 'markov_rank' > 0 "
                              "(set confidence_head_with_markov: false for a head-less backbone)")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def out_vocab_size(self) -> int:
        """Width of the lm_head and the sequential head's output: N, or V without a subset."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def variant(self) -> str:
        """"dspark" when a sequential or confidence head is configured, else "dflash"."""
        return "dspark" if (self.markov_rank > 0 or self.confidence_head) else "dflash"

    def layer_config(self) -> TargetConfig:
        """The Qwen3 layer config the draft decoder layers are built from."""
        return layer_config(self, self.num_draft_layers)

    @classmethod
    def from_target(cls, target: TargetConfig, *, target_layer_ids: tuple[int, ...],
                    mask_token_id: int, **overrides: Any) -> "BlockDrafterConfig":
        """Copy the layer dimensions of `target`; `overrides` set the drafter-only fields (and may
        narrow the MLP: `intermediate_size`)."""
        args = target_dims(target)
        args.update(overrides)
        cfg = cls(target_layer_ids=tuple(target_layer_ids), mask_token_id=mask_token_id, **args)
        cfg.check_target(target)
        return cfg

    def check_target(self, target: TargetConfig) -> None:
        """Raise ConfigError if this drafter cannot read `target` (dims or layer ids differ)."""
        check_same_width(self, target)
        check_tap_layers(self.target_layer_ids, target)


def default_target_layer_ids(num_layers: int, num_taps: int = 5) -> tuple[int, ...]:
    """Evenly spaced tap layers from 1 to num_layers-3 (Qwen3 36 -> (1, 9, 17, 25, 33))."""
    hi = num_layers - 3
    if num_taps < 1 or hi - 1 < num_taps - 1:
        raise ConfigError(f"cannot place {num_taps} distinct tap layers in 1..{hi} "
                          f"(target has {num_layers} layers); give target_layer_ids explicitly")
    if num_taps == 1:
        return (1,)
    return tuple(int(round(1 + k * (hi - 1) / (num_taps - 1))) for k in range(num_taps))


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
    """The target's output projection, kernel [H, V] (Linear layout), frozen; float32 logits."""

    def __init__(self, hidden: int, vocab: int, *, rngs: nnx.Rngs, dtype="float32",
                 param_dtype="float32"):
        self.dtype = jnp.dtype(dtype)
        w = _INIT_STD * jax.random.normal(rngs.params(), (hidden, vocab), jnp.float32)
        self.kernel = Frozen(w.astype(param_dtype), logical_axes=("embed", "vocab"))

    def __call__(self, h: Array) -> Array:
        w = jax.lax.stop_gradient(self.kernel[...]).astype(self.dtype)
        return jnp.dot(h.astype(self.dtype), w).astype(jnp.float32)


def copy_frozen_from_target(embed: FrozenEmbed, head: FrozenLMHead, target_model: Any,
                            vocab: "dv.DraftVocab | None" = None) -> None:
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


def attend_context_and_block(q_bthd: Array, k_ctx_bshd: Array, v_ctx_bshd: Array,
                             mask_ctx_bts: Array, k_blk_bthd: Array, v_blk_bthd: Array,
                             mask_blk_btt: Array) -> Array:
    """GQA attention over [context keys ; block keys] without concatenating K/V.

    Equal to `gqa_attention(q, concat(k_ctx, k_blk), concat(v_ctx, v_blk), concat(masks))` (same
    float32 softmax, rows with no visible key give zeros) but never copies the context cache.
    """
    b, t, nh, hd = q_bthd.shape
    nkv = k_ctx_bshd.shape[2]
    q = q_bthd.reshape(b, t, nkv, nh // nkv, hd)
    s_ctx = jnp.einsum("btkgd,bskd->bkgts", q, k_ctx_bshd, preferred_element_type=jnp.float32)
    s_blk = jnp.einsum("btkgd,bskd->bkgts", q, k_blk_bthd, preferred_element_type=jnp.float32)
    scores = jnp.concatenate([s_ctx, s_blk], axis=-1) * (hd ** -0.5)
    m = jnp.concatenate([mask_ctx_bts, mask_blk_btt], axis=-1)[:, None, None, :, :]
    scores = jnp.where(m, scores, jnp.finfo(jnp.float32).min)
    probs = jnp.where(m, jax.nn.softmax(scores, axis=-1), 0.0)
    n_ctx = k_ctx_bshd.shape[1]
    p_ctx = probs[..., :n_ctx].astype(v_ctx_bshd.dtype)
    p_blk = probs[..., n_ctx:].astype(v_blk_bthd.dtype)
    out = (jnp.einsum("bkgts,bskd->btkgd", p_ctx, v_ctx_bshd, preferred_element_type=jnp.float32)
           + jnp.einsum("bkgts,bskd->btkgd", p_blk, v_blk_bthd, preferred_element_type=jnp.float32))
    return out.reshape(b, t, nh, hd).astype(q_bthd.dtype)


class DraftDecoderLayer(DecoderLayer):
    """A Qwen3 decoder layer (same parameters and names) whose attention also sees injected context
    keys/values."""

    def context_kv(self, ctx_bsh: Array, positions_bs: Array) -> tuple[Array, Array]:
        """Normed, rotated context keys and values [B, S, nkv, hd] (same k/v projections)."""
        return self.self_attn.keys_values(ctx_bsh, positions_bs)

    def _mlp(self, x: Array, attn_bthd: Array) -> Array:
        x = x + self.self_attn.output(attn_bthd)
        return x + self.mlp(self.post_attention_layernorm(x))

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

    def cached_block(self, x_bth: Array, positions_bt: Array, k_ctx: Array, v_ctx: Array,
                     mask_ctx_bts: Array) -> Array:
        """One block per row attends to cached context K/V and to its whole block."""
        b, t, _ = x_bth.shape
        xn = self.input_layernorm(x_bth)
        q = self.self_attn.queries(xn, positions_bt)
        k_blk, v_blk = self.self_attn.keys_values(xn, positions_bt)
        full = jnp.ones((b, t, t), bool)
        attn = attend_context_and_block(q, k_ctx, v_ctx, mask_ctx_bts, k_blk.astype(k_ctx.dtype),
                                        v_blk.astype(v_ctx.dtype), full)
        return self._mlp(x_bth, attn)


class BlockBackbone(nnx.Module):
    """The DFlash drafter (block backbone, no heads); `dspark.DSparkDrafter` adds the heads.

    Protocol attributes: `gamma` (= block_size), `tap_layers` (= target_layer_ids),
    `needs_hidden` (False). State: a `specjax.models.cache.KVCache` with one entry per draft layer
    holding the normed, rotated context keys/values [slots, max_len, nkv, hd] and `lengths[slots]`.
    """

    def __init__(self, cfg: BlockDrafterConfig, *, rngs: nnx.Rngs | None = None, dtype="float32",
                 param_dtype="float32"):
        if type(self) is BlockBackbone and cfg.variant != "dflash":
            raise ConfigError("BlockBackbone has no sequential/confidence head: build "
                              "specjax.drafters.dspark.DSparkDrafter for markov_rank > 0 or "
                              "confidence_head: true")
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.gamma = cfg.block_size
        self.tap_layers = tuple(cfg.target_layer_ids)
        self.needs_hidden = False
        self.dtype = jnp.dtype(dtype)
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        lcfg = cfg.layer_config()
        h = cfg.hidden_size
        self.embed_tokens = FrozenEmbed(cfg.vocab_size, h, rngs=rngs, **kw)
        self.fc = Linear(cfg.num_taps * h, h, logical_axes=("features", "embed"), rngs=rngs, **kw)
        self.hidden_norm = RMSNorm(h, eps=cfg.rms_norm_eps, **kw)
        self.layers = nnx.List([DraftDecoderLayer(lcfg, rngs=rngs, **kw)
                                for _ in range(cfg.num_draft_layers)])
        self.norm = RMSNorm(h, eps=cfg.rms_norm_eps, **kw)
        self.lm_head = FrozenLMHead(h, cfg.out_vocab_size, rngs=rngs, **kw)
        self.draft_vocab = (dv.DraftVocab(cfg.vocab_size, cfg.draft_vocab_size)
                            if cfg.draft_vocab_size else nnx.data(None))
        # Filled in by dspark.DSparkDrafter (declared as data so a subclass may assign modules).
        self.markov_head = nnx.data(None)
        self.confidence_head = nnx.data(None)
        self.confidence_temperatures = nnx.data(None)

    # ------------------------------------------------------------------ shared pieces
    def context_features(self, taps_bsf: Array) -> Array:
        """ctx = hidden_norm(fc(taps)) [B, S, H] from concatenated target taps [B, S, L*H]."""
        want = self.config.num_taps * self.config.hidden_size
        if taps_bsf.shape[-1] != want:
            raise ValueError(f"taps last dim must be num_taps*hidden = {want}, got shape "
                             f"{taps_bsf.shape}")
        return self.hidden_norm(self.fc(taps_bsf))

    def lm_logits(self, h_xh: Array) -> Array:
        """Frozen lm_head applied to hidden [..., H] -> float32 logits [..., N] (N = V without a
        draft vocabulary; with one, the target's logits restricted to the draft tokens)."""
        return self.lm_head(h_xh)

    def draft_labels(self, labels: Array) -> Array:
        """Target-id labels -> indices into the draft logits (-1: outside the draft vocabulary)."""
        return dv.draft_labels(self.draft_vocab, labels)

    def head_bias(self, h_xkh: Array, prev_xk: Array) -> Array | None:
        """Sequential-head logit bias [..., K, N] (float32) with teacher-forced prev tokens
        (target ids)."""
        if self.markov_head is None:
            return None
        return self.markov_head.bias_sequence(h_xkh, dv.draft_index(self.draft_vocab, prev_xk))

    def draft_logits(self, h_xkh: Array, prev_xk: Array) -> Array:
        """z_k = lm_head(h_k) + head bias(prev_k): float32 [..., K, N]; chunk over leading axes."""
        z = self.lm_logits(h_xkh)
        bias = self.head_bias(h_xkh, prev_xk)
        return z if bias is None else z + bias

    def confidence_logits(self, h_xkh: Array, prev_xk: Array) -> Array | None:
        """Raw confidence logits [..., K] (float32), or None without a confidence head."""
        if self.confidence_head is None:
            return None
        extra = None
        if self.config.confidence_head_with_markov:
            extra = self.markov_head.embed_prev(dv.draft_index(self.draft_vocab, prev_xk))
        return self.confidence_head(h_xkh, extra)

    # ------------------------------------------------------------------ training
    def backbone_hidden(self, taps_bsf: Array, input_ids_bs: Array, anchors_ba: Array,
                        keep_ba: Array) -> Array:
        """Final-normed backbone hidden [B, A, K, H] for A anchor blocks per sequence.

        Block slot 0 holds ids[a] (the mask token for unkept blocks), slots 1.. the mask token;
        slot j sits at position a+j and sees context t < a and its own block (reference §2.4).
        """
        cfg = self.config
        b, s = input_ids_bs.shape
        a = anchors_ba.shape[1]
        kk = self.gamma
        if taps_bsf.shape[:2] != (b, s):
            raise ValueError(f"taps_bsf {taps_bsf.shape} must be [B, S, L*H] with B, S of "
                             f"input_ids_bs {input_ids_bs.shape}")
        if anchors_ba.shape != (b, a) or keep_ba.shape != (b, a):
            raise ValueError(f"anchors_ba {anchors_ba.shape} and keep_ba {keep_ba.shape} must be "
                             f"[B={b}, A]")
        ctx = self.context_features(taps_bsf)
        anchor_tok = jnp.take_along_axis(input_ids_bs, jnp.clip(anchors_ba, 0, s - 1), axis=1)
        slot0 = jnp.where(keep_ba, anchor_tok, cfg.mask_token_id)
        ids_bak = jnp.concatenate(
            [slot0[..., None].astype(jnp.int32),
             jnp.full((b, a, kk - 1), cfg.mask_token_id, jnp.int32)], axis=-1)
        x = self.embed_tokens(ids_bak.reshape(b, a * kk))
        pos_blk = jnp.asarray(block_positions(anchors_ba, kk), jnp.int32).reshape(b, a * kk)
        pos_ctx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        mask = block_attention_mask(anchors_ba, keep_ba, s, kk)
        for layer in self.layers:
            x = layer.train_block(x, pos_blk, ctx, pos_ctx, mask)
        return self.norm(x).reshape(b, a, kk, -1)

    def teacher_prev_tokens(self, input_ids_bs: Array, anchors_ba: Array) -> Array:
        """Teacher-forced previous tokens [B, A, K]: [ids[a], ids[a+1], .., ids[a+K-1]] (clamped)."""
        s = input_ids_bs.shape[1]
        idx = anchors_ba[..., None] + jnp.arange(self.gamma, dtype=jnp.int32)
        idx = jnp.clip(idx, 0, s - 1)
        b, a, kk = idx.shape
        return jnp.take_along_axis(input_ids_bs, idx.reshape(b, a * kk), axis=1).reshape(b, a, kk)

    def train_forward(self, taps_bsf: Array, input_ids_bs: Array, anchors_ba: Array,
                      keep_ba: Array, prev_tokens_bak: Array | None = None,
                      *, with_logits: bool = True
                      ) -> tuple[Array, Array | None, Array | None]:
        """Training forward over A anchors per sequence.

        Returns (hidden [B,A,K,H], logits [B,A,K,N] float32 or None if not `with_logits`,
        confidence logits [B,A,K] float32 or None). `prev_tokens_bak` defaults to the teacher-forced
        [anchor, labels[..., :K-1]] (labels[j] = ids[a+j+1]); with `with_logits=False` a trainer can
        compute `draft_logits(h, prev)` itself in chunks over anchors.
        """
        h = self.backbone_hidden(taps_bsf, input_ids_bs, anchors_ba, keep_ba)
        prev = prev_tokens_bak if prev_tokens_bak is not None else \
            self.teacher_prev_tokens(input_ids_bs, anchors_ba)
        logits = self.draft_logits(h, prev) if with_logits else None
        return h, logits, self.confidence_logits(h, prev)

    # ------------------------------------------------------------------ inference
    def init_state(self, slots: int, max_len: int) -> kvc.KVCache:
        """Empty per-layer context K/V caches [slots, max_len, nkv, hd] and lengths [slots]."""
        cfg = self.config
        return kvc.KVCache.init(num_layers=cfg.num_draft_layers, slots=slots, max_len=max_len,
                                kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                dtype=self.dtype)

    def commit(self, state: kvc.KVCache, update: ContextUpdate) -> kvc.KVCache:
        """Append the context K/V of update rows [0:B] at each row's length (write, then mask)."""
        if update.taps is None:
            raise ValueError("block drafter commit needs update.taps (target hidden taps at "
                             f"layers {self.tap_layers})")
        b, t = update.tokens.shape
        if update.taps.shape[:2] != (b, t):
            raise ValueError(f"update.taps {update.taps.shape} must be [B={b}, T={t}, L*H]")
        lengths = state.lengths[:b]
        ctx = self.context_features(update.taps)
        pos = update.positions.astype(jnp.int32)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            k, v = layer.context_kv(ctx, pos)
            ks.append(kvc.write(state.k[i], k, lengths))
            vs.append(kvc.write(state.v[i], v, lengths))
        n = jnp.clip(update.n_valid.astype(jnp.int32), 0, t)
        return kvc.KVCache(k=tuple(ks), v=tuple(vs), lengths=state.lengths.at[:b].add(n))

    def block_hidden(self, state: kvc.KVCache, anchor_b: Array, position_b: Array) -> Array:
        """Backbone hidden [B, K, H] of one block per row over its cached context."""
        b = anchor_b.shape[0]
        kk = self.gamma
        lengths = state.lengths[:b]
        ids = jnp.concatenate([anchor_b.astype(jnp.int32)[:, None],
                               jnp.full((b, kk - 1), self.config.mask_token_id, jnp.int32)], axis=1)
        x = self.embed_tokens(ids)
        pos = position_b.astype(jnp.int32)[:, None] + jnp.arange(kk, dtype=jnp.int32)[None, :]
        m = state.max_len
        mask_ctx = jnp.arange(m, dtype=jnp.int32)[None, None, :] < lengths[:, None, None]
        mask_ctx = jnp.broadcast_to(mask_ctx, (b, kk, m))
        for i, layer in enumerate(self.layers):
            x = layer.cached_block(x, pos, state.k[i][:b], state.v[i][:b], mask_ctx)
        return self.norm(x)

    def propose_with_logits(self, state: kvc.KVCache, anchor_b: Array, position_b: Array,
                            sampling: SamplingArrays, key_b: Array) -> tuple[DraftBlock, Array]:
        """`propose`, also returning the draft logits z [B, K, V] (float32) the q came from
        (-inf outside a draft vocabulary)."""
        b = anchor_b.shape[0]
        vocab = self.draft_vocab
        h = self.block_hidden(state, anchor_b, position_b)  # [B, K, H]
        u = self.lm_logits(h)  # [B, K, N]
        head = self.markov_head
        carry0 = (head.init_carry((b,), h.dtype) if head is not None else None,
                  dv.draft_index(vocab, anchor_b))

        def step(carry, xs):
            head_carry, prev_b = carry  # prev_b: draft index of the previous token
            k, u_bn, h_bh = xs
            z = u_bn
            if head is not None:
                head_carry, bias = head.step(head_carry, h_bh, prev_b)
                z = z + bias
            q = probs_from_logits(z, sampling)
            d = sample(round_key(key_b, k), q)  # a draft index
            return (head_carry, d), (d, q, z)

        xs = (jnp.arange(self.gamma, dtype=jnp.int32), jnp.swapaxes(u, 0, 1), jnp.swapaxes(h, 0, 1))
        _, (d_kb, q_kbn, z_kbn) = jax.lax.scan(step, carry0, xs)
        tokens = dv.target_ids(vocab, jnp.swapaxes(d_kb, 0, 1))
        conf = None
        if self.confidence_head is not None:
            prev = jnp.concatenate([anchor_b.astype(jnp.int32)[:, None], tokens[:, :-1]], axis=1)
            c_logit = self.confidence_logits(h, prev)
            temps = self.confidence_temperatures[...].astype(jnp.float32)
            conf = jax.nn.sigmoid(c_logit / temps[None, :])
        q = dv.full_probs(vocab, jnp.swapaxes(q_kbn, 0, 1))
        block = DraftBlock(tokens=tokens, q=q, confidence=conf)
        return block, dv.full_logits(vocab, jnp.swapaxes(z_kbn, 0, 1))

    def propose(self, state: kvc.KVCache, anchor_b: Array, position_b: Array,
                sampling: SamplingArrays, key_b: Array) -> DraftBlock:
        """Propose gamma tokens per row [0:B]: the anchor at position_b sees cached context
        j < lengths[b]; tokens are sampled left to right from q = probs_from_logits(z_k)."""
        return self.propose_with_logits(state, anchor_b, position_b, sampling, key_b)[0]


__all__ = ["BlockBackbone", "BlockDrafterConfig", "Calibration", "DraftDecoderLayer", "Frozen",
           "FrozenEmbed", "FrozenLMHead", "attend_context_and_block", "copy_frozen_from_target",
           "copy_output_norm_from_target", "default_target_layer_ids"]
