"""Serving on top of the engine: continuous batching on a background thread (`async_engine`), the
OpenAI-compatible API (`openai_api`: validation, generation, streaming chunks; `schema`: the request
sampling fields shared with the batch jobs) served over HTTP by FastAPI + uvicorn (`http_server`), and
resumable offline batch jobs (`batch_job`)."""
