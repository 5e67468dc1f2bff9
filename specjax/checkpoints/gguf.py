"""GGUF checkpoints (llama.cpp's format) -> a `CausalLM`, read with the `gguf` package (numpy only).

Architectures (`general.architecture`): llama, qwen2, qwen3. The config comes from the metadata
(`{arch}.block_count`, `{arch}.embedding_length`, `{arch}.feed_forward_length`,
`{arch}.attention.head_count[_kv]`, `{arch}.attention.layer_norm_rms_epsilon`,
`{arch}.attention.key_length` or `{arch}.rope.dimension_count` (head_dim), `{arch}.rope.freq_base`,
`{arch}.rope.scaling.*`, `{arch}.context_length`, `tokenizer.ggml.{bos,eos}_token_id`); the
vocabulary size, q/k/v biases and tied embeddings (no `output.weight`) from the tensors.

Tensors are dequantized to float32 one at a time on load (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 and the K-quants Q2_K..Q6_K). GGUF lists shapes innermost first, so the numpy arrays are
already in the Hugging Face [out, in] layout. Names (`blk.{i}.` = `model.layers.{i}.`):

    token_embd.weight -> model.embed_tokens.weight    output_norm.weight -> model.norm.weight
    output.weight -> lm_head.weight                   attn_norm -> input_layernorm
    ffn_norm -> post_attention_layernorm              attn_q|attn_k|attn_v|attn_output ->
    self_attn.q_proj|k_proj|v_proj|o_proj             attn_q_norm|attn_k_norm -> self_attn.q_norm|k_norm
    ffn_gate|ffn_up|ffn_down -> mlp.gate_proj|up_proj|down_proj

llama.cpp's converter permutes the rows of Llama-family `attn_q` / `attn_k` (weights and biases)
per head so that rotate-half RoPE pairs become interleaved; the loader undoes it (rows viewed as
[heads, head_dim/2, 2] -> [heads, 2, head_dim/2]). Qwen2 and Qwen3 GGUFs are not permuted.
"""
from __future__ import annotations

import os
import re
from typing import Any, Iterator, Mapping

import numpy as np

from specjax.config import FAMILIES, ConfigError, TargetConfig

GGUF_SUFFIX = ".gguf"
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_PERMUTED_ARCHITECTURES = ("llama",)  # the converter's Q/K row permutation

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


