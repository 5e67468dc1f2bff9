"""Standalone draft model: an independent small causal LM sharing the target's vocabulary.

The classic draft-model / assistant-model method: a small CausalLM with its own KV cache.
`commit` runs its forward over the committed tokens (the prompt at prefill, the anchor plus the
accepted drafts after a round), extending its cache; `propose` runs gamma single-token steps in a
`lax.scan` from the anchor, writing past the committed length (write, then mask: the lengths in
the state are untouched, so the next commit overwrites those entries). It reads no target
features (`tap_layers` = (), `needs_hidden` = False).

Checkpoint names: the draft model is a plain CausalLM held as `model`, so its Hugging
Face names are its own (`model.embed_tokens.weight`, `model.layers.{i}...`, `lm_head.weight`),
obtained by dropping our leading `model.` attribute.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.sampling import SamplingArrays, probs_from_logits, round_key, sample
from specjax.drafters.base import ContextUpdate, DraftBlock
from specjax.models import cache as kvc
from specjax.models.decoder import CausalLM

Array = jax.Array


class StandaloneDrafter(nnx.Module):
    """An independent draft LM with the `Drafter` protocol. State: its own `KVCache`."""

    def __init__(self, model: CausalLM, gamma: int):
        if not isinstance(model, CausalLM):
            raise ValueError(f"model must be a CausalLM, got {type(model).__name__}")
        if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
            raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
        self.model = model
        self.config = model.config
        self.gamma = gamma
        self.tap_layers = ()
        self.needs_hidden = False

    @classmethod
    def from_config(cls, cfg: TargetConfig, gamma: int, *, rngs: nnx.Rngs | None = None,
                    dtype="float32", param_dtype="float32") -> "StandaloneDrafter":
        """A freshly initialised draft LM of config `cfg`."""
        return cls(CausalLM(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype), gamma)

    def check_target(self, target: TargetConfig) -> None:
        """Raise ConfigError unless the draft LM shares the target's vocabulary size."""
        if self.config.vocab_size != target.vocab_size:
            raise ConfigError(f"draft model field 'vocab_size' ({self.config.vocab_size}) differs "
                              f"from the target's ({target.vocab_size})")

    def init_state(self, slots: int, max_len: int) -> kvc.KVCache:
        """An empty KV cache of the draft LM ([slots, max_len, nkv, hd] per layer)."""
        return self.model.init_cache(slots, max_len)

    def commit(self, state: kvc.KVCache, update: ContextUpdate) -> kvc.KVCache:
        """Run the draft LM over the committed tokens of rows [0:B], extending their caches."""
        b, t = update.tokens.shape
        if update.positions.shape != (b, t):
            raise ValueError(f"update.positions {update.positions.shape} must be [B={b}, T={t}]")
        n = jnp.clip(update.n_valid.astype(jnp.int32), 0, t)
        out = self.model.forward(update.tokens.astype(jnp.int32), update.positions.astype(jnp.int32),
                                 state, n, logits="none")
        return out.cache

    def propose_with_logits(self, state: kvc.KVCache, anchor_b: Array, position_b: Array,
                            sampling: SamplingArrays, key_b: Array) -> tuple[DraftBlock, Array]:
        """`propose`, also returning the draft logits [B, gamma, V] (float32) each q came from."""
        b = anchor_b.shape[0]
        sub = kvc.KVCache(k=tuple(x[:b] for x in state.k), v=tuple(x[:b] for x in state.v),
                          lengths=state.lengths[:b])
        pos0 = position_b.astype(jnp.int32)

        def step(carry, k):
            cache, tok_b = carry
            out = self.model.forward(tok_b[:, None], (pos0 + k)[:, None], cache, logits="all")
            z = out.logits[:, 0]  # [B, V] float32
            q = probs_from_logits(z, sampling)
            nxt = sample(round_key(key_b, k), q)
            return (out.cache, nxt), (nxt, q, z)

        carry0 = (sub, anchor_b.astype(jnp.int32))
        _, (tok_gb, q_gbv, z_gbv) = jax.lax.scan(step, carry0, jnp.arange(self.gamma, dtype=jnp.int32))
        block = DraftBlock(tokens=jnp.swapaxes(tok_gb, 0, 1), q=jnp.swapaxes(q_gbv, 0, 1),
                           confidence=None)
        return block, jnp.swapaxes(z_gbv, 0, 1)

    def propose(self, state: kvc.KVCache, anchor_b: Array, position_b: Array,
                sampling: SamplingArrays, key_b: Array) -> DraftBlock:
        """Propose gamma tokens for rows [0:B] autoregressively from the anchor at position_b."""
        return self.propose_with_logits(state, anchor_b, position_b, sampling, key_b)[0]


__all__ = ["StandaloneDrafter"]
