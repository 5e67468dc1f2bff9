"""Per-round records of speculative decoding, and the STS calibration of a drafter's confidences.

`RoundRecorder` hooks an `Engine`'s `on_round` callback and keeps, for every active request of
every round: the verified proposal length m (ell), the accepted draft prefix n, whether an accepted
stop token ended the round (then no bonus token), and the drafter's per-position confidences.
`RoundLog.arrays()` hands them to `specjax.eval.metrics` (acceptance and calibration metrics) and to
`specjax.scheduling.calibration.fit_sts`.

Confidence logits. The engine reports confidences c_k = sigmoid(z_k / T_k) with the drafter's STS
temperatures T. To recover the raw logits z exactly enough, the confidences are collected with every
temperature set to `COLLECT_TEMPERATURE` (4): z = 4 * logit(c). float32 sigmoid saturates at
|z / T| ~ 16, so raw logits stay recoverable up to |z| ~ 64 (beyond that they are clipped, which only
matters for confidences within 1e-7 of 0 or 1). The temperature only scales the confidence; with a
fixed verification policy it does not change a single decoded token.

Calibration files. `save_calibration(dir, temps, meta)` writes `<dir>/calibration.json`
(`specjax.scheduling.calibration.save_sts`) and, for a DSpark drafter directory, also the
`confidence_temperatures` field of its config.json (`specjax.drafters.dspark_kind.set_confidence_temperatures`), so
that loading the directory applies them. `apply_calibration(drafter, dir)` applies a directory's
calibration to a loaded drafter (the config.json field, else a `calibration.json` found there).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Sequence

import numpy as np

from specjax.scheduling.calibration_metrics import confidence_metrics
from specjax.scheduling.calibration import apply_sts, fit_sts, load_sts, save_sts

CALIBRATION_FILE = "calibration.json"
COLLECT_TEMPERATURE = 4.0
_EPS = 1e-7  # float32 resolution near 1: confidences are clipped to [eps, 1 - eps]


@dataclasses.dataclass
class RoundLog:
    """Verification rounds of many requests (one entry per request per round)."""

    accepted: list[int] = dataclasses.field(default_factory=list)  # n: accepted draft tokens
    proposed: list[int] = dataclasses.field(default_factory=list)  # m: verified draft tokens (ell)
    stopped: list[bool] = dataclasses.field(default_factory=list)  # an accepted stop token ended it
    confidence: list[list[float]] = dataclasses.field(default_factory=list)  # [gamma] per entry
    request: list[str] = dataclasses.field(default_factory=list)  # the entry's request id
    seconds: float = 0.0  # wall time of the rounds

    def __len__(self) -> int:
        return len(self.accepted)

    def observe(self, info: dict[str, Any]) -> None:
        """Add one engine round (`Engine.on_round` info dict)."""
        ell, acc = info["ell"], info["accepted"]
        if len(ell) != len(acc):
            raise ValueError(f"round info has {len(ell)} ell values and {len(acc)} accepted counts")
        stopped = info.get("stopped") or [False] * len(acc)
        ids = info.get("request_ids") or [""] * len(acc)
        if len(ids) != len(acc):
            raise ValueError(f"round info has {len(ids)} request ids for {len(acc)} requests")
        conf = info.get("confidence")
        if conf is not None and len(conf) != len(acc):
            raise ValueError(f"round info has {len(conf)} confidence rows for {len(acc)} requests")
        if conf is None and self.confidence:
            raise ValueError("round info lacks 'confidence' while earlier rounds had it")
        self.accepted += [int(x) for x in acc]
        self.proposed += [int(x) for x in ell]
        self.stopped += [bool(x) for x in stopped]
        self.request += [str(x) for x in ids]
        if conf is not None:
            if len(self.confidence) != len(self.accepted) - len(acc):
                raise ValueError("round info has 'confidence' while earlier rounds lacked it")
            self.confidence += [[float(c) for c in row] for row in conf]
        self.seconds += float(info.get("seconds", 0.0))

    def extend(self, other: "RoundLog") -> None:
        """Append another log's rounds (both with or both without confidences)."""
        if bool(self.confidence) != bool(other.confidence) and len(self) and len(other):
            raise ValueError("cannot merge a log with confidences and one without")
        self.accepted += other.accepted
        self.proposed += other.proposed
        self.stopped += other.stopped
        self.request += other.request
        self.confidence += other.confidence
        self.seconds += other.seconds

    def arrays(self, *, drafted_only: bool = True) -> dict[str, np.ndarray | None]:
        """numpy views: `accepted` [N], `proposed` [N], `bonus` [N] (0/1), `request` [N] (str),
        `confidence` [N, gamma] or None. `drafted_only` keeps rounds that verified at least one
        draft token."""
        n = np.asarray(self.accepted, np.int64)
        m = np.asarray(self.proposed, np.int64)
        bonus = 1 - np.asarray(self.stopped, np.int64)
        req = np.asarray(self.request, dtype=object)
        conf = np.asarray(self.confidence, np.float64) if self.confidence else None
        if drafted_only:
            keep = m > 0
            n, m, bonus, req = n[keep], m[keep], bonus[keep], req[keep]
            conf = None if conf is None else conf[keep]
        return {"accepted": n, "proposed": m, "bonus": bonus, "request": req, "confidence": conf}


