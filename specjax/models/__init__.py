"""Target models: Qwen3 dense decoder and its KV cache."""
