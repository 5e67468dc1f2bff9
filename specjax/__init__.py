"""specjax: speculative decoding for JAX with DSpark-style drafters and confidence-scheduled verification."""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def load_target(path: str, *, dtype: str = "float32", mesh: Any = None, fold_norms: bool = True):
    """Load a target -> (model, TargetConfig) from a Hugging Face Qwen3 / Llama / Qwen2 checkpoint
    directory or a `.gguf` file (dequantized). `model(tokens, positions)` gives logits. With
    `fold_norms` each layer's norm weights are folded into the projections that read them (fewer
    kernels per layer; exports divide them back out)."""
    from specjax.checkpoints import load_target as _load
    return _load(path, dtype=dtype, mesh=mesh, fold_norms=fold_norms)


def __getattr__(name: str) -> Any:  # lazy: `import specjax` stays cheap and jax-free
    if name in ("LLM", "SamplingParams", "Output"):
        from specjax import api
        return getattr(api, name)
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")


__all__ = ["load_target", "LLM", "SamplingParams", "Output", "__version__"]
