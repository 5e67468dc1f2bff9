"""Tiny random Hugging Face checkpoints for tests (torch is used only here and in tests).

`make_tiny_lm(tmp_path, family, ...)` builds a `transformers` Qwen3 / Llama / Qwen2 CausalLM
(`make_tiny_qwen3`: the Qwen3 one) with random weights
(norm weights perturbed too, so a swapped or missing norm is visible), saves it with
`save_pretrained` (safetensors) and returns the directory. `hf_forward` runs a saved (or in-memory)
model on right-padded numpy tokens and returns numpy logits and hidden states.
`make_tiny_tokenizer(dir)` writes a small word-level fast tokenizer.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import torch
import transformers

transformers.utils.logging.disable_progress_bar()  # quiet save_pretrained / from_pretrained


_FAMILIES = {  # model_type -> (config class, model class)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def make_tiny_lm(tmp_path: str | pathlib.Path, family: str = "qwen3", *, tie: bool = False,
                 heads: int = 4, kv_heads: int = 2, head_dim: int = 16, hidden: int = 32,
                 layers: int = 2, vocab: int = 97, intermediate: int = 64,
                 rope_scaling: dict[str, Any] | None = None, rope_theta: float = 10000.0,
                 seed: int = 0, dtype: str = "float32", max_shard_size: str | None = None,
                 max_positions: int = 256, subdir: str | None = None) -> pathlib.Path:
    """Save a random tiny `{Qwen3,Llama,Qwen2}ForCausalLM` under tmp_path/subdir; return that dir.

    `family` "qwen3", "llama" or "qwen2" (Qwen2 has q/k/v biases, also randomised);
    `rope_scaling` e.g. {"rope_type": "linear", "factor": 2.0} or a llama3 dict; `dtype`
    "float32" or "bfloat16" (the saved tensor dtype); `max_shard_size` (e.g. "20KB") writes a
    sharded checkpoint.
    """
    rope = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling:
        rope.update({k: v for k, v in rope_scaling.items() if k != "type"})
        rope["rope_type"] = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    config_cls, model_cls = (getattr(transformers, n) for n in _FAMILIES[family])
    cfg = config_cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, rope_parameters=rope, bos_token_id=1, eos_token_id=2,
        initializer_range=0.02)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and name.endswith(".bias"):  # q/k/v biases: O(1) shifts
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:  # RMSNorm weights: around one, but distinct per norm
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:  # scale so that logits are O(1) and every weight matters
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    out = pathlib.Path(tmp_path) / (subdir or f"tiny_{family}")
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, safe_serialization=True, **kw)
    return out


def make_tiny_qwen3(tmp_path: str | pathlib.Path, *, subdir: str = "tiny_qwen3",
                    **kw: Any) -> pathlib.Path:
    """`make_tiny_lm` of the Qwen3 family."""
    return make_tiny_lm(tmp_path, "qwen3", subdir=subdir, **kw)


def load_hf_model(path: str | pathlib.Path) -> transformers.PreTrainedModel:
    """Load a saved checkpoint (any family) in float32 with eager attention (local files only)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", local_files_only=True).eval()


def hf_forward(model_or_path: Any, tokens_bt: np.ndarray,
               valid_b: np.ndarray | None = None) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Torch forward on right-padded tokens: (logits [B,T,V], hidden_states (L+1) x [B,T,H])."""
    model = model_or_path
    if not isinstance(model, torch.nn.Module):
        model = load_hf_model(model_or_path)
    b, t = tokens_bt.shape
    if valid_b is None:
        valid_b = np.full((b,), t)
    attn = (np.arange(t)[None, :] < np.asarray(valid_b)[:, None]).astype(np.int64)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(tokens_bt, np.int64)),
                    attention_mask=torch.as_tensor(attn), output_hidden_states=True,
                    use_cache=False)
    return (out.logits.float().numpy(),
            tuple(h.float().numpy() for h in out.hidden_states))


def make_tiny_tokenizer(out_dir: str | pathlib.Path, vocab: int = 97) -> pathlib.Path:
    """Write a word-level fast tokenizer ("<unk>", "<s>", "</s>", then "w3".."w{vocab-1}")."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="</s>")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


def padded_batch(seed: int, lengths: tuple[int, ...], vocab: int):
    """Random right-padded token rows: (tokens [B,T] int32, positions [B,T], valid lengths [B])."""
    import numpy as np
    rng = np.random.RandomState(seed)
    t = max(lengths)
    valid = np.asarray(lengths, np.int32)
    tokens = rng.randint(3, vocab, size=(len(lengths), t)).astype(np.int32)
    tokens[np.arange(t)[None, :] >= valid[:, None]] = 0  # right padding
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape)
    return tokens, positions, valid


def single_and_sharded(path: str | pathlib.Path, data: int, tensor: int):
    """A saved target loaded on one device and on a (data, tensor) mesh under the "serve" rules:
    (single model, sharded model, the mesh). Needs data * tensor emulated devices (conftest)."""
    import jax

    from specjax import checkpoints, sharding
    assert len(jax.devices()) >= data * tensor
    single, _ = checkpoints.load_target(path)
    mesh = sharding.make_mesh((data, tensor), ("data", "tensor"))
    sharded, _ = checkpoints.load_target(path, mesh=mesh, rules="serve")
    return single, sharded, mesh
