"""Eagle3 drafter (reference §4): one decoder layer over fused target features, trained with TTT.

Architecture. Target hidden taps (concatenated in `target_layer_ids` order, width L*H) are fused by
`fc` (L*H -> H, no bias, no norm after it) into g. The single decoder layer (`midlayer`) takes
`[input_layernorm(embed(x)) ; hidden_norm(g)]` (2H wide) into its q/k/v projections (per-head q/k
RMSNorm, RoPE, causal GQA attention); the residual stream is the un-normed g; then the usual
post-attention norm + SwiGLU. Logits are `lm_head(norm(out))`: `norm` is trainable, `embed_tokens`
and `lm_head` are frozen full-vocabulary copies of the target's (`common.Frozen` variables, read
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

Checkpoint: architectures ["Qwen3Eagle3Model"] (DeepSpec; also read: "Eagle3DraftModel", and
SpecForge's "LlamaForCausalLMEagle3"). Tensor names: `embed_tokens.weight`, `fc.weight [H, L*H]`,
`layers.0.{hidden_norm,input_layernorm,post_attention_layernorm}.weight`,
`layers.0.self_attn.{q,k,v}_proj.weight [*, 2H]`, `layers.0.self_attn.o_proj.weight`,
`layers.0.self_attn.{q_norm,k_norm}.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight`; SpecForge's files name the layer `midlayer.` (our module's own
attribute name), which is read too. config.json: the target's config plus `target_layer_ids,
ttt_length, step_loss_decay, draft_num_hidden_layers, num_target_layers` and our
`num_speculative_tokens` (gamma; default ttt_length, as DeepSpec proposes).

The pending-feature pair cache, propose loop and step-0 training forward are
`specjax.drafters.common.PairCacheDrafter`, shared with MTP-1.

Objective (kind "eagle3"): `ttt_forward` over `block_size` steps against the target's next-token
distribution, soft CE with step weights `ttt_decay`^k (`specjax.drafters.losses.eagle3_loss`);
step k at row t predicts ids[t+k+2], target logits lm_head(hidden[t+1]) restricted to the draft
vocabulary. A position whose label lies outside a draft vocabulary is dropped from every step
(EAGLE-3 masks by the target's top token; the label is what the training text holds).

Draft vocabulary (`draft_vocab_size` N > 0, EAGLE-3's reduced vocabulary): `lm_head` holds the
target head's columns of the N draft tokens; each step samples a draft index, feeds the target id
`d2t[index]` to the next step and hands verification q scattered into the full vocabulary (zero
elsewhere). The maps are stored as EAGLE-3's `d2t` / `t2d` tensors (`specjax.drafters.vocab`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.checkpoints import drafters as hf
from specjax.checkpoints.common import KeyMap
from specjax.config import ConfigError, TargetConfig
from specjax.drafters import losses
from specjax.drafters import vocab as dv
from specjax.drafters.base import ContextUpdate, Kind, TargetView
from specjax.drafters.common import (FrozenEmbed, FrozenHeadTraining, FrozenLMHead,
                                     PairCacheDrafter, TapDims, copy_frozen_from_target,
                                     default_target_layer_ids, drafter_key_map, shift_left)
from specjax.drafters.loading import check_target, fill
from specjax.models.layers import Linear, RMSNorm, SwiGLU
from specjax.models.unfused import Attention

Array = jax.Array
ARCHITECTURE = "Qwen3Eagle3Model"
ARCHITECTURE_ALIASES = ("Eagle3DraftModel", "LlamaForCausalLMEagle3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config(TapDims):
    """An Eagle3 drafter. `gamma`: tokens proposed per round; `ttt_length`: training unroll."""

    gamma: int = 7
    ttt_length: int = 7
    step_loss_decay: float = 0.8

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("gamma", "ttt_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"field '{name}' must be an integer >= 1, got {v!r}")
        if not 0.0 < self.step_loss_decay <= 1.0:
            raise ConfigError(f"field 'step_loss_decay' must be in (0, 1], got {self.step_loss_decay}")


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
        self.midlayer = Eagle3DecoderLayer(cfg.layer_config(), rngs=rngs, **kw)
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
        row t predict ids[t+k+2]: pass them to `specjax.drafters.losses.eagle3_loss` with target
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

# ------------------------------------------------------------------------------------------------
# checkpoint format


def key_map(layout: str = "deepspec") -> KeyMap:
    """Eagle3 drafter <-> `layers.0.*` (layout "deepspec") or `midlayer.*` ("midlayer")."""
    if layout == "deepspec":
        return KeyMap(prefix_map={"midlayer.": "layers.0."}, variable_types=drafter_key_map().variable_types)
    if layout == "midlayer":
        return drafter_key_map()
    raise ValueError(f"unknown Eagle3 layout {layout!r} (known: 'deepspec', 'midlayer')")


def layout(names: Iterable[str]) -> str:
    """"midlayer" if a checkpoint's tensors use SpecForge's `midlayer.` names, else "deepspec"."""
    return "midlayer" if any(n.startswith("midlayer.") for n in names) else "deepspec"


def config_from_hf(d: Mapping[str, Any], *, source: str = "config.json") -> Eagle3Config:
    """An `Eagle3Config` from an Eagle3 config.json mapping (DeepSpec `Qwen3Eagle3Model`; the tap
    layers may also come from SpecForge's `eagle_config.eagle_aux_hidden_state_layer_ids`).
    gamma = `num_speculative_tokens`, else `ttt_length` (DeepSpec proposes ttt_length tokens)."""
    if hf.architecture(d, source) not in (ARCHITECTURE, *ARCHITECTURE_ALIASES):
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not an Eagle3 "
                          f"architecture")
    tc = hf.one_layer_from_hf(d, source, "an Eagle3")
    src = d
    if d.get("target_layer_ids") is None and isinstance(d.get("eagle_config"), Mapping) and \
            d["eagle_config"].get("eagle_aux_hidden_state_layer_ids") is not None:
        src = {"target_layer_ids": d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]}
    hf.require(src, source, "target_layer_ids")
    ids = hf.int_list_field(src, "target_layer_ids", source)
    hf.check_layer_ids_vs_count(ids, d, source)
    ttt = hf.int_field(d, "ttt_length", source, minimum=1) if d.get("ttt_length") is not None else 7
    decay = d.get("step_loss_decay", 0.8)
    if isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise ConfigError(f"{source}: field 'step_loss_decay' must be a number, got {decay!r}")
    gamma = hf.int_field(d, hf.GAMMA_FIELD, source, minimum=1) \
        if d.get(hf.GAMMA_FIELD) is not None else ttt
    try:
        return Eagle3Config(**hf.layer_dims_from_hf(tc), target_layer_ids=ids, gamma=gamma,
                            ttt_length=ttt, step_loss_decay=float(decay),
                            draft_vocab_size=hf.draft_vocab_size_from_hf(d, tc.vocab_size, source))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def hf_config(cfg: Eagle3Config, target_config: Any = None, *, dtype: Any = "float32",
              extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpec `Qwen3Eagle3Model` config.json mapping of an `Eagle3Config` (plus our
    `num_speculative_tokens` = gamma)."""
    base, tcfg = hf.target_hf_base(target_config)
    if tcfg is not None:
        cfg.check_target(tcfg)
    d = hf.draft_layers_dict(base, cfg, 1, ARCHITECTURE, dtype)
    d.update(target_layer_ids=list(cfg.target_layer_ids), ttt_length=cfg.ttt_length,
             step_loss_decay=float(cfg.step_loss_decay), draft_num_hidden_layers=1,
             **{hf.GAMMA_FIELD: cfg.gamma})
    hf.set_draft_vocab_size(d, cfg.draft_vocab_size)
    if tcfg is not None:
        d["num_target_layers"] = tcfg.num_hidden_layers
    else:
        d.pop("num_target_layers", None)
    d = hf.merge_extra(d, extra)
    hf.check_round_trip(config_from_hf(d, source="the written config.json"), cfg)
    return d


def _load(path: str, d: Mapping[str, Any], source: str, tcfg: TargetConfig | None, tmodel: Any,
          *, dtype: Any, compute_dtype: Any, gamma: int | None, mesh: Any, rules: Any
          ) -> Eagle3Drafter:
    cfg = config_from_hf(d, source=source)
    if gamma is not None:
        cfg = dataclasses.replace(cfg, gamma=int(gamma))
    check_target(cfg.check_target, tcfg, source)
    drafter = nnx.eval_shape(lambda: Eagle3Drafter(cfg, rngs=nnx.Rngs(0), dtype=compute_dtype,
                                                   param_dtype=dtype))
    fill(drafter, path, lambda names: key_map(layout(names)), cfg=cfg, target_model=tmodel,
         mesh=mesh, rules=rules)
    return drafter


def _save(drafter: Eagle3Drafter, target_config: Any, *, dtype: Any,
          extra: Mapping[str, Any] | None, num_anchors: int) -> tuple[dict[str, Any], KeyMap]:
    del num_anchors
    return hf_config(drafter.config, target_config, dtype=dtype, extra=extra), key_map()


# ------------------------------------------------------------------------------------------------
# training


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Training(FrozenHeadTraining):
    """The `model:` fields of kind "eagle3": one midlayer (`num_draft_layers` 1) on
    `target_layer_ids` (empty: 3 evenly spaced layers), training-time test over `block_size` steps
    (also the proposal length) with step weights `ttt_decay`^k."""

    target_layer_ids: tuple[int, ...] = ()
    num_draft_layers: int = 1
    block_size: int = 7
    ttt_decay: float = 0.8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_draft_layers != 1:
            raise ConfigError(f"field 'num_draft_layers' must be 1 for kind 'eagle3' (one "
                              f"midlayer), got {self.num_draft_layers}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) \
                or self.block_size < 1:
            raise ConfigError(f"field 'block_size' must be > 0, got {self.block_size!r}")
        if not 0.0 < self.ttt_decay <= 1.0:
            raise ConfigError(f"field 'ttt_decay' must be in (0, 1], got {self.ttt_decay!r}")


def _build(sec: Eagle3Training, target: Any, tcfg: TargetConfig, *, rngs: nnx.Rngs, dtype: Any,
           param_dtype: Any, draft_ids: Any) -> tuple[Eagle3Drafter, Eagle3Config,
                                                      tuple[int, ...]]:
    layer_ids = tuple(sec.target_layer_ids) or default_target_layer_ids(tcfg.num_hidden_layers, 3)
    cfg = Eagle3Config.from_target(tcfg, target_layer_ids=layer_ids, gamma=sec.block_size,
                                   ttt_length=sec.block_size, step_loss_decay=sec.ttt_decay,
                                   draft_vocab_size=sec.draft_vocab_size, **sec.width())
    drafter = make_eagle3_drafter(target, cfg, rngs, dtype=dtype, param_dtype=param_dtype,
                                  draft_ids=draft_ids)
    sec.init_norm(drafter.norm, target)
    return drafter, cfg, layer_ids


def eagle3_loss_fn(*, horizon: int, decay: float = 0.8, chunk_tokens: int | None = None,
                   feature_dtype: Any = jnp.bfloat16):
    """The Eagle3 training-time-test loss `(model, batch, rng, target) -> (loss, metrics)` over
    `horizon` steps (reference §4; module docstring)."""
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")

    def loss_fn(model: Any, batch: Mapping[str, Array], rng: Array, target: TargetView):
        del rng
        ids = jnp.asarray(batch["input_ids"], jnp.int32)
        lm = jnp.asarray(batch["loss_mask"]).astype(jnp.float32)
        taps_bsf, hid = target.features(feature_dtype)
        taps_bsf = taps_bsf.astype(feature_dtype)
        step_logits = model.ttt_forward(taps_bsf, ids, horizon)  # [K, B, S, N]
        t_logits = model.lm_head(shift_left(hid.astype(feature_dtype), 1))  # [B, S, N]
        in_vocab = dv.draft_labels(model.draft_vocab, shift_left(ids, 2)) >= 0
        mask = shift_left(lm, 2) * in_vocab.astype(jnp.float32)
        return losses.eagle3_loss(step_logits, t_logits, mask, decay=decay,
                                  chunk_tokens=chunk_tokens)

    return loss_fn


def _objective(sec: Eagle3Training, *, feature_dtype: Any):
    return eagle3_loss_fn(horizon=sec.block_size, decay=sec.ttt_decay,
                          chunk_tokens=sec.chunk_anchors, feature_dtype=feature_dtype)


KINDS = (Kind("eagle3", (ARCHITECTURE, *ARCHITECTURE_ALIASES), Eagle3Drafter, _load, _save,
              Eagle3Training, _build, _objective, cache=True),)

__all__ = ["ARCHITECTURE", "ARCHITECTURE_ALIASES", "Eagle3Attention", "Eagle3Config",
           "Eagle3DecoderLayer", "Eagle3Drafter", "Eagle3Training", "KINDS",
           "attend_causal_plus_diagonal", "config_from_hf", "eagle3_loss_fn", "hf_config",
           "key_map", "layout", "make_eagle3_drafter"]