class RoundRecorder:
    """Context manager: records every round of `engine` into `log` (chains any existing hook)."""

    def __init__(self, engine: Any, log: RoundLog | None = None):
        self.engine = engine
        self.log = log if log is not None else RoundLog()
        self._prev: Callable[[dict[str, Any]], None] | None = None

    def __enter__(self) -> RoundLog:
        self._prev = self.engine.on_round
        prev = self._prev

        def hook(info: dict[str, Any]) -> None:
            if prev is not None:
                prev(info)
            self.log.observe(info)
        self.engine.on_round = hook
        return self.log

    def __exit__(self, *exc: Any) -> None:
        self.engine.on_round = self._prev


def run_requests(engine: Any, requests: Sequence[Any], *, progress: bool = True, desc: str = "decoding",
                 on_done: Callable[[Any, RoundLog], None] | None = None) -> tuple[RoundLog, dict[str, Any]]:
    """Serve `requests` (EngineRequest) to completion while recording rounds; `on_done(request,
    log)` runs for each request as it finishes (its rounds are all in the log by then).

    Returns (log, stats) with stats `generated_tokens`, `seconds`, `tokens_per_second`. Shows a
    progress bar over requests with the generation rate."""
    from tqdm.auto import tqdm

    if engine.has_work():
        raise RuntimeError("the engine is busy with other requests")
    for r in requests:
        engine.add_request(r)
    t0 = time.perf_counter()
    tokens = 0
    last = 0.0
    with RoundRecorder(engine) as log, tqdm(total=len(requests), desc=desc, unit="req",
                                            disable=not progress, leave=False) as bar:
        while engine.has_work():
            done = engine.step()
            for r in done:
                tokens += len(r.output_ids)
                if on_done is not None:
                    on_done(r, log)
            bar.update(len(done))
            now = time.perf_counter()
            if now - last > 0.5:
                bar.set_postfix(tok_s=f"{tokens / max(now - t0, 1e-9):.1f}", refresh=False)
                last = now
    secs = time.perf_counter() - t0
    return log, {"generated_tokens": tokens, "seconds": secs,
                 "tokens_per_second": tokens / secs if secs > 0 else 0.0}


# ---------------------------------------------------------------------------------------------
# confidences of a drafter
# ---------------------------------------------------------------------------------------------

def drafter_has_confidence(drafter: Any) -> bool:
    """Whether `drafter.propose` returns per-position confidences (traced abstractly: no compute)."""
    if drafter is None:
        return False
    if hasattr(drafter, "confidence_head"):
        return getattr(drafter, "confidence_head") is not None
    import jax
    import jax.numpy as jnp

    from specjax.sampling import SamplingArrays

    def probe():
        state = drafter.init_state(1, 8)
        sa = SamplingArrays.broadcast(1)
        keys = jax.random.split(jax.random.key(0), 1)
        zero = jnp.zeros((1,), jnp.int32)
        return drafter.propose(state, zero, zero, sa, keys)
    return jax.eval_shape(probe).confidence is not None


def confidence_temperatures(drafter: Any) -> np.ndarray | None:
    """The drafter's STS temperatures [gamma] (float64), or None if it has none to set."""
    if not hasattr(drafter, "set_confidence_temperatures"):
        return None
    var = getattr(drafter, "confidence_temperatures", None)
    if var is None:
        return None
    return np.asarray(var[...], np.float64)


def set_temperatures(drafter: Any, temps: Any) -> None:
    """`drafter.set_confidence_temperatures(temps)` (ValueError if it cannot take temperatures)."""
    if not hasattr(drafter, "set_confidence_temperatures"):
        raise ValueError(f"{type(drafter).__name__} has no confidence temperatures to set")
    drafter.set_confidence_temperatures(np.asarray(temps, np.float32))


def prepare_for_collection(drafter: Any) -> float:
    """Set every STS temperature of `drafter` to COLLECT_TEMPERATURE (before building an engine);
    returns the temperature by which recorded confidences must be read (1.0 when it has none)."""
    if confidence_temperatures(drafter) is None:
        return 1.0
    set_temperatures(drafter, np.full((int(drafter.gamma),), COLLECT_TEMPERATURE))
    return COLLECT_TEMPERATURE


def confidence_logits(conf: Any, collect_temperature: float = 1.0) -> np.ndarray:
    """Raw confidence logits z = T_collect * logit(c) of confidences recorded with temperature
    T_collect (clipped to [1e-7, 1 - 1e-7] first)."""
    c = np.clip(np.asarray(conf, np.float64), _EPS, 1.0 - _EPS)
    return collect_temperature * (np.log(c) - np.log1p(-c))


