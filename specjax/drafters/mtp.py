"""MTP drafter: a DeepSeek-style multi-token-prediction module used serially (MTP-1, gamma = 1).

From the target's final-normed hidden state h_j at position j and the embedding of the next token
x_{j+1}: u_j = eh_proj([enorm(embed(x_{j+1})) ; hnorm(h_j)]) (2H -> H, no bias), one Qwen3
decoder block (causal self-attention over the earlier u's, at RoPE position j), then the final norm
and the frozen shared lm_head predict x_{j+2}. At serving time the last committed position's hidden
state waits for the anchor (the same pending-feature pair cache as Eagle3, shared through
`specjax.drafters.common.PairCacheDrafter`), so one proposal = one token.

Checkpoint: architectures ["SpecjaxMTPDrafter"], config.json the target's config (one layer) plus
`num_speculative_tokens: 1`. Tensor names follow DeepSeek-V3's MTP layer layout (relative to the layer prefix):
`enorm.weight`, `hnorm.weight`, `eh_proj.weight [H, 2H]`, `input_layernorm.weight`,
`self_attn.{q,k,v,o}_proj.weight`, `self_attn.{q_norm,k_norm}.weight`,
`post_attention_layernorm.weight`, `mlp.{gate,up,down}_proj.weight`, `shared_head.norm.weight`,
`shared_head.head.weight` (frozen copy of the target's lm_head), `embed_tokens.weight` (frozen copy
of the target's embedding). Our NNX attribute paths are exactly these module paths.

Draft vocabulary (`draft_vocab_size` N > 0): `shared_head.head` holds the target head's columns of
the N draft tokens and q is scattered into the full vocabulary (see `specjax.drafters.vocab`).

Objective (kind "mtp"): (hidden[t], ids[t+1]) -> ids[t+2], CE + TV against the target's
lm_head(hidden[t+1]) (`specjax.drafters.losses.mtp_loss`); labels outside a draft vocabulary
leave the CE only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.checkpoints import drafters as hf
from specjax.checkpoints.common import KeyMap
from specjax.config import ConfigError, TargetConfig, check_non_negative
from specjax.drafters import losses
from specjax.drafters import vocab as dv
from specjax.drafters.base import ContextUpdate, Kind, TargetView
from specjax.drafters.common import (FrozenEmbed, FrozenHeadTraining, FrozenLMHead, LayerDims,
                                     PairCacheDrafter, copy_frozen_from_target, drafter_key_map,
                                     shift_left)
from specjax.drafters.loading import check_gamma, check_target, fill
from specjax.models.layers import Linear, RMSNorm, SwiGLU
from specjax.models.unfused import Attention

Array = jax.Array
ARCHITECTURE = "SpecjaxMTPDrafter"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MTPConfig(LayerDims):
    """An MTP-1 drafter; the layer dimensions are the target's."""


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
        lcfg = cfg.layer_config()
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

# ------------------------------------------------------------------------------------------------
# checkpoint format


