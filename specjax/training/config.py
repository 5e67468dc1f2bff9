"""Frozen dataclass configs for drafter training runs, loaded from YAML with `load_train_config`.

A run is `TrainConfig`: the drafter and its loss (`ModelConfig`), the optimizer (`OptimizerConfig`),
the step count (`ScheduleConfig`), data (`DataConfig`: an offline target cache or online JSONL),
checkpointing, logging, the mesh and an optional learning curve (`CurveConfig`). Defaults follow the shipped DeepSpec DSpark configs
(reference §6.1); the DFlash preset differs only in the loss weights and heads.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import yaml

from specjax.drafters.registry import KINDS, TRAINING_KINDS
from specjax.config import (ConfigError, check_positive, coerce_floats, fields_from_dict,
                            from_dict, read_yaml_mapping, to_dict)

DATA_MODES = ("cache", "online")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping (torch defaults, reference §6.4)."""

    learning_rate: float = 6.0e-4
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1.0e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # <= 0 disables clipping
    warmup_ratio: float = 0.04  # warmup steps = int(warmup_ratio * total_steps)

    def __post_init__(self) -> None:
        coerce_floats(self)
        check_positive(self, "learning_rate", "eps")
        for n in ("b1", "b2"):
            if not 0.0 <= getattr(self, n) < 1.0:
                raise ConfigError(f"field '{n}' must be in [0, 1), got {getattr(self, n)!r}")
        if self.weight_decay < 0:
            raise ConfigError(f"field 'weight_decay' must be >= 0, got {self.weight_decay!r}")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            raise ConfigError(f"field 'warmup_ratio' must be in [0, 1], got {self.warmup_ratio!r}")


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Run length: `total_steps` optimizer steps, or `num_epochs` x steps per epoch when None."""

    num_epochs: int = 10
    total_steps: int | None = None

    def __post_init__(self) -> None:
        check_positive(self, "num_epochs", "total_steps")

    def resolve_total_steps(self, steps_per_epoch: int) -> int:
        """T: total_steps if set, else num_epochs * steps_per_epoch (reference §6.3)."""
        if self.total_steps is not None:
            return self.total_steps
        if steps_per_epoch < 1:
            raise ConfigError("the data set has fewer samples than one global batch "
                              "(data.batch_size); cannot derive total_steps")
        return self.num_epochs * steps_per_epoch


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training data: an offline target cache (`mode: cache`) or chat JSONL run through the frozen
    target inside the step (`mode: online`).

    `batch_size` is the global number of sequences per optimizer step; `micro_batch_size` the number
    per accumulation micro-step (global, over all devices), so grad_accum = batch_size /
    micro_batch_size. Sequences are right-padded to the smallest of `length_buckets` that fits.
    """

    mode: str = "cache"
    cache_dir: str | None = None
    extra_cache_dirs: tuple[str, ...] = ()  # more caches read after cache_dir as one data set
    train_jsonl: tuple[str, ...] = ()
    tokenizer: str | None = None  # tokenizer directory (online mode); default: the target dir
    max_length: int = 4096
    min_loss_tokens: int = 14
    system_prompt: str | None = None
    enable_thinking: bool | None = None
    batch_size: int = 512
    micro_batch_size: int | None = None
    length_buckets: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    seed: int = 42
    shuffle: bool = True
    # tensorstore cache pool of each opened cache directory (mode cache): shard indexes and recently
    # read chunks; None = specjax.training.features.DEFAULT_CACHE_POOL_BYTES, 0 = no pool
    cache_pool_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.cache_pool_bytes is not None and (isinstance(self.cache_pool_bytes, bool) or not isinstance(
                self.cache_pool_bytes, int) or self.cache_pool_bytes < 0):
            raise ConfigError(f"field 'cache_pool_bytes' must be an integer >= 0 (or null), got "
                              f"{self.cache_pool_bytes!r}")
        if self.mode not in DATA_MODES:
            raise ConfigError(f"field 'mode' must be one of {DATA_MODES}, got {self.mode!r}")
        if self.mode == "cache" and not self.cache_dir:
            raise ConfigError("field 'cache_dir' is required when data.mode is 'cache'")
        if self.extra_cache_dirs and self.mode != "cache":
            raise ConfigError("field 'extra_cache_dirs' needs data.mode 'cache'")
        if self.mode == "online" and not self.train_jsonl:
            raise ConfigError("field 'train_jsonl' must list at least one file when data.mode is "
                              "'online'")
        check_positive(self, "max_length", "batch_size", "micro_batch_size")
        if self.min_loss_tokens < 0:
            raise ConfigError(f"field 'min_loss_tokens' must be >= 0, got {self.min_loss_tokens}")
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ConfigError(f"field 'batch_size' ({self.batch_size}) must be a multiple of "
                              f"'micro_batch_size' ({self.micro_batch_size})")
        if not self.length_buckets or any(b <= 0 for b in self.length_buckets):
            raise ConfigError(f"field 'length_buckets' must list positive lengths, got "
                              f"{self.length_buckets!r}")
        if max(self.length_buckets) < self.max_length:
            raise ConfigError(f"field 'length_buckets' must include a bucket >= max_length "
                              f"({self.max_length}), got {self.length_buckets!r}")

    @property
    def grad_accum_steps(self) -> int:
        return 1 if self.micro_batch_size is None else self.batch_size // self.micro_batch_size


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints every `save_every` steps (and at the end / on SIGTERM), `keep` newest."""

    directory: str = "checkpoints/run"
    save_every: int = 3000
    keep: int = 3
    async_save: bool = True
    resume: bool = True

    def __post_init__(self) -> None:
        if not self.directory:
            raise ConfigError("field 'directory' must be a non-empty path")
        check_positive(self, "save_every", "keep")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Metrics every `every` steps to a JSONL file and TensorBoard under `directory`; tqdm bar."""

    directory: str = "logs/run"
    every: int = 10
    jsonl: bool = True
    tensorboard: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        check_positive(self, "every")


