"""Meshes and logical-axis rules: the only module that knows mesh axis names.

Parameters and caches carry logical axis names (`embed`, `mlp`, `q_heads`, `kv_heads`, `head_dim`,
`vocab`, `batch`, `seq`, `cache_batch`, `cache_seq`, ...). A rules preset maps each logical name to
mesh axes; a dimension whose size the mesh axes do not divide stays replicated, and each mesh axis
is used at most once per array.

Meshes use `AxisType.Auto` by default: with Explicit axes ordinary model code (an embedding gather,
a head reshape) raises unless every op names its output sharding.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

Rules = Mapping[str, tuple[str, ...]]

# Training: batch over data and fsdp, parameters' embed dim over fsdp, heads / mlp / vocab over tensor.
TRAIN_RULES: Rules = {
    "batch": ("data", "fsdp"), "embed": ("fsdp",), "mlp": ("tensor",), "q_heads": ("tensor",),
    "kv_heads": ("tensor",), "vocab": ("tensor",), "head_dim": (), "seq": (), "anchors": (),
    "cache_batch": ("data", "fsdp"), "cache_seq": (), "rank": (), "features": (),
}
# Serving: parameters split over tensor; cache slots (and the requests in them) over data.
SERVE_RULES: Rules = {
    "batch": ("data",), "embed": (), "mlp": ("tensor",), "q_heads": ("tensor",), "kv_heads": ("tensor",),
    "vocab": ("tensor",), "head_dim": (), "seq": (), "cache_batch": ("data",), "cache_seq": (),
    "rank": (), "features": (),
}
PRESETS: dict[str, Rules] = {"train": TRAIN_RULES, "serve": SERVE_RULES}
TRAIN_AXES = ("data", "fsdp", "tensor")
SERVE_AXES = ("data", "tensor")


def rules_for(preset: str | Rules) -> Rules:
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown sharding preset {preset!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[preset]
    return preset


def make_mesh(shape: Sequence[int], axis_names: Sequence[str], *, explicit: bool = False,
              devices: Sequence[Any] | None = None) -> Mesh:
    """A device mesh; Auto axes unless `explicit`. The product of `shape` must equal the device count."""
    devices = list(devices) if devices is not None else jax.devices()
    n = int(np.prod(shape))
    if n > len(devices):
        raise ValueError(f"mesh shape {tuple(shape)} needs {n} devices, only {len(devices)} available")
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(tuple(shape), tuple(axis_names), axis_types=(kind,) * len(shape),
                         devices=devices[:n])


def serve_mesh(data: int = 1, tensor: int | None = None) -> Mesh:
    """A (data, tensor) mesh over the local devices; tensor defaults to all devices / data."""
    tensor = tensor or max(1, len(jax.devices()) // data)
    return make_mesh((data, tensor), SERVE_AXES)


def train_mesh(data: int = 1, fsdp: int | None = None, tensor: int = 1) -> Mesh:
    fsdp = fsdp or max(1, len(jax.devices()) // (data * tensor))
    return make_mesh((data, fsdp, tensor), TRAIN_AXES)


def partition_spec(logical_axes: Iterable[str | None] | None, shape: Sequence[int], mesh: Mesh,
                   rules: str | Rules) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec, replicating dims the mesh axes don't divide."""
    rules = rules_for(rules)
    if logical_axes is None:
        return PartitionSpec()
    logical_axes = tuple(logical_axes)
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {logical_axes} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[Any] = []
    for name, size in zip(logical_axes, shape):
        mesh_axes = [a for a in rules.get(name, ()) if a in mesh.shape and a not in used] if name else []
        chosen: list[str] = []
        prod = 1
        for a in mesh_axes:
            if size % (prod * mesh.shape[a]) == 0:
                chosen.append(a)
                prod *= mesh.shape[a]
        used.update(chosen)
        spec.append(None if not chosen else (chosen[0] if len(chosen) == 1 else tuple(chosen)))
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, logical_axes: Iterable[str | None] | None, shape: Sequence[int],
                   rules: str | Rules) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical_axes, shape, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def state_shardings(state: nnx.State, mesh: Mesh, rules: str | Rules) -> Any:
    """A pytree of NamedShardings matching an nnx State, read from each Variable's `logical_axes`."""
    def one(v: Any) -> Any:
        if isinstance(v, nnx.Variable):
            axes = v.get_metadata().get("logical_axes")
            return v.replace(named_sharding(mesh, axes, v.get_value().shape, rules))
        return replicated(mesh)
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def place(tree: Any, shardings: Any) -> Any:
    """jax.device_put `tree` with `shardings` (one, or a matching pytree); abstract leaves
    (ShapeDtypeStructs, e.g. of a runner that only lowers) take the sharding instead, so programs can
    be lowered for devices that only compile (a deviceless GPU topology)."""
    if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree)):
        return jax.device_put(tree, shardings)  # one batched transfer
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def shard_state(state: nnx.State, mesh: Mesh, rules: str | Rules) -> nnx.State:
    """Place every Variable of `state` with its logical sharding."""
    return place(state, state_shardings(state, mesh, rules))


def shard_module(module: nnx.Module, mesh: Mesh, rules: str | Rules) -> nnx.Module:
    """Shard a module's variables in place over `mesh` and return it."""
    graphdef, state = nnx.split(module)
    nnx.update(module, shard_state(state, mesh, rules))
    return module


def shard_tree(tree: Any, axes_tree: Any, mesh: Mesh, rules: str | Rules) -> Any:
    """Place a pytree of arrays given a matching pytree of logical-axis tuples."""
    return place(tree, tree_shardings(tree, axes_tree, mesh, rules))


def tree_shardings(tree: Any, axes_tree: Any, mesh: Mesh, rules: str | Rules) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    axes = treedef.flatten_up_to(axes_tree)
    return treedef.unflatten([named_sharding(mesh, a, x.shape, rules) for x, a in zip(leaves, axes)])
