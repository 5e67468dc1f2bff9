"""The KV cache as an explicit pytree.

Per layer k and v are heads-major [slots, kv_heads, max_len, head_dim] (the layout attention
reads without transposes: `layers.attend`); `lengths[slots]` is the number of committed tokens of
each slot. New tokens are written at each row's own length (one scatter per buffer, writes past
`max_len` dropped) and attention masks come from lengths alone, so rejecting draft tokens is just
setting a smaller length: stale entries past it are masked and overwritten later (write, then mask;
no copies).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array

CACHE_AXES = ("cache_batch", "kv_heads", "cache_seq", "head_dim")
LENGTHS_AXES = ("cache_batch",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[Array, ...]
    v: tuple[Array, ...]
    lengths: Array  # [slots] int32

    @classmethod
    def init(cls, *, num_layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
             dtype="float32") -> "KVCache":
        shape = (slots, kv_heads, max_len, head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        return cls(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   lengths=jnp.zeros((slots,), jnp.int32))

    @property
    def slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def with_lengths(self, lengths: Array) -> "KVCache":
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def write_indices(lengths_s: Array, t: int) -> Array:
    """Cache rows [S, T] that T new tokens occupy: each row's own length + 0..T-1."""
    return lengths_s[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def write(buf_skmd: Array, new_btkd: Array, lengths_b: Array, rows_b: Array | None = None) -> Array:
    """Scatter T new entries [B, T, kv_heads, hd] per row into a heads-major buffer
    [slots, kv_heads, max_len, hd] at that row's length (one scatter); entries past max_len are
    dropped. Row b of `new` goes to cache slot `rows_b[b]` (default: slot b; an id >= slots drops
    the row)."""
    b, t = new_btkd.shape[:2]
    idx = write_indices(lengths_b, t)
    rows = jnp.arange(b, dtype=jnp.int32) if rows_b is None else rows_b.astype(jnp.int32)
    return buf_skmd.at[rows[:, None], :, idx].set(new_btkd.astype(buf_skmd.dtype), mode="drop")


def read_rows(buf_skmd: Array, b: int, rows_b: Array | None = None, kv_len: int | None = None) -> Array:
    """The cache a call of B rows attends to, [B, kv_heads, kv_len or max_len, hd]: slots [0:B]
    (a slice) or the given slot ids, cache rows [0:kv_len] when given."""
    buf = buf_skmd if kv_len is None else buf_skmd[:, :, :kv_len]
    return buf[:b] if rows_b is None else jnp.take(buf, rows_b, axis=0, mode="clip")


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