# ---------------------------------------------------------------------------------------------
# calibration
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class CalibrationResult:
    """Fitted STS temperatures with calibration metrics on the fitting rounds."""

    temperatures: np.ndarray  # [gamma]
    before: dict[str, Any]  # confidence_metrics with temperatures 1
    after: dict[str, Any]  # confidence_metrics with the fitted temperatures
    num_rounds: int

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (per-position ECE before/after, weighted ECE, rounds)."""
        g = len(self.temperatures)
        return {"temperatures": [float(t) for t in self.temperatures], "num_rounds": self.num_rounds,
                "ece_before": [_num(self.before["ece"][k]) for k in range(g)],
                "ece_after": [_num(self.after["ece"][k]) for k in range(g)],
                "ece_weighted_before": _num(self.before["ece_weighted"]),
                "ece_weighted_after": _num(self.after["ece_weighted"]),
                "count": [int(c) for c in self.before["count"]]}


def _num(x: Any) -> float | None:
    x = float(x)
    return None if np.isnan(x) else x


def calibrate_rounds(log: RoundLog, collect_temperature: float = 1.0, *, grid: Any = None,
                     bins: int = 20) -> CalibrationResult:
    """Fit STS on the drafted rounds of `log` (confidences recorded at `collect_temperature`)."""
    a = log.arrays()
    if a["confidence"] is None:
        raise ValueError("the recorded rounds carry no confidences (does the drafter have a confidence head?)")
    if a["accepted"].size == 0:
        raise ValueError("no verification round proposed a draft token: nothing to calibrate on")
    z = confidence_logits(a["confidence"], collect_temperature)
    temps = fit_sts(z, a["accepted"], a["proposed"], grid, bins=bins)
    before = confidence_metrics(apply_sts(z, np.ones_like(temps)), a["accepted"], a["proposed"], bins=bins)
    after = confidence_metrics(apply_sts(z, temps), a["accepted"], a["proposed"], bins=bins)
    return CalibrationResult(temperatures=temps, before=before, after=after, num_rounds=int(a["accepted"].size))


def save_calibration(drafter_dir: str | os.PathLike, temps: Any, meta: dict[str, Any] | None = None) -> str:
    """Write `<drafter_dir>/calibration.json`; for a DSpark drafter directory also store the
    temperatures in its config.json (`confidence_temperatures`). Returns the calibration file path."""
    from specjax.drafters import dspark_kind
    from specjax.config import read_json

    d = os.fspath(drafter_dir)
    if not os.path.isdir(d):
        raise ValueError(f"drafter directory does not exist: {d}")
    path = os.path.join(d, CALIBRATION_FILE)
    save_sts(path, temps, meta)
    cfg_path = os.path.join(d, "config.json")
    if os.path.isfile(cfg_path):
        archs = read_json(cfg_path).get("architectures") or []
        if archs and archs[0] == dspark_kind.ARCHITECTURE:
            dspark_kind.set_confidence_temperatures(d, [float(t) for t in np.asarray(temps).ravel()])
    return path


def apply_calibration(drafter: Any, drafter_dir: str | os.PathLike | None) -> np.ndarray | None:
    """Apply a drafter directory's STS calibration to a loaded drafter; returns the temperatures
    applied, or None when the directory has none.

    The config.json field `confidence_temperatures` (which `load_drafter` already applies, and which
    `save_calibration` writes together with calibration.json) wins; otherwise `calibration.json`
    is used. ValueError if the length differs from gamma or the drafter cannot take temperatures."""
    from specjax.drafters import dspark_kind
    from specjax.config import read_json

    if drafter_dir is None:
        return None
    d = os.fspath(drafter_dir)
    gamma = int(getattr(drafter, "gamma", -1))
    cfg_path = os.path.join(d, "config.json")
    temps = None
    if os.path.isfile(cfg_path):
        cfg = read_json(cfg_path)
        if isinstance(cfg, dict) and cfg.get(dspark_kind.CONFIDENCE_TEMPERATURES_FIELD) is not None:
            temps = dspark_kind.confidence_temperatures_from_hf(cfg, gamma, cfg_path).astype(np.float64)
    path = os.path.join(d, CALIBRATION_FILE)
    if temps is None and os.path.isfile(path):
        temps, _ = load_sts(path)
        if temps.shape != (gamma,):
            raise ValueError(f"{path}: {temps.size} temperatures for a drafter with gamma {gamma}")
    if temps is None:
        return None
    set_temperatures(drafter, temps)
    return temps


__all__ = ["CALIBRATION_FILE", "COLLECT_TEMPERATURE", "CalibrationResult", "RoundLog", "RoundRecorder",
           "apply_calibration", "calibrate_rounds", "confidence_logits", "confidence_temperatures",
           "drafter_has_confidence", "prepare_for_collection", "run_requests", "save_calibration",
           "set_temperatures"]
