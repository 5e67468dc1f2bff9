"""Standalone draft model: an independent small causal LM sharing the target's vocabulary.

The classic draft-model / assistant-model method: a small CausalLM with its own KV cache.
`commit` runs its forward over the committed tokens (the prompt at prefill, the anchor plus the
accepted drafts after a round), extending its cache; `propose` runs gamma single-token steps in a
`lax.scan` from the anchor, writing past the committed length (write, then mask: the lengths in
the state are untouched, so the next commit overwrites those entries). It reads no target
features (`tap_layers` = (), `needs_hidden` = False).

Checkpoint: the draft model is a plain CausalLM held as `model`, so its Hugging Face names are
its own (`model.embed_tokens.weight`, `model.layers.{i}...`, `lm_head.weight`), obtained by dropping
our leading `model.` attribute. Its config.json is a Qwen3 / Llama / Qwen2 CausalLM config (so
transformers loads it as is) with `"specjax_drafter": "standalone"` and `num_speculative_tokens`;
a plain checkpoint of these families loads too, and architectures "SpecjaxStandaloneDrafter" is
read (the family then comes from `model_type`).

Objective (kind "standalone"): a small LM of the `draft_*` dimensions (the target's family,
vocabulary, RoPE and EOS) distilled from the target: next-token CE + TV against the target's
logits (`specjax.drafters.losses.mtp_loss`). With `alpha_tv` 0 it is the cross-entropy on the
training text alone (`losses.lm_loss`): the frozen target is not run, so a step costs only the
draft LM (sequence-level distillation on the target's regenerated answers).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import checkpoints
from specjax.checkpoints import drafters as hf
from specjax.checkpoints.common import KeyMap
from specjax.config import (SUPPORTED_ARCHITECTURES, ConfigError, TargetConfig,
                            check_non_negative, check_positive)
from specjax.drafters import losses
from specjax.drafters.base import ContextUpdate, DraftBlock, Kind, TargetView
from specjax.drafters.common import TrainingSection, shift_left
from specjax.drafters.drafting import DraftGuide, Draw, draft_loop, loop_q, step_outputs
from specjax.models import cache as kvc
from specjax.models.decoder import CausalLM
from specjax.sampling import SamplingArrays

Array = jax.Array
ARCHITECTURE = "SpecjaxStandaloneDrafter"
MARKER_FIELD = "specjax_drafter"  # value "standalone" on a CausalLM config
_CAUSAL_LMS = tuple(a for a in SUPPORTED_ARCHITECTURES if a.endswith("ForCausalLM"))


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

    @property
    def dtype(self) -> Any:
        """The model's compute dtype (that of its q)."""
        return self.model.model.embed_tokens.dtype

    def check_target(self, target: TargetConfig) -> None:
        """Raise ConfigError unless the draft LM shares the target's vocabulary size."""
        if self.config.vocab_size != target.vocab_size:
            raise ConfigError(f"draft model field 'vocab_size' ({self.config.vocab_size}) differs "
                              f"from the target's ({target.vocab_size})")

    def init_state(self, slots: int, max_len: int) -> kvc.KVCache:
        """An empty KV cache of the draft LM ([2, slots, nkv, max_len, hd] per layer)."""
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

    def restart(self, state: kvc.KVCache, start_b: Array) -> kvc.KVCache:
        """Rows [0:B] cut back to their caches' first start_b positions (prefix caching)."""
        return kvc.cut_rows(state, start_b)

    def propose_with_logits(self, state: kvc.KVCache, anchor_b: Array, position_b: Array,
                            sampling: SamplingArrays, key_b: Array,
                            kv_len: int | None = None) -> tuple[DraftBlock, Array]:
        """`propose`, also returning the draft logits [B, gamma, V] (float32) each q came from."""
        return self._draft(state, anchor_b, position_b, sampling, key_b, kv_len, None, with_logits=True)

    def propose(self, state: kvc.KVCache, anchor_b: Array, position_b: Array,
                sampling: SamplingArrays, key_b: Array, kv_len: int | None = None,
                guide: DraftGuide | None = None) -> DraftBlock:
        """Propose gamma tokens for rows [0:B] autoregressively from the anchor at position_b
        (its cache read up to the context bound kv_len plus the block's gamma entries), under the
        rows' automata with a `guide` (`drafting.draft_loop`)."""
        return self._draft(state, anchor_b, position_b, sampling, key_b, kv_len, guide, with_logits=False)[0]

    def _draft(self, state: kvc.KVCache, anchor_b: Array, position_b: Array, sampling: SamplingArrays,
               key_b: Array, kv_len: int | None, guide: DraftGuide | None, *,
               with_logits: bool) -> tuple[DraftBlock, Array | None]:
        b = anchor_b.shape[0]
        # the block's own gamma entries follow the committed context: read rows [0:kv_len + gamma)
        read = None if kv_len is None or kv_len + self.gamma >= state.max_len else kv_len + self.gamma
        sub = kvc.KVCache(kv=tuple(x[:, :b] for x in state.kv), lengths=state.lengths[:b])
        pos0 = position_b.astype(jnp.int32)

        def step(k: Array, carry: tuple[kvc.KVCache, Array], draw: Draw) -> tuple[tuple, Array, dict[str, Array]]:
            cache, tok_b = carry
            out = self.model.forward(tok_b[:, None], (pos0 + k)[:, None], cache, logits="all", kv_len=read)
            z = out.logits[:, 0]  # [B, V] float32
            nxt, q = draw(z)
            return (out.cache, nxt), nxt, step_outputs(q, z, with_logits)

        _, tokens, outs = draft_loop(step, (sub, anchor_b.astype(jnp.int32)), self.gamma, sampling, key_b,
                                     self.dtype, guide)
        q_bgv = loop_q(outs, tokens, self.model.config.vocab_size, self.dtype)
        return DraftBlock(tokens=tokens, q=q_bgv, confidence=None), outs.get("z")



