"""External checkpoint formats <-> specjax params: the only package that knows external tensor names.

    common     key maps, safetensors reading/writing, loading params into modules (no pickles)
    targets    Hugging Face target directories (Qwen3 / Llama / Qwen2): load, export, tokenizer
    drafters   drafter key maps (DeepSpec names) and config.json dialects
               (loading and saving by architecture: `specjax.drafters.registry`)
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
from specjax.checkpoints.drafters import (CONFIDENCE_TEMPERATURES_FIELD, DEFAULT_NUM_ANCHORS,
                                          DSPARK_ARCHITECTURE, EAGLE3_ARCHITECTURE,
                                          GAMMA_FIELD, MTP_ARCHITECTURE, NGRAM_ARCHITECTURE,
                                          STANDALONE_ARCHITECTURE, STANDALONE_FIELD,
                                          block_drafter_config_from_hf, block_drafter_hf_config,
                                          confidence_temperatures_from_hf, drafter_architecture,
                                          eagle3_config_from_hf, eagle3_hf_config,
                                          draft_vocab_hf_tensors, draft_vocab_tensors,
                                          eagle3_key_map, eagle3_layout,
                                          mtp_config_from_hf, mtp_hf_config, mtp_key_map,
                                          ngram_config_from_hf, ngram_hf_config,
                                          read_drafter_config, set_confidence_temperatures,
                                          standalone_config_from_hf, standalone_hf_config,
                                          standalone_key_map, dspark_key_map, target_hf_base)
from specjax.checkpoints.gguf import (SUPPORTED_GGUF_ARCHITECTURES, SUPPORTED_QUANT_TYPES,
                                      GGUFError, is_gguf)
from specjax.checkpoints.targets import (TOKENIZER_FILES, export_target, load_target,
                                         load_target_weights, load_tokenizer, read_target_config)

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES", "PICKLE_SUFFIXES", "SAFE_INDEX", "SAFE_WEIGHTS", "TARGET_KEY_MAP",
    "KeyMap", "LeafRule", "LoadReport", "ParamEntry", "SafetensorsDir", "iter_hf_tensors",
    "load_params_into", "module_to_hf_tensors", "param_entries", "read_safetensors_dir",
    "skip_tensors", "write_config_json", "write_safetensors",
    "CONFIDENCE_TEMPERATURES_FIELD", "DEFAULT_NUM_ANCHORS", "DSPARK_ARCHITECTURE",
    "EAGLE3_ARCHITECTURE", "GAMMA_FIELD", "MTP_ARCHITECTURE", "NGRAM_ARCHITECTURE",
    "STANDALONE_ARCHITECTURE", "STANDALONE_FIELD", "block_drafter_config_from_hf",
    "block_drafter_hf_config", "confidence_temperatures_from_hf", "drafter_architecture",
    "eagle3_config_from_hf", "eagle3_hf_config", "eagle3_key_map", "eagle3_layout",
    "draft_vocab_hf_tensors", "draft_vocab_tensors", "mtp_config_from_hf", "mtp_hf_config",
    "mtp_key_map",
    "ngram_config_from_hf", "ngram_hf_config", "read_drafter_config",
    "set_confidence_temperatures", "standalone_config_from_hf", "standalone_hf_config",
    "standalone_key_map", "dspark_key_map", "target_hf_base",
    "SUPPORTED_GGUF_ARCHITECTURES", "SUPPORTED_QUANT_TYPES", "GGUFError", "is_gguf",
    "TOKENIZER_FILES", "export_target", "load_target", "load_target_weights", "load_tokenizer",
    "read_target_config",
]