@dataclasses.dataclass(frozen=True)
class CurveSet:
    """A named set of prompt files (evaluation rows: `turns`, `conversations` or `prompt`) for the
    learning curve; the first `CurveConfig.prompts` prompts of each file (the evaluation's capped
    order) are used."""

    name: str
    files: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("curve set field 'name' must be a non-empty string")
        if not self.files:
            raise ConfigError(f"curve set {self.name!r}: field 'files' must list one or more prompt files")


@dataclasses.dataclass(frozen=True)
class CurveConfig:
    """A learning curve (`specjax.eval.curve`): every `every` steps (0: none) and at the end of the
    run, the drafter's tau at T=0 on the target's greedy answers (`max_tokens` each) to the prompts
    of each set (prompts of more than `max_prompt_tokens` tokens left out). The greedy texts are made
    once into `texts` (default <logging.directory>/curve_texts.jsonl); the points go to
    <logging.directory>/learning_curve.jsonl."""

    every: int = 0
    sets: tuple[CurveSet, ...] = ()
    prompts: int = 16
    max_prompt_tokens: int = 256
    max_tokens: int = 64
    texts: str | None = None

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"field 'every' must be >= 0, got {self.every}")
        check_positive(self, "prompts", "max_prompt_tokens", "max_tokens")
        names = [s.name for s in self.sets]
        if self.every and not names:
            raise ConfigError("curve: field 'sets' must name one or more prompt sets when 'every' > 0")
        if len(set(names)) != len(names):
            raise ConfigError(f"curve: set names repeat: {names}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Training mesh (data, fsdp, tensor); fsdp 0 means all remaining devices."""

    data: int = 1
    fsdp: int = 0
    tensor: int = 1

    def __post_init__(self) -> None:
        check_positive(self, "data", "tensor")
        if self.fsdp < 0:
            raise ConfigError(f"field 'fsdp' must be >= 0, got {self.fsdp}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The drafter to train: its `kind`, the target it reads (a Hugging Face checkpoint directory
    or GGUF file), dtypes, the init seed, and the kind's own section: a
    `specjax.drafters.registry.KINDS[kind].config` (e.g. `specjax.drafters.dspark_kind.BlockTraining`
    for "dspark": heads, anchors, loss weights; reference §5.1, §6.1).

    In YAML the section's fields sit under `model:` next to `kind` (`from_mapping` splits them;
    a field the kind does not have is an error naming the kind), and `config_dict` writes the same
    layout back.
    """

    kind: str = "dspark"
    target: str = ""
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"  # master weights
    target_dtype: str = "bfloat16"  # the frozen target (online mode)
    init_seed: int = 0
    section: Any = None  # the kind's section; None = its defaults

    def __post_init__(self) -> None:
        if self.kind not in TRAINING_KINDS:
            raise ConfigError(f"field 'kind' must be one of {TRAINING_KINDS}, got {self.kind!r}")
        if not self.target:
            raise ConfigError("field 'target' (the target checkpoint directory) is required")
        for n in ("compute_dtype", "param_dtype", "target_dtype"):
            if getattr(self, n) not in DTYPES:
                raise ConfigError(f"field '{n}' must be one of {DTYPES}, got {getattr(self, n)!r}")
        section_cls = KINDS[self.kind].config
        if self.section is None:
            object.__setattr__(self, "section", section_cls())
        elif type(self.section) is not section_cls:
            raise ConfigError(f"kind {self.kind!r} takes a {section_cls.__name__} section, got "
                              f"{type(self.section).__name__}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "") -> "ModelConfig":
        """Read a `model:` mapping: the fields above plus the kind's section fields, flat."""
        own = {f.name for f in dataclasses.fields(cls)} - {"section"}
        kind = data.get("kind", "dspark")
        if kind not in TRAINING_KINDS:
            raise ConfigError(f"field 'kind' must be one of {TRAINING_KINDS}, got {kind!r}"
                              + (f" in {source}" if source else ""))
        section = fields_from_dict(KINDS[kind].config,
                                   {k: v for k, v in data.items() if k not in own},
                                   source=f"{source} (kind {kind!r})" if source else
                                   f"kind {kind!r}")
        common = {k: v for k, v in data.items() if k in own}
        return fields_from_dict(cls, {**common, "section": section}, source=source)

    def config_dict(self) -> dict[str, Any]:
        """The flat `model:` mapping `from_mapping` reads."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "section"}
        return {**own, **to_dict(self.section)}

    @property
    def draft_vocab_size(self) -> int:
        """The section's draft vocabulary size (0: the full vocabulary, or a kind without one)."""
        return getattr(self.section, "draft_vocab_size", 0)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One drafter training run."""

    model: ModelConfig
    data: DataConfig
    name: str = "run"
    seed: int = 42
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    mesh: MeshConfig = MeshConfig()
    curve: CurveConfig = CurveConfig()
    export_dir: str | None = None  # Hugging Face style export of the final drafter


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        nxt = cur.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
        cur = nxt
    cur[keys[-1]] = value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `section.field=value` overrides (values parsed as YAML) to a config mapping."""
    out = yaml.safe_load(yaml.safe_dump(dict(data))) or {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        _set_path(out, key.strip(), yaml.safe_load(raw))
    return out


def load_train_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a TrainConfig from YAML, then apply `section.field=value` overrides."""
    data = read_yaml_mapping(path)
    return from_dict(TrainConfig, apply_overrides(data, overrides), source=os.fspath(path))


def train_config_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain data for the run's saved copy of its config."""
    return to_dict(cfg)


__all__ = ["CheckpointConfig", "CurveConfig", "CurveSet", "DataConfig", "LoggingConfig", "MeshConfig", "ModelConfig",
           "OptimizerConfig", "ScheduleConfig", "TrainConfig", "apply_overrides",
           "load_train_config", "train_config_dict"]
