"""The DSpark and DFlash kinds: checkpoint format, training section, builder and objective of
`specjax.drafters.dspark.DSparkDrafter`.

Checkpoint: architectures ["Qwen3DSparkModel"] with DeepSpec's tensor names (reference §2.6), all
without a `model.` prefix: embed_tokens.weight [V,H] (frozen copy), fc.weight [H, L*H],
hidden_norm.weight [H], layers.{i}.self_attn.{q,k,v,o}_proj.weight,
layers.{i}.self_attn.{q_norm,k_norm}.weight [hd], layers.{i}.mlp.{gate,up,down}_proj.weight,
layers.{i}.{input,post_attention}_layernorm.weight, norm.weight [H], lm_head.weight [V,H] (frozen
copy), markov_head.markov_w1.weight [V,r], markov_head.markov_w2.weight [V,r],
confidence_head.proj.{weight [1,H(+r)], bias [1]}; the RNN head adds
markov_head.joint_proj.{weight [3r, 2r+H], bias [3r]}. DFlash has neither Markov nor confidence
tensors. config.json: the target's config (`specjax.checkpoints.drafters`) plus DeepSpec's
`block_size, mask_token_id, target_layer_ids, num_anchors, num_target_layers, markov_rank,
markov_head_type, enable_confidence_head, confidence_head_with_markov`, and ours:
`confidence_temperatures` (the STS calibration of a confidence head, one temperature per block
slot; absent = all ones) and `draft_vocab_size`. DeepSpec ignores the fields it does not know.

Objective (reference §5.1, §6.2): per step up to `num_anchors` anchors per sequence sampled among
the completion tokens (`specjax.drafters.block_layout`); draft logits with teacher-forced previous
tokens; target logits = the frozen lm_head of the target hidden at a + j (with a draft vocabulary:
restricted to its tokens, and labels outside it leave the CE out); CE + TV (+ confidence BCE),
position-weighted (`specjax.drafters.losses`). Kind "dflash" is the same drafter without heads,
trained with CE only by default.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.checkpoints import drafters as hf
from specjax.checkpoints.common import KeyMap, write_config_json
from specjax.config import ConfigError, TargetConfig, check_non_negative, check_positive
from specjax.drafters import block_layout, losses
from specjax.drafters.base import Kind, TargetView
from specjax.drafters.common import FrozenHeadTraining, default_target_layer_ids, drafter_key_map
from specjax.drafters.dspark import (MARKOV_HEAD_TYPES, BlockDrafterConfig, DSparkDrafter,
                                     make_block_drafter)
from specjax.drafters.loading import check_gamma, check_target, fill
from specjax.drafters.warm_start import copy_layer_from_target

Array = jax.Array
ARCHITECTURE = "Qwen3DSparkModel"
CONFIDENCE_TEMPERATURES_FIELD = "confidence_temperatures"
DEFAULT_NUM_ANCHORS = 512


# ------------------------------------------------------------------------------------------------
# checkpoint format


def config_from_hf(d: Mapping[str, Any], *, source: str = "config.json") -> BlockDrafterConfig:
    """A `BlockDrafterConfig` from a DeepSpec `Qwen3DSparkModel` config.json mapping.

    DeepSpec writes `markov_head_type` only when markov_rank > 0 and `confidence_head_with_markov`
    only when the confidence head is on; both are then required."""
    if hf.architecture(d, source) != ARCHITECTURE:
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not "
                          f"{ARCHITECTURE!r}")
    tc = hf.qwen3_layers_from_hf(d, source)
    hf.require(d, source, "target_layer_ids", "mask_token_id", "block_size", "markov_rank",
               "enable_confidence_head")
    if d.get("enable_d2_feature"):
        raise ConfigError(f"{source}: field 'enable_d2_feature' true is not supported")
    rank = hf.int_field(d, "markov_rank", source, minimum=0)
    head_type = "vanilla"
    if rank > 0:
        hf.require(d, source, "markov_head_type")
        head_type = str(d["markov_head_type"]).lower()
        if head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"{source}: field 'markov_head_type' {d['markov_head_type']!r} is not "
                              f"supported (supported: {', '.join(MARKOV_HEAD_TYPES)})")
    conf = hf.bool_field(d, "enable_confidence_head", source)
    if conf:
        hf.require(d, source, "confidence_head_with_markov")
    with_markov = (hf.bool_field(d, "confidence_head_with_markov", source)
                   if d.get("confidence_head_with_markov") is not None else rank > 0)
    ids = hf.int_list_field(d, "target_layer_ids", source)
    hf.check_layer_ids_vs_count(ids, d, source)
    try:
        return BlockDrafterConfig(
            **hf.layer_dims_from_hf(tc), target_layer_ids=ids,
            mask_token_id=hf.int_field(d, "mask_token_id", source, minimum=0),
            num_draft_layers=tc.num_hidden_layers,
            block_size=hf.int_field(d, "block_size", source, minimum=1), markov_rank=rank,
            markov_head_type=head_type, confidence_head=conf,
            confidence_head_with_markov=with_markov,
            draft_vocab_size=hf.draft_vocab_size_from_hf(d, tc.vocab_size, source))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def confidence_temperatures_from_hf(d: Mapping[str, Any], gamma: int,
                                    source: str = "config.json") -> np.ndarray | None:
    """The STS temperatures [gamma] stored in a DSpark config.json, or None when absent."""
    v = d.get(CONFIDENCE_TEMPERATURES_FIELD)
    if v is None:
        return None
    try:
        t = np.asarray(v, np.float64)
    except (TypeError, ValueError):
        t = np.zeros((0,))
    if t.shape != (gamma,) or not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ConfigError(f"{source}: field '{CONFIDENCE_TEMPERATURES_FIELD}' must be {gamma} "
                          f"finite values > 0 (one per block slot), got {v!r}")
    return t.astype(np.float32)


def hf_config(cfg: BlockDrafterConfig, target_config: Any = None, *, dtype: Any = "float32",
              num_anchors: int = DEFAULT_NUM_ANCHORS,
              confidence_temperatures: Sequence[float] | None = None,
              extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpec `Qwen3DSparkModel` config.json mapping of a `BlockDrafterConfig`.

    `target_config` (see `specjax.checkpoints.target_hf_base`) is deep-copied as the base, so the
    target's own fields and rope dialect are kept; without it a Qwen3 config is built from the
    drafter's dimensions (and `num_target_layers` is left out). `num_anchors` is DeepSpec's
    training field (required by its model class); `extra` adds fields (a conflicting value
    raises)."""
    base, tcfg = hf.target_hf_base(target_config)
    if tcfg is not None:
        cfg.check_target(tcfg)
    d = hf.draft_layers_dict(base, cfg, cfg.num_draft_layers, ARCHITECTURE, dtype)
    d.update(block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
             target_layer_ids=list(cfg.target_layer_ids), num_anchors=int(num_anchors),
             markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
             enable_confidence_head=bool(cfg.confidence_head),
             confidence_head_with_markov=bool(cfg.confidence_head_with_markov))
    hf.set_draft_vocab_size(d, cfg.draft_vocab_size)
    if tcfg is not None:
        d["num_target_layers"] = tcfg.num_hidden_layers
    else:
        d.pop("num_target_layers", None)
    d.pop(CONFIDENCE_TEMPERATURES_FIELD, None)
    if confidence_temperatures is not None:
        if not cfg.confidence_head:
            raise ValueError("confidence_temperatures given for a drafter without a confidence head")
        d[CONFIDENCE_TEMPERATURES_FIELD] = [float(t) for t in confidence_temperatures]
        confidence_temperatures_from_hf(d, cfg.block_size, "confidence_temperatures")  # validates
    d = hf.merge_extra(d, extra)
    hf.check_round_trip(config_from_hf(d, source="the written config.json"), cfg)
    return d


