"""Building the offline target cache (layout and reader: `specjax.training.features`).

`build_cache` runs the frozen target over tokenised samples in batches of one padded shape per
length bucket and writes each batch's tokens, taps and final hidden states into the zarr arrays;
`build_state.json` records how many samples are complete, so a rerun continues after the last
complete sample. The offsets index and `manifest.json` are written last.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any, Iterable, Mapping, Sequence

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tensorstore as ts
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.decoding.buckets import next_pow2
from specjax.io import write_json_atomic
from specjax.training.features import (BUILD_STATE, CACHE_VERSION, DEFAULT_SHARD_BYTES, INDEX_ARRAY,
                                       MANIFEST, TOKEN_ARRAYS, CacheMismatchError, TargetIdentity,
                                       bytes_per_token, create_array, estimate_bytes, open_array,
                                       plan_hash, read_json, stored_bytes, target_features_jit,
                                       token_layout)


@dataclasses.dataclass(frozen=True)
class BuildReport:
    path: str
    num_samples: int
    num_tokens: int
    samples_written: int  # by this call (0 when the cache was already complete)
    complete: bool


def _length_bucket(n: int, minimum: int = 16) -> int:
    return next_pow2(n, minimum)


def _rows_cap(s_pad: int, batch_size: int, max_batch_tokens: int | None) -> int:
    if not max_batch_tokens:
        return batch_size
    return max(1, min(batch_size, max_batch_tokens // s_pad))


def _batches(lengths: Sequence[int], start: int, batch_size: int, max_batch_tokens: int | None,
             ) -> Iterable[tuple[int, int]]:
    """Consecutive sample ranges [i0, i1) from `start` (contiguous rows in the token arrays), at
    most `_rows_cap(bucket)` rows each, so every batch pads to one shape per length bucket."""
    i = start
    n = len(lengths)
    while i < n:
        j = i + 1
        longest = lengths[i]
        while j < n:
            cand = max(longest, lengths[j])
            if j + 1 - i > _rows_cap(_length_bucket(cand), batch_size, max_batch_tokens):
                break
            longest = cand
            j += 1
        yield i, j
        i = j


@dataclasses.dataclass(frozen=True)
class _Samples:
    """The checked samples of one build, with their offsets in the token arrays."""

    ids: list[np.ndarray]
    masks: list[np.ndarray]
    lengths: list[int]
    offsets: np.ndarray  # int64 [N + 1]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])


def _check_taps(cfg: TargetConfig, tap_layers: tuple[int, ...], identity: TargetIdentity) -> None:
    if not tap_layers:
        raise ValueError("tap_layers must name at least one target layer to cache")
    for lid in tap_layers:
        if not -1 <= lid < cfg.num_hidden_layers:
            raise ConfigError(f"tap layer {lid} out of range [-1, {cfg.num_hidden_layers}) for the "
                              f"target at {identity.path}")


def _check_samples(samples: Sequence[tuple[Any, Any]], cfg: TargetConfig) -> _Samples:
    if not samples:
        raise ValueError("no samples to cache")
    ids_list = [np.asarray(s[0], np.int32).reshape(-1) for s in samples]
    mask_list = [np.asarray(s[1], np.uint8).reshape(-1) for s in samples]
    for i, (a, m) in enumerate(zip(ids_list, mask_list)):
        if len(a) == 0 or len(a) != len(m):
            raise ValueError(f"sample {i}: input_ids ({len(a)}) and loss_mask ({len(m)}) must be "
                             "non-empty and of equal length")
        if a.min() < 0 or a.max() >= cfg.vocab_size:
            raise ValueError(f"sample {i}: token ids must be in [0, {cfg.vocab_size})")
    lengths = [len(a) for a in ids_list]
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return _Samples(ids_list, mask_list, lengths, offsets)


def _header(sm: _Samples, cfg: TargetConfig, tap_layers: tuple[int, ...],
            identity: TargetIdentity, tokenizer_name: str, chunk_tokens: int, shard_bytes: int,
            extra_manifest: Mapping[str, Any] | None) -> dict[str, Any]:
    """The manifest of the cache (less its creation time)."""
    h, nl, n = cfg.hidden_size, len(tap_layers), len(sm.lengths)
    layout = token_layout(sm.num_tokens, h, nl, chunk_tokens=chunk_tokens, shard_bytes=shard_bytes)
    return {
        "version": CACHE_VERSION, "target_layer_ids": list(tap_layers), "hidden_size": h,
        "target": identity.to_dict(), "tokenizer": tokenizer_name, "num_samples": n,
        "num_tokens": sm.num_tokens, "chunk_tokens": chunk_tokens, "plan_hash":
            plan_hash(sm.ids, sm.masks), "hidden_dtype": "bfloat16", "token_dtype": "int32",
        "mask_dtype": "uint8", "offsets": INDEX_ARRAY, "arrays": layout,
        "bytes_per_token": bytes_per_token(h, nl),
        "data_bytes": estimate_bytes(sm.num_tokens, h, nl, n),
        "stored_bytes": stored_bytes(sm.num_tokens, h, nl, n, chunk_tokens=chunk_tokens,
                                     shard_bytes=shard_bytes),
        **dict(extra_manifest or {}),
    }


def _open_or_start(out_dir: str, header: Mapping[str, Any],
                   ) -> tuple[int, dict[str, ts.TensorStore]]:
    """(samples already done, the token arrays): a partial build of the same cache resumes, a
    fresh one creates empty arrays and `build_state.json`."""
    state_path = os.path.join(out_dir, BUILD_STATE)
    paths = {n: os.path.join(out_dir, n) for n in TOKEN_ARRAYS}
    if os.path.exists(state_path):
        prev = read_json(state_path)
        _check_same_build(prev.get("header", {}), header, out_dir)
        return int(prev.get("samples_done", 0)), {n: open_array(p) for n, p in paths.items()}
    for n in TOKEN_ARRAYS + (INDEX_ARRAY,):
        shutil.rmtree(os.path.join(out_dir, n), ignore_errors=True)
    arrays = {n: create_array(paths[n], spec["dtype"],
                              [header["num_tokens"]] + ([spec["features"]] if spec["features"] else []),
                              chunk=header["chunk_tokens"], shard=spec["shard_tokens"])
              for n, spec in header["arrays"].items()}
    write_json_atomic(state_path, {"header": header, "samples_done": 0})
    return 0, arrays


def _write_batch(arrays: Mapping[str, ts.TensorStore], sm: _Samples, i0: int, i1: int,
                 target_split: tuple[Any, Any], tap_layers: tuple[int, ...], batch_size: int,
                 max_batch_tokens: int | None) -> None:
    """Run the target over samples [i0, i1) (padded to one shape per length bucket) and write
    their tokens, taps and hidden states; returns when the writes are done."""
    graphdef, params = target_split
    rows, lengths = i1 - i0, sm.lengths
    s_pad = _length_bucket(max(lengths[i0:i1]))
    b_pad = _rows_cap(s_pad, batch_size, max_batch_tokens)  # one shape per length bucket
    ids_pad = np.zeros((b_pad, s_pad), np.int32)
    valid = np.zeros((b_pad,), np.int32)
    for r, i in enumerate(range(i0, i1)):
        ids_pad[r, :lengths[i]] = sm.ids[i]
        valid[r] = lengths[i]
    valid[rows:] = 1
    taps, hid = target_features_jit(params, graphdef, jnp.asarray(ids_pad),
                                    jnp.asarray(valid), tap_layers=tap_layers)
    taps = np.asarray(taps, ml_dtypes.bfloat16)
    hid = np.asarray(hid, ml_dtypes.bfloat16)
    lo, hi = int(sm.offsets[i0]), int(sm.offsets[i1])
    cat = {
        "input_ids": np.concatenate(sm.ids[i0:i1]),
        "loss_mask": np.concatenate(sm.masks[i0:i1]),
        "taps": np.concatenate([taps[r, :lengths[i]] for r, i in enumerate(range(i0, i1))]),
        "hidden": np.concatenate([hid[r, :lengths[i]] for r, i in enumerate(range(i0, i1))]),
    }
    futures = [arrays[n][lo:hi].write(cat[n]) for n in TOKEN_ARRAYS]
    for f in futures:
        f.result()


def _finish(out_dir: str, header: Mapping[str, Any], offsets: np.ndarray) -> None:
    """Write the offsets index and the manifest (marking the cache complete)."""
    idx = create_array(os.path.join(out_dir, INDEX_ARRAY), "int64", [len(offsets)],
                       chunk=len(offsets), shard=None)
    idx.write(offsets).result()
    manifest = dict(header)
    manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    write_json_atomic(os.path.join(out_dir, MANIFEST), manifest)
    os.remove(os.path.join(out_dir, BUILD_STATE))


def build_cache(out_dir: str | os.PathLike, target: nnx.Module, samples: Sequence[tuple[Any, Any]],
                *, tap_layers: Sequence[int], identity: TargetIdentity,
                tokenizer_name: str = "", batch_size: int = 8, max_batch_tokens: int | None = 65536,
                chunk_tokens: int = 64, shard_bytes: int = DEFAULT_SHARD_BYTES,
                extra_manifest: Mapping[str, Any] | None = None, stop_after: int | None = None,
                progress: bool = False) -> BuildReport:
    """Write (or finish) an offline target cache for tokenised samples.

    `samples`: (input_ids int [S_i], loss_mask [S_i]) pairs, already truncated and filtered; they
    are stored in order. `target`: the frozen `CausalLM` (run as is, e.g. bf16). A rerun
    over the same samples and target continues after the last complete sample (per batch: the
    sample data is written and awaited, then `build_state.json` is advanced); the offsets index
    and `manifest.json` are written last. A partial cache made from different samples, target or
    layers is refused with the mismatching field named. `stop_after` ends this call after that
    many samples have been written by it (a resumable partial build; used by tests).
    """
    out_dir = os.path.normpath(os.fspath(out_dir))
    tap_layers = tuple(int(x) for x in tap_layers)
    cfg: TargetConfig = target.config
    _check_taps(cfg, tap_layers, identity)
    if chunk_tokens < 1 or batch_size < 1:
        raise ValueError("chunk_tokens and batch_size must be >= 1")
    sm = _check_samples(samples, cfg)
    n = len(sm.lengths)
    header = _header(sm, cfg, tap_layers, identity, tokenizer_name, chunk_tokens, shard_bytes,
                     extra_manifest)
    os.makedirs(out_dir, exist_ok=True)
    man_path = os.path.join(out_dir, MANIFEST)
    if os.path.exists(man_path):  # complete: fine if it is the same cache, else refuse
        _check_same_build(read_json(man_path), header, out_dir)
        return BuildReport(out_dir, n, sm.num_tokens, 0, True)
    done, arrays = _open_or_start(out_dir, header)
    target_split = nnx.split(target)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, initial=done, desc="target cache", unit="sample")
    written = 0
    for i0, i1 in _batches(sm.lengths, done, batch_size, max_batch_tokens):
        if stop_after is not None and written >= stop_after:
            break
        i1 = min(i1, i0 + (stop_after - written)) if stop_after is not None else i1
        _write_batch(arrays, sm, i0, i1, target_split, tap_layers, batch_size, max_batch_tokens)
        done, written = i1, written + i1 - i0
        write_json_atomic(os.path.join(out_dir, BUILD_STATE), {"header": header, "samples_done": done})
        if bar is not None:
            bar.update(i1 - i0)
    if bar is not None:
        bar.close()
    if done < n:
        return BuildReport(out_dir, n, sm.num_tokens, written, False)
    _finish(out_dir, header, sm.offsets)
    return BuildReport(out_dir, n, sm.num_tokens, written, True)


_BUILD_FIELDS = ("version", "target_layer_ids", "hidden_size", "target", "num_samples",
                 "num_tokens", "chunk_tokens", "arrays", "plan_hash")


def _check_same_build(existing: Mapping[str, Any], header: Mapping[str, Any], out_dir: str) -> None:
    for k in _BUILD_FIELDS:
        if existing.get(k) != header.get(k):
            raise CacheMismatchError(
                f"{out_dir} already holds a cache (or a partial build) with a different '{k}' "
                f"({existing.get(k)!r}, this build: {header.get(k)!r}); remove it or choose "
                "another output directory")


__all__ = ["BuildReport", "build_cache"]
