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
import functools
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
            k = min(ell, end - a)  # no draft is accepted past the text's end
            n = int(np.cumprod(drafts[a, :k] == text[a + 1:a + 1 + k]).sum())
            proposed.append(ell)
            accepted.append(n)
        a += n + 1
    return GreedyRounds(tuple(proposed), tuple(accepted))


@dataclasses.dataclass(frozen=True)
class TextFeatures:
    """The target's features of a batch of texts, as online training computes them
    (`specjax.training.features.target_features`), right-padded to one length.

    `ids_bs` int32 [B, S] (0 past each text), `lengths_b` [B], `taps_bslh` [B, S, L, H] the raw
    outputs of the layers `layer_ids` (-1 = the embedding output), `hidden_bsh` [B, S, H] the
    final-normed hidden state.
    """

    ids_bs: np.ndarray
    lengths_b: np.ndarray
    layer_ids: tuple[int, ...]
    taps_bslh: Array
    hidden_bsh: Array

    def taps(self, layers: Sequence[int], shift: int = 0) -> Array:
        """Concatenated taps [B, S, len(layers) * H] of `layers`; row t holds row t - shift's."""
        missing = [x for x in layers if x not in self.layer_ids]
        if missing:
            raise ValueError(f"tap layers {missing} were not computed (have {self.layer_ids})")
        t = jnp.stack([self.taps_bslh[:, :, self.layer_ids.index(x)] for x in layers], axis=2)
        return _shift_rows(t.reshape(t.shape[:2] + (-1,)), shift)

    def final_hidden(self, target: Any, layer_offset: int = 0, shift: int = 0) -> Array:
        """The final-normed hidden state [B, S, H] (with `layer_offset`, the target's final norm
        over layer L - 1 + layer_offset's output); row t holds row t - shift's."""
        if layer_offset == 0:
            return _shift_rows(self.hidden_bsh, shift)
        last = target.config.num_hidden_layers - 1
        return _shift_rows(target.model.norm(self.taps([last + layer_offset])), shift)


def _shift_rows(x_bsf: Array, shift: int) -> Array:
    """x[:, t - shift] at t (edge rows repeated)."""
    if shift == 0:
        return x_bsf
    idx = jnp.clip(jnp.arange(x_bsf.shape[1]) - shift, 0, x_bsf.shape[1] - 1)
    return x_bsf[:, idx]


