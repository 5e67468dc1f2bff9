"""Serving on top of the engine: continuous batching on a background thread (`async_engine`), an
OpenAI-compatible HTTP server (`http_server`) and resumable offline batch jobs (`batch_job`)."""
