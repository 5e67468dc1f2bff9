"""External checkpoint formats <-> specjax params: the only package that knows external tensor names.

    common     key maps, safetensors reading/writing, loading params into modules (no pickles)
    layouts    which stored tensors one param is (transposed kernels; the target's fused q/k/v
               and gate/up kernels as their Hugging Face parts)
    targets    Hugging Face target directories (Qwen3 / Llama / Qwen2): load, export, tokenizer
    drafters   what every drafter kind's config.json and tensors share (each kind's own key map
               and config.json fields live in its module; `specjax.drafters.registry` loads and
               saves by architecture)
    gguf       llama.cpp GGUF files (llama, qwen2, qwen3): metadata -> config, dequantized tensors

The names below are the public API; import them from here.
"""
from __future__ import annotations

from specjax.checkpoints.common import (DEFAULT_MAX_SHARD_BYTES, PICKLE_SUFFIXES, SAFE_INDEX,
                                        SAFE_WEIGHTS, TARGET_KEY_MAP, KeyMap, LeafRule, LoadReport,
                                        ParamEntry, SafetensorsDir, iter_hf_tensors,
                                        load_params_into, module_to_hf_tensors, param_entries,
                                        read_safetensors_dir, skip_tensors, write_config_json,
                                        write_safetensors)
from specjax.checkpoints.drafters import (GAMMA_FIELD, draft_vocab_hf_tensors, draft_vocab_tensors,
                                          read_drafter_config, target_hf_base)
from specjax.checkpoints.gguf import (SUPPORTED_GGUF_ARCHITECTURES, SUPPORTED_QUANT_TYPES,
                                      GGUFError, is_gguf)
from specjax.checkpoints.targets import (TOKENIZER_FILES, export_target, load_target,
                                         load_target_weights, load_tokenizer, read_target_config)

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES", "PICKLE_SUFFIXES", "SAFE_INDEX", "SAFE_WEIGHTS", "TARGET_KEY_MAP",
    "KeyMap", "LeafRule", "LoadReport", "ParamEntry", "SafetensorsDir", "iter_hf_tensors",
    "load_params_into", "module_to_hf_tensors", "param_entries", "read_safetensors_dir",
    "skip_tensors", "write_config_json", "write_safetensors",
    "GAMMA_FIELD", "draft_vocab_hf_tensors", "draft_vocab_tensors", "read_drafter_config",
    "target_hf_base",
    "SUPPORTED_GGUF_ARCHITECTURES", "SUPPORTED_QUANT_TYPES", "GGUFError", "is_gguf",
    "TOKENIZER_FILES", "export_target", "load_target", "load_target_weights", "load_tokenizer",
    "read_target_config",
]
