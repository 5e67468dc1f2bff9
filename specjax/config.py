"""Frozen dataclass configs with YAML load/save and validation.

`TargetConfig` describes a Qwen3, Llama or Qwen2 decoder and is read from (and written to) a Hugging
Face `config.json`; both config dialects are understood (top-level `rope_theta`/`rope_scaling` of
older checkpoints and transformers 5's `rope_parameters`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from typing import Any, Mapping, TypeVar

import yaml

T = TypeVar("T")



class ConfigError(ValueError):
    """A config file or field is invalid; the message names the field (and file)."""


def _coerce(value: Any, tp: Any, field: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return _coerce(value, non_none[0], field) if len(non_none) == 1 else value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"field '{field}' must be a list, got {value!r}")
        inner = args[0] if args else Any
        return tuple(_coerce(v, inner, field) for v in value)
    if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
        return from_dict(tp, value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"field '{field}' must be an integer, got {value!r}")
    if tp in (int, str, bool) and not isinstance(value, tp):
        raise ConfigError(f"field '{field}' must be {tp.__name__}, got {value!r}")
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], *, source: str = "") -> T:
    """Build a frozen dataclass from a mapping; unknown keys and wrong types raise ConfigError.
    A class with its own reader (`cls.from_mapping(data, source=...)`) is read by it."""
    reader = getattr(cls, "from_mapping", None)
    if reader is not None:
        return reader(data, source=source)
    return fields_from_dict(cls, data, source=source)


def fields_from_dict(cls: type[T], data: Mapping[str, Any], *, source: str = "") -> T:
    """`from_dict` field by field (for a class's own reader)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    where = f" in {source}" if source else ""
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown} for {cls.__name__}{where}")
    kwargs = {}
    for k, v in data.items():
        try:
            kwargs[k] = _coerce(v, hints[k], k)
        except ConfigError as e:
            raise ConfigError(f"{e}{where}") from None
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{cls.__name__}{where}: {e}") from None
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as plain YAML/JSON-able data (tuples become lists)."""
    def conv(v: Any) -> Any:
        if hasattr(v, "config_dict"):  # a class with its own layout (the inverse of from_mapping)
            return v.config_dict()
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        return v
    return conv(obj)


def coerce_floats(obj: Any) -> None:
    """Accept YAML 1.1 number strings such as '6e-4' for a frozen dataclass's float fields; reject
    other non-numbers (ConfigError names the field)."""
    for f in dataclasses.fields(obj):
        if f.type not in ("float", "float | None"):
            continue
        v = getattr(obj, f.name)
        if v is None and f.type == "float | None":
            continue
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                raise ConfigError(f"field '{f.name}' must be a number, got {v!r}") from None
            object.__setattr__(obj, f.name, v)
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"field '{f.name}' must be a number, got {v!r}")
        else:
            object.__setattr__(obj, f.name, float(v))


def check_positive(obj: Any, *names: str) -> None:
    """ConfigError unless each named field is None or > 0."""
    for n in names:
        v = getattr(obj, n)
        if v is not None and not v > 0:
            raise ConfigError(f"field '{n}' must be > 0, got {v!r}")


def check_non_negative(obj: Any, *names: str) -> None:
    """ConfigError unless each named field is >= 0."""
    for n in names:
        if getattr(obj, n) < 0:
            raise ConfigError(f"field '{n}' must be >= 0, got {getattr(obj, n)!r}")


def read_yaml_mapping(path: str | os.PathLike) -> Mapping[str, Any]:
    """The top-level mapping of a YAML file (errors name the file)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def load_yaml(cls: type[T], path: str | os.PathLike) -> T:
    """Load a config dataclass from a YAML file."""
    return from_dict(cls, read_yaml_mapping(path), source=os.fspath(path))


def save_yaml(obj: Any, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(obj), f, sort_keys=False)


# Decoder families one `CausalLM` serves, switched by config fields (reference: the Hugging Face
# configs). model_type -> (architectures accepted, q/k RMSNorm, default q/k/v bias).
FAMILIES: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "qwen3": (("Qwen3ForCausalLM", "Qwen3Model"), True, False),
    "llama": (("LlamaForCausalLM", "LlamaModel"), False, False),
    "qwen2": (("Qwen2ForCausalLM", "Qwen2Model"), False, True),
}
SUPPORTED_ARCHITECTURES = tuple(a for archs, _, _ in FAMILIES.values() for a in archs)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu",)


def family_of(architecture: str, *, source: str = "config.json") -> str:
    """The model_type ("qwen3", "llama", "qwen2") of a Hugging Face architecture name."""
    for model_type, (archs, _, _) in FAMILIES.items():
        if architecture in archs:
            return model_type
    raise ConfigError(f"{source}: unsupported architecture {architecture!r}; supported: "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)}")


LAYER_DIM_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim")


def check_layer_dims(cfg: Any, *extra: str) -> None:
    """The layer-dimension checks every model config shares (the target's and each drafter's
    `LayerDims`): LAYER_DIM_FIELDS and `extra` positive integers, query heads a multiple of K/V
    heads. ConfigError names the field."""
    for name in LAYER_DIM_FIELDS + extra:
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"field '{name}' must be an integer > 0, got {v!r}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"field 'num_attention_heads' ({cfg.num_attention_heads}) must be a "
                          f"multiple of 'num_key_value_heads' ({cfg.num_key_value_heads})")