class GGUFError(ConfigError):
    """A GGUF file cannot be read (truncated, unsupported content); the message names the file."""


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a path naming a `.gguf` file (existing or not: the loader names a missing one)."""
    return os.fspath(path).lower().endswith(GGUF_SUFFIX) and not os.path.isdir(path)


def hf_name(gguf_name: str) -> str | None:
    """Our (Hugging Face) tensor name of a llama.cpp tensor name; None if it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk_rows(rows_x: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head Q/K row permutation of a [R, ...] weight or [R] bias."""
    r = rows_x.shape[0]
    if r % (2 * num_heads):
        raise ValueError(f"{r} rows do not split into {num_heads} heads of even size")
    return rows_x.reshape(num_heads, r // num_heads // 2, 2, *rows_x.shape[1:]) \
        .swapaxes(1, 2).reshape(rows_x.shape)


def permute_qk_rows(rows_x: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (the inverse of `unpermute_qk_rows`)."""
    r = rows_x.shape[0]
    return rows_x.reshape(num_heads, 2, r // num_heads // 2, *rows_x.shape[1:]) \
        .swapaxes(1, 2).reshape(rows_x.shape)


class GGUFFile:
    """A parsed GGUF file: metadata and tensor records (data memory-mapped, not yet read)."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise GGUFError(f"GGUF file does not exist: {path}")
        import gguf  # the `gguf` package (absolute import), not this module

        self.path = path
        size = os.path.getsize(path)
        try:
            self._reader = gguf.GGUFReader(path, "r")
        except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
            raise GGUFError(f"{path}: truncated or corrupt GGUF file ({size} bytes): "
                            f"{type(e).__name__}: {e}") from None
        for t in self._reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise GGUFError(f"{path}: truncated GGUF file: tensor '{t.name}' ends at byte "
                                f"{end}, the file has {size}")
        self.tensors = {t.name: t for t in self._reader.tensors}

    def value(self, key: str, default: Any = ...) -> Any:
        """A metadata value; GGUFError names the key (and file) when it is missing."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFError(f"{self.path}: missing GGUF metadata key '{key}'")
            return default
        return field.contents()

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy shape (outermost first) of tensor `name`."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def check_type(self, name: str) -> None:
        """GGUFError unless tensor `name` has a supported (dequantizable) type."""
        from gguf import GGMLQuantizationType

        kind = GGMLQuantizationType(self.tensors[name].tensor_type).name
        if kind not in SUPPORTED_QUANT_TYPES:
            raise GGUFError(f"{self.path}: tensor '{name}' has quantization type {kind}, which is "
                            f"not supported (supported: {', '.join(SUPPORTED_QUANT_TYPES)})")

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32, numpy shape (outermost first)."""
        from gguf import quants

        self.check_type(name)
        t = self.tensors[name]
        arr = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        return arr.reshape(self.shape(name))


def _int(f: GGUFFile, key: str, default: Any = ...) -> int:
    v = f.value(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise GGUFError(f"{f.path}: metadata key '{key}' must be a positive integer, got {v!r}")
    return int(v)


def _float(f: GGUFFile, key: str, default: Any = ...) -> float:
    v = f.value(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
        raise GGUFError(f"{f.path}: metadata key '{key}' must be a number, got {v!r}")
    return float(v)


def gguf_architecture(f: GGUFFile) -> str:
    """`general.architecture`, checked against the supported ones."""
    arch = f.value("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise GGUFError(f"{f.path}: unsupported GGUF architecture {arch!r} (general.architecture; "
                        f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
    return arch


def _rope_scaling(f: GGUFFile, arch: str) -> dict[str, Any]:
    kind = f.value(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        if "rope_freqs.weight" in f.tensors:
            raise GGUFError(f"{f.path}: tensor 'rope_freqs.weight' (per-frequency RoPE factors, "
                            f"as written for llama3 scaling) is not supported")
        return dict(rope_type="default", rope_factor=1.0)
    if kind == "linear":
        return dict(rope_type="linear", rope_factor=_float(f, f"{arch}.rope.scaling.factor"))
    raise GGUFError(f"{f.path}: metadata key '{arch}.rope.scaling.type' is {kind!r}, which is not "
                    f"supported (supported: none, linear)")


def read_gguf_config(f: GGUFFile) -> TargetConfig:
    """The TargetConfig of a parsed GGUF file (metadata, plus what only the tensors tell)."""
    arch = gguf_architecture(f)
    p = f"{arch}."
    hidden = _int(f, p + "embedding_length")
    heads = _int(f, p + "attention.head_count")
    head_dim = _int(f, p + "attention.key_length",
                    f.value(p + "rope.dimension_count", hidden // heads))
    if "token_embd.weight" not in f.tensors:
        raise GGUFError(f"{f.path}: missing tensor 'token_embd.weight'")
    vocab = f.shape("token_embd.weight")[0]
    declared = f.value(p + "vocab_size", vocab)
    if declared != vocab:
        raise GGUFError(f"{f.path}: metadata key '{p}vocab_size' ({declared}) differs from "
                        f"tensor 'token_embd.weight' ({vocab} rows)")
    eos = f.value("tokenizer.ggml.eos_token_id", None)
    archs, qk_norm, _ = FAMILIES[arch]
    try:
        return TargetConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=_int(f, p + "feed_forward_length"),
            num_hidden_layers=_int(f, p + "block_count"), num_attention_heads=heads,
            num_key_value_heads=_int(f, p + "attention.head_count_kv", heads), head_dim=head_dim,
            rms_norm_eps=_float(f, p + "attention.layer_norm_rms_epsilon"),
            rope_theta=_float(f, p + "rope.freq_base", 10000.0), **_rope_scaling(f, arch),
            tie_word_embeddings="output.weight" not in f.tensors,
            max_position_embeddings=_int(f, p + "context_length", 8192),
            bos_token_id=f.value("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=() if eos is None else (int(eos),),
            architecture=archs[0], model_type=arch, qk_norm=qk_norm,
            attention_bias="blk.0.attn_q.bias" in f.tensors)
    except ConfigError as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{f.path}: {e}") from None


class GGUFTensors(Mapping[str, np.ndarray]):
    """Lazy mapping Hugging Face name -> float32 array over a GGUF file's tensors (dequantized,
    Q/K rows un-permuted for Llama) for `common.load_params_into`; one tensor read per lookup."""

    def __init__(self, f: GGUFFile, cfg: TargetConfig):
        self.source = f.path
        self._file = f
        self._cfg = cfg
        self._names: dict[str, str] = {}
        unknown = []
        for name in f.tensors:
            ours = hf_name(name)
            if ours is None:
                unknown.append(name)
            else:
                self._names[ours] = name
        if unknown:
            raise GGUFError(f"{f.path}: tensor(s) {unknown[:8]} have no counterpart in a "
                            f"{cfg.architecture}")
        for name in f.tensors:  # before any tensor is dequantized
            f.check_type(name)

    def _heads(self, gguf_name: str) -> int | None:
        if self._cfg.model_type not in _PERMUTED_ARCHITECTURES:
            return None
        part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        return {"attn_q": self._cfg.num_attention_heads,
                "attn_k": self._cfg.num_key_value_heads}.get(part)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._file.shape(self._names[name])

    def __getitem__(self, name: str) -> np.ndarray:
        gname = self._names[name]
        arr = self._file.read(gname)
        heads = self._heads(gname)
        return arr if heads is None else unpermute_qk_rows(arr, heads)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


def open_gguf_target(path: str | os.PathLike) -> tuple[TargetConfig, GGUFTensors]:
    """(config, lazy HF-named tensors) of a `.gguf` target file (`targets.load_target` loads it)."""
    f = GGUFFile(path)
    cfg = read_gguf_config(f)
    return cfg, GGUFTensors(f, cfg)


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer (and chat template) stored in a `.gguf` file, built by transformers."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file does not exist: {path}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                         gguf_file=os.path.basename(path), local_files_only=True,
                                         trust_remote_code=False)
