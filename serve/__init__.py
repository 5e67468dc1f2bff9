"""Runnable serving programs, thin shims over `specjax.cli`: `python -m serve.server` (OpenAI-compatible
HTTP, also `specjax-serve`) and `python -m serve.batch` (offline JSONL batch jobs, also `specjax-batch`)."""
