"""Target features for drafter training: online (inside the jitted step) or an offline cache.

Features of a sequence are the target's hidden taps at `tap_layers` (raw decoder-layer outputs,
-1 = embedding output) concatenated per token -> [S, L*H], and its final-normed hidden state
[S, H] (target logits are recomputed from it through the frozen lm_head).

* Online: `target_features(target_params, graphdef, ids, valid, tap_layers=...)` runs the frozen
  target inside the training step (stop_gradient), so no cache is needed.
* Offline: `specjax.training.cache_build.build_cache` writes a tensorstore zarr store; `TargetCache` reads it back and checks
  that it was made for the target, layers and hidden size the trainer expects.

Cache layout (`<dir>/`): token-major zarr v3 arrays, uncompressed: `input_ids` int32 [T],
`loss_mask` uint8 [T], `taps` bfloat16 [T, L*H] (layer blocks in `tap_layers` order), `hidden`
bfloat16 [T, H]. Reads and writes address chunks of `chunk_tokens` rows (default 64); chunks are
packed into shard files of about `shard_bytes` (zarr's sharding codec), so a billion-token cache is
a few hundred thousand files rather than tens of millions. The index `offsets` int64 [N+1] (sample
i is rows offsets[i]:offsets[i+1]) and `manifest.json` are written last (the manifest's presence
marks a complete cache). While building, `build_state.json` records how many samples are complete,
and a rerun continues after the last complete sample.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.io import iter_jsonl
from specjax.models.layers import concat_taps

Array = jax.Array

CACHE_VERSION = 1  # zarr v3 arrays
MANIFEST = "manifest.json"
BUILD_STATE = "build_state.json"
TOKEN_ARRAYS = ("input_ids", "loss_mask", "taps", "hidden")
INDEX_ARRAY = "offsets"
BYTES_PER_TOKEN_FIXED = 5  # input_ids int32 (4) + loss_mask uint8 (1)
BYTES_PER_INDEX_ENTRY = 8  # offsets int64, N + 1 entries
DEFAULT_SHARD_BYTES = 32 * 2**20
# tensorstore cache pool of an opened cache (shard indexes and chunks, least recently used first out)
DEFAULT_CACHE_POOL_BYTES = 64 * 2**20


class CacheMismatchError(ConfigError):
    """A target cache was built for a different target / layers / hidden size than expected."""


# ------------------------------------------------------------------------------------------------
# online features


def target_features(target_params: Any, graphdef: Any, ids_bs: Array, valid_b: Array | None = None,
                    *, tap_layers: Sequence[int], dtype: Any = jnp.bfloat16,
                    ) -> tuple[Array | None, Array]:
    """Frozen target forward -> (taps [B, S, L*H], or None when `tap_layers` is empty,
    final-normed hidden [B, S, H]) in `dtype` (None: the target's compute dtype).

    `target_params` / `graphdef` come from `nnx.split(target)` of a `CausalLM`;
    `valid_b` [B] is each row's count of real tokens (right padding; default S). Jittable; both
    outputs are wrapped in stop_gradient, so no gradient ever reaches the target.
    """
    target = nnx.merge(graphdef, target_params)
    b, s = ids_bs.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if valid_b is not None:
        valid_b = jnp.asarray(valid_b, jnp.int32)
    out = target.forward(jnp.asarray(ids_bs, jnp.int32), positions, valid_b=valid_b,
                         tap_layers=tuple(tap_layers), logits="none")
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    taps = cast(concat_taps(out.taps)) if tap_layers else None
    return jax.lax.stop_gradient(taps), jax.lax.stop_gradient(cast(out.hidden))


# ------------------------------------------------------------------------------------------------
# identity and size


@dataclasses.dataclass(frozen=True)
class TargetIdentity:
    """Which target a cache was made from: its directory and a hash of its config."""

    path: str
    config_hash: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "config_hash": self.config_hash}


def config_hash(cfg: TargetConfig) -> str:
    """sha256 (hex, 16 chars) of the target's canonical Hugging Face config mapping."""
    blob = json.dumps(cfg.to_hf_dict(), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def target_identity(path: str | os.PathLike, cfg: TargetConfig) -> TargetIdentity:
    return TargetIdentity(path=os.path.normpath(os.fspath(path)), config_hash=config_hash(cfg))


def bytes_per_token(hidden: int, num_layers: int) -> int:
    """Stored bytes per token: ids (4) + loss mask (1) + bf16 taps (2*L*H) + bf16 hidden (2*H)."""
    return BYTES_PER_TOKEN_FIXED + 2 * hidden * (num_layers + 1)


def estimate_bytes(num_tokens: int, hidden: int, num_layers: int, num_samples: int = 0) -> int:
    """Bytes of tensor data in a cache of `num_tokens` tokens in `num_samples` samples.

    = T * (5 + 2H(L+1)) + 8 (N + 1): per token int32 id, uint8 loss mask, bf16 taps and bf16
    final hidden, plus the int64 offsets index. (DeepSpec's 6 + 2H(L+1), reference §7.5, also
    counts an all-ones attention mask, which is not stored here.) `stored_bytes` gives the exact
    size on disk, which adds chunk padding and shard indexes (well under 1% at real sizes).
    """
    if num_tokens < 0 or hidden <= 0 or num_layers <= 0 or num_samples < 0:
        raise ValueError(f"invalid sizes: num_tokens={num_tokens}, hidden={hidden}, "
                         f"num_layers={num_layers}, num_samples={num_samples}")
    index = BYTES_PER_INDEX_ENTRY * (num_samples + 1) if num_samples else 0
    return num_tokens * bytes_per_token(hidden, num_layers) + index


def _floor_pow2(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def token_layout(num_tokens: int, hidden: int, num_layers: int, *, chunk_tokens: int = 64,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, dict[str, Any]]:
    """Per token array: dtype, features per row (0 for 1-D), bytes per row and shard_tokens.

    A shard holds a power-of-two number of chunks: as many as fit in `shard_bytes`, but no more
    than needed to hold all `num_tokens` rows.
    """
    if chunk_tokens < 1 or shard_bytes < 1:
        raise ValueError("chunk_tokens and shard_bytes must be >= 1")
    need_chunks = 1 << max(0, (max(1, math.ceil(num_tokens / chunk_tokens)) - 1).bit_length())
    out = {}
    for name, dtype, feats, item in (("input_ids", "int32", 0, 4), ("loss_mask", "uint8", 0, 1),
                                     ("taps", "bfloat16", num_layers * hidden, 2),
                                     ("hidden", "bfloat16", hidden, 2)):
        row = item * max(feats, 1)
        per_shard = min(_floor_pow2(shard_bytes // (row * chunk_tokens)), need_chunks)
        out[name] = {"dtype": dtype, "features": feats, "row_bytes": row,
                     "chunk_tokens": chunk_tokens, "shard_tokens": per_shard * chunk_tokens}
    return out


def stored_bytes(num_tokens: int, hidden: int, num_layers: int, num_samples: int, *,
                 chunk_tokens: int = 64, shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Exact bytes of the array files a cache occupies (zarr metadata and JSON not counted).

    Per token array: every chunk touching [0, T) is stored full size (ceil(T / chunk) chunks of
    chunk_tokens rows), plus each shard's index (16 bytes per chunk slot + a 4-byte checksum);
    the offsets index is one unsharded chunk of 8 (N + 1) bytes.
    """
    layout = token_layout(num_tokens, hidden, num_layers, chunk_tokens=chunk_tokens,
                          shard_bytes=shard_bytes)
    total = BYTES_PER_INDEX_ENTRY * (num_samples + 1)
    n_chunks = math.ceil(num_tokens / chunk_tokens)
    for spec in layout.values():
        n_shards = math.ceil(num_tokens / spec["shard_tokens"])
        slots = spec["shard_tokens"] // chunk_tokens
        total += n_chunks * chunk_tokens * spec["row_bytes"] + n_shards * (16 * slots + 4)
    return total


def stored_tensor_bytes(path: str | os.PathLike) -> int:
    """Bytes of the array data files (no zarr.json metadata) under a cache directory."""
    total = 0
    for name in TOKEN_ARRAYS + (INDEX_ARRAY,):
        d = os.path.join(os.fspath(path), name)
        if not os.path.isdir(d):
            continue
        for root, _, files in os.walk(d):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                         if f != "zarr.json" and not f.startswith("."))
    return total


# ------------------------------------------------------------------------------------------------
# zarr helpers


def create_array(path: str, dtype: str, shape: Sequence[int], *, chunk: int,
            shard: int | None) -> ts.TensorStore:
    """A new uncompressed zarr v3 array, chunked (and optionally sharded) along axis 0."""
    rest = list(shape[1:])
    raw = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if shard is None:
        grid, codecs = [chunk] + rest, raw
    else:
        grid = [shard] + rest
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [chunk] + rest, "codecs": raw, "index_location": "end",
            "index_codecs": raw + [{"name": "crc32c"}]}}]
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
            "metadata": {"data_type": dtype, "shape": list(shape), "fill_value": 0,
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
                         "codecs": codecs},
            "store_data_equal_to_fill_value": True}
    return ts.open(spec, create=True, delete_existing=True).result()


def cache_context(cache_pool_bytes: int | None = None) -> ts.Context:
    """A tensorstore Context whose cache pool holds at most `cache_pool_bytes` (None: the default
    DEFAULT_CACHE_POOL_BYTES; 0: no caching, every read fetches the shard index again)."""
    n = DEFAULT_CACHE_POOL_BYTES if cache_pool_bytes is None else cache_pool_bytes
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ConfigError(f"field 'cache_pool_bytes' must be an integer >= 0, got {cache_pool_bytes!r}")
    return ts.Context({"cache_pool": {"total_bytes_limit": int(n)}})


def open_array(path: str, context: ts.Context | None = None) -> ts.TensorStore:
    """Open an existing array. With a `context` (the reader's), cached shard indexes and chunks are
    trusted after open: a complete cache is never rewritten in place."""
    if not os.path.isdir(path):
        raise ConfigError(f"cache array missing: {path}")
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
    if context is not None:
        spec["recheck_cached_data"] = "open"
    return ts.open(spec, open=True, context=context).result()


def plan_hash(ids: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a, m in zip(ids, masks):
        h.update(np.asarray(a, np.int32).tobytes())
        h.update(b"|")
        h.update(np.asarray(m, np.uint8).tobytes())
        h.update(b";")
    return h.hexdigest()[:16]


@functools.partial(jax.jit, static_argnums=(1,), static_argnames=("tap_layers", "dtype"))
def target_features_jit(target_params: Any, graphdef: Any, ids_bs: Array, valid_b: Array, *,
                        tap_layers: tuple[int, ...], dtype: Any = jnp.bfloat16,
                        ) -> tuple[Array, Array]:
    """`target_features` compiled once per (graphdef, shapes, tap_layers, dtype)."""
    return target_features(target_params, graphdef, ids_bs, valid_b, tap_layers=tap_layers,
                           dtype=dtype)


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None


# ------------------------------------------------------------------------------------------------
# reading


class TargetCache:
    """Read-only view of a complete cache; validates it against what the trainer expects.

    `expect_layers`, `expect_hidden`, `expect_target` (a TargetIdentity; its `path` is compared
    only when `check_target_path`) raise CacheMismatchError naming the field that differs.
    `cache[i]` / `read([i, ...])` return dicts of numpy arrays: input_ids int32 [S],
    loss_mask uint8 [S], taps bfloat16 [S, L*H], hidden bfloat16 [S, H]. Its arrays share one
    tensorstore cache pool of `cache_pool_bytes` (see `cache_context`).
    """

    def __init__(self, path: str | os.PathLike, *, expect_layers: Sequence[int] | None = None,
                 expect_hidden: int | None = None, expect_target: TargetIdentity | None = None,
                 check_target_path: bool = False, cache_pool_bytes: int | None = None):
        self.context = cache_context(cache_pool_bytes)
        self.path = os.path.normpath(os.fspath(path))
        if not os.path.isdir(self.path):
            raise ConfigError(f"target cache directory does not exist: {self.path}")
        man = os.path.join(self.path, MANIFEST)
        if not os.path.exists(man):
            hint = " (a build is in progress or was interrupted: rerun build_cache to finish it)" \
                if os.path.exists(os.path.join(self.path, BUILD_STATE)) else ""
            raise ConfigError(f"no {MANIFEST} in {self.path}: not a complete target cache{hint}")
        self.manifest = read_json(man)
        m = self.manifest
        if m.get("version") != CACHE_VERSION:
            raise CacheMismatchError(f"{man}: field 'version' is {m.get('version')!r}, this reader "
                                     f"reads version {CACHE_VERSION}")
        if expect_layers is not None and list(m.get("target_layer_ids", [])) != list(expect_layers):
            raise CacheMismatchError(
                f"{man}: field 'target_layer_ids' is {m.get('target_layer_ids')}, the trainer "
                f"expects {list(expect_layers)}")
        if expect_hidden is not None and m.get("hidden_size") != expect_hidden:
            raise CacheMismatchError(f"{man}: field 'hidden_size' is {m.get('hidden_size')}, the "
                                     f"trainer expects {expect_hidden}")
        if expect_target is not None:
            got = m.get("target", {})
            if got.get("config_hash") != expect_target.config_hash:
                raise CacheMismatchError(
                    f"{man}: field 'target.config_hash' is {got.get('config_hash')!r} (target "
                    f"{got.get('path')!r}), the trainer's target {expect_target.path!r} has "
                    f"{expect_target.config_hash!r}")
            if check_target_path and got.get("path") != expect_target.path:
                raise CacheMismatchError(f"{man}: field 'target.path' is {got.get('path')!r}, the "
                                         f"trainer expects {expect_target.path!r}")
        self.arrays = {n: open_array(os.path.join(self.path, n), self.context) for n in TOKEN_ARRAYS}
        self.offsets = np.asarray(open_array(os.path.join(self.path, INDEX_ARRAY)).read().result(),
                                  np.int64)
        if len(self.offsets) != m["num_samples"] + 1 or self.offsets[-1] != m["num_tokens"]:
            raise ConfigError(f"{self.path}: offsets index does not match the manifest")
        self.tap_layers = tuple(m["target_layer_ids"])
        self.hidden_size = int(m["hidden_size"])

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.read([i])[0]

    def read(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Samples at `indices` (all reads issued concurrently)."""
        n = len(self)
        futures = []
        for i in indices:
            i = int(i)
            if not 0 <= i < n:
                raise IndexError(f"sample index {i} out of range [0, {n})")
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            futures.append({k: a[lo:hi].read() for k, a in self.arrays.items()})
        return [{k: np.asarray(f.result()) for k, f in fs.items()} for fs in futures]


# ------------------------------------------------------------------------------------------------
# jsonl samples -> (ids, mask)


def tokenize_record(record: Mapping[str, Any], tokenizer: Any, *, max_length: int,
                    system_prompt: str | None = None, enable_thinking: bool | None = None,
                    ) -> tuple[np.ndarray, np.ndarray]:
    """One JSONL record -> (input_ids int32 [S], loss_mask uint8 [S]).

    Accepted records: {"input_ids", "loss_mask"} (pre-tokenised), {"conversations" | "messages":
    [{"role", "content"}, ...]} (the tokenizer's chat template; loss on assistant turns), or
    {"prompt", "completion"} (loss on the completion and EOS).
    """
    from specjax.training import data as tdata

    if "input_ids" in record:
        ids = np.asarray(record["input_ids"], np.int32)[:max_length]
        mask = np.asarray(record.get("loss_mask", np.ones_like(ids)), np.uint8)[:max_length]
        if ids.shape != mask.shape:
            raise ValueError("record 'input_ids' and 'loss_mask' lengths differ")
        return ids, mask
    if tokenizer is None:
        raise ValueError("a tokenizer is needed for records without 'input_ids'")
    conv = record.get("conversations", record.get("messages"))
    if conv is not None:
        return tdata.assistant_loss_mask(tokenizer, conv, max_length=max_length,
                                         system_prompt=system_prompt,
                                         enable_thinking=enable_thinking)
    if "prompt" in record and "completion" in record:
        return tdata.completion_loss_mask(tokenizer, record["prompt"], record["completion"],
                                          max_length=max_length)
    raise ValueError(f"record has none of 'input_ids', 'conversations', 'messages', "
                     f"'prompt'+'completion' (keys: {sorted(record)})")


def read_jsonl_samples(paths: Sequence[str | os.PathLike], tokenizer: Any, *, max_length: int,
                       min_loss_tokens: int = 0, system_prompt: str | None = None,
                       enable_thinking: bool | None = None,
                       on_skip: Callable[[str, int, str], None] | None = None,
                       ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Tokenise every record of the JSONL files; drop samples with fewer than `min_loss_tokens`
    loss tokens (reference §7.3). Bad JSON raises ValueError naming file and line."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for p in paths:
        p = os.fspath(p)
        if not os.path.exists(p):
            raise ConfigError(f"data file not found: {p}")
        for row in iter_jsonl(p, objects=True):
            try:
                ids, mask = tokenize_record(row.value, tokenizer, max_length=max_length,
                                            system_prompt=system_prompt,
                                            enable_thinking=enable_thinking)
            except ValueError as e:
                raise ValueError(f"{p}:{row.line}: {e}") from None
            if len(ids) == 0 or int(mask.sum()) < min_loss_tokens:
                if on_skip is not None:
                    on_skip(p, row.line, f"{int(mask.sum())} loss tokens < {min_loss_tokens}")
                continue
            out.append((ids, mask))
    return out


__all__ = ["CacheMismatchError", "TargetCache", "TargetIdentity", "bytes_per_token", "cache_context",
           "config_hash", "create_array", "estimate_bytes", "open_array", "plan_hash", "read_json",
           "read_jsonl_samples", "stored_bytes", "stored_tensor_bytes", "target_features",
           "target_features_jit", "target_identity", "token_layout", "tokenize_record"]
