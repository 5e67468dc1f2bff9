"""Start a block drafter's own layer from one of the target's decoder layers (a training option).

DeepSpec starts the draft layers at random. `init_layer_from_target: L` instead copies target layer
L into the (first) draft layer and sets the context path so that, at the start, the drafter's
context keys/values are exactly target layer L's over the tap that feeds it:

- `fc` reads only tap L-1 (the output of layer L-1, the input of layer L) through an identity
  block; its other tap columns start at zero and stay trainable;
- `hidden_norm` (the context's norm before the k/v projections) gets layer L's input norm weight;
- the attention projections and both layer norms are copied; a draft layer narrower than the
  target's MLP keeps the `intermediate_size` channels with the largest
  |gate| * |up| * |down| norms;
- the drafter's per-head q/k norms (Qwen3-style layers; a Llama target has none) start at the
  root-mean-square per head dimension that the copied projections give an isotropic normed input,
  so attention logits keep roughly the target's scale.

Block slots still enter as token embeddings, so this is a warm start, not an equivalence.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.config import ConfigError
from specjax.models.layers import split_gate_up, split_qkv
from specjax.models.norm_folding import unfolded_kernel


def _np(x: Any) -> np.ndarray:
    return np.asarray(x[...], np.float32)


def _set(param: Any, value: np.ndarray) -> None:
    param[...] = jnp.asarray(value, param[...].dtype)


def _copy_linear(dst: Any, kernel: np.ndarray, bias: np.ndarray | None) -> None:
    """Set a Linear's kernel (and its bias: the given one, or zeros)."""
    _set(dst.kernel, kernel)
    if dst.bias is not None:
        _set(dst.bias, bias if bias is not None else np.zeros(dst.bias[...].shape, np.float32))


def mlp_channels(gate_hi: np.ndarray, up_hi: np.ndarray, down_ih: np.ndarray, keep: int) -> np.ndarray:
    """Indices (ascending) of the `keep` MLP channels with the largest |gate|*|up|*|down| norms."""
    score = (np.linalg.norm(gate_hi, axis=0) * np.linalg.norm(up_hi, axis=0)
             * np.linalg.norm(down_ih, axis=1))
    return np.sort(np.argsort(-score, kind="stable")[:keep])


def head_rms(w_ln_h: np.ndarray, kernel_hf: np.ndarray, head_dim: int) -> np.ndarray:
    """Per head dimension RMS [head_dim] of (x * w_ln) @ kernel for isotropic unit-variance x."""
    var_f = ((w_ln_h[:, None] * kernel_hf) ** 2).sum(axis=0)
    return np.sqrt(var_f.reshape(-1, head_dim).mean(axis=0))


def copy_layer_from_target(drafter: Any, target_model: Any, layer_id: int) -> None:
    """Warm-start `drafter` (a DSparkDrafter) from target layer `layer_id`, in place
    (draft layer i from target layer layer_id + i). Raises ConfigError naming the field when the
    target has no such layer, tap layer_id - 1 is not one of the drafter's taps, or a draft MLP is
    wider than the target's."""
    cfg = drafter.config
    layers_t = target_model.model.layers
    n_t = len(layers_t)
    n_d = len(drafter.layers)
    if not 0 < layer_id <= n_t - n_d:
        raise ConfigError(f"field 'init_layer_from_target' must be in [1, {n_t - n_d}] (target "
                          f"has {n_t} layers, drafter {n_d}), got {layer_id}")
    taps = tuple(cfg.target_layer_ids)
    if layer_id - 1 not in taps:
        raise ConfigError(f"field 'init_layer_from_target' = {layer_id} needs tap layer "
                          f"{layer_id - 1} (the input of layer {layer_id}) in target_layer_ids "
                          f"{list(taps)}")
    h = cfg.hidden_size
    fc = np.zeros((len(taps) * h, h), np.float32)
    j = taps.index(layer_id - 1)
    fc[j * h:(j + 1) * h] = np.eye(h, dtype=np.float32)
    _set(drafter.fc.kernel, fc)
    if drafter.fc.bias is not None:
        _set(drafter.fc.bias, np.zeros((h,), np.float32))
    _set(drafter.hidden_norm.weight, _np(layers_t[layer_id].input_layernorm.weight))
    for i, layer in enumerate(drafter.layers):
        src = layers_t[layer_id + i]
        _set(layer.input_layernorm.weight, _np(src.input_layernorm.weight))
        _set(layer.post_attention_layernorm.weight, _np(src.post_attention_layernorm.weight))
        src_attn = src.self_attn
        q_k_v = split_qkv(unfolded_kernel(src.input_layernorm, src_attn.qkv_proj.kernel[...]))
        biases = (split_qkv(_np(src_attn.qkv_proj.bias)) if src_attn.qkv_proj.bias is not None
                  else (None,) * 3)
        for name, kernel, bias in zip(("q_proj", "k_proj", "v_proj"), q_k_v, biases):
            _copy_linear(getattr(layer.self_attn, name), kernel, bias)
        _copy_linear(layer.self_attn.o_proj, _np(src_attn.o_proj.kernel), None)
        w_ln = _np(src.input_layernorm.weight)
        hd = cfg.head_dim
        for norm_name, kernel in (("q_norm", q_k_v[0]), ("k_norm", q_k_v[1])):
            dst_n, src_n = getattr(layer.self_attn, norm_name), getattr(src_attn, norm_name)
            if dst_n is None:
                continue
            _set(dst_n.weight, _np(src_n.weight) if src_n is not None else head_rms(w_ln, kernel, hd))
        gate, up = split_gate_up(unfolded_kernel(src.post_attention_layernorm,
                                                 src.mlp.gate_up_proj.kernel[...]))
        down = _np(src.mlp.down_proj.kernel)
        width = layer.mlp.gate_proj.kernel[...].shape[1]
        if width > gate.shape[1]:
            raise ConfigError(f"field 'draft_intermediate_size' = {width} is wider than the target's "
                              f"MLP ({gate.shape[1]}); init_layer_from_target cannot copy it")
        keep = mlp_channels(gate, up, down, width)
        _set(layer.mlp.gate_proj.kernel, gate[:, keep])
        _set(layer.mlp.up_proj.kernel, up[:, keep])
        _set(layer.mlp.down_proj.kernel, down[keep, :])


__all__ = ["copy_layer_from_target", "head_rms", "mlp_channels"]
