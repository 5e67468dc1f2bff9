"""Engine-independent references from a target (the losslessness tests compare against them): one
cache-free forward over whole sequences gives its greedy choices and its next-token logits."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.decoding.buckets import next_pow2


def _teacher_forced(sequences: Sequence[Sequence[int]], starts: Sequence[int]):
    """Padded inputs for one cache-free forward over whole sequences (width: the longest, rounded up
    to 32), and for each sequence s the positions whose outputs predict s[start:] (rows padded
    with 0, up to a power of two of the longest continuation)."""
    if len(starts) != len(sequences):
        raise ValueError(f"{len(starts)} starts for {len(sequences)} sequences")
    if any(st < 1 or len(s) <= st for s, st in zip(sequences, starts)):
        raise ValueError("every sequence needs more tokens than its start, and start >= 1")
    width = -(-max(len(s) for s in sequences) // 32) * 32
    toks = np.zeros((len(sequences), width), np.int32)
    rows = np.zeros((len(sequences), next_pow2(max(len(s) - st for s, st in zip(sequences, starts)), 16)),
                    np.int32)
    for i, (s, st) in enumerate(zip(sequences, starts)):
        toks[i, :len(s)] = s
        rows[i, :len(s) - st] = np.arange(st - 1, len(s) - 1)
    valid = np.asarray([len(s) for s in sequences], np.int32)
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), toks.shape)
    return toks, pos, valid, rows


def _logits_at(model: Any, sequences, starts, reduce) -> np.ndarray:
    """reduce(logits [B, R, V]) at the rows of `_teacher_forced`: the vocabulary projection runs on
    those rows only."""
    toks, pos, valid, rows = _teacher_forced(sequences, starts)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, toks, pos, valid, rows):
        m = nnx.merge(graphdef, state)
        hidden_bwh = m.forward(toks, pos, None, valid, logits="none").hidden
        return reduce(m.logits(jnp.take_along_axis(hidden_bwh, rows[:, :, None], axis=1)))

    return np.asarray(run(state, toks, pos, valid, rows))


def continuation_logits(model: Any, sequences: Sequence[Sequence[int]], start: int) -> list[np.ndarray]:
    """For each sequence s, the target's logits for s[start:] given what precedes each token (one
    padded forward, no cache): float64 [len(s) - start, V] per sequence."""
    out = _logits_at(model, sequences, [start] * len(sequences), lambda x: x)
    return [out[i, :len(s) - start].astype(np.float64) for i, s in enumerate(sequences)]


def first_non_greedy(model: Any, prompts: Sequence[Sequence[int]],
                     answers: Sequence[Sequence[int]]) -> list[int | None]:
    """For each (prompt, answer): the index of the first answer token that is not the target's
    argmax given the prompt and the answer before it, or None when the whole answer is the target's
    greedy continuation (by induction, what its own KV-cache greedy loop would produce). One padded
    forward over all of them, argmax on the device."""
    seqs = [list(p) + list(a) for p, a in zip(prompts, answers)]
    best = _logits_at(model, seqs, [len(p) for p in prompts], lambda x: jnp.argmax(x, axis=-1))
    out: list[int | None] = []
    for i, a in enumerate(answers):
        bad = np.flatnonzero(best[i, :len(a)] != np.asarray(a))
        out.append(int(bad[0]) if bad.size else None)
    return out


def randomized_pit(tokens: Sequence[int], probs_nv: np.ndarray, seed: int = 0) -> np.ndarray:
    """Randomized probability integral transform of sampled tokens under their claimed
    distributions (tokens ordered by descending probability, ties by id): Uniform(0, 1) iff each
    token was drawn from its row of `probs_nv` exactly."""
    rng = np.random.default_rng(seed)
    t_n = np.asarray(tokens, np.int64)
    p_n = probs_nv[np.arange(len(t_n)), t_n]
    ahead_nv = (probs_nv > p_n[:, None]) | ((probs_nv == p_n[:, None])
                                            & (np.arange(probs_nv.shape[1])[None, :] < t_n[:, None]))
    below_n = np.where(ahead_nv, probs_nv, 0.0).sum(axis=1)
    return np.clip(below_n + rng.random(len(t_n)) * p_n, 0.0, 1.0)