# ------------------------------------------------------------------------------------------------
# checkpoint format


def config_from_hf(d: Mapping[str, Any], *, source: str = "config.json",
                   default_gamma: int = 4) -> tuple[TargetConfig, int]:
    """(the draft LM's TargetConfig, gamma) of a standalone drafter config.json (module
    docstring); gamma = `num_speculative_tokens` or `default_gamma`."""
    arch = hf.architecture(d, source)
    if arch != ARCHITECTURE and arch not in _CAUSAL_LMS:
        raise ConfigError(f"{source}: architectures {d.get('architectures')!r} is not a standalone "
                          f"draft LM")
    marker = d.get(MARKER_FIELD)
    if marker is not None and marker != "standalone":
        raise ConfigError(f"{source}: field '{MARKER_FIELD}' must be 'standalone', "
                          f"got {marker!r}")
    lm = dict(d)
    if arch == ARCHITECTURE:
        lm["architectures"] = []  # the family comes from model_type
    tc = TargetConfig.from_hf_dict(lm, source=source)
    if d.get(hf.GAMMA_FIELD) is not None:
        return tc, hf.int_field(d, hf.GAMMA_FIELD, source, minimum=1)
    return tc, default_gamma


def hf_config(model_config: TargetConfig, gamma: int, *, dtype: Any = "float32",
              extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A CausalLM config.json mapping (loadable by transformers) marked as a standalone
    drafter with its proposal length."""
    d = model_config.to_hf_dict()
    d["torch_dtype"] = str(jnp.dtype(dtype))
    d[MARKER_FIELD] = "standalone"
    d[hf.GAMMA_FIELD] = int(gamma)
    return hf.merge_extra(d, extra)


def key_map() -> KeyMap:
    """Standalone drafter (its LM held as `model`) <-> plain CausalLM names."""
    return KeyMap(prefix_map={"model.": ""})


def _load(path: str, d: Mapping[str, Any], source: str, tcfg: TargetConfig | None, tmodel: Any,
          *, dtype: Any, compute_dtype: Any, gamma: int | None, mesh: Any, rules: Any
          ) -> StandaloneDrafter:
    del tmodel
    lm_cfg, saved_gamma = config_from_hf(d, source=source)
    if tcfg is not None and lm_cfg.vocab_size != tcfg.vocab_size:
        raise ConfigError(f"{source}: drafter is incompatible with the target: draft model field "
                          f"'vocab_size' ({lm_cfg.vocab_size}) differs from the target's "
                          f"({tcfg.vocab_size})")
    model = checkpoints.load_target_weights(path, lm_cfg, dtype=dtype,
                                            compute_dtype=compute_dtype, mesh=mesh, rules=rules)
    return StandaloneDrafter(model, int(gamma) if gamma is not None else saved_gamma)


def _save(drafter: StandaloneDrafter, target_config: Any, *, dtype: Any,
          extra: Mapping[str, Any] | None, num_anchors: int) -> tuple[dict[str, Any], KeyMap]:
    del num_anchors
    if target_config is not None:
        drafter.check_target(hf.target_hf_base(target_config)[1])
    return hf_config(drafter.model.config, drafter.gamma, dtype=dtype, extra=extra), key_map()


# ------------------------------------------------------------------------------------------------
# training


@dataclasses.dataclass(frozen=True, kw_only=True)
class StandaloneTraining(TrainingSection):
    """The `model:` fields of kind "standalone": a `num_draft_layers`-layer LM proposing
    `block_size` tokens, with the `draft_*` dimensions (`draft_intermediate_size` 0 = the
    target's), and the loss weights of CE and TV against the target."""

    num_draft_layers: int = 5
    block_size: int = 7
    draft_hidden_size: int = 128
    draft_num_attention_heads: int = 2
    draft_num_key_value_heads: int = 1
    draft_head_dim: int = 64
    alpha_ce: float = 0.1
    alpha_tv: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "num_draft_layers", "block_size", "draft_hidden_size",
                       "draft_num_attention_heads", "draft_num_key_value_heads", "draft_head_dim")
        check_non_negative(self, "alpha_ce", "alpha_tv")

    def lm_config(self, tcfg: TargetConfig) -> TargetConfig:
        """The draft LM's config: the target's family, vocab, RoPE and EOS with `draft_*` dims."""
        return dataclasses.replace(
            tcfg, hidden_size=self.draft_hidden_size,
            intermediate_size=self.draft_intermediate_size or tcfg.intermediate_size,
            num_hidden_layers=self.num_draft_layers,
            num_attention_heads=self.draft_num_attention_heads,
            num_key_value_heads=self.draft_num_key_value_heads, head_dim=self.draft_head_dim,
            tie_word_embeddings=True)


def _build(sec: StandaloneTraining, target: Any, tcfg: TargetConfig, *, rngs: nnx.Rngs,
           dtype: Any, param_dtype: Any, draft_ids: Any
           ) -> tuple[StandaloneDrafter, TargetConfig, tuple[int, ...]]:
    del target
    if draft_ids is not None:
        raise ConfigError("draft_ids were given for kind 'standalone' (no draft vocabulary)")
    cfg = sec.lm_config(tcfg)
    drafter = StandaloneDrafter.from_config(cfg, sec.block_size, rngs=rngs, dtype=dtype,
                                            param_dtype=param_dtype)
    return drafter, cfg, ()


def standalone_loss_fn(*, alpha_ce: float = 0.1, alpha_tv: float = 0.9,
                       chunk_tokens: int | None = None):
    """The distillation loss `(model, batch, rng, target) -> (loss, metrics)` (module
    docstring)."""

    def loss_fn(model: Any, batch: Mapping[str, Array], rng: Array, target: TargetView):
        del rng
        ids = jnp.asarray(batch["input_ids"], jnp.int32)
        lm = jnp.asarray(batch["loss_mask"]).astype(jnp.float32)
        valid = batch.get("valid")
        b, s = ids.shape
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        vb = None if valid is None else jnp.asarray(valid, jnp.int32)
        if alpha_tv == 0:
            hid = model.model.forward(ids, pos, valid_b=vb, logits="none").hidden
            loss, metrics = losses.lm_loss(hid, model.model.logits, shift_left(ids, 1),
                                           shift_left(lm, 1), chunk_tokens=chunk_tokens)
            return alpha_ce * loss, {**metrics, "loss": alpha_ce * loss}
        z = model.model.forward(ids, pos, valid_b=vb, logits="all").logits
        _, hid = target.features(None)
        t_logits = jax.lax.stop_gradient(target.logits(hid))
        return losses.mtp_loss(z, t_logits, shift_left(ids, 1), shift_left(lm, 1),
                               alpha_ce=alpha_ce, alpha_tv=alpha_tv, chunk_tokens=chunk_tokens)

    return loss_fn


def _objective(sec: StandaloneTraining, *, feature_dtype: Any):
    del feature_dtype
    return standalone_loss_fn(alpha_ce=sec.alpha_ce, alpha_tv=sec.alpha_tv,
                              chunk_tokens=sec.chunk_anchors)


KINDS = (Kind("standalone", (ARCHITECTURE, *_CAUSAL_LMS), StandaloneDrafter, _load, _save,
              StandaloneTraining, _build, _objective, cache=False),)

__all__ = ["ARCHITECTURE", "KINDS", "MARKER_FIELD", "StandaloneDrafter", "StandaloneTraining",
           "config_from_hf", "hf_config", "key_map", "standalone_loss_fn"]
