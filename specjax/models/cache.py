"""The KV cache as an explicit pytree.

Per layer keys and values share one buffer [2, slots, kv_heads, max_len, head_dim] (`kv[0]` the
keys, `kv[1]` the values: contiguous halves, each heads-major, the layout attention reads without
copies or transposes, `layers.attend`); `lengths[slots]` is the number of committed tokens of each
slot. New tokens are written at each row's own length, keys and values in one scatter per layer
(writes past `max_len` dropped), and attention masks come from lengths alone, so rejecting draft
tokens is just setting a smaller length: stale entries past it are masked and overwritten later
(write, then mask; no copies). Slots are axis 1 of a key/value buffer and axis 0 of everything else
(`slot_axes`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

KV_AXES = (None, "cache_batch", "kv_heads", "cache_seq", "head_dim")
LENGTHS_AXES = ("cache_batch",)
KV_SLOT_AXIS = 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    kv: tuple[Array, ...]  # per layer [2, slots, kv_heads, max_len, head_dim]: keys [0], values [1]
    lengths: Array  # [slots] int32

    @classmethod
    def init(cls, *, num_layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
             dtype="float32") -> "KVCache":
        shape = (2, slots, kv_heads, max_len, head_dim)
        return cls(kv=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)), lengths=jnp.zeros((slots,), jnp.int32))

    @property
    def slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.kv[0].shape[-2]

    def with_lengths(self, lengths: Array) -> "KVCache":
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def cut_rows(cache: KVCache, lengths_b: Array) -> KVCache:
    """Rows [0:B] cut back to lengths_b [B] committed tokens (entries past them are masked, then
    overwritten); the other rows unchanged."""
    return cache.with_lengths(cache.lengths.at[:lengths_b.shape[0]].set(lengths_b.astype(jnp.int32)))


def slot_axes(tree: Any) -> Any:
    """The slot axis of every leaf of a state pytree: KV_SLOT_AXIS for the key/value buffers of a
    `KVCache` in it, 0 for every other leaf (lengths included)."""
    def one(node: Any) -> Any:
        if isinstance(node, KVCache):
            return KVCache(kv=tuple(KV_SLOT_AXIS for _ in node.kv), lengths=0)
        return jax.tree.map(lambda _: 0, node)
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, KVCache))


def write_indices(lengths_s: Array, t: int) -> Array:
    """Cache rows [S, T] that T new tokens occupy: each row's own length + 0..T-1."""
    return lengths_s[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def write(buf: Array, new_bt_d: Array, lengths_b: Array, rows_b: Array | None = None, slot_axis: int = 0,
          n_valid_b: Array | None = None) -> Array:
    """Scatter T new entries per row into a buffer whose axis `slot_axis` indexes slots and whose
    last two are [max_len, d], at that row's length, in one scatter. `new` is [B, T, *the buffer's
    other axes in order, d]; entries past max_len are dropped, and with `n_valid_b` so are a row's
    entries from its n_valid-th on (the buffer keeps what it held there). Row b of `new` goes to cache
    slot `rows_b[b]` (default: slot b; an id >= slots drops the row)."""
    b, t = new_bt_d.shape[:2]
    idx = write_indices(lengths_b, t)
    if n_valid_b is not None:
        idx = jnp.where(jnp.arange(t)[None, :] < n_valid_b[:, None], idx, buf.shape[-2])
    rows = jnp.arange(b, dtype=jnp.int32) if rows_b is None else rows_b.astype(jnp.int32)
    at = (slice(None),) * slot_axis + (rows[:, None],) + (slice(None),) * (buf.ndim - slot_axis - 3) + (idx,)
    return buf.at[at].set(new_bt_d.astype(buf.dtype), mode="drop")


def write_kv(kv_2skmd: Array, k_btkd: Array, v_btkd: Array, lengths_b: Array, rows_b: Array | None = None) -> Array:
    """Keys and values [B, T, kv_heads, hd] into a layer's key/value buffer (`write`: one scatter)."""
    return write(kv_2skmd, jnp.stack([k_btkd, v_btkd], axis=2), lengths_b, rows_b, slot_axis=KV_SLOT_AXIS)


def read_rows(buf: Array, b: int, rows_b: Array | None = None, kv_len: int | None = None, slot_axis: int = 0) -> Array:
    """The part of a buffer [..., max_len, d] (slots on `slot_axis`) a call of B rows attends to:
    slots [0:B] (a slice) or the given slot ids, cache rows [0:kv_len] when given."""
    buf = buf if kv_len is None else buf[..., :kv_len, :]
    if rows_b is None:
        return jax.lax.slice_in_dim(buf, 0, b, axis=slot_axis)
    return jnp.take(buf, rows_b, axis=slot_axis, mode="clip")


def read_kv(kv_2skmd: Array, b: int, rows_b: Array | None = None, kv_len: int | None = None) -> tuple[Array, Array]:
    """Keys and values [B, kv_heads, kv_len or max_len, hd] a call of B rows attends to (`read_rows`)."""
    kv = read_rows(kv_2skmd, b, rows_b, kv_len, slot_axis=KV_SLOT_AXIS)
    return kv[0], kv[1]


def cached_mask(lengths_s: Array, t: int, max_len: int) -> Array:
    """[S, T, max_len]: query t of row s (at cache row lengths[s] + t) sees keys j <= lengths[s] + t."""
    q_idx = write_indices(lengths_s, t)
    return jnp.arange(max_len, dtype=jnp.int32)[None, None, :] <= q_idx[:, :, None]


def causal_mask(t: int, valid_b: Array | None = None) -> Array:
    """[B, T, T] causal mask without a cache; keys at or past a row's valid length are hidden."""
    ar = jnp.arange(t, dtype=jnp.int32)
    m = ar[None, :, None] >= ar[None, None, :]
    if valid_b is None:
        return m
    return m & (ar[None, None, :] < valid_b[:, None, None])