def set_confidence_temperatures(path: str | os.PathLike, temps: Sequence[float]) -> None:
    """Store STS temperatures (one per block slot) in a DSpark drafter directory's config.json."""
    d, source = hf.read_drafter_config(path)
    cfg = config_from_hf(d, source=source)
    if not cfg.confidence_head:
        raise ConfigError(f"{source}: the drafter has no confidence head "
                          f"(enable_confidence_head: false)")
    d[CONFIDENCE_TEMPERATURES_FIELD] = [float(t) for t in temps]
    confidence_temperatures_from_hf(d, cfg.block_size, source)
    write_config_json(path, d)


def key_map() -> KeyMap:
    """DSpark/DFlash drafter <-> DeepSpec `Qwen3DSparkModel` names (our paths mirror them)."""
    return drafter_key_map()


def _load(path: str, d: Mapping[str, Any], source: str, tcfg: TargetConfig | None, tmodel: Any,
          *, dtype: Any, compute_dtype: Any, gamma: int | None, mesh: Any, rules: Any
          ) -> DSparkDrafter:
    cfg = config_from_hf(d, source=source)
    check_target(cfg.check_target, tcfg, source)
    check_gamma(gamma, cfg.block_size, cfg.variant)
    temps = confidence_temperatures_from_hf(d, cfg.block_size, source) \
        if cfg.confidence_head else None
    drafter = nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0), dtype=compute_dtype,
                                                   param_dtype=dtype))
    fill(drafter, path, key_map(), cfg=cfg, target_model=tmodel, mesh=mesh, rules=rules)
    if cfg.confidence_head:
        drafter.confidence_temperatures.set_value(jnp.ones((cfg.block_size,), jnp.float32))
        if temps is not None:
            drafter.set_confidence_temperatures(temps)
    return drafter


