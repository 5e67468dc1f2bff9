"""Runnable serving programs: `python -m serve.server` (OpenAI-compatible HTTP) and
`python -m serve.batch` (offline JSONL batch jobs)."""