def _hf_architecture(d: Mapping[str, Any], source: str) -> tuple[str, str]:
    """(architecture, family) of a Hugging Face config: from `architectures[0]` (which must agree
    with `model_type`), else from `model_type` (default qwen3)."""
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if archs:
        arch = archs[0]
        family = family_of(arch, source=source)
        if model_type is not None and model_type != family:
            raise ConfigError(f"{source}: model_type {model_type!r} does not match architecture "
                              f"{arch!r} (expected {family!r})")
        return arch, family
    family = model_type or "qwen3"
    if family not in FAMILIES:
        raise ConfigError(f"{source}: unsupported model_type {family!r}; supported: "
                          f"{', '.join(FAMILIES)}")
    return FAMILIES[family][0][0], family


def _check_hf_fields(d: Mapping[str, Any], family: str, source: str) -> None:
    """ConfigError naming a missing required field or an unsupported value."""
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    if missing:
        raise ConfigError(f"{source}: missing field(s) {missing}")
    act = d.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    if d.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias true is not supported (supported: false)")
    if family != "qwen3" and d.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window true is not supported (supported: false)")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A dense decoder of the Qwen3, Llama or Qwen2 family (field names follow Hugging Face).

    The families differ only in fields: `qk_norm` (per-head q/k RMSNorm: Qwen3), `attention_bias`
    (q/k/v projection bias: Qwen2, optional in Llama), `tie_word_embeddings` and the RoPE scaling
    (`rope_type` default / linear / llama3 with its low/high frequency factors and original context).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "Qwen3ForCausalLM"
    model_type: str = "qwen3"
    qk_norm: bool = True
    attention_bias: bool = False

    def __post_init__(self) -> None:
        check_layer_dims(self, "num_hidden_layers")
        if self.model_type not in FAMILIES:
            raise ConfigError(f"field 'model_type' {self.model_type!r} is not supported "
                              f"(supported: {', '.join(FAMILIES)})")
        if family_of(self.architecture, source="field 'architecture'") != self.model_type:
            raise ConfigError(f"field 'architecture' {self.architecture!r} does not belong to "
                              f"model_type {self.model_type!r}")
        _, family_qk_norm, _ = FAMILIES[self.model_type]
        if self.qk_norm != family_qk_norm:
            raise ConfigError(f"field 'qk_norm' must be {family_qk_norm} for model_type "
                              f"{self.model_type!r}, got {self.qk_norm}")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ConfigError("field 'attention_bias' must be true for model_type 'qwen2'")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope_scaling type '{self.rope_type}' is not supported "
                              f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if self.rope_factor <= 0:
            raise ConfigError(f"rope_scaling field 'factor' must be > 0, got {self.rope_factor}")
        if self.rope_type == "llama3" and not (
                0 < self.rope_low_freq_factor < self.rope_high_freq_factor
                and self.rope_original_max_position_embeddings > 0):
            raise ConfigError("rope_scaling (llama3) needs 0 < low_freq_factor < high_freq_factor "
                              "and original_max_position_embeddings > 0, got "
                              f"{self.rope_low_freq_factor}, {self.rope_high_freq_factor}, "
                              f"{self.rope_original_max_position_embeddings}")

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rope_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `layers.apply_rope` for this config's RoPE."""
        return dict(theta=self.rope_theta, rope_type=self.rope_type, factor=self.rope_factor,
                    low_freq_factor=self.rope_low_freq_factor,
                    high_freq_factor=self.rope_high_freq_factor,
                    original_max_position=self.rope_original_max_position_embeddings)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], *, source: str = "config.json") -> "TargetConfig":
        """Parse a Hugging Face Qwen3 / Llama / Qwen2 `config.json` mapping (both rope dialects).

        Unsupported architectures or field values raise ConfigError naming them and what is
        supported."""
        arch, family = _hf_architecture(d, source)
        _check_hf_fields(d, family, source)
        _, qk_norm, default_bias = FAMILIES[family]
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or {}
        theta = d.get("rope_theta") or rope.get("rope_theta") or 10000.0
        params = dict(rope)
        params.update(scaling)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        nh = int(d["num_attention_heads"])
        try:
            return cls(
                vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]), num_attention_heads=nh,
                num_key_value_heads=int(d.get("num_key_value_heads") or nh),
                head_dim=int(d.get("head_dim") or d["hidden_size"] // nh),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                rope_type=str(rope_type), rope_factor=float(params.get("factor", 1.0) or 1.0),
                rope_low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                rope_high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                rope_original_max_position_embeddings=int(
                    params.get("original_max_position_embeddings", 8192)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
                bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids, architecture=arch,
                model_type=family, qk_norm=qk_norm,
                attention_bias=bool(d.get("attention_bias", default_bias)))
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` mapping that transformers loads as this config's architecture."""
        rope_scaling: dict[str, Any] | None = None
        if self.rope_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": self.rope_factor}
        elif self.rope_type == "llama3":
            rope_scaling = {"rope_type": "llama3", "factor": self.rope_factor,
                            "low_freq_factor": self.rope_low_freq_factor,
                            "high_freq_factor": self.rope_high_freq_factor,
                            "original_max_position_embeddings":
                                self.rope_original_max_position_embeddings}
        eos: Any = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else (
            self.eos_token_ids[0] if self.eos_token_ids else None)
        arch = self.architecture if self.architecture.endswith("ForCausalLM") else \
            FAMILIES[self.model_type][0][0]
        d: dict[str, Any] = {
            "architectures": [arch], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_dropout": 0.0, "bos_token_id": self.bos_token_id, "eos_token_id": eos,
            "torch_dtype": "float32",
        }
        if self.model_type == "qwen3":
            d.update(attention_bias=self.attention_bias, use_sliding_window=False, sliding_window=None)
        elif self.model_type == "llama":
            d.update(attention_bias=self.attention_bias, mlp_bias=False)
        elif self.model_type == "qwen2":
            d.update(use_sliding_window=False, sliding_window=None)
        return d


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"missing file: {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