def _save(drafter: DSparkDrafter, target_config: Any, *, dtype: Any,
          extra: Mapping[str, Any] | None, num_anchors: int) -> tuple[dict[str, Any], KeyMap]:
    temps = None
    if drafter.confidence_head is not None:
        temps = np.asarray(jax.device_get(drafter.confidence_temperatures[...]), np.float64)
        temps = None if np.all(temps == 1.0) else temps.tolist()
    d = hf_config(drafter.config, target_config, dtype=dtype, num_anchors=num_anchors,
                  confidence_temperatures=temps, extra=extra)
    return d, key_map()


# ------------------------------------------------------------------------------------------------
# training


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockTraining(FrozenHeadTraining):
    """The `model:` fields of kind "dspark" (defaults: DeepSpec's shipped configs, reference
    §6.1). `mask_token_id` is required (Qwen3: 151669); `target_layer_ids` empty means the evenly
    spaced default; `init_layer_from_target` L starts the draft layer(s) from target layer L
    (`specjax.drafters.warm_start`; None = random, as DeepSpec)."""

    mask_token_id: int | None = None
    target_layer_ids: tuple[int, ...] = ()
    num_draft_layers: int = 5
    block_size: int = 7
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_anchors: int = 512
    alpha_ce: float = 0.1
    alpha_tv: float = 0.9
    alpha_conf: float = 1.0
    loss_decay: float = 4.0
    init_layer_from_target: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mask_token_id is None or self.mask_token_id < 0:
            raise ConfigError(f"field 'mask_token_id' must be a token id >= 0, got "
                              f"{self.mask_token_id!r}")
        check_positive(self, "num_draft_layers", "block_size", "num_anchors", "loss_decay")
        check_non_negative(self, "alpha_ce", "alpha_tv", "alpha_conf")
        v = self.init_layer_from_target
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"field 'init_layer_from_target' must be a target layer id >= 1 "
                              f"or null, got {v!r}")
        if self.confidence_head and self.alpha_conf == 0:
            raise ConfigError("field 'alpha_conf' is 0 but confidence_head is true: the head "
                              "would never be trained")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashTraining(BlockTraining):
    """The `model:` fields of kind "dflash": those of "dspark", without the heads."""

    def __post_init__(self) -> None:
        if self.markov_rank or self.confidence_head:
            raise ConfigError("kind 'dflash' has no sequential or confidence head: set "
                              "markov_rank: 0 and confidence_head: false (or use kind 'dspark')")
        super().__post_init__()


def _build(sec: BlockTraining, target: Any, tcfg: TargetConfig, *, rngs: nnx.Rngs, dtype: Any,
           param_dtype: Any, draft_ids: Any) -> tuple[DSparkDrafter, BlockDrafterConfig,
                                                      tuple[int, ...]]:
    layer_ids = tuple(sec.target_layer_ids) or default_target_layer_ids(tcfg.num_hidden_layers)
    cfg = BlockDrafterConfig.from_target(
        tcfg, target_layer_ids=layer_ids, mask_token_id=sec.mask_token_id,
        num_draft_layers=sec.num_draft_layers, block_size=sec.block_size,
        markov_rank=sec.markov_rank, markov_head_type=sec.markov_head_type,
        confidence_head=sec.confidence_head,
        confidence_head_with_markov=sec.confidence_head_with_markov and sec.markov_rank > 0,
        draft_vocab_size=sec.draft_vocab_size, **sec.width())
    drafter = make_block_drafter(target, tcfg, cfg, rngs=rngs, dtype=dtype,
                                 param_dtype=param_dtype, draft_ids=draft_ids)
    sec.init_norm(drafter.norm, target)
    if sec.init_layer_from_target is not None:
        copy_layer_from_target(drafter, target, sec.init_layer_from_target)
    return drafter, cfg, layer_ids


