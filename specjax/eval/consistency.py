"""Train/inference consistency: replay the engine's greedy rounds from a drafter's training forward.

At T=0 under a fixed verification policy, a round from anchor position a verifies ell draft
tokens and accepts the longest prefix of them that equals the greedy text. With teacher forcing
(every earlier slot fed the text's token), slot k's argmax is the token the drafter would propose
at inference whenever slots 1..k-1 were accepted, so the accepted length of every round follows
from one training forward over the whole text and the target's features of that text (the same
frozen-target features online training computes, `specjax.training.features.target_features`):

    block (DSpark / DFlash)  train_forward(taps, ids, anchors = every answer position): slot k of
                             anchor a predicts ids[a + k]
    Eagle3                   ttt_forward(taps, ids, horizon = gamma): step k - 1 at row a - 1
                             predicts ids[a + k]
    MTP-1                    train_forward(hidden, ids): row a - 1 predicts ids[a + 1]

`simulate_greedy_rounds` walks the rounds with the engine's rules (`specjax.decoding.engine`):
the first answer token comes from the prefill; each round verifies ell = min(gamma, room in the
cache, tokens still wanted - 1) drafts (a round with ell = 0 is not a drafting round); n accepted
drafts commit n + 1 tokens (n when the last accepted one ends the text); the text's end is where
the engine stopped (an eos / stop token, max_tokens or a full cache). tau = 1 + accepted / rounds
over drafting rounds, as `RequestMetrics.mean_acceptance_length`.

Negative controls (`tap_shift`, `layer_offset`) feed deliberately misaligned features: position t
reads the features of t - tap_shift, or every tap layer id moves by layer_offset (MTP-1, which
reads the final-normed hidden state: the final norm over layer L - 1 + layer_offset's output).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.training.features import target_features_jit

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GreedyRounds:
    """Drafting rounds of one request: verified lengths ell and accepted drafts n, in order."""

    proposed: tuple[int, ...]
    accepted: tuple[int, ...]

    @property
    def num_drafts(self) -> int:
        return len(self.proposed)

    @property
    def tau(self) -> float:
        """1 + accepted / drafting rounds (1.0 without a drafting round)."""
        return 1.0 + sum(self.accepted) / self.num_drafts if self.num_drafts else 1.0


def pooled_tau(rounds: Sequence[GreedyRounds]) -> float:
    """tau over the drafting rounds of many requests (1 + all accepted / all drafting rounds)."""
    drafts = sum(r.num_drafts for r in rounds)
    return 1.0 + sum(sum(r.accepted) for r in rounds) / drafts if drafts else 1.0


def walk_rounds(prompt_len: int, text_ids: Sequence[int], drafts: np.ndarray, *, gamma: int,
                max_tokens: int, max_len: int) -> GreedyRounds:
    """The engine's rounds over a finished greedy text (prompt + answer, `text_ids`).

    `drafts` [len(text_ids), gamma]: row a holds the tokens the drafter proposes from an anchor at
    position a (slot k predicts position a + k + 1; only rows prompt_len..len - 2 are read).
    `max_tokens` / `max_len`: the request's and the engine's limits (they cap the last rounds).
    """
    text = np.asarray(text_ids, np.int64)
    end = len(text) - 1  # position of the last answer token
    if not prompt_len <= end < max_len:
        raise ValueError(f"text of {len(text)} tokens after a {prompt_len}-token prompt does not "
                         f"fit max_len {max_len}")
    if end - prompt_len + 1 > max_tokens:
        raise ValueError(f"answer of {end - prompt_len + 1} tokens exceeds max_tokens {max_tokens}")
    proposed, accepted = [], []
    a = prompt_len  # anchor position = cache length; the prefill emitted text[prompt_len]
    while a < end:
        emitted = a - prompt_len + 1
        ell = max(0, min(gamma, max_len - 1 - a, max_tokens - emitted - 1))
        n = 0
        if ell:
            match = drafts[a, :min(ell, end - a)] == text[a + 1:a + 1 + min(ell, end - a)]
            n = int(np.cumprod(match).sum())
            proposed.append(ell)
            accepted.append(n)
        a += n + 1
    return GreedyRounds(tuple(proposed), tuple(accepted))


def _shift_rows(x_sf: Array, shift: int) -> Array:
    """x[t - shift] at t (edge rows repeated)."""
    if shift == 0:
        return x_sf
    idx = jnp.clip(jnp.arange(x_sf.shape[0]) - shift, 0, x_sf.shape[0] - 1)
    return x_sf[idx]


def target_text_features(target: Any, text_ids: Sequence[int], tap_layers: Sequence[int], *,
                         dtype: Any = None) -> tuple[Array | None, Array]:
    """(taps [S, L*H] or None, final-normed hidden [S, H]) of one text, computed as online
    training does (`target_features`); `dtype` None keeps the target's compute dtype (what the
    engine hands its drafter)."""
    graphdef, params = nnx.split(target)
    ids = jnp.asarray(np.asarray(text_ids, np.int32)[None])
    taps, hidden = target_features_jit(params, graphdef, ids, jnp.asarray([ids.shape[1]], jnp.int32),
                                       tap_layers=tuple(int(x) for x in tap_layers), dtype=dtype)
    return (None if taps is None else taps[0]), hidden[0]


def _to_target_ids(drafter: Any, logits_xn: Array) -> np.ndarray:
    idx = jnp.argmax(logits_xn, axis=-1)
    vocab = getattr(drafter, "draft_vocab", None)
    return np.asarray(idx if vocab is None else vocab.to_target(idx), np.int64)


def draft_table(target: Any, drafter: Any, text_ids: Sequence[int], prompt_len: int, *,
                tap_shift: int = 0, layer_offset: int = 0, dtype: Any = None) -> np.ndarray:
    """Greedy proposals [len(text_ids), gamma] (target ids) from the drafter's training forward
    at every anchor position prompt_len..len - 2 (other rows -1); see the module docstring."""
    ids = np.asarray(text_ids, np.int32)
    s, g = len(ids), int(drafter.gamma)
    if not 1 <= prompt_len < s:
        raise ValueError(f"prompt_len must be in [1, {s}), got {prompt_len}")
    ids_bs = jnp.asarray(ids[None])
    anchors = np.arange(prompt_len, s - 1)
    out = np.full((s, g), -1, np.int64)
    if not len(anchors):
        return out
    if getattr(drafter, "needs_hidden", False):  # MTP-1: the final-normed hidden state
        if g != 1:
            raise ValueError(f"a hidden-state drafter proposes 1 token, this one gamma={g}")
        last = target.config.num_hidden_layers - 1
        if layer_offset:
            taps, _ = target_text_features(target, ids, (last + layer_offset,), dtype=dtype)
            hidden = target.model.norm(taps)
        else:
            _, hidden = target_text_features(target, ids, (), dtype=dtype)
        hidden = _shift_rows(hidden, tap_shift).astype(drafter.dtype)
        logits = drafter.train_forward(hidden[None], ids_bs)[0]  # row t predicts ids[t + 2]
        out[anchors, 0] = _to_target_ids(drafter, logits[anchors - 1])
        return out
    layers = tuple(int(x) + layer_offset for x in drafter.tap_layers)
    if not layers:
        raise ValueError(f"{type(drafter).__name__} reads no target features: nothing to simulate")
    taps, _ = target_text_features(target, ids, layers, dtype=dtype)
    taps = _shift_rows(taps, tap_shift).astype(drafter.dtype)[None]
    if hasattr(drafter, "ttt_forward"):  # Eagle3: step k - 1 at row a - 1 predicts ids[a + k]
        logits = drafter.ttt_forward(taps, ids_bs, g)[:, 0]  # [K, S, N]
        out[anchors] = _to_target_ids(drafter, logits[:, anchors - 1]).T
        return out
    if hasattr(drafter, "backbone_hidden"):  # block drafter: slot k of anchor a -> ids[a + k]
        a_ba = jnp.asarray(anchors[None], jnp.int32)
        _, logits, _ = drafter.train_forward(taps, ids_bs, a_ba, jnp.ones_like(a_ba, bool))
        out[anchors] = _to_target_ids(drafter, logits[0])
        return out
    raise ValueError(f"no training forward to simulate for {type(drafter).__name__}")


def simulate_greedy_rounds(target: Any, drafter: Any, prompt_ids: Sequence[int],
                           answer_ids: Sequence[int], *, max_tokens: int | None = None,
                           max_len: int, gamma: int | None = None, tap_shift: int = 0,
                           layer_offset: int = 0, dtype: Any = None) -> GreedyRounds:
    """The drafting rounds a fixed-policy engine runs at T=0 to produce `answer_ids` after
    `prompt_ids`, replayed from the drafter's training forward (module docstring).

    `max_tokens`: the request's limit (default len(answer_ids): exact for an answer that ended on
    it); `max_len`: the engine's cache length; `gamma`: the engine's proposal length (default the
    drafter's). `tap_shift` / `layer_offset` misalign the features (negative controls).
    """
    if not answer_ids:
        raise ValueError("answer_ids is empty: the engine emits at least the prefill's token")
    text = list(prompt_ids) + list(answer_ids)
    table = draft_table(target, drafter, text, len(prompt_ids), tap_shift=tap_shift,
                        layer_offset=layer_offset, dtype=dtype)
    g = int(drafter.gamma) if gamma is None else int(gamma)
    if not 0 <= g <= table.shape[1]:
        raise ValueError(f"gamma {g} exceeds the drafter's proposal length {table.shape[1]}")
    return walk_rounds(len(prompt_ids), text, table, gamma=g,
                       max_tokens=len(answer_ids) if max_tokens is None else max_tokens,
                       max_len=max_len)


def engine_greedy_rounds(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
                         ) -> tuple[list[list[int]], list[GreedyRounds]]:
    """Greedy answers of an `specjax.LLM` to `prompts` (token ids) and each request's drafting
    rounds as the engine recorded them (`on_round`)."""
    from specjax.api import SamplingParams
    from specjax.eval.rounds import RoundRecorder

    with RoundRecorder(llm.engine) as log:
        outs = llm.generate([list(p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens))
    rounds = []
    for o in outs:
        mine = [(m, n) for rid, m, n in zip(log.request, log.proposed, log.accepted)
                if rid == o.request_id and m > 0]
        rounds.append(GreedyRounds(tuple(m for m, _ in mine), tuple(n for _, n in mine)))
    return [o.token_ids for o in outs], rounds


__all__ = ["GreedyRounds", "draft_table", "engine_greedy_rounds", "pooled_tau",
           "simulate_greedy_rounds", "target_text_features", "walk_rounds"]
