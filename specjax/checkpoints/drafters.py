"""Drafter checkpoints: tensor names (key maps) and config.json dialects of every drafter kind.

A drafter directory is `config.json` + safetensors (`specjax.drafters.registry` reads and writes
them; it dispatches on `architectures[0]`). Tensor names, all without a `model.` prefix:

DSpark / DFlash, architectures ["Qwen3DSparkModel"] (DeepSpec's names, reference §2.6):
  embed_tokens.weight [V,H] (frozen copy), fc.weight [H, L*H], hidden_norm.weight [H],
  layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q_norm,k_norm}.weight [hd],
  layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.{input,post_attention}_layernorm.weight,
  norm.weight [H], lm_head.weight [V,H] (frozen copy), markov_head.markov_w1.weight [V,r],
  markov_head.markov_w2.weight [V,r], confidence_head.proj.{weight [1,H(+r)], bias [1]};
  the RNN head adds markov_head.joint_proj.{weight [3r, 2r+H], bias [3r]}. DFlash has neither
  Markov nor confidence tensors.
Eagle3, architectures ["Qwen3Eagle3Model"] (DeepSpec; also read: "Eagle3DraftModel", and
  SpecForge's "LlamaForCausalLMEagle3" with its `midlayer.` names): embed_tokens.weight,
  fc.weight [H, L*H], layers.0.{hidden_norm,input_layernorm,post_attention_layernorm}.weight,
  layers.0.self_attn.{q,k,v}_proj.weight [*, 2H], layers.0.self_attn.o_proj.weight,
  layers.0.self_attn.{q_norm,k_norm}.weight, layers.0.mlp.*, norm.weight, lm_head.weight.
  (Our module calls the layer `midlayer`; the key map renames it.)
MTP-1, architectures ["SpecjaxMTPDrafter"] (DeepSeek-V3 MTP layer names): embed_tokens.weight,
  enorm.weight, hnorm.weight, eh_proj.weight [H, 2H], input_layernorm.weight, self_attn.*,
  post_attention_layernorm.weight, mlp.*, shared_head.norm.weight, shared_head.head.weight.
Standalone draft LM: a plain CausalLM checkpoint (model.*, lm_head.weight) whose
  config.json adds `"specjax_drafter": "standalone"` (architectures ["Qwen3ForCausalLM"],
  ["LlamaForCausalLM"] or ["Qwen2ForCausalLM"], so transformers loads it as is;
  "SpecjaxStandaloneDrafter" is read too).
N-gram, architectures ["SpecjaxNGramDrafter"]: config.json only, no tensors.

config.json: the target's Qwen3 config deep-copied (both rope dialects are read: transformers
5's `rope_parameters` and the older top-level `rope_theta`/`rope_scaling`; the target's dialect
is kept on write) with num_hidden_layers = draft layers, tie_word_embeddings false, layer_types
all "full_attention", sliding windows off, plus the drafter's fields: DeepSpec's
`block_size, mask_token_id, target_layer_ids, num_anchors, num_target_layers, markov_rank,
markov_head_type, enable_confidence_head, confidence_head_with_markov` for DSpark/DFlash and
`target_layer_ids, ttt_length, step_loss_decay, draft_num_hidden_layers, num_target_layers` for
Eagle3. Ours: `num_speculative_tokens` (proposal length of Eagle3 / standalone / n-gram) and
`confidence_temperatures` (the STS calibration of a DSpark confidence head: one temperature per
block slot; absent = all ones; `set_confidence_temperatures` updates it in place). These have
no tensors, so a checkpoint with them still loads in DeepSpec, which ignores unknown fields.

Draft vocabulary (`specjax.drafters.vocab`): a drafter over N < V target tokens writes
`draft_vocab_size: N` (SpecForge's EAGLE-3 field; for DSpark/DFlash and MTP-1 an extension of
ours: absent means the full vocabulary, so ordinary DeepSpec checkpoints load unchanged) and
EAGLE-3's tensors `d2t` int64 [N] (target id = draft id + d2t[draft id]) and `t2d` bool [V]; its
`lm_head.weight` (MTP: `shared_head.head.weight`) is [N, H] and a Markov head's
`markov_w1.weight` [N+1, r] / `markov_w2.weight` [N, r]. A file whose `draft_vocab_size` equals
`vocab_size` is a full-vocabulary drafter (its `d2t`/`t2d`, if any, must be identity maps).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.checkpoints.common import KeyMap, write_config_json
from specjax.config import SUPPORTED_ARCHITECTURES, ConfigError, TargetConfig, read_json

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
EAGLE3_ARCHITECTURE = "Qwen3Eagle3Model"
EAGLE3_ARCHITECTURE_ALIASES = ("Eagle3DraftModel", "LlamaForCausalLMEagle3")
MTP_ARCHITECTURE = "SpecjaxMTPDrafter"
STANDALONE_ARCHITECTURE = "SpecjaxStandaloneDrafter"
STANDALONE_FIELD = "specjax_drafter"  # value "standalone" on a CausalLM config
NGRAM_ARCHITECTURE = "SpecjaxNGramDrafter"
GAMMA_FIELD = "num_speculative_tokens"
CONFIDENCE_TEMPERATURES_FIELD = "confidence_temperatures"
DEFAULT_NUM_ANCHORS = 512
_CAUSAL_LMS = tuple(a for a in SUPPORTED_ARCHITECTURES if a.endswith("ForCausalLM"))
_EAGLE3_VOCAB_MAPS = ("d2t", "t2d")  # SpecForge/EAGLE3 reduced-vocabulary maps


def _drafter_variable_types() -> tuple[type, ...]:
    from specjax.drafters.block import Frozen

    return (nnx.Param, Frozen)


def dspark_key_map() -> KeyMap:
    """DSpark/DFlash drafter <-> DeepSpec `Qwen3DSparkModel` names (our paths mirror them)."""
    return KeyMap(variable_types=_drafter_variable_types())


def eagle3_key_map(layout: str = "deepspec") -> KeyMap:
    """Eagle3 drafter <-> `layers.0.*` (layout "deepspec") or `midlayer.*` ("midlayer")."""
    if layout == "deepspec":
        return KeyMap(prefix_map={"midlayer.": "layers.0."}, variable_types=_drafter_variable_types())
    if layout == "midlayer":
        return KeyMap(variable_types=_drafter_variable_types())
    raise ValueError(f"unknown Eagle3 layout {layout!r} (known: 'deepspec', 'midlayer')")


def eagle3_layout(names: Iterable[str]) -> str:
    """"midlayer" if a checkpoint's tensors use SpecForge's `midlayer.` names, else "deepspec"."""
    return "midlayer" if any(n.startswith("midlayer.") for n in names) else "deepspec"


def mtp_key_map() -> KeyMap:
    """MTP-1 drafter <-> DeepSeek-V3 MTP layer names (our paths mirror them)."""
    return KeyMap(variable_types=_drafter_variable_types())


def standalone_key_map() -> KeyMap:
    """Standalone drafter (its LM held as `model`) <-> plain CausalLM names."""
    return KeyMap(prefix_map={"model.": ""})


def draft_vocab_tensors(tensors: Mapping[str, np.ndarray], vocab_size: int,
                        draft_vocab_size: int, source: str) -> tuple[np.ndarray | None, list[str]]:
    """(draft ids [N] or None, names of the `d2t`/`t2d` tensors present) of a checkpoint.

    With draft_vocab_size 0 only identity maps over the full vocabulary may be present; with
    N > 0 `d2t` is required and `t2d`, when present, must mark the same ids (ValueError)."""
    from specjax.drafters import vocab as dv

    present = [n for n in _EAGLE3_VOCAB_MAPS if n in tensors]
    if draft_vocab_size == 0:
        for name in present:
            arr = np.asarray(tensors[name])
            identity = (arr.shape == (vocab_size,) and
                        (not np.any(arr) if name == "d2t" else bool(np.all(arr))))
            if not identity:
                raise ValueError(f"{source}: tensor '{name}' {list(arr.shape)} maps a reduced "
                                 f"draft vocabulary but config.json has no 'draft_vocab_size' "
                                 f"below vocab_size ({vocab_size})")
        return None, present
    if "d2t" not in tensors:
        raise ValueError(f"{source}: config.json sets draft_vocab_size={draft_vocab_size} but the "
                         f"checkpoint has no tensor 'd2t'")
    ids = dv.draft_ids_from_tensors(np.asarray(tensors["d2t"]),
                                    np.asarray(tensors["t2d"]) if "t2d" in tensors else None,
                                    vocab_size, source)
    if ids.size != draft_vocab_size:
        raise ValueError(f"{source}: tensor 'd2t' has {ids.size} entries, config.json "
                         f"draft_vocab_size is {draft_vocab_size}")
    return ids, present


def draft_vocab_hf_tensors(draft_ids: np.ndarray, vocab_size: int) -> list[tuple[str, np.ndarray]]:
    """EAGLE-3's `d2t` (int64 offsets [N]) and `t2d` (bool [V]) tensors of a draft vocabulary."""
    from specjax.drafters import vocab as dv

    return [("d2t", dv.d2t_offsets(draft_ids)), ("t2d", dv.t2d_mask(draft_ids, vocab_size))]