def config_from_hf(d: Mapping[str, Any], *, source: str = "config.json") -> MTPConfig:
    """An `MTPConfig` from a `SpecjaxMTPDrafter` config.json mapping."""
    if hf.architecture(d, source) != ARCHITECTURE:
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not "
                          f"{ARCHITECTURE!r}")
    tc = hf.one_layer_from_hf(d, source, "an MTP-1")
    try:
        return MTPConfig(**hf.layer_dims_from_hf(tc),
                         draft_vocab_size=hf.draft_vocab_size_from_hf(d, tc.vocab_size, source))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def hf_config(cfg: MTPConfig, target_config: Any = None, *, dtype: Any = "float32",
              extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `SpecjaxMTPDrafter` config.json mapping of an `MTPConfig` (one layer, gamma 1)."""
    base, tcfg = hf.target_hf_base(target_config)
    if tcfg is not None:
        cfg.check_target(tcfg)
    d = hf.draft_layers_dict(base, cfg, 1, ARCHITECTURE, dtype)
    d[hf.GAMMA_FIELD] = 1
    hf.set_draft_vocab_size(d, cfg.draft_vocab_size)
    if tcfg is not None:
        d["num_target_layers"] = tcfg.num_hidden_layers
    d = hf.merge_extra(d, extra)
    hf.check_round_trip(config_from_hf(d, source="the written config.json"), cfg)
    return d


def key_map() -> KeyMap:
    """MTP-1 drafter <-> DeepSeek-V3 MTP layer names (our paths mirror them)."""
    return drafter_key_map()


def _load(path: str, d: Mapping[str, Any], source: str, tcfg: TargetConfig | None, tmodel: Any,
          *, dtype: Any, compute_dtype: Any, gamma: int | None, mesh: Any, rules: Any
          ) -> MTPDrafter:
    cfg = config_from_hf(d, source=source)
    check_target(cfg.check_target, tcfg, source)
    check_gamma(gamma, 1, "MTP-1")
    drafter = nnx.eval_shape(lambda: MTPDrafter(cfg, rngs=nnx.Rngs(0), dtype=compute_dtype,
                                                param_dtype=dtype))
    fill(drafter, path, key_map(), cfg=cfg, target_model=tmodel, mesh=mesh, rules=rules)
    return drafter


def _save(drafter: MTPDrafter, target_config: Any, *, dtype: Any,
          extra: Mapping[str, Any] | None, num_anchors: int) -> tuple[dict[str, Any], KeyMap]:
    del num_anchors
    return hf_config(drafter.config, target_config, dtype=dtype, extra=extra), key_map()


# ------------------------------------------------------------------------------------------------
# training


@dataclasses.dataclass(frozen=True, kw_only=True)
class MTPTraining(FrozenHeadTraining):
    """The `model:` fields of kind "mtp": the loss weights of CE and TV against the target."""

    alpha_ce: float = 0.1
    alpha_tv: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        check_non_negative(self, "alpha_ce", "alpha_tv")


def _build(sec: MTPTraining, target: Any, tcfg: TargetConfig, *, rngs: nnx.Rngs, dtype: Any,
           param_dtype: Any, draft_ids: Any) -> tuple[MTPDrafter, MTPConfig, tuple[int, ...]]:
    cfg = MTPConfig.from_target(tcfg, draft_vocab_size=sec.draft_vocab_size, **sec.width())
    drafter = make_mtp_drafter(target, cfg, rngs, dtype=dtype, param_dtype=param_dtype,
                               draft_ids=draft_ids)
    sec.init_norm(drafter.shared_head.norm, target)
    return drafter, cfg, ()


def mtp_loss_fn(*, alpha_ce: float = 0.1, alpha_tv: float = 0.9, chunk_tokens: int | None = None,
                feature_dtype: Any = jnp.bfloat16):
    """The MTP-1 loss `(model, batch, rng, target) -> (loss, metrics)` (module docstring)."""

    def loss_fn(model: Any, batch: Mapping[str, Array], rng: Array, target: TargetView):
        del rng
        ids = jnp.asarray(batch["input_ids"], jnp.int32)
        lm = jnp.asarray(batch["loss_mask"]).astype(jnp.float32)
        _, hid = target.features(feature_dtype)
        hid = hid.astype(feature_dtype)
        z = model.train_forward(hid, ids)  # [B, S, N]
        t_logits = model.shared_head.head(shift_left(hid, 1))
        labels = dv.draft_labels(model.draft_vocab, shift_left(ids, 2))
        return losses.mtp_loss(z, t_logits, labels, shift_left(lm, 2),
                               alpha_ce=alpha_ce, alpha_tv=alpha_tv, chunk_tokens=chunk_tokens)

    return loss_fn


def _objective(sec: MTPTraining, *, feature_dtype: Any):
    return mtp_loss_fn(alpha_ce=sec.alpha_ce, alpha_tv=sec.alpha_tv,
                       chunk_tokens=sec.chunk_anchors, feature_dtype=feature_dtype)


KINDS = (Kind("mtp", (ARCHITECTURE,), MTPDrafter, _load, _save, MTPTraining, _build, _objective,
              cache=True),)

__all__ = ["ARCHITECTURE", "KINDS", "MTPConfig", "MTPDrafter", "MTPTraining", "SharedHead",
           "config_from_hf", "hf_config", "key_map", "make_mtp_drafter", "mtp_loss_fn"]
