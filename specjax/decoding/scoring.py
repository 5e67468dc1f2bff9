"""Prompt scoring (echo, prompt_logprobs): log-probabilities of a prompt's tokens from one cache-free
target pass, beside the engine's rounds."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from specjax.decoding import buckets as bk
from specjax.decoding.requests import token_logprobs


def score_prompt(engine: Any, req: Any) -> tuple[list[tuple[float, list[int], list[float]]], list[int]]:
    """`Engine.score`: one cache-free target pass over `req`'s prompt (the score program)."""
    n = len(req.prompt_ids)
    if engine.cfg.max_logprobs == 0 or not 0 <= (req.logprobs or 0) <= engine.cfg.max_logprobs:
        raise ValueError(f"request {req.request_id}: logprobs must be in [0, {engine.cfg.max_logprobs}]")
    plen = bk.pick(engine.buckets.prefill, n, what="prompt length to score")
    toks = np.zeros((1, plen), np.int32)
    toks[0, :n] = req.prompt_ids
    ints = np.array([[n], [0], [0], [req.top_k]], np.int32)
    floats = np.array([[req.temperature], [req.top_p], [req.min_p]], np.float32)
    outs = jax.device_get(engine.runner.run("score", (1, plen), tokens_bt=toks, ints_4b=ints, floats_3b=floats))
    return token_logprobs(req, outs, 0, n - 1), outs["rank"][0, :n - 1].tolist()