def _draft_vocab_size(d: Mapping[str, Any], vocab_size: int, source: str) -> int:
    """config.json `draft_vocab_size`: absent or equal to vocab_size -> 0 (full vocabulary)."""
    if d.get("draft_vocab_size") is None:
        return 0
    n = _int_field(d, "draft_vocab_size", source, minimum=1)
    if n > vocab_size:
        raise ConfigError(f"{source}: field 'draft_vocab_size' ({n}) exceeds 'vocab_size' "
                          f"({vocab_size})")
    return 0 if n == vocab_size else n


def _set_draft_vocab_size(d: dict[str, Any], n: int) -> None:
    if n:
        d["draft_vocab_size"] = int(n)
    else:
        d.pop("draft_vocab_size", None)


# -- config.json reading -----------------------------------------------------------------------

def read_drafter_config(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """(config.json mapping, its path) of a drafter directory; ConfigError names what is missing."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ConfigError(f"drafter directory does not exist: {path}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ConfigError(f"no config.json in drafter directory {path} (expected {cfg_path})")
    d = read_json(cfg_path)
    if not isinstance(d, dict):
        raise ConfigError(f"{cfg_path}: top level must be a JSON object")
    return d, cfg_path


def drafter_architecture(d: Mapping[str, Any], source: str = "config.json") -> str:
    """The drafter kind of a config.json: "dspark" (DSpark or DFlash), "eagle3", "mtp",
    "standalone" or "ngram"; ConfigError names an unknown `architectures[0]`."""
    archs = d.get("architectures")
    if not isinstance(archs, (list, tuple)) or not archs or not isinstance(archs[0], str):
        raise ConfigError(f"{source}: field 'architectures' must be a non-empty list of names, "
                          f"got {archs!r}")
    arch = archs[0]
    if arch == DSPARK_ARCHITECTURE:
        return "dspark"
    if arch == EAGLE3_ARCHITECTURE or arch in EAGLE3_ARCHITECTURE_ALIASES:
        return "eagle3"
    if arch == MTP_ARCHITECTURE:
        return "mtp"
    if arch == NGRAM_ARCHITECTURE:
        return "ngram"
    if arch == STANDALONE_ARCHITECTURE or arch in _CAUSAL_LMS:
        return "standalone"
    known = [DSPARK_ARCHITECTURE, EAGLE3_ARCHITECTURE, *EAGLE3_ARCHITECTURE_ALIASES,
             MTP_ARCHITECTURE, STANDALONE_ARCHITECTURE, *_CAUSAL_LMS, NGRAM_ARCHITECTURE]
    raise ConfigError(f"{source}: unsupported drafter architecture {arch!r} "
                      f"(supported: {', '.join(known)})")


def _require(d: Mapping[str, Any], source: str, *names: str) -> None:
    missing = [n for n in names if d.get(n) is None]
    if missing:
        raise ConfigError(f"{source}: missing field(s) {missing}")


def _int_field(d: Mapping[str, Any], name: str, source: str, *, minimum: int | None = None) -> int:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or \
            (minimum is not None and v < minimum):
        at_least = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"{source}: field '{name}' must be an integer{at_least}, got {v!r}")
    return int(v)


def _int_list_field(d: Mapping[str, Any], name: str, source: str) -> tuple[int, ...]:
    v = d.get(name)
    if not isinstance(v, (list, tuple)) or not v or any(
            isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in v):
        raise ConfigError(f"{source}: field '{name}' must be a non-empty list of integers, "
                          f"got {v!r}")
    return tuple(int(i) for i in v)


def _bool_field(d: Mapping[str, Any], name: str, source: str) -> bool:
    v = d.get(name)
    if not isinstance(v, bool):
        raise ConfigError(f"{source}: field '{name}' must be true or false, got {v!r}")
    return v


def _qwen3_layers_from_hf(d: Mapping[str, Any], source: str) -> TargetConfig:
    """The Qwen3 layer fields of a drafter config.json (both rope dialects) as a TargetConfig;
    rejects what the drafter layers cannot run (sliding windows, attention biases, other MLPs)."""
    if d.get("model_type", "qwen3") not in ("qwen3", None):
        raise ConfigError(f"{source}: unsupported model_type {d.get('model_type')!r} (need 'qwen3')")
    if d.get("hidden_act", "silu") not in ("silu", None):
        raise ConfigError(f"{source}: field 'hidden_act' must be 'silu', got {d.get('hidden_act')!r}")
    if d.get("attention_bias"):
        raise ConfigError(f"{source}: field 'attention_bias' true is not supported")
    if d.get("use_sliding_window"):
        raise ConfigError(f"{source}: field 'use_sliding_window' true is not supported "
                          f"(drafter layers use full attention)")
    types = d.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise ConfigError(f"{source}: field 'layer_types' must be all 'full_attention', "
                          f"got {sorted(set(types))}")
    return TargetConfig.from_hf_dict({**d, "architectures": ["Qwen3ForCausalLM"]}, source=source)


def _one_layer_from_hf(d: Mapping[str, Any], source: str, kind: str) -> TargetConfig:
    """The layer config of a one-layer drafter (Eagle3, MTP-1); ConfigError names the field."""
    tc = _qwen3_layers_from_hf(d, source)
    if tc.num_hidden_layers != 1:
        raise ConfigError(f"{source}: field 'num_hidden_layers' must be 1 for {kind} drafter, "
                          f"got {tc.num_hidden_layers}")
    return tc


def _layer_dims(tc: TargetConfig) -> dict[str, Any]:
    return dict(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                intermediate_size=tc.intermediate_size,
                num_attention_heads=tc.num_attention_heads,
                num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
                rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, rope_type=tc.rope_type,
                rope_factor=tc.rope_factor)


def _check_layer_ids_vs_count(ids: Sequence[int], d: Mapping[str, Any], source: str) -> None:
    n = d.get("num_target_layers")
    if n is None:
        return
    n = _int_field(d, "num_target_layers", source, minimum=1)
    bad = [i for i in ids if not -1 <= i < n]
    if bad:
        raise ConfigError(f"{source}: field 'target_layer_ids' has {bad} outside [-1, "
                          f"num_target_layers={n})")


def block_drafter_config_from_hf(d: Mapping[str, Any], *, source: str = "config.json"):
    """A `BlockDrafterConfig` from a DeepSpec `Qwen3DSparkModel` config.json mapping.

    DeepSpec writes `markov_head_type` only when markov_rank > 0 and `confidence_head_with_markov`
    only when the confidence head is on; both are then required."""
    from specjax.drafters.block import MARKOV_HEAD_TYPES, BlockDrafterConfig

    if drafter_architecture(d, source) != "dspark":
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not "
                          f"{DSPARK_ARCHITECTURE!r}")
    tc = _qwen3_layers_from_hf(d, source)
    _require(d, source, "target_layer_ids", "mask_token_id", "block_size", "markov_rank",
             "enable_confidence_head")
    if d.get("enable_d2_feature"):
        raise ConfigError(f"{source}: field 'enable_d2_feature' true is not supported")
    rank = _int_field(d, "markov_rank", source, minimum=0)
    head_type = "vanilla"
    if rank > 0:
        _require(d, source, "markov_head_type")
        head_type = str(d["markov_head_type"]).lower()
        if head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"{source}: field 'markov_head_type' {d['markov_head_type']!r} is not "
                              f"supported (supported: {', '.join(MARKOV_HEAD_TYPES)})")
    conf = _bool_field(d, "enable_confidence_head", source)
    if conf:
        _require(d, source, "confidence_head_with_markov")
    with_markov = (_bool_field(d, "confidence_head_with_markov", source)
                   if d.get("confidence_head_with_markov") is not None else rank > 0)
    ids = _int_list_field(d, "target_layer_ids", source)
    _check_layer_ids_vs_count(ids, d, source)
    try:
        return BlockDrafterConfig(
            **_layer_dims(tc), target_layer_ids=ids,
            mask_token_id=_int_field(d, "mask_token_id", source, minimum=0),
            num_draft_layers=tc.num_hidden_layers,
            block_size=_int_field(d, "block_size", source, minimum=1), markov_rank=rank,
            markov_head_type=head_type, confidence_head=conf,
            confidence_head_with_markov=with_markov,
            draft_vocab_size=_draft_vocab_size(d, tc.vocab_size, source))
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


def eagle3_config_from_hf(d: Mapping[str, Any], *, source: str = "config.json"):
    """An `Eagle3Config` from an Eagle3 config.json mapping (DeepSpec `Qwen3Eagle3Model`; the tap
    layers may also come from SpecForge's `eagle_config.eagle_aux_hidden_state_layer_ids`).
    gamma = `num_speculative_tokens`, else `ttt_length` (DeepSpec proposes ttt_length tokens)."""
    from specjax.drafters.eagle3 import Eagle3Config

    if drafter_architecture(d, source) != "eagle3":
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not an Eagle3 "
                          f"architecture")
    tc = _one_layer_from_hf(d, source, "an Eagle3")
    src = d
    if d.get("target_layer_ids") is None and isinstance(d.get("eagle_config"), Mapping) and \
            d["eagle_config"].get("eagle_aux_hidden_state_layer_ids") is not None:
        src = {"target_layer_ids": d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]}
    _require(src, source, "target_layer_ids")
    ids = _int_list_field(src, "target_layer_ids", source)
    _check_layer_ids_vs_count(ids, d, source)
    ttt = _int_field(d, "ttt_length", source, minimum=1) if d.get("ttt_length") is not None else 7
    decay = d.get("step_loss_decay", 0.8)
    if isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise ConfigError(f"{source}: field 'step_loss_decay' must be a number, got {decay!r}")
    gamma = _int_field(d, GAMMA_FIELD, source, minimum=1) if d.get(GAMMA_FIELD) is not None else ttt
    try:
        return Eagle3Config(**_layer_dims(tc), target_layer_ids=ids, gamma=gamma, ttt_length=ttt,
                            step_loss_decay=float(decay),
                            draft_vocab_size=_draft_vocab_size(d, tc.vocab_size, source))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def mtp_config_from_hf(d: Mapping[str, Any], *, source: str = "config.json"):
    """An `MTPConfig` from a `SpecjaxMTPDrafter` config.json mapping."""
    from specjax.drafters.mtp import MTPConfig

    if drafter_architecture(d, source) != "mtp":
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not "
                          f"{MTP_ARCHITECTURE!r}")
    tc = _one_layer_from_hf(d, source, "an MTP-1")
    try:
        return MTPConfig(**_layer_dims(tc),
                         draft_vocab_size=_draft_vocab_size(d, tc.vocab_size, source))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def standalone_config_from_hf(d: Mapping[str, Any], *, source: str = "config.json",
                              default_gamma: int = 4) -> tuple[TargetConfig, int]:
    """(the draft LM's TargetConfig, gamma) of a standalone drafter config.json: a Qwen3, Llama
    or Qwen2 CausalLM config (with or without `specjax_drafter: "standalone"`; architectures
    `SpecjaxStandaloneDrafter` takes the family from `model_type`, default qwen3); gamma =
    `num_speculative_tokens` or `default_gamma`."""
    if drafter_architecture(d, source) != "standalone":
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not a standalone "
                          f"draft LM")
    marker = d.get(STANDALONE_FIELD)
    if marker is not None and marker != "standalone":
        raise ConfigError(f"{source}: field '{STANDALONE_FIELD}' must be 'standalone', "
                          f"got {marker!r}")
    lm = dict(d)
    if d["architectures"][0] == STANDALONE_ARCHITECTURE:
        lm["architectures"] = []  # the family comes from model_type
    tc = TargetConfig.from_hf_dict(lm, source=source)
    if d.get(GAMMA_FIELD) is not None:
        return tc, _int_field(d, GAMMA_FIELD, source, minimum=1)
    return tc, default_gamma


def ngram_config_from_hf(d: Mapping[str, Any], *,
                         source: str = "config.json") -> dict[str, int | None]:
    """The n-gram drafter's fields: {vocab_size (or None), gamma, max_ngram, min_ngram}."""
    if drafter_architecture(d, source) != "ngram":
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not "
                          f"{NGRAM_ARCHITECTURE!r}")
    out: dict[str, int | None] = {"vocab_size": None, "gamma": 4, "max_ngram": 3, "min_ngram": 1}
    if d.get("vocab_size") is not None:
        out["vocab_size"] = _int_field(d, "vocab_size", source, minimum=1)
    for ours, field in (("gamma", GAMMA_FIELD), ("max_ngram", "max_ngram"),
                        ("min_ngram", "min_ngram")):
        if d.get(field) is not None:
            out[ours] = _int_field(d, field, source, minimum=1)
    if out["min_ngram"] > out["max_ngram"]:
        raise ConfigError(f"{source}: field 'min_ngram' ({out['min_ngram']}) exceeds "
                          f"'max_ngram' ({out['max_ngram']})")
    return out


# -- config.json writing -----------------------------------------------------------------------

def target_hf_base(target_config: Any) -> tuple[dict[str, Any] | None, TargetConfig | None]:
    """(a deep copy of the target's HF config mapping or None, the target's TargetConfig or None)
    from a TargetConfig, an HF config mapping, a checkpoint directory or config.json path, a
    CausalLM (its `.config`) or None."""
    import copy

    if target_config is None:
        return None, None
    if isinstance(target_config, TargetConfig):
        return target_config.to_hf_dict(), target_config
    if isinstance(target_config, (str, os.PathLike)):
        p = os.fspath(target_config)
        p = os.path.join(p, "config.json") if os.path.isdir(p) else p
        d = read_json(p)
        return copy.deepcopy(d), TargetConfig.from_hf_dict(d, source=p)
    if isinstance(target_config, Mapping):
        d = copy.deepcopy(dict(target_config))
        return d, TargetConfig.from_hf_dict(d, source="target_config")
    cfg = getattr(target_config, "config", None)
    if isinstance(cfg, TargetConfig):
        return cfg.to_hf_dict(), cfg
    raise ValueError(f"target_config must be a TargetConfig, an HF config mapping, a checkpoint "
                     f"path or a target model, got {type(target_config).__name__}")


def _set_rope(d: dict[str, Any], theta: float, rope_type: str, factor: float) -> None:
    """Write RoPE settings in the dialect `d` already uses (transformers 5's `rope_parameters`
    when present, else top-level `rope_theta` / `rope_scaling`)."""
    if isinstance(d.get("rope_parameters"), Mapping):
        rp: dict[str, Any] = {"rope_type": rope_type, "rope_theta": float(theta)}
        if rope_type != "default":
            rp["factor"] = float(factor)
        d["rope_parameters"] = rp
        d.pop("rope_theta", None)
        d.pop("rope_scaling", None)
    else:
        d["rope_theta"] = float(theta)
        d["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type,
                                                                 "factor": float(factor)}


def _draft_layers_dict(base: dict[str, Any] | None, cfg: Any, num_layers: int,
                       architecture: str, dtype: Any) -> dict[str, Any]:
    """The target's config (or a fresh Qwen3 one) with the draft layers' fields set."""
    if base is None:
        base = TargetConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_hidden_layers=num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_type=cfg.rope_type,
            rope_factor=cfg.rope_factor).to_hf_dict()
    d = dict(base)
    d.update(architectures=[architecture], model_type="qwen3", vocab_size=cfg.vocab_size,
             hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
             num_attention_heads=cfg.num_attention_heads,
             num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
             rms_norm_eps=cfg.rms_norm_eps, hidden_act="silu", attention_bias=False,
             num_hidden_layers=num_layers, layer_types=["full_attention"] * num_layers,
             sliding_window=None, use_sliding_window=False, tie_word_embeddings=False)
    d.setdefault("max_window_layers", num_layers)
    _set_rope(d, cfg.rope_theta, cfg.rope_type, cfg.rope_factor)
    d["torch_dtype"] = str(jnp.dtype(dtype))
    if "dtype" in d:
        d["dtype"] = d["torch_dtype"]
    return d


def _merge_extra(d: dict[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    for k, v in (extra or {}).items():
        if k in d and d[k] != v:
            raise ValueError(f"extra config field '{k}' ({v!r}) conflicts with the drafter's "
                             f"value {d[k]!r}")
        d[k] = v
    return d


def block_drafter_hf_config(cfg: Any, target_config: Any = None, *, dtype: Any = "float32",
                            num_anchors: int = DEFAULT_NUM_ANCHORS,
                            confidence_temperatures: Sequence[float] | None = None,
                            extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpec `Qwen3DSparkModel` config.json mapping of a `BlockDrafterConfig`.

    `target_config` (see `target_hf_base`) is deep-copied as the base, so the target's own fields
    and rope dialect are kept; without it a Qwen3 config is built from the drafter's dimensions
    (and `num_target_layers` is left out). `num_anchors` is DeepSpec's training field (required by
    its model class); `extra` adds fields (a conflicting value raises)."""
    base, tcfg = target_hf_base(target_config)
    if tcfg is not None:
        cfg.check_target(tcfg)
    d = _draft_layers_dict(base, cfg, cfg.num_draft_layers, DSPARK_ARCHITECTURE, dtype)
    d.update(block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
             target_layer_ids=list(cfg.target_layer_ids), num_anchors=int(num_anchors),
             markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
             enable_confidence_head=bool(cfg.confidence_head),
             confidence_head_with_markov=bool(cfg.confidence_head_with_markov))
    _set_draft_vocab_size(d, cfg.draft_vocab_size)
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
    d = _merge_extra(d, extra)
    back = block_drafter_config_from_hf(d, source="the written config.json")
    if back != cfg:  # the written file must describe exactly this drafter
        raise RuntimeError(f"internal error: config.json does not round-trip ({back} != {cfg})")
    return d


def eagle3_hf_config(cfg: Any, target_config: Any = None, *, dtype: Any = "float32",
                     extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpec `Qwen3Eagle3Model` config.json mapping of an `Eagle3Config` (plus our
    `num_speculative_tokens` = gamma)."""
    base, tcfg = target_hf_base(target_config)
    if tcfg is not None:
        cfg.check_target(tcfg)
    d = _draft_layers_dict(base, cfg, 1, EAGLE3_ARCHITECTURE, dtype)
    d.update(target_layer_ids=list(cfg.target_layer_ids), ttt_length=cfg.ttt_length,
             step_loss_decay=float(cfg.step_loss_decay), draft_num_hidden_layers=1,
             **{GAMMA_FIELD: cfg.gamma})
    _set_draft_vocab_size(d, cfg.draft_vocab_size)
    if tcfg is not None:
        d["num_target_layers"] = tcfg.num_hidden_layers
    else:
        d.pop("num_target_layers", None)
    d = _merge_extra(d, extra)
    back = eagle3_config_from_hf(d, source="the written config.json")
    if back != cfg:
        raise RuntimeError(f"internal error: config.json does not round-trip ({back} != {cfg})")
    return d


def mtp_hf_config(cfg: Any, target_config: Any = None, *, dtype: Any = "float32",
                  extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `SpecjaxMTPDrafter` config.json mapping of an `MTPConfig` (one layer, gamma 1)."""
    base, tcfg = target_hf_base(target_config)
    if tcfg is not None:
        cfg.check_target(tcfg)
    d = _draft_layers_dict(base, cfg, 1, MTP_ARCHITECTURE, dtype)
    d[GAMMA_FIELD] = 1
    _set_draft_vocab_size(d, cfg.draft_vocab_size)
    if tcfg is not None:
        d["num_target_layers"] = tcfg.num_hidden_layers
    d = _merge_extra(d, extra)
    back = mtp_config_from_hf(d, source="the written config.json")
    if back != cfg:
        raise RuntimeError(f"internal error: config.json does not round-trip ({back} != {cfg})")
    return d


def standalone_hf_config(model_config: TargetConfig, gamma: int, *, dtype: Any = "float32",
                         extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A CausalLM config.json mapping (loadable by transformers) marked as a standalone
    drafter with its proposal length."""
    d = model_config.to_hf_dict()
    d["torch_dtype"] = str(jnp.dtype(dtype))
    d[STANDALONE_FIELD] = "standalone"
    d[GAMMA_FIELD] = int(gamma)
    return _merge_extra(d, extra)


def ngram_hf_config(vocab_size: int, gamma: int, max_ngram: int, min_ngram: int, *,
                    extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `SpecjaxNGramDrafter` config.json mapping (no tensors)."""
    d = {"architectures": [NGRAM_ARCHITECTURE], "vocab_size": int(vocab_size),
         GAMMA_FIELD: int(gamma), "max_ngram": int(max_ngram), "min_ngram": int(min_ngram)}
    return _merge_extra(d, extra)



def set_confidence_temperatures(path: str | os.PathLike, temps: Sequence[float]) -> None:
    """Store STS temperatures (one per block slot) in a DSpark drafter directory's config.json."""
    d, source = read_drafter_config(path)
    cfg = block_drafter_config_from_hf(d, source=source)
    if not cfg.confidence_head:
        raise ConfigError(f"{source}: the drafter has no confidence head "
                          f"(enable_confidence_head: false)")
    d[CONFIDENCE_TEMPERATURES_FIELD] = [float(t) for t in temps]
    confidence_temperatures_from_hf(d, cfg.block_size, source)
    write_config_json(path, d)
