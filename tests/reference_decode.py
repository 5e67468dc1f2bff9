"""Engine-independent reference decoding of a target (the losslessness tests compare against it)."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.decoding.buckets import next_pow2


def greedy_generate(model: Any, prompt_ids: Sequence[int], max_new_tokens: int, *,
                    eos_token_id: int | None = None) -> list[int]:
    """Greedy continuation of one prompt with the target's own KV cache (prefill padded to a power
    of two, then one-token steps); stops after `eos_token_id` (included) or max_new_tokens."""
    n = len(prompt_ids)
    if n == 0 or max_new_tokens < 1:
        raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
    p = next_pow2(n, 16)
    # power-of-two shapes, so prompts of similar length share the compiled programs
    cache = model.init_cache(1, max(p, next_pow2(n + max_new_tokens)))
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, cache, tokens_bt, positions_bt, valid_b):
        out = nnx.merge(graphdef, state).forward(tokens_bt, positions_bt, cache, valid_b,
                                                 logits="last")
        return jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32), out.cache

    toks = np.zeros((1, p), np.int32)
    toks[0, :n] = np.asarray(prompt_ids, np.int32)
    nxt, cache = run(state, cache, toks, np.arange(p, dtype=np.int32)[None], np.asarray([n], np.int32))
    out = [int(nxt[0])]
    while len(out) < max_new_tokens and (eos_token_id is None or out[-1] != eos_token_id):
        pos = np.asarray([[n + len(out) - 1]], np.int32)
        nxt, cache = run(state, cache, np.asarray([[out[-1]]], np.int32), pos,
                         np.asarray([1], np.int32))
        out.append(int(nxt[0]))
    return out


def continuation_logits(model: Any, sequences: Sequence[Sequence[int]], start: int) -> list[np.ndarray]:
    """For each sequence s, the target's logits for s[start:] given what precedes each token (one
    padded forward, no cache): float64 [len(s) - start, V] per sequence."""
    if start < 1 or any(len(s) <= start for s in sequences):
        raise ValueError(f"every sequence needs more than start={start} tokens")
    n = max(len(s) for s in sequences)
    width = next_pow2(n, 16)
    toks = np.zeros((len(sequences), width), np.int32)
    # the positions whose logits predict s[start:] (padded to the width: shapes depend on it alone)
    rows = np.zeros((len(sequences), width), np.int32)
    for i, s in enumerate(sequences):
        toks[i, :len(s)] = s
        rows[i, :len(s) - start] = np.arange(start - 1, len(s) - 1)
    valid = np.asarray([len(s) for s in sequences], np.int32)
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), toks.shape)
    graphdef, state = nnx.split(model)

    @jax.jit
    def gathered(state, toks, pos, valid, rows):
        logits_bwv = nnx.merge(graphdef, state).forward(toks, pos, None, valid, logits="all").logits
        return jnp.take_along_axis(logits_bwv, rows[:, :, None], axis=1)

    out = np.asarray(gathered(state, toks, pos, valid, rows), np.float64)
    return [out[i, :len(s) - start] for i, s in enumerate(sequences)]


def randomized_pit(tokens: Sequence[int], probs_nv: np.ndarray, seed: int = 0) -> np.ndarray:
    """Randomized probability integral transform of sampled tokens under their claimed
    distributions (tokens ordered by descending probability): Uniform(0, 1) iff each token was
    drawn from its row of `probs_nv` exactly."""
    rng = np.random.default_rng(seed)
    out = np.empty(len(tokens))
    for i, (t, p) in enumerate(zip(tokens, probs_nv)):
        order = np.argsort(-p, kind="stable")
        rank = int(np.flatnonzero(order == t)[0])
        below = float(p[order[:rank]].sum())
        out[i] = below + rng.random() * float(p[t])
    return np.clip(out, 0.0, 1.0)
