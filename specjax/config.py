"""Frozen dataclass configs with YAML load/save and validation.

`TargetConfig` describes a Qwen3-architecture decoder and is read from (and written to) a Hugging
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

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model")
SUPPORTED_ROPE_TYPES = ("default", "linear")


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
    """Build a frozen dataclass from a mapping; unknown keys and wrong types raise ConfigError."""
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
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        return v
    return conv(obj)


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


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A Qwen3 dense decoder. Field names follow the Hugging Face `Qwen3Config`."""

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
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "Qwen3ForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"field '{name}' must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"field 'num_attention_heads' ({self.num_attention_heads}) must be a multiple of "
                f"'num_key_value_heads' ({self.num_key_value_heads})")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope_scaling type '{self.rope_type}' is not supported "
                              f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if self.rope_factor <= 0:
            raise ConfigError(f"rope_scaling field 'factor' must be > 0, got {self.rope_factor}")

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], *, source: str = "config.json") -> "TargetConfig":
        """Parse a Hugging Face Qwen3 `config.json` mapping (both rope dialects)."""
        archs = d.get("architectures") or ["Qwen3ForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"{source}: unsupported architectures {archs!r}; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if d.get("model_type", "qwen3") != "qwen3":
            raise ConfigError(f"{source}: unsupported model_type {d.get('model_type')!r} (need 'qwen3')")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {missing}")
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or {}
        theta = d.get("rope_theta") or rope.get("rope_theta") or 10000.0
        params = dict(rope)
        params.update(scaling)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        factor = float(params.get("factor", 1.0) or 1.0)
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
                rope_type=str(rope_type), rope_factor=factor,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
                bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids, architecture=arch)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` mapping that transformers' Qwen3ForCausalLM loads."""
        rope_scaling = None if self.rope_type == "default" else {
            "rope_type": self.rope_type, "factor": self.rope_factor}
        eos: Any = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else (
            self.eos_token_ids[0] if self.eos_token_ids else None)
        return {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
            "sliding_window": None, "bos_token_id": self.bos_token_id, "eos_token_id": eos,
            "torch_dtype": "float32",
        }


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"missing file: {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
