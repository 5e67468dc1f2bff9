"""MTP drafter: a DeepSeek-style multi-token-prediction module used serially (MTP-1, gamma = 1).

From the target's final-normed hidden state h_j at position j and the embedding of the next token
x_{j+1}: u_j = eh_proj([enorm(embed(x_{j+1})) ; hnorm(h_j)]) (2H -> H, no bias), one Qwen3
decoder block (causal self-attention over the earlier u's, at RoPE position j), then the final norm
and the frozen shared lm_head predict x_{j+2}. At serving time the last committed position's hidden
state waits for the anchor (the same pending-feature pair cache as Eagle3, shared through
`specjax.drafters.eagle3.PairCacheDrafter`), so one proposal = one token.

Checkpoint names follow DeepSeek-V3's MTP layer layout (relative to the layer prefix):
`enorm.weight`, `hnorm.weight`, `eh_proj.weight [H, 2H]`, `input_layernorm.weight`,
`self_attn.{q,k,v,o}_proj.weight`, `self_attn.{q_norm,k_norm}.weight`,
`post_attention_layernorm.weight`, `mlp.{gate,up,down}_proj.weight`, `shared_head.norm.weight`,
`shared_head.head.weight` (frozen copy of the target's lm_head), `embed_tokens.weight` (frozen copy
of the target's embedding). Our NNX attribute paths are exactly these module paths.

Draft vocabulary (`draft_vocab_size` N > 0): `shared_head.head` holds the target head's columns of
the N draft tokens and q is scattered into the full vocabulary (see `specjax.drafters.vocab`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import TargetConfig
from specjax.drafters import vocab as dv
from specjax.drafters.base import ContextUpdate
from specjax.drafters.block import FrozenEmbed, FrozenLMHead, copy_frozen_from_target
from specjax.drafters.dims import check_same_width, layer_config, target_dims, validate_layer_dims
from specjax.drafters.eagle3 import PairCacheDrafter
from specjax.models.layers import Linear, RMSNorm, SwiGLU
from specjax.models.decoder import Attention

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """An MTP-1 drafter; the layer dimensions are the target's."""

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
    draft_vocab_size: int = 0  # N > 0: draft over N target tokens; 0 = the full vocabulary

    def __post_init__(self) -> None:
        validate_layer_dims(self)
        dv.validate_draft_vocab_size(self.draft_vocab_size, self.vocab_size)

    @property
    def out_vocab_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_target(cls, target: TargetConfig, **overrides: Any) -> "MTPConfig":
        args = target_dims(target)
        args.update(overrides)
        cfg = cls(**args)
        cfg.check_target(target)
        return cfg

    def check_target(self, target: TargetConfig) -> None:
        """Raise ConfigError if the vocabulary or hidden size differ from the target's."""
        check_same_width(self, target)


class SharedHead(nnx.Module):
    """Final norm (trainable) + the frozen shared output head."""

    def __init__(self, hidden: int, vocab: int, *, eps: float, rngs: nnx.Rngs, dtype="float32",
                 param_dtype="float32"):
        self.norm = RMSNorm(hidden, eps=eps, dtype=dtype, param_dtype=param_dtype)
        self.head = FrozenLMHead(hidden, vocab, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x: Array) -> Array:
        return self.head(self.norm(x))


class MTPDrafter(PairCacheDrafter):
    """MTP-1 drafter with the `Drafter` protocol (`gamma` = 1, `tap_layers` = (),
    `needs_hidden` = True: commit reads `ContextUpdate.hidden`)."""

    def __init__(self, cfg: MTPConfig, *, rngs: nnx.Rngs | None = None, dtype="float32",
                 param_dtype="float32"):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.gamma = 1
        self.tap_layers = ()
        self.needs_hidden = True
        self.hidden_size = cfg.hidden_size
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.dtype = jnp.dtype(dtype)
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        lcfg = layer_config(cfg)
        self.embed_tokens = FrozenEmbed(cfg.vocab_size, h, rngs=rngs, **kw)
        self.enorm = RMSNorm(h, eps=eps, **kw)
        self.hnorm = RMSNorm(h, eps=eps, **kw)
        self.eh_proj = Linear(2 * h, h, logical_axes=("features", "embed"), rngs=rngs, **kw)
        self.input_layernorm = RMSNorm(h, eps=eps, **kw)
        self.self_attn = Attention(lcfg, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(h, eps=eps, **kw)
        self.mlp = SwiGLU(h, cfg.intermediate_size, rngs=rngs, **kw)
        self.shared_head = SharedHead(h, cfg.out_vocab_size, eps=eps, rngs=rngs, **kw)
        self.draft_vocab = (dv.DraftVocab(cfg.vocab_size, cfg.draft_vocab_size)
                            if cfg.draft_vocab_size else nnx.data(None))

    # hooks -------------------------------------------------------------------------------------
    def _features(self, update: ContextUpdate) -> Array:
        if update.hidden is None:
            raise ValueError("MTP commit needs update.hidden (the target's final-normed hidden "
                             "state); build the engine with a drafter whose needs_hidden is True")
        if update.hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"update.hidden last dim must be hidden_size={self.hidden_size}, got "
                             f"shape {update.hidden.shape}")
        return update.hidden

    def _attn_input(self, feat_bth: Array, tok_bt: Array) -> tuple[Array, Array]:
        e = self.enorm(self.embed_tokens(tok_bt))
        x = self.eh_proj(jnp.concatenate([e, self.hnorm(feat_bth.astype(e.dtype))], axis=-1))
        return self.input_layernorm(x), x

    def _attention(self) -> Attention:
        return self.self_attn

    def _finish(self, residual_bth: Array, attn_bthd: Array) -> Array:
        x = residual_bth + self.self_attn.output(attn_bthd)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _logits(self, out_xh: Array) -> Array:
        return self.shared_head(out_xh)

    # training ----------------------------------------------------------------------------------
    def train_forward(self, hidden_bsh: Array, input_ids_bs: Array) -> Array:
        """Logits [B, S, N] (float32): row t predicts ids[t+2] from (hidden[t], ids[t+1]), causal
        over rows (the last row is paired with token 0 and has no target)."""
        if hidden_bsh.shape[:2] != input_ids_bs.shape or hidden_bsh.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_bsh {hidden_bsh.shape} must be [B, S, H={self.hidden_size}] "
                             f"with B, S of input_ids_bs {input_ids_bs.shape}")
        return self._logits(self.step0_layer(hidden_bsh, input_ids_bs))


def make_mtp_drafter(target_model: Any, cfg: MTPConfig | None = None,
                     rngs: nnx.Rngs | None = None, *, dtype="float32", param_dtype="float32",
                     draft_ids=None) -> MTPDrafter:
    """Build an MTP drafter for `target_model` (a CausalLM; dims copied when `cfg` is
    None) with its embedding and lm_head copied into the frozen copies; `draft_ids`
    [draft_vocab_size] when N > 0."""
    cfg = cfg if cfg is not None else MTPConfig.from_target(target_model.config)
    cfg.check_target(target_model.config)
    d = MTPDrafter(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    dv.install_draft_vocab(d, cfg.draft_vocab_size, draft_ids)
    copy_frozen_from_target(d.embed_tokens, d.shared_head.head, target_model, d.draft_vocab)
    return d


__all__ = ["MTPConfig", "MTPDrafter", "SharedHead", "make_mtp_drafter"]
