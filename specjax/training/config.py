"""Frozen dataclass configs for drafter training runs, loaded from YAML with `load_train_config`.

A run is `TrainConfig`: the drafter and its loss (`ModelConfig`), the optimizer (`OptimizerConfig`),
the step count (`ScheduleConfig`), data (`DataConfig`: an offline target cache or online JSONL),
checkpointing, logging and the mesh. Defaults follow the shipped DeepSpec DSpark configs
(reference §6.1); the DFlash preset differs only in the loss weights and heads.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import yaml

from specjax.config import ConfigError, from_dict, read_yaml_mapping, to_dict

MODEL_KINDS = ("dspark", "dflash", "eagle3", "mtp", "standalone")
BLOCK_KINDS = ("dspark", "dflash")
# kinds that can train from an offline target cache (taps + final hidden); standalone needs the
# target's full logits and trains online
CACHE_KINDS = BLOCK_KINDS + ("eagle3", "mtp")
DATA_MODES = ("cache", "online")
DTYPES = ("float32", "bfloat16", "float16")


def _fix_floats(obj: Any) -> None:
    """Accept YAML 1.1 number strings such as '6e-4' for float fields; reject other non-numbers."""
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


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if v is not None and not v > 0:
            raise ConfigError(f"field '{n}' must be > 0, got {v!r}")


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
        _fix_floats(self)
        _positive(self, "learning_rate", "eps")
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
        _positive(self, "num_epochs", "total_steps")

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
        _positive(self, "max_length", "batch_size", "micro_batch_size")
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
        _positive(self, "save_every", "keep")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Metrics every `every` steps to a JSONL file and TensorBoard under `directory`; tqdm bar."""

    directory: str = "logs/run"
    every: int = 10
    jsonl: bool = True
    tensorboard: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        _positive(self, "every")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Training mesh (data, fsdp, tensor); fsdp 0 means all remaining devices."""

    data: int = 1
    fsdp: int = 0
    tensor: int = 1

    def __post_init__(self) -> None:
        _positive(self, "data", "tensor")
        if self.fsdp < 0:
            raise ConfigError(f"field 'fsdp' must be >= 0, got {self.fsdp}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The drafter to train, the target it reads, and its loss (reference §5.1, §6.1).

    `target` is a Hugging Face Qwen3 checkpoint directory. `target_layer_ids` empty means the
    evenly spaced default. `mask_token_id` None means vocab_size - 1 would be wrong for real
    tokenizers, so it is required for training DSpark / DFlash (Qwen3: 151669).

    Kinds: "dspark" / "dflash" (block drafters), "eagle3" (training-time test over `block_size`
    steps, `ttt_decay`), "mtp" (MTP-1 on the target's final hidden state) and "standalone" (a
    small Qwen3 LM of the `draft_*` dimensions, distilled from the target). The block-only fields
    (markov / confidence heads, anchors) are ignored for the other kinds; `num_draft_layers` is
    the layer count of Eagle3 (1 supported) and of the standalone LM. `draft_vocab_size` N > 0
    makes a dspark / dflash / eagle3 / mtp drafter propose over the N most frequent tokens of
    the training data (`specjax.drafters.vocab`); 0 = the full vocabulary.
    """

    kind: str = "dspark"
    target: str = ""
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
    chunk_anchors: int | None = None  # compute vocabulary-sized terms this many anchors at a time
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"  # master weights
    target_dtype: str = "bfloat16"  # the frozen target (online mode)
    init_seed: int = 0
    # start the drafter's final norm (before its frozen lm_head) at the target's final norm
    # weight instead of one (DeepSpec: one); every kind but standalone, which has its own head
    init_norm_from_target: bool = False
    # dspark / dflash: start the draft layer(s) from target layer L (and L+1, ..) with fc reading
    # tap L-1 (`specjax.drafters.warm_start`); None = random, as DeepSpec
    init_layer_from_target: int | None = None
    draft_vocab_size: int = 0
    # eagle3: decay of the per-step TTT loss weights (the unroll horizon is block_size)
    ttt_decay: float = 0.8
    # the MLP width of the drafter's own layers, every kind (0 = the target's intermediate_size)
    draft_intermediate_size: int = 0
    # standalone: the draft LM's other dimensions (vocabulary, RoPE and EOS are the target's)
    draft_hidden_size: int = 128
    draft_num_attention_heads: int = 2
    draft_num_key_value_heads: int = 1
    draft_head_dim: int = 64

    def __post_init__(self) -> None:
        _fix_floats(self)
        if self.kind not in MODEL_KINDS:
            raise ConfigError(f"field 'kind' must be one of {MODEL_KINDS}, got {self.kind!r}")
        if not self.target:
            raise ConfigError("field 'target' (the target checkpoint directory) is required")
        if self.kind in BLOCK_KINDS and (self.mask_token_id is None or self.mask_token_id < 0):
            raise ConfigError(f"field 'mask_token_id' must be a token id >= 0, got "
                              f"{self.mask_token_id!r}")
        _positive(self, "num_draft_layers", "block_size", "num_anchors", "loss_decay",
                  "chunk_anchors")
        for n in ("alpha_ce", "alpha_tv", "alpha_conf"):
            if getattr(self, n) < 0:
                raise ConfigError(f"field '{n}' must be >= 0, got {getattr(self, n)!r}")
        for n in ("compute_dtype", "param_dtype", "target_dtype"):
            if getattr(self, n) not in DTYPES:
                raise ConfigError(f"field '{n}' must be one of {DTYPES}, got {getattr(self, n)!r}")
        if self.kind == "dflash" and (self.markov_rank or self.confidence_head):
            raise ConfigError("kind 'dflash' has no sequential or confidence head: set "
                              "markov_rank: 0 and confidence_head: false (or use kind 'dspark')")
        if isinstance(self.draft_intermediate_size, bool) or \
                not isinstance(self.draft_intermediate_size, int) or self.draft_intermediate_size < 0:
            raise ConfigError(f"field 'draft_intermediate_size' must be an integer >= 0 (0 = the "
                              f"target's), got {self.draft_intermediate_size!r}")
        _positive(self, "draft_hidden_size", "draft_num_attention_heads", "draft_num_key_value_heads", "draft_head_dim")
        if not 0.0 < self.ttt_decay <= 1.0:
            raise ConfigError(f"field 'ttt_decay' must be in (0, 1], got {self.ttt_decay!r}")
        if isinstance(self.draft_vocab_size, bool) or not isinstance(self.draft_vocab_size, int) \
                or self.draft_vocab_size < 0:
            raise ConfigError(f"field 'draft_vocab_size' must be an integer >= 0 (0 = full "
                              f"vocabulary), got {self.draft_vocab_size!r}")
        if not isinstance(self.init_norm_from_target, bool):
            raise ConfigError(f"field 'init_norm_from_target' must be true or false, got "
                              f"{self.init_norm_from_target!r}")
        if self.kind == "standalone" and self.init_norm_from_target:
            raise ConfigError("field 'init_norm_from_target' is not supported for kind "
                              "'standalone' (its own LM head is not the target's)")
        if self.init_layer_from_target is not None:
            v = self.init_layer_from_target
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"field 'init_layer_from_target' must be a target layer id >= 1 "
                                  f"or null, got {v!r}")
            if self.kind not in BLOCK_KINDS:
                raise ConfigError(f"field 'init_layer_from_target' is only supported for the block "
                                  f"kinds {BLOCK_KINDS}, got kind {self.kind!r}")
        if self.kind == "standalone" and self.draft_vocab_size:
            raise ConfigError("field 'draft_vocab_size' is not supported for kind 'standalone' "
                              "(its own LM head is already small)")
        if self.kind in BLOCK_KINDS and self.confidence_head and self.alpha_conf == 0:
            raise ConfigError("field 'alpha_conf' is 0 but confidence_head is true: the head "
                              "would never be trained")


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


__all__ = ["BLOCK_KINDS", "CheckpointConfig", "DataConfig", "LoggingConfig", "MeshConfig", "ModelConfig",
           "OptimizerConfig", "ScheduleConfig", "TrainConfig", "apply_overrides",
           "load_train_config", "train_config_dict"]
