"""How one parameter of ours is stored: which tensors, in which layout.

A plain parameter is one tensor (a 2-D kernel stored transposed, see `common.LeafRule`). A fused one
is several: the target's `self_attn.qkv_proj` kernel [H, nkv, q_per_kv + 2, hd] (and Qwen2's bias)
is stored as the Hugging Face `self_attn.{q,k,v}_proj` tensors and `mlp.gate_up_proj` [H, 2, F] as
`mlp.{gate,up}_proj`, so checkpoint files never change; loading fuses (`models.layers.fuse_qkv`,
`fuse_gate_up`) and export splits. A fused parameter's name from the key map (e.g.
`model.layers.0.self_attn.qkv_proj.weight`) names no stored tensor; its `Fusion` gives the parts.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import numpy as np

from specjax.models.layers import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Fusion:
    """A parameter whose name ends with `suffix` is stored as the tensors ending with `parts`
    (kernels [out, in] when `transpose`); `kind` is "qkv" or "gate_up"."""

    suffix: str
    parts: tuple[str, ...]
    transpose: bool
    kind: str

    def part_shapes(self, shape: Shape) -> list[Shape]:
        """The stored parts' shapes of our parameter shape."""
        if self.kind == "qkv":
            lead, (nkv, g2, hd) = tuple(shape[:-3]), shape[-3:]
            shapes = [lead + (nkv * (g2 - 2) * hd,), lead + (nkv * hd,), lead + (nkv * hd,)]
        else:
            shapes = [tuple(shape[:-2]) + (shape[-1],)] * 2
        return [s[::-1] if self.transpose else s for s in shapes]

    def join(self, parts: Sequence[np.ndarray], shape: Shape) -> np.ndarray:
        ours = [p.T if self.transpose else p for p in parts]
        return fuse_qkv(*ours, kv_heads=shape[-3]) if self.kind == "qkv" else fuse_gate_up(*ours)

    def split(self, value: np.ndarray) -> list[np.ndarray]:
        parts = split_qkv(value) if self.kind == "qkv" else split_gate_up(value)
        return [p.T if self.transpose else p for p in parts]


_ATTN, _MLP = ".self_attn.", ".mlp."
FUSIONS: tuple[Fusion, ...] = (
    Fusion(_ATTN + "qkv_proj.weight", tuple(f"{_ATTN}{p}_proj.weight" for p in "qkv"), True, "qkv"),
    Fusion(_ATTN + "qkv_proj.bias", tuple(f"{_ATTN}{p}_proj.bias" for p in "qkv"), False, "qkv"),
    Fusion(_MLP + "gate_up_proj.weight", (_MLP + "gate_proj.weight", _MLP + "up_proj.weight"), True,
           "gate_up"),
)


def hf_shape(shape: Sequence[int], transpose: bool) -> Shape:
    shape = tuple(int(s) for s in shape)
    if transpose:
        if len(shape) != 2:
            raise ValueError(f"transpose rule needs a 2-D param, got shape {shape}")
        return shape[::-1]
    return shape


class TensorPlan(NamedTuple):
    """The stored tensors of one parameter: their names and shapes, and the two conversions."""

    names: tuple[str, ...]
    shapes: tuple[Shape, ...]
    to_ours: Callable[[Sequence[np.ndarray]], np.ndarray]  # stored tensors -> our layout
    to_stored: Callable[[np.ndarray], list[np.ndarray]]  # our layout -> stored tensors


def plan(name: str, transpose: bool, shape: Sequence[int],
         fusions: Sequence[Fusion] = FUSIONS) -> TensorPlan:
    """The stored tensors of the parameter of shape `shape` named `name` by a key map."""
    shape = tuple(int(s) for s in shape)
    f = next((f for f in fusions if name.endswith(f.suffix)), None)
    if f is None:
        return TensorPlan((name,), (hf_shape(shape, transpose),),
                          lambda a: a[0].T if transpose else a[0],
                          lambda v: [v.T if transpose else v])
    base = name[:-len(f.suffix)]
    return TensorPlan(tuple(base + p for p in f.parts), tuple(f.part_shapes(shape)),
                      lambda a: f.join(a, shape), f.split)
