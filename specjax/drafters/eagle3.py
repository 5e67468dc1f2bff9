"""Eagle3 drafter (reference §4): one decoder layer over fused target features, trained with TTT.

Architecture. Target hidden taps (concatenated in `target_layer_ids` order, width L*H) are fused by
`fc` (L*H -> H, no bias, no norm after it) into g. The single decoder layer (`midlayer`) takes
`[input_layernorm(embed(x)) ; hidden_norm(g)]` (2H wide) into its q/k/v projections (per-head q/k
RMSNorm, RoPE, causal GQA attention); the residual stream is the un-normed g; then the usual
post-attention norm + SwiGLU. Logits are `lm_head(norm(out))`: `norm` is trainable, `embed_tokens`
and `lm_head` are frozen full-vocabulary copies of the target's (`block.Frozen` variables, read
through `stop_gradient`; an optimizer built with `wrt=nnx.Param` never sees them).

Pairs. Position j of the draft sequence pairs the feature of position j with the NEXT token
x_{j+1} and sits at RoPE position j. At training step k (training-time test) the feature is the
draft's own layer output of step k-1 (H wide, before the final norm) and the token is x_{j+k+1}.

Inference state (`PairCacheState`): the K/V of the committed pairs (write, then mask) plus the
feature of the last committed position, which still waits for its next token: a commit receives
tokens at positions P..P+n-1 with their taps, pairs the pending feature of P-1 with the token at P,
the feature of P+i with the token at P+i+1, and keeps the feature of P+n-1 pending; the next
proposal pairs it with the anchor. `propose` runs gamma steps: step 0 = (pending feature, anchor) at
position anchor-1, step k = (own output of step k-1, draft token k) at anchor-1+k; every step attends
to the committed pairs and to the earlier steps of this proposal (kept in a small per-call K/V
buffer of gamma entries, which is what writing past the committed length and masking would give,
without copying the context cache).

Checkpoint names (Eagle3 convention of the EAGLE3/SpecForge release format, which DeepSpec's
Eagle3 trainer adapts; DeepSpec's own Qwen3 Eagle3 modeling file was not available to check):
`fc.weight [H, L*H]`, `midlayer.hidden_norm.weight`, `midlayer.input_layernorm.weight`,
`midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]`, `midlayer.self_attn.o_proj.weight`,
`midlayer.self_attn.{q_norm,k_norm}.weight`, `midlayer.post_attention_layernorm.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight`, `embed_tokens.weight`.
Our NNX attribute paths are exactly these module paths (Linear `kernel` <-> HF `weight`).

`PairCacheDrafter` (the pending-feature cache, propose loop and step-0 training forward) is shared
with `specjax.drafters.mtp.MTPDrafter`.

Draft vocabulary (`draft_vocab_size` N > 0, EAGLE-3's reduced vocabulary): `lm_head` holds the
target head's columns of the N draft tokens; each step samples a draft index, feeds the target id
`d2t[index]` to the next step and hands verification q scattered into the full vocabulary (zero
elsewhere). The maps are stored as EAGLE-3's `d2t` / `t2d` tensors (`specjax.drafters.vocab`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.sampling import SamplingArrays, probs_from_logits, round_key, sample
from specjax.drafters import vocab as dv
from specjax.drafters.base import ContextUpdate, DraftBlock
from specjax.drafters.dims import (check_same_width, check_tap_layers, layer_config, target_dims,
                                   validate_layer_dims, validate_tap_layer_ids)
from specjax.drafters.block import (Frozen, FrozenEmbed, FrozenLMHead, attend_context_and_block,
                                    copy_frozen_from_target)
from specjax.models import cache as kvc
from specjax.models.layers import Linear, RMSNorm, SwiGLU, gqa_attention
from specjax.models.decoder import Attention

Array = jax.Array

@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """An Eagle3 drafter. `gamma`: tokens proposed per round; `ttt_length`: training unroll."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: tuple[int, ...]
    gamma: int = 7
    ttt_length: int = 7
    step_loss_decay: float = 0.8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    draft_vocab_size: int = 0  # N > 0: draft over N target tokens (EAGLE-3 d2t/t2d); 0 = all

    def __post_init__(self) -> None:
        validate_layer_dims(self)
        dv.validate_draft_vocab_size(self.draft_vocab_size, self.vocab_size)
        object.__setattr__(self, "target_layer_ids", validate_tap_layer_ids(self.target_layer_ids))
        for name in ("gamma", "ttt_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"field '{name}' must be an integer >= 1, got {v!r}")
        if not 0.0 < self.step_loss_decay <= 1.0:
            raise ConfigError(f"field 'step_loss_decay' must be in (0, 1], got {self.step_loss_decay}")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def out_vocab_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_target(cls, target: TargetConfig, *, target_layer_ids: tuple[int, ...],
                    **overrides: Any) -> "Eagle3Config":
        """Copy the layer dimensions of `target`; `overrides` set the other fields."""
        args = target_dims(target)
        args.update(overrides)
        cfg = cls(target_layer_ids=tuple(target_layer_ids), **args)
        cfg.check_target(target)
        return cfg

    def check_target(self, target: TargetConfig) -> None:
        """Raise ConfigError if this drafter cannot read `target` (widths or layer ids differ)."""
        check_same_width(self, target)
        check_tap_layers(self.target_layer_ids, target)


# ------------------------------------------------------------------------------------------------
# the pending-feature pair cache (shared with MTP)


class PairCacheState(NamedTuple):
    """Per-slot drafter state; every leaf has a leading `slots` axis."""

    k: Array  # [slots, max_len, nkv, hd] normed, rotated keys of committed pairs
    v: Array  # [slots, max_len, nkv, hd]
    lengths: Array  # [slots] int32: committed pairs (= position of the pending feature)
    pending: Array  # [slots, H] feature of the last committed position (awaits its next token)
    has_pending: Array  # [slots] bool


def shift_left(ids_bs: Array, k: int, fill: int = 0) -> Array:
    """ids[:, t + k] at t (`fill` past the end)."""
    s = ids_bs.shape[1]
    if k >= s:
        return jnp.full_like(ids_bs, fill)
    pad = jnp.full((ids_bs.shape[0], k), fill, ids_bs.dtype)
    return jnp.concatenate([ids_bs[:, k:], pad], axis=1)


def attend_causal_plus_diagonal(q_bthd: Array, k0_bthd: Array, v0_bthd: Array,
                                kd: list[Array], vd: list[Array]) -> Array:
    """TTT attention: query t sees step-0 keys <= t and, in each later step's chunk, the key at t.

    q/k0/v0 [B, T, heads, hd]; kd/vd: one [B, T, nkv, hd] per later step (the diagonal keys).
    Float32 softmax over all visible keys jointly (the same as a dense mask over the concatenated
    chunks, without materialising it).
    """
    b, t, nh, hd = q_bthd.shape
    nkv = k0_bthd.shape[2]
    q = q_bthd.reshape(b, t, nkv, nh // nkv, hd)
    s0 = jnp.einsum("btkgd,bskd->bkgts", q, k0_bthd, preferred_element_type=jnp.float32)
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    s0 = jnp.where(causal, s0, jnp.finfo(jnp.float32).min)
    parts = [s0]
    for kj in kd:
        parts.append(jnp.einsum("btkgd,btkd->bkgt", q, kj, preferred_element_type=jnp.float32)[..., None])
    scores = jnp.concatenate(parts, axis=-1) * (hd ** -0.5)
    probs = jax.nn.softmax(scores, axis=-1)
    p0 = jnp.where(causal, probs[..., :t], 0.0).astype(v0_bthd.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p0, v0_bthd, preferred_element_type=jnp.float32)
    for j, vj in enumerate(vd):
        pj = jnp.moveaxis(probs[..., t + j], 3, 1)  # [B, T, nkv, g]
        out = out + pj[..., None] * vj[:, :, :, None, :].astype(jnp.float32)
    return out.reshape(b, t, nh, hd).astype(q_bthd.dtype)


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
        """Empty pair cache [slots, max_len, nkv, hd], no pending feature."""
        shape = (slots, max_len, self.num_kv_heads, self.head_dim)
        return PairCacheState(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype),
                              lengths=jnp.zeros((slots,), jnp.int32),
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
        new_k = kvc.write(state.k, k, lengths)
        new_v = kvc.write(state.v, v, lengths)
        last = jnp.take_along_axis(feats, jnp.clip(n - 1, 0, t - 1)[:, None, None], axis=1)[:, 0]
        pending = jnp.where((n > 0)[:, None], last, state.pending[:b])
        return PairCacheState(k=new_k, v=new_v, lengths=state.lengths.at[:b].add(n_pairs),
                              pending=state.pending.at[:b].set(pending),
                              has_pending=state.has_pending.at[:b].set(has | (n > 0)))

    def propose_with_logits(self, state: PairCacheState, anchor_b: Array, position_b: Array,
                            sampling: SamplingArrays, key_b: Array) -> tuple[DraftBlock, Array]:
        """`propose`, also returning the draft logits [B, gamma, V] (float32) each q came from
        (-inf outside a draft vocabulary)."""
        b = anchor_b.shape[0]
        vocab = self.draft_vocab
        g = self.gamma
        lengths = state.lengths[:b]
        k_ctx, v_ctx = state.k[:b], state.v[:b]
        m = k_ctx.shape[1]
        mask_ctx = (jnp.arange(m, dtype=jnp.int32)[None, :] < lengths[:, None])[:, None, :]  # [B,1,M]
        base_pos = position_b.astype(jnp.int32) - 1  # the pending feature's position
        attn = self._attention()
        buf = jnp.zeros((b, g, self.num_kv_heads, self.head_dim), k_ctx.dtype)

        def step(carry, k):
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
            q_bn = probs_from_logits(z, sampling)
            nxt = dv.target_ids(vocab, sample(round_key(key_b, k), q_bn))
            return (out[:, 0].astype(feat_bh.dtype), nxt, dk, dv_), (nxt, q_bn, z)

        carry0 = (state.pending[:b], anchor_b.astype(jnp.int32), buf, buf)
        _, (tok_gb, q_gbn, z_gbn) = jax.lax.scan(step, carry0, jnp.arange(g, dtype=jnp.int32))
        block = DraftBlock(tokens=jnp.swapaxes(tok_gb, 0, 1),
                           q=dv.full_probs(vocab, jnp.swapaxes(q_gbn, 0, 1)), confidence=None)
        return block, dv.full_logits(vocab, jnp.swapaxes(z_gbn, 0, 1))

    def propose(self, state: PairCacheState, anchor_b: Array, position_b: Array,
                sampling: SamplingArrays, key_b: Array) -> DraftBlock:
        """Propose gamma tokens for rows [0:B] (anchor at position_b), sampled from the q returned."""
        return self.propose_with_logits(state, anchor_b, position_b, sampling, key_b)[0]


# ------------------------------------------------------------------------------------------------
# Eagle3


class Eagle3Attention(Attention):
    """Qwen3 attention whose q/k/v projections read the 2H-wide [embedding ; feature] input."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        super().__init__(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        h2, nh, nkv, hd = 2 * cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(h2, nh * hd, logical_axes=("embed", "q_heads"), **kw)
        self.k_proj = Linear(h2, nkv * hd, logical_axes=("embed", "kv_heads"), **kw)
        self.v_proj = Linear(h2, nkv * hd, logical_axes=("embed", "kv_heads"), **kw)


class Eagle3DecoderLayer(nnx.Module):
    """The Eagle3 `midlayer`: attention over [input_layernorm(emb) ; hidden_norm(g)], residual g."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32"):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
        self.self_attn = Eagle3Attention(cfg, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, **kw)

    def attn_input(self, emb_bth: Array, g_bth: Array) -> tuple[Array, Array]:
        """(2H attention input, residual g)."""
        x = jnp.concatenate([self.input_layernorm(emb_bth), self.hidden_norm(g_bth)], axis=-1)
        return x, g_bth

    def finish(self, residual_bth: Array, attn_bthd: Array) -> Array:
        x = residual_bth + self.self_attn.output(attn_bthd)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(PairCacheDrafter):
    """Eagle3 (reference §4) with the `Drafter` protocol; see the module docstring.

    Protocol attributes: `gamma`, `tap_layers` (= target_layer_ids), `needs_hidden` (False).
    """

    def __init__(self, cfg: Eagle3Config, *, rngs: nnx.Rngs | None = None, dtype="float32",
                 param_dtype="float32"):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.gamma = cfg.gamma
        self.tap_layers = tuple(cfg.target_layer_ids)
        self.needs_hidden = False
        self.hidden_size = cfg.hidden_size
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.dtype = jnp.dtype(dtype)
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        h = cfg.hidden_size
        self.embed_tokens = FrozenEmbed(cfg.vocab_size, h, rngs=rngs, **kw)
        self.fc = Linear(cfg.num_taps * h, h, logical_axes=("features", "embed"), rngs=rngs, **kw)
        self.midlayer = Eagle3DecoderLayer(layer_config(cfg), rngs=rngs, **kw)
        self.norm = RMSNorm(h, eps=cfg.rms_norm_eps, **kw)
        self.lm_head = FrozenLMHead(h, cfg.out_vocab_size, rngs=rngs, **kw)
        self.draft_vocab = (dv.DraftVocab(cfg.vocab_size, cfg.draft_vocab_size)
                            if cfg.draft_vocab_size else nnx.data(None))

    # hooks -------------------------------------------------------------------------------------
    def fused_features(self, taps_bsf: Array) -> Array:
        """g = fc(taps) [B, S, H] from concatenated target taps [B, S, L*H] (no norm)."""
        want = self.config.num_taps * self.config.hidden_size
        if taps_bsf.shape[-1] != want:
            raise ValueError(f"taps last dim must be num_taps*hidden = {want}, got shape "
                             f"{taps_bsf.shape}")
        return self.fc(taps_bsf)

    def _features(self, update: ContextUpdate) -> Array:
        if update.taps is None:
            raise ValueError(f"Eagle3 commit needs update.taps (target hidden taps at layers "
                             f"{self.tap_layers})")
        return self.fused_features(update.taps)

    def _attn_input(self, feat_bth: Array, tok_bt: Array) -> tuple[Array, Array]:
        return self.midlayer.attn_input(self.embed_tokens(tok_bt), feat_bth)

    def _attention(self) -> Attention:
        return self.midlayer.self_attn

    def _finish(self, residual_bth: Array, attn_bthd: Array) -> Array:
        return self.midlayer.finish(residual_bth, attn_bthd)

    def _logits(self, out_xh: Array) -> Array:
        return self.lm_head(self.norm(out_xh))

    # training ----------------------------------------------------------------------------------
    def ttt_hidden(self, taps_bsf: Array, input_ids_bs: Array, horizon: int | None = None) -> Array:
        """Training-time-test layer outputs [K, B, S, H] (before the final norm), K = horizon.

        Step k at row t pairs the step k-1 output at t (step 0: fused features g_t) with token
        ids[t+k+1] (0 past the end) at RoPE position t+k; query t sees step-0 keys <= t and, in
        every later step's chunk, only the key at t. Step k at row t predicts ids[t+k+2].
        """
        k_steps = self.config.ttt_length if horizon is None else int(horizon)
        b, s = input_ids_bs.shape
        if k_steps < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        if taps_bsf.shape[:2] != (b, s):
            raise ValueError(f"taps_bsf {taps_bsf.shape} must be [B, S, L*H] with B, S of "
                             f"input_ids_bs {input_ids_bs.shape}")
        ids = input_ids_bs.astype(jnp.int32)
        attn = self.midlayer.self_attn
        h = self.fused_features(taps_bsf)
        ar = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        k0 = v0 = None
        kd: list[Array] = []
        vd: list[Array] = []
        outs = []
        for k in range(k_steps):
            x_in, res = self.midlayer.attn_input(self.embed_tokens(shift_left(ids, k + 1)), h)
            pos = ar + k
            q = attn.queries(x_in, pos)
            kk, vv = attn.keys_values(x_in, pos)
            if k == 0:
                k0, v0 = kk, vv
            else:
                kd.append(kk)
                vd.append(vv)
            a = attend_causal_plus_diagonal(q, k0, v0, kd, vd)
            h = self.midlayer.finish(res, a)
            outs.append(h)
        return jnp.stack(outs, axis=0)

    def ttt_forward(self, taps_bsf: Array, input_ids_bs: Array, horizon: int | None = None) -> Array:
        """Training-time-test logits [K, B, S, N] (float32); see `ttt_hidden`. Step k's logits at
        row t predict ids[t+k+2]: pass them to `specjax.training.losses.eagle3_loss` with target
        logits lm_head(target_final_hidden[t+1]) at row t (restricted to the draft vocabulary)."""
        return self._logits(self.ttt_hidden(taps_bsf, input_ids_bs, horizon))


def make_eagle3_drafter(target_model: Any, cfg: Eagle3Config, rngs: nnx.Rngs | None = None, *,
                        dtype="float32", param_dtype="float32", draft_ids=None) -> Eagle3Drafter:
    """Build an Eagle3 drafter for `target_model` (a CausalLM) with its embedding and
    lm_head copied into the frozen copies; `draft_ids` [draft_vocab_size] when N > 0."""
    cfg.check_target(target_model.config)
    d = Eagle3Drafter(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    dv.install_draft_vocab(d, cfg.draft_vocab_size, draft_ids)
    copy_frozen_from_target(d.embed_tokens, d.lm_head, target_model, d.draft_vocab)
    return d


__all__ = ["Eagle3Attention", "Eagle3Config", "Eagle3DecoderLayer", "Eagle3Drafter", "Frozen",
           "PairCacheDrafter", "PairCacheState", "attend_causal_plus_diagonal",
           "make_eagle3_drafter", "shift_left"]