def text_features(target: Any, texts: Sequence[Sequence[int]], *,
                  layer_ids: Sequence[int] | None = None, length_multiple: int = 64,
                  dtype: Any = None) -> TextFeatures:
    """`TextFeatures` of `texts` in one target forward, padded to a multiple of `length_multiple`.

    `layer_ids`: the layers to keep (default every layer and the embedding output, enough for any
    drafter and the layer-offset controls; [B, S, L + 1, H] floats, so meant for a few short
    texts). `dtype` None keeps the target's compute dtype (what the engine hands its drafter)."""
    if not texts or not all(len(t) for t in texts):
        raise ValueError("texts must be one or more non-empty token id lists")
    n_layers = target.config.num_hidden_layers
    layers = tuple(range(-1, n_layers)) if layer_ids is None else tuple(int(x) for x in layer_ids)
    lengths = np.asarray([len(t) for t in texts], np.int32)
    s = -(-int(lengths.max()) // length_multiple) * length_multiple
    ids = np.zeros((len(texts), s), np.int32)
    for i, t in enumerate(texts):
        ids[i, :len(t)] = t
    graphdef, params = nnx.split(target)
    taps, hidden = target_features_jit(params, graphdef, jnp.asarray(ids), jnp.asarray(lengths),
                                       tap_layers=layers, dtype=dtype)
    taps = taps.reshape(taps.shape[:2] + (len(layers), -1))
    return TextFeatures(ids, lengths, layers, taps, hidden)


def _argmax_ids(drafter: Any, logits_xn: Array) -> Array:
    idx = jnp.argmax(logits_xn, axis=-1)
    vocab = getattr(drafter, "draft_vocab", None)
    return idx.astype(jnp.int32) if vocab is None else vocab.to_target(idx)


def drafter_family(drafter: Any) -> str:
    """Which training forward replays `drafter`: "block" (DSpark / DFlash `train_forward` over
    anchors), "eagle3" (`ttt_forward`) or "mtp" (`train_forward` on the final hidden state)."""
    if getattr(drafter, "needs_hidden", False) and hasattr(drafter, "train_forward"):
        return "mtp"
    if hasattr(drafter, "ttt_forward"):
        return "eagle3"
    if hasattr(drafter, "backbone_hidden") and hasattr(drafter, "train_forward"):
        return "block"
    raise ValueError(f"no training forward to replay for {type(drafter).__name__}")


@functools.partial(jax.jit, static_argnums=(0, 1))
def _proposals(graphdef: Any, family: str, state: Any, feats_bsf: Array, ids_bs: Array,
               anchors_ba: Array, keep_ba: Array) -> Array:
    """Greedy proposals (target ids): [B, A, K] of each anchor (block), [K, B, S] of each row
    (Eagle3: step k at row t predicts ids[t + k + 2]) or [B, S] (MTP-1: row t predicts ids[t + 2])."""
    drafter = nnx.merge(graphdef, state)
    if family == "mtp":
        return _argmax_ids(drafter, drafter.train_forward(feats_bsf, ids_bs))
    if family == "eagle3":
        return _argmax_ids(drafter, drafter.ttt_forward(feats_bsf, ids_bs, drafter.gamma))
    _, logits, _ = drafter.train_forward(feats_bsf, ids_bs, anchors_ba, keep_ba)
    return _argmax_ids(drafter, logits)


def draft_tables(target: Any, drafter: Any, features: TextFeatures, prompt_lens: Sequence[int], *,
                 tap_shift: int = 0, layer_offset: int = 0, anchor_multiple: int = 16,
                 ) -> list[np.ndarray]:
    """Per text, the greedy proposals [len, gamma] (target ids) of the drafter's training forward
    from an anchor at each position prompt_len..len - 2 (other rows -1): row a, slot k predicts
    position a + k + 1 (module docstring). Block anchors are padded to a multiple of
    `anchor_multiple` (unkept blocks), so a batch compiles once per padded shape."""
    family = drafter_family(drafter)
    g = int(drafter.gamma)
    lengths = features.lengths_b
    for p, n in zip(prompt_lens, lengths):
        if not 1 <= p < n:
            raise ValueError(f"prompt length {p} must be in [1, text length {n})")
    if family == "mtp":
        if g != 1:
            raise ValueError(f"an MTP drafter proposes 1 token, this one gamma={g}")
        feats = features.final_hidden(target, layer_offset, tap_shift).astype(drafter.dtype)
    else:
        feats = features.taps([x + layer_offset for x in drafter.tap_layers], tap_shift)
    spans = [np.arange(p, n - 1) for p, n in zip(prompt_lens, lengths)]
    a_pad = max(1, -(-max(len(s) for s in spans) // anchor_multiple) * anchor_multiple)
    anchors = np.zeros((len(spans), a_pad), np.int32)
    keep = np.zeros((len(spans), a_pad), bool)
    for i, s in enumerate(spans):
        anchors[i, :len(s)], keep[i, :len(s)] = s, True
    graphdef, state = nnx.split(drafter)
    out = np.asarray(_proposals(graphdef, family, state, feats, jnp.asarray(features.ids_bs),
                                jnp.asarray(anchors), jnp.asarray(keep)), np.int64)
    tables = []
    for i, (s, n) in enumerate(zip(spans, lengths)):
        t = np.full((int(n), g), -1, np.int64)
        if family == "block":
            t[s] = out[i, :len(s)]
        elif family == "eagle3":
            t[s] = out[:, i, s - 1].T
        else:
            t[s, 0] = out[i, s - 1]
        tables.append(t)
    return tables


def simulate_greedy_rounds(target: Any, drafter: Any, prompts: Sequence[Sequence[int]],
                           answers: Sequence[Sequence[int]], *, max_tokens: int | Sequence[int] | None = None,
                           max_len: int, gamma: int | None = None, tap_shift: int = 0,
                           layer_offset: int = 0, features: TextFeatures | None = None,
                           ) -> list[GreedyRounds]:
    """The drafting rounds a fixed-policy engine runs at T=0 to produce each of `answers` after
    its prompt, replayed from the drafter's training forward (module docstring).

    `max_tokens`: each request's limit (default its answer's length: exact for an answer that ended
    on it); `max_len`: the engine's cache length; `gamma`: the engine's proposal length (default
    the drafter's). `tap_shift` / `layer_offset` misalign the features (negative controls).
    `features`: `text_features` of the texts prompt + answer, to reuse across calls.
    """
    if len(prompts) != len(answers) or any(not a for a in answers):
        raise ValueError("need one non-empty answer per prompt (the prefill emits a token)")
    texts = [list(p) + list(a) for p, a in zip(prompts, answers)]
    if features is None:
        features = text_features(target, texts)
    elif [list(r[:n]) for r, n in zip(features.ids_bs, features.lengths_b)] != texts:
        raise ValueError("features were computed for other texts")
    tables = draft_tables(target, drafter, features, [len(p) for p in prompts],
                          tap_shift=tap_shift, layer_offset=layer_offset)
    g = int(drafter.gamma) if gamma is None else int(gamma)
    if not 0 <= g <= int(drafter.gamma):
        raise ValueError(f"gamma {g} exceeds the drafter's proposal length {drafter.gamma}")
    if max_tokens is None or isinstance(max_tokens, (int, np.integer)):
        max_tokens = [len(a) if max_tokens is None else int(max_tokens) for a in answers]
    return [walk_rounds(len(p), text, table, gamma=g, max_tokens=m, max_len=max_len)
            for p, text, table, m in zip(prompts, texts, tables, max_tokens)]


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


__all__ = ["GreedyRounds", "TextFeatures", "draft_tables", "drafter_family", "engine_greedy_rounds",
           "pooled_tau", "simulate_greedy_rounds", "text_features", "walk_rounds"]
