"""Measured verify-step cost per executed bucket (numpy only; never imports jax).

A verify step over R active requests, where request r verifies ell_r draft tokens, executes the
bucket (slots bucket >= R, tokens-per-slot bucket >= 1 + max_r ell_r): every row carries its anchor
plus its draft tokens, padded to the bucket. The table stores the measured seconds of one verify step
for every (slots bucket, tokens-per-slot bucket) of the engine's grid; `seconds(slots, tokens)` is
the cost of the bucket that would actually execute, so the staircase made by padding is part of the
scheduler's model.

Tables are saved as JSON keyed by `CostTableMeta` (target identity, dtype, hardware, context length,
bucket set); an engine refuses a table measured for anything else (`check_matches`).
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
import operator
import os
from typing import Any, Mapping

import numpy as np

from specjax.io import write_json_atomic

FORMAT_NAME = "specjax.cost_table"
FORMAT_VERSION = 1


def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a positive integer, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{field} must be a positive integer, got {value!r}") from None
    if out < 1:
        raise ValueError(f"{field} must be a positive integer, got {value!r}")
    return int(out)


def _bucket_tuple(values: Any, field: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{field} must be a sequence of positive integers, got {values!r}")
    out = tuple(_positive_int(v, f"{field} entry") for v in values)
    if not out:
        raise ValueError(f"{field} must not be empty")
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"{field} must be strictly increasing, got {out}")
    return out


TIMED_ROUNDS = ("draft+verify", "fused_fill")  # what one timed round of a table is (CostTableMeta)


@dataclasses.dataclass(frozen=True)
class CostTableMeta:
    """What a cost table was measured for; all fields must match the engine that uses it."""

    target: str  # target model identity (name and/or weights hash)
    dtype: str  # compute dtype of the verify step, e.g. "bfloat16"
    hardware: str  # device kind and count, e.g. "TPU v5e x8" or "cpu"
    context_length: int  # KV-cache length the steps were measured at
    slots_buckets: tuple[int, ...]  # strictly increasing
    tokens_buckets: tuple[int, ...]  # tokens-per-slot buckets, strictly increasing
    # what one timed round is: "draft+verify" (host-scheduled policies: a draft call, then a verify
    # call) or "fused_fill" (confidence_async: one call); tables written before this field: the former
    timed_round: str = "draft+verify"

    def __post_init__(self) -> None:
        if self.timed_round not in TIMED_ROUNDS:
            raise ValueError(f"CostTableMeta.timed_round must be one of {TIMED_ROUNDS}, got {self.timed_round!r}")
        for name in ("target", "dtype", "hardware"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"CostTableMeta.{name} must be a non-empty string, got {value!r}")
        object.__setattr__(
            self, "context_length", _positive_int(self.context_length, "CostTableMeta.context_length")
        )
        object.__setattr__(
            self, "slots_buckets", _bucket_tuple(self.slots_buckets, "CostTableMeta.slots_buckets")
        )
        object.__setattr__(
            self, "tokens_buckets", _bucket_tuple(self.tokens_buckets, "CostTableMeta.tokens_buckets")
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (bucket tuples become lists)."""
        d = dataclasses.asdict(self)
        d["slots_buckets"] = list(self.slots_buckets)
        d["tokens_buckets"] = list(self.tokens_buckets)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "meta") -> "CostTableMeta":
        """Inverse of `to_dict`; unknown or missing keys are errors naming `source`."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{source}: metadata must be an object, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in d and f.default is dataclasses.MISSING]
        unknown = sorted(k for k in d if k not in names)
        if missing:
            raise ValueError(f"{source}: metadata is missing field(s) {missing}")
        if unknown:
            raise ValueError(f"{source}: metadata has unknown field(s) {unknown}")
        try:
            return cls(**{n: d[n] for n in names if n in d})
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


class CostTable:
    """Seconds per verify step for every (slots bucket, tokens-per-slot bucket) of a grid."""

    def __init__(
        self,
        slots_buckets: tuple[int, ...],
        tokens_buckets: tuple[int, ...],
        seconds_st: np.ndarray,
        meta: CostTableMeta | None = None,
    ) -> None:
        """Prefer `from_seconds` / `from_json`. `seconds_st[i, k]` is the cost of bucket
        (slots_buckets[i], tokens_buckets[k])."""
        sb = _bucket_tuple(slots_buckets, "slots_buckets")
        tb = _bucket_tuple(tokens_buckets, "tokens_buckets")
        sec = np.array(seconds_st, dtype=np.float64)
        if sec.shape != (len(sb), len(tb)):
            raise ValueError(
                f"seconds must have shape (len(slots_buckets), len(tokens_buckets)) = "
                f"{(len(sb), len(tb))}, got {sec.shape}"
            )
        bad = ~(np.isfinite(sec) & (sec > 0))
        if bad.any():
            i, k = map(int, np.argwhere(bad)[0])
            raise ValueError(
                f"seconds for bucket (slots={sb[i]}, tokens_per_slot={tb[k]}) must be positive "
                f"and finite, got {sec[i, k]!r}"
            )
        if meta is not None:
            if not isinstance(meta, CostTableMeta):
                raise ValueError(f"meta must be a CostTableMeta or None, got {type(meta).__name__}")
            if meta.slots_buckets != sb:
                raise ValueError(
                    f"meta.slots_buckets {meta.slots_buckets} != the table's slots buckets {sb}"
                )
            if meta.tokens_buckets != tb:
                raise ValueError(
                    f"meta.tokens_buckets {meta.tokens_buckets} != the table's tokens buckets {tb}"
                )
        sec.setflags(write=False)
        self._slots = sb
        self._tokens = tb
        self._seconds_st = sec
        self._meta = meta
        # stair_st[i, t]: seconds of the bucket that executes t tokens per slot (t = 0..max) for
        # slots bucket i; t = 0 maps to the smallest bucket.
        t_index = np.searchsorted(np.asarray(tb), np.arange(tb[-1] + 1), side="left")
        stair = sec[:, t_index]
        stair.setflags(write=False)
        self._stair_st = stair

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_seconds(
        cls, seconds: Mapping[tuple[int, int], float], meta: CostTableMeta | None = None
    ) -> "CostTable":
        """Build from `{(slots_bucket, tokens_per_slot_bucket): seconds}`; the keys must form a
        full grid (every slots bucket x every tokens bucket) and every value be positive, finite."""
        if not isinstance(seconds, Mapping) or not seconds:
            raise ValueError("seconds must be a non-empty mapping {(slots, tokens_per_slot): seconds}")
        parsed: dict[tuple[int, int], float] = {}
        for key, value in seconds.items():
            if not isinstance(key, tuple) or len(key) != 2:
                raise ValueError(f"cost table key must be a (slots, tokens_per_slot) pair, got {key!r}")
            s = _positive_int(key[0], f"slots bucket in key {key!r}")
            t = _positive_int(key[1], f"tokens_per_slot bucket in key {key!r}")
            if isinstance(value, bool):
                raise ValueError(f"seconds for bucket {key!r} must be a number, got {value!r}")
            try:
                x = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"seconds for bucket {key!r} must be a number, got {value!r}") from None
            if not (math.isfinite(x) and x > 0):
                raise ValueError(f"seconds for bucket {key!r} must be positive and finite, got {value!r}")
            if (s, t) in parsed:
                raise ValueError(f"duplicate cost table bucket {(s, t)}")
            parsed[(s, t)] = x
        sb = tuple(sorted({s for s, _ in parsed}))
        tb = tuple(sorted({t for _, t in parsed}))
        missing = [(s, t) for s in sb for t in tb if (s, t) not in parsed]
        if missing:
            raise ValueError(
                f"cost table is missing bucket(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                f"of the grid slots={sb} x tokens_per_slot={tb}"
            )
        sec = np.array([[parsed[(s, t)] for t in tb] for s in sb], dtype=np.float64)
        return cls(sb, tb, sec, meta)

    # ---- accessors ----------------------------------------------------------------------------

    @property
    def meta(self) -> CostTableMeta | None:
        return self._meta

    @property
    def slots_buckets(self) -> tuple[int, ...]:
        return self._slots

    @property
    def tokens_buckets(self) -> tuple[int, ...]:
        return self._tokens

    @property
    def max_slots(self) -> int:
        return self._slots[-1]

    @property
    def max_tokens_per_slot(self) -> int:
        return self._tokens[-1]

    @property
    def seconds_st(self) -> np.ndarray:
        """Read-only [len(slots_buckets), len(tokens_buckets)] matrix of seconds."""
        return self._seconds_st

    def as_dict(self) -> dict[tuple[int, int], float]:
        """`{(slots_bucket, tokens_bucket): seconds}`, the input form of `from_seconds`."""
        return {
            (s, t): float(self._seconds_st[i, k])
            for i, s in enumerate(self._slots)
            for k, t in enumerate(self._tokens)
        }

    def _slots_index(self, slots: int) -> int:
        s = _positive_int(slots, "slots")
        i = bisect.bisect_left(self._slots, s)
        if i == len(self._slots):
            raise ValueError(
                f"slots={s} exceeds the largest slots bucket {self._slots[-1]} of the cost table"
            )
        return i

    def _bucket_index(self, slots: int, tokens_per_slot: int) -> tuple[int, int]:
        i = self._slots_index(slots)
        t = _positive_int(tokens_per_slot, "tokens_per_slot")
        k = bisect.bisect_left(self._tokens, t)
        if k == len(self._tokens):
            raise ValueError(
                f"tokens_per_slot={t} exceeds the largest tokens-per-slot bucket "
                f"{self._tokens[-1]} of the cost table"
            )
        return i, k

    def bucket_for(self, slots: int, tokens_per_slot: int) -> tuple[int, int]:
        """Smallest (slots bucket >= slots, tokens bucket >= tokens_per_slot); ValueError beyond
        the largest bucket."""
        i, k = self._bucket_index(slots, tokens_per_slot)
        return self._slots[i], self._tokens[k]

    def seconds(self, slots: int, tokens_per_slot: int) -> float:
        """Seconds of the bucket that executes `slots` rows of `tokens_per_slot` tokens each."""
        i, k = self._bucket_index(slots, tokens_per_slot)
        return float(self._seconds_st[i, k])

    def steps_per_second(self, slots: int, tokens_per_slot: int) -> float:
        """1 / seconds(slots, tokens_per_slot): verify steps per second of the executed bucket."""
        return 1.0 / self.seconds(slots, tokens_per_slot)

    def staircase(self, slots: int) -> np.ndarray:
        """Read-only float64 [max_tokens_per_slot + 1]: entry t = seconds of the bucket executing
        `slots` rows of t tokens each (entry 0 = the smallest bucket)."""
        return self._stair_st[self._slots_index(slots)]

    # ---- metadata -----------------------------------------------------------------------------

    def check_matches(self, meta: CostTableMeta) -> None:
        """Raise ValueError naming every field where this table's metadata differs from `meta`
        (the engine refuses a table measured for another target, dtype, hardware, context length
        or bucket set)."""
        if not isinstance(meta, CostTableMeta):
            raise ValueError(f"meta must be a CostTableMeta, got {type(meta).__name__}")
        if self._meta is None:
            raise ValueError("cost table has no metadata, so it cannot be checked against the engine")
        diffs = [
            f"{f.name}: table has {getattr(self._meta, f.name)!r}, engine has {getattr(meta, f.name)!r}"
            for f in dataclasses.fields(CostTableMeta)
            if getattr(self._meta, f.name) != getattr(meta, f.name)
        ]
        if diffs:
            raise ValueError("cost table does not match the engine: " + "; ".join(diffs))

    # ---- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; requires metadata."""
        if self._meta is None:
            raise ValueError("a cost table needs metadata (CostTableMeta) to be saved")
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "meta": self._meta.to_dict(),
            "entries": [
                {"slots": s, "tokens_per_slot": t, "seconds": sec}
                for (s, t), sec in self.as_dict().items()
            ],
        }

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the table (with its metadata) as JSON; the file is replaced atomically."""
        write_json_atomic(path, self.to_dict(), indent=1, allow_nan=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "cost table") -> "CostTable":
        """Inverse of `to_dict`; errors name `source` and the offending field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT_NAME:
            raise ValueError(f"{source}: field 'format' must be {FORMAT_NAME!r}, got {d.get('format')!r}")
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{source}: field 'version' must be {FORMAT_VERSION}, got {d.get('version')!r}"
            )
        unknown = sorted(set(d) - {"format", "version", "meta", "entries"})
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}")
        if "meta" not in d:
            raise ValueError(f"{source}: missing field 'meta'")
        meta = CostTableMeta.from_dict(d["meta"], source=f"{source}: field 'meta'")
        entries = d.get("entries")
        if not isinstance(entries, list):
            raise ValueError(f"{source}: field 'entries' must be a list")
        seconds: dict[tuple[int, int], float] = {}
        for n, e in enumerate(entries):
            if not isinstance(e, Mapping) or set(e) != {"slots", "tokens_per_slot", "seconds"}:
                raise ValueError(
                    f"{source}: entries[{n}] must have exactly the keys slots, tokens_per_slot, seconds"
                )
            key = (e["slots"], e["tokens_per_slot"])
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in key):
                raise ValueError(f"{source}: entries[{n}] slots/tokens_per_slot must be integers")
            if key in seconds:
                raise ValueError(f"{source}: entries[{n}] duplicates bucket {key}")
            seconds[key] = e["seconds"]
        try:
            return cls.from_seconds(seconds, meta=meta)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> "CostTable":
        """Load a table written by `to_json`; errors name the file."""
        path = os.fspath(path)
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=path)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CostTable):
            return NotImplemented
        return (
            self._slots == other._slots
            and self._tokens == other._tokens
            and self._meta == other._meta
            and bool(np.array_equal(self._seconds_st, other._seconds_st))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"CostTable(slots_buckets={self._slots}, tokens_buckets={self._tokens}, "
            f"meta={self._meta!r})"
        )