def gather_positions(x_bsh: Array, idx_bak: Array) -> Array:
    """x[b, clip(idx[b, a, k], 0, S-1)] -> [B, A, K, H]."""
    b, s = x_bsh.shape[:2]
    idx = jnp.clip(idx_bak, 0, s - 1)
    flat = jnp.take_along_axis(x_bsh, idx.reshape(b, -1)[..., None], axis=1)
    return flat.reshape(idx.shape + x_bsh.shape[2:])


def block_drafter_loss(*, num_anchors: int, alpha_ce: float = 0.1, alpha_tv: float = 0.9,
                       alpha_conf: float = 1.0, decay: float = 4.0,
                       chunk_anchors: int | None = None, feature_dtype: Any = jnp.bfloat16):
    """The DSpark / DFlash loss `(model, batch, rng, target: TargetView) -> (loss, metrics)` (module
    docstring). Batch: input_ids [B,S], loss_mask [B,S], valid [B]; the target's taps and final
    hidden come from `target.features(feature_dtype)`. Vocabulary-sized work runs
    `chunk_anchors` anchors at a time."""

    def loss_fn(model: Any, batch: Mapping[str, Array], rng: Array, target: TargetView):
        ids = jnp.asarray(batch["input_ids"], jnp.int32)
        lm = batch["loss_mask"]
        taps, hid = target.features(feature_dtype)
        kk = model.gamma
        anchors, keep = block_layout.sample_anchors(rng, lm, num_anchors)
        labels = model.draft_labels(block_layout.block_labels(ids, anchors, keep, kk))  # -1: not draftable
        emask = block_layout.eval_mask(lm, anchors, keep, kk)
        h = model.backbone_hidden(taps, ids, anchors, keep)  # [B, A, K, H]
        prev = model.teacher_prev_tokens(ids, anchors)  # [B, A, K]
        conf = model.confidence_logits(h, prev)
        t_idx = anchors[..., None] + jnp.arange(kk, dtype=jnp.int32)
        t_hidden = gather_positions(hid, t_idx)  # target hidden at a + j

        def terms(h_c, prev_c, th_c, lab_c):
            z = model.draft_logits(h_c, prev_c)
            t = model.lm_logits(th_c)
            return losses.dspark_slot_terms(z, t, lab_c)

        ce, l1 = losses.map_over_axis1(terms, (h, prev, t_hidden, labels), chunk_anchors)
        loss, metrics = losses.dspark_loss_from_terms(
            ce, l1, emask, conf if alpha_conf > 0 else None, alpha_ce=alpha_ce,
            alpha_tv=alpha_tv, alpha_conf=alpha_conf, decay=decay, ce_mask_bak=labels >= 0)
        metrics = dict(metrics)
        keep_f = keep.astype(jnp.float32)
        cand = block_layout.anchor_candidates(lm).astype(jnp.float32)
        metrics["valid_anchors_per_seq"] = jnp.mean(jnp.sum(cand, axis=1))
        metrics["sampled_anchors_per_seq"] = jnp.mean(jnp.sum(keep_f, axis=1))
        metrics["tokens_per_block"] = jnp.sum(emask) / jnp.maximum(jnp.sum(keep_f), 1.0)
        return loss, metrics

    return loss_fn


def _objective(sec: BlockTraining, *, feature_dtype: Any):
    return block_drafter_loss(
        num_anchors=sec.num_anchors, alpha_ce=sec.alpha_ce, alpha_tv=sec.alpha_tv,
        alpha_conf=sec.alpha_conf if sec.confidence_head else 0.0, decay=sec.loss_decay,
        chunk_anchors=sec.chunk_anchors, feature_dtype=feature_dtype)


KINDS = (
    Kind("dspark", (ARCHITECTURE,), DSparkDrafter, _load, _save, BlockTraining, _build,
         _objective, cache=True),
    Kind("dflash", (), DSparkDrafter, _load, _save, DFlashTraining, _build, _objective,
         cache=True),
)

__all__ = ["ARCHITECTURE", "BlockTraining", "CONFIDENCE_TEMPERATURES_FIELD",
           "DEFAULT_NUM_ANCHORS", "DFlashTraining", "KINDS", "block_drafter_loss",
           "confidence_temperatures_from_hf", "config_from_hf", "gather_positions", "hf_config",
           "key_map", "set_confidence_temperatures"]
