"""Resumable evaluation: the rounds of each finished request, one fsynced line per request in a
progress file per drafter and dataset (`<out>/progress/<drafter>__<dataset>.jsonl`), so a rerun of
the same evaluation decodes only the requests that had not finished (the paper's protocol, up to
2048 new tokens per prompt, runs for hours on a CPU). Each request is seeded on its own (seed + its
index), so its rounds do not depend on which requests share the engine with it. The file's first
line holds what the evaluation was run with; a rerun with other settings is refused, naming the file.
"""
from __future__ import annotations

import os
import re
from typing import Any

from specjax.eval.rounds import RoundLog
from specjax.io import DurableAppender, read_jsonl


def progress_path(out_dir: str, drafter: str, dataset: str) -> str:
    safe = lambda s: re.sub(r"[^\w.-]+", "_", s)  # noqa: E731
    return os.path.join(out_dir, "progress", f"{safe(drafter)}__{safe(dataset)}.jsonl")


class EvalProgress:
    """The finished requests of one drafter on one dataset, read from and appended to `path`."""

    def __init__(self, path: str, fingerprint: dict[str, Any]):
        rows = read_jsonl(path, objects=True, repair_torn_tail=True, missing_ok=True)
        if rows and rows[0].get("fingerprint") != fingerprint:
            old = rows[0].get("fingerprint") or {}
            diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
            raise ValueError(f"{path} holds the progress of an evaluation run with other settings (differing: "
                             f"{', '.join(diff) or 'its first line'}); use another --out or delete the file")
        self.path = path
        self.done: dict[str, dict[str, Any]] = {r["request"]: r for r in rows[1:]}
        self._out = DurableAppender(path)
        if not rows:
            self._out.append({"fingerprint": fingerprint})

    def record(self, request: Any, log: RoundLog) -> None:
        """Append a finished request: its rounds in `log` and its generated token count."""
        rid = request.request_id
        rows = [i for i, r in enumerate(log.request) if r == rid]
        rec = {"request": rid, "generated": len(request.output_ids),
               "accepted": [log.accepted[i] for i in rows], "proposed": [log.proposed[i] for i in rows],
               "stopped": [log.stopped[i] for i in rows],
               "confidence": [log.confidence[i] for i in rows] if log.confidence else None}
        self._out.append(rec)
        self.done[rid] = rec

    def stored_log(self, request_ids: list[str]) -> RoundLog:
        """The rounds of the requests finished in earlier runs, among `request_ids`, in that order."""
        log = RoundLog()
        for rid in request_ids:
            rec = self.done.get(rid)
            if rec is None:
                continue
            part = RoundLog(accepted=list(rec["accepted"]), proposed=list(rec["proposed"]),
                            stopped=list(rec["stopped"]), confidence=list(rec["confidence"] or []),
                            request=[rid] * len(rec["accepted"]))
            log.extend(part)
        return log

    def close(self) -> None:
        self._out.close()
