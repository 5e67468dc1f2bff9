"""DSpark / DFlash block drafters (reference §2, §3): a parallel drafter over the target's hidden
taps, with an optional sequential head and confidence head.

Context features `ctx = hidden_norm(fc(concat_l taps_l))` are injected into every draft layer as
extra keys/values (projected by the layer's own k_proj/v_proj/k_norm, rotated at the context
positions). A block of `gamma` inputs (the anchor + gamma-1 mask tokens, slot j at position a+j)
attends to the context strictly before the anchor and to its own block bidirectionally, and yields
gamma logits: slot j predicts the token at a+j+1 (anchor as first prediction, reference §3.1). The
sequential (Markov / RNN) head adds a logit bias from the previous token, the confidence head a
per-slot acceptance logit (`specjax.drafters.dspark_layers`). DFlash is this drafter with neither
head (markov_rank 0, no confidence head).

The same module trains (`train_forward`: A anchors per sequence in one call, block-sparse mask,
`specjax.drafters.block_layout`) and serves (the `Drafter` protocol of `specjax.drafters.base`: a
per-slot context K/V cache that `commit` appends to and `propose` reads). Embedding and lm_head
are frozen copies of the target's (`specjax.drafters.common.Frozen`). Attribute names mirror the
Hugging Face / DeepSpec checkpoint names (reference §2.6); the checkpoint format, the training
section and the objective of the kind are in `specjax.drafters.dspark_kind`.

Previous tokens: teacher-forced in training (prev = [anchor, labels[:K-1]]), the sampled draft
tokens at inference (prev = [anchor, sampled[:-1]]).

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
import numpy as np
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.drafters import vocab as dv
from specjax.drafters.base import ContextUpdate, DraftBlock
from specjax.drafters.block_layout import block_attention_mask, block_positions
from specjax.drafters.common import Calibration, FrozenEmbed, FrozenLMHead, TapDims, copy_frozen_from_target
from specjax.drafters.drafting import DraftGuide, Draw, draft_loop, loop_q, step_outputs
from specjax.drafters.dspark_layers import ConfidenceHead, DraftDecoderLayer, MarkovHead, RNNHead
from specjax.models import cache as kvc
from specjax.models.layers import Linear, RMSNorm
from specjax.models.pallas_attention import ATTENTION_IMPLEMENTATIONS
from specjax.models.pallas_mlp import MLP_IMPLEMENTATIONS
from specjax.sampling import SamplingArrays

Array = jax.Array
MARKOV_HEAD_TYPES = ("vanilla", "rnn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockDrafterConfig(TapDims):
    """A DFlash / DSpark block drafter (the layer dimensions and `target_layer_ids` of `TapDims`).

    `block_size` is gamma (slots per block = draft tokens per proposal). `markov_rank` 0 means no
    sequential head (DFlash); `markov_head_type` is "vanilla" (W2 W1[x_{k-1}]) or "rnn".
    `confidence_head_with_markov` feeds W1[x_{k-1}] to the confidence head as well as the backbone
    hidden state (needs markov_rank > 0).
    """

    mask_token_id: int
    num_draft_layers: int = 5
    block_size: int = 7
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_head_with_markov: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_draft_layers", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"field '{name}' must be an integer > 0, got {v!r}")
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
    def variant(self) -> str:
        """"dspark" when a sequential or confidence head is configured, else "dflash"."""
        return "dspark" if (self.markov_rank > 0 or self.confidence_head) else "dflash"

    def layer_config(self, num_layers: int | None = None) -> TargetConfig:
        """The Qwen3 layer config the draft decoder layers are built from."""
        return super().layer_config(num_layers or self.num_draft_layers)


class DSparkDrafter(nnx.Module):
    """The DSpark drafter: block backbone + optional sequential head (`markov_head`) + optional
    `confidence_head`. With markov_rank 0 and no confidence head it is the DFlash drafter.

    Protocol attributes: `gamma` (= block_size), `tap_layers` (= target_layer_ids),
    `needs_hidden` (False), `has_confidence` (a confidence head), `attention_implementations`,
    `mlp_implementations`. State: a
    `specjax.models.cache.KVCache` with one entry per draft layer holding the normed, rotated
    context keys/values [2, slots, nkv, max_len, hd] and `lengths[slots]`.
    """

    attention_implementations = ATTENTION_IMPLEMENTATIONS  # its context attention: XLA's ops or the kernel
    mlp_implementations = MLP_IMPLEMENTATIONS  # its layers' gate/up products and SiLU gate: XLA's ops or the kernel

    def __init__(self, cfg: BlockDrafterConfig, *, rngs: nnx.Rngs | None = None, dtype="float32",
                 param_dtype="float32"):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.gamma = cfg.block_size
        self.tap_layers = tuple(cfg.target_layer_ids)
        self.needs_hidden = False
        self.dtype = jnp.dtype(dtype)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        h = cfg.hidden_size
        self.embed_tokens = FrozenEmbed(cfg.vocab_size, h, **kw)
        self.fc = Linear(cfg.num_taps * h, h, logical_axes=("features", "embed"), **kw)
        self.hidden_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.layers = nnx.List([DraftDecoderLayer(cfg.layer_config(), **kw)
                                for _ in range(cfg.num_draft_layers)])
        self.norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.lm_head = FrozenLMHead(h, cfg.out_vocab_size, **kw)
        self.draft_vocab = (dv.DraftVocab(cfg.vocab_size, cfg.draft_vocab_size)
                            if cfg.draft_vocab_size else nnx.data(None))
        self.markov_head = nnx.data(None)
        if cfg.markov_rank > 0:
            n = cfg.draft_vocab_size
            rows = n + 1 if n else cfg.vocab_size  # + the "outside the draft vocabulary" row
            head_cls = MarkovHead if cfg.markov_head_type == "vanilla" else RNNHead
            extra = () if head_cls is MarkovHead else (h,)
            self.markov_head = head_cls(rows, cfg.markov_rank, *extra, out_vocab=cfg.out_vocab_size,
                                        **kw)
        self.confidence_head = nnx.data(None)
        self.confidence_temperatures = nnx.data(None)
        if cfg.confidence_head:
            width = h + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(width, **kw)
            self.confidence_temperatures = Calibration(jnp.ones((cfg.block_size,), jnp.float32),
                                                       logical_axes=(None,))

    @property
    def has_confidence(self) -> bool:
        return self.confidence_head is not None

    def set_confidence_temperatures(self, temps) -> None:
        """Set the STS temperatures [gamma] (finite, > 0) that divide confidence logits at inference."""
        if self.confidence_head is None:
            raise ValueError("this drafter has no confidence head (confidence_head: false)")
        t = np.asarray(temps, np.float32)
        if t.shape != (self.gamma,) or not np.all(np.isfinite(t)) or np.any(t <= 0):
            raise ValueError(f"confidence_temperatures must be [{self.gamma}] finite values > 0, "
                             f"got {temps!r}")
        self.confidence_temperatures[...] = jnp.asarray(t)

    # ------------------------------------------------------------------ shared pieces
    def context_features(self, taps_bsf: Array) -> Array:
        """ctx = hidden_norm(fc(taps)) [B, S, H] from concatenated target taps [B, S, L*H]."""
        want = self.config.num_taps * self.config.hidden_size
        if taps_bsf.shape[-1] != want:
            raise ValueError(f"taps last dim must be num_taps*hidden = {want}, got shape "
                             f"{taps_bsf.shape}")
        return self.hidden_norm(self.fc(taps_bsf))

    def lm_logits(self, h_xh: Array, out_dtype: Any = jnp.float32) -> Array:
        """Frozen lm_head applied to hidden [..., H] -> logits [..., N] in `out_dtype` (N = V without
        a draft vocabulary; with one, the target's logits restricted to the draft tokens)."""
        return self.lm_head(h_xh, out_dtype)

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
        """Empty per-layer context key/value caches [2, slots, nkv, max_len, hd] and lengths [slots]."""
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
        kvs = tuple(kvc.write_kv(state.kv[i], *layer.context_kv(ctx, pos), lengths)
                    for i, layer in enumerate(self.layers))
        n = jnp.clip(update.n_valid.astype(jnp.int32), 0, t)
        return kvc.KVCache(kv=kvs, lengths=state.lengths.at[:b].add(n))

    def restart(self, state: kvc.KVCache, start_b: Array) -> kvc.KVCache:
        """Rows [0:B] cut back to the context of their first start_b positions (prefix caching)."""
        return kvc.cut_rows(state, start_b)

    def block_hidden(self, state: kvc.KVCache, anchor_b: Array, position_b: Array,
                     kv_len: int | None = None, attention: str = "xla", mlp: str = "xla") -> Array:
        """Backbone hidden [B, K, H] of one block per row over its cached context (rows [0:kv_len)
        of it when given: `Drafter.propose`), its attention and MLP with XLA's ops or the Pallas
        kernels (`attention`, `mlp`: `DraftDecoderLayer.cached_block`)."""
        b = anchor_b.shape[0]
        kk = self.gamma
        ids = jnp.concatenate([anchor_b.astype(jnp.int32)[:, None],
                               jnp.full((b, kk - 1), self.config.mask_token_id, jnp.int32)], axis=1)
        x = self.embed_tokens(ids)
        pos = position_b.astype(jnp.int32)[:, None] + jnp.arange(kk, dtype=jnp.int32)[None, :]
        for i, layer in enumerate(self.layers):
            x = layer.cached_block(x, pos, state.kv[i], state.lengths[:b], kv_len, attention, mlp)
        return self.norm(x)

    def propose_with_logits(self, state: kvc.KVCache, anchor_b: Array, position_b: Array,
                            sampling: SamplingArrays, key_b: Array, kv_len: int | None = None,
                            attention: str = "xla", mlp: str = "xla") -> tuple[DraftBlock, Array]:
        """`propose`, also returning the draft logits z [B, K, V] (float32) the q came from
        (-inf outside a draft vocabulary)."""
        return self._draft(state, anchor_b, position_b, sampling, key_b, kv_len, attention, mlp, None,
                           with_logits=True)

    def propose(self, state: kvc.KVCache, anchor_b: Array, position_b: Array, sampling: SamplingArrays,
                key_b: Array, kv_len: int | None = None, attention: str = "xla", mlp: str = "xla",
                guide: DraftGuide | None = None) -> DraftBlock:
        """Propose gamma tokens per row [0:B]: the anchor at position_b sees cached context
        j < lengths[b] (read from rows [0:kv_len) when given; its attention in XLA's ops or, with
        `attention` "pallas", one kernel per layer; likewise its MLP's gate with `mlp`); tokens are
        sampled left to right from q = draft_probs(z_k) (probs_from_logits in the drafter's dtype), under
        the rows' automata with a `guide` (`drafting.draft_loop`)."""
        return self._draft(state, anchor_b, position_b, sampling, key_b, kv_len, attention, mlp, guide,
                           with_logits=False)[0]

    def _draft(self, state: kvc.KVCache, anchor_b: Array, position_b: Array, sampling: SamplingArrays,
               key_b: Array, kv_len: int | None, attention: str, mlp: str, guide: DraftGuide | None, *,
               with_logits: bool) -> tuple[DraftBlock, Array | None]:
        b = anchor_b.shape[0]
        vocab = self.draft_vocab
        h = self.block_hidden(state, anchor_b, position_b, kv_len, attention, mlp)  # [B, K, H]
        u = self.lm_logits(h, self.dtype)  # [B, K, N] in the compute dtype, float32 a step at a time
        head = self.markov_head
        carry0 = (head.init_carry((b,), h.dtype) if head is not None else None, dv.draft_index(vocab, anchor_b))

        def step(k: Array, carry: tuple, draw: Draw) -> tuple[tuple, Array, dict[str, Array]]:
            head_carry, prev_b = carry  # prev_b: draft index of the previous token
            z = jax.lax.dynamic_index_in_dim(u, k, axis=1, keepdims=False).astype(jnp.float32)
            if head is not None:
                head_carry, bias = head.step(head_carry, jax.lax.dynamic_index_in_dim(h, k, axis=1, keepdims=False),
                                             prev_b)
                z = z + bias
            d, q = draw(z)  # d: a draft index
            return (head_carry, d), d, step_outputs(q, z, with_logits)

        _, d_bk, outs = draft_loop(step, carry0, self.gamma, sampling, key_b, self.dtype, guide,
                                   None if vocab is None else vocab.d2t[...])
        q_bkn = loop_q(outs, d_bk, u.shape[-1], self.dtype)
        tokens = dv.target_ids(vocab, d_bk)
        conf = None
        if self.confidence_head is not None:
            prev = jnp.concatenate([anchor_b.astype(jnp.int32)[:, None], tokens[:, :-1]], axis=1)
            c_logit = self.confidence_logits(h, prev)
            temps = self.confidence_temperatures[...].astype(jnp.float32)
            conf = jax.nn.sigmoid(c_logit / temps[None, :])
        block = DraftBlock(tokens=tokens, q=dv.full_probs(vocab, q_bkn), confidence=conf,
                           q_draft=None if vocab is None else q_bkn)
        return block, (dv.full_logits(vocab, outs["z"]) if with_logits else None)


def make_block_drafter(target_model, target_config: TargetConfig, cfg: BlockDrafterConfig,
                       rngs: nnx.Rngs | None = None, *, dtype="float32", param_dtype="float32",
                       draft_ids=None) -> DSparkDrafter:
    """Build a DSpark/DFlash drafter and copy the target's embedding and lm_head into its frozen
    copies (a tied target's lm_head is its embedding transposed). `draft_ids`: the target ids of
    the draft vocabulary ([draft_vocab_size], e.g. from `vocab.build_draft_vocab`), required
    exactly when cfg.draft_vocab_size > 0."""
    cfg.check_target(target_config)
    drafter = DSparkDrafter(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    dv.install_draft_vocab(drafter, cfg.draft_vocab_size, draft_ids)
    copy_frozen_from_target(drafter.embed_tokens, drafter.lm_head, target_model,
                            drafter.draft_vocab)
    return drafter


__all__ = ["BlockDrafterConfig", "DSparkDrafter", "MARKOV_HEAD_TYPES", "make_block_drafter"]
