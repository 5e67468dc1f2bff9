"""Learning curves: a drafter's tau at T=0 on fixed greedy texts, every few hundred training steps.

The texts are the target's greedy answers (plain decoding, `max_tokens` each) to the first prompts
of a few named sets (training prompts, held-out ShareGPT prompts, the evaluation sets), made once
by `write_curve_texts` into a JSONL file of {"set", "prompt_ids", "answer_ids"} rows. A point
replays the engine's rounds on those texts from the drafter's training forward
(`specjax.eval.consistency.simulate_greedy_rounds`: the engine's tau under fixed verification,
tests/test_train_infer_consistency.py) over target features computed once per set, so it costs one
drafter forward per set and no decoding. Points are appended to a JSONL log (`CurveLog`), one per
step, never twice: a resumed run skips the steps the log holds.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Mapping, Sequence

from specjax.io import DurableAppender, iter_jsonl, write_jsonl_atomic

CURVE_LOG = "learning_curve.jsonl"


@dataclasses.dataclass(frozen=True)
class CurveText:
    """One greedy text: a set name, its chat-templated prompt and the target's greedy answer."""

    set: str
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]


def read_curve_texts(path: str | os.PathLike) -> dict[str, list[CurveText]]:
    """The texts of `path` by set, in file order; a malformed row raises ValueError naming
    file:line and the field."""
    out: dict[str, list[CurveText]] = {}
    for row in iter_jsonl(path, objects=True):
        where, v = f"{os.fspath(path)}:{row.line}", row.value
        if not isinstance(v.get("set"), str) or not v["set"]:
            raise ValueError(f"{where}: field 'set' must be a non-empty string")
        for field in ("prompt_ids", "answer_ids"):
            ids = v.get(field)
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"{where}: field '{field}' must be a non-empty list of token ids")
        out.setdefault(v["set"], []).append(CurveText(v["set"], tuple(v["prompt_ids"]), tuple(v["answer_ids"])))
    if not out:
        raise ValueError(f"{os.fspath(path)}: no curve texts")
    return out


def write_curve_texts(llm: Any, prompt_sets: Mapping[str, Sequence[Sequence[int]]], path: str | os.PathLike,
                      *, max_tokens: int) -> dict[str, int]:
    """Greedy answers of `llm` (an `specjax.LLM`, plain decoding) to each set's prompts (token ids),
    written atomically to `path`; returns the texts per set (an empty answer is left out)."""
    from specjax.api import SamplingParams

    rows, counts = [], {}
    for name, prompts in prompt_sets.items():
        outs = llm.generate([list(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens))
        kept = [{"set": name, "prompt_ids": list(map(int, p)), "answer_ids": list(map(int, o.token_ids))}
                for p, o in zip(prompts, outs) if o.token_ids]
        rows += kept
        counts[name] = len(kept)
    write_jsonl_atomic(path, rows)
    return counts


class LearningCurve:
    """tau at T=0 of a drafter on fixed greedy texts per set (module docstring); the target's
    features are computed once, for `tap_layers` (and the final hidden state)."""

    def __init__(self, target: Any, texts: Mapping[str, Sequence[CurveText]], *, max_len: int,
                 max_tokens: int, tap_layers: Sequence[int]):
        from specjax.eval.consistency import text_features

        self.target, self.max_len, self.max_tokens = target, int(max_len), int(max_tokens)
        self.texts = {k: list(v) for k, v in texts.items()}
        for name, rows in self.texts.items():
            longest = max(len(t.prompt_ids) + len(t.answer_ids) for t in rows)
            if longest >= self.max_len:
                raise ValueError(f"curve set {name!r}: a text of {longest} tokens does not fit max_len {max_len}")
        self.features = {name: text_features(target, [t.prompt_ids + t.answer_ids for t in rows],
                                             layer_ids=sorted(set(tap_layers)) or [-1])
                         for name, rows in self.texts.items()}

    def taus(self, drafter: Any) -> dict[str, dict[str, float]]:
        """Per set: tau (pooled over its texts) and the drafting rounds it rests on."""
        from specjax.eval.consistency import pooled_tau, simulate_greedy_rounds

        out = {}
        for name, rows in self.texts.items():
            rounds = simulate_greedy_rounds(self.target, drafter, [t.prompt_ids for t in rows],
                                            [t.answer_ids for t in rows], max_tokens=self.max_tokens,
                                            max_len=self.max_len, features=self.features[name])
            out[name] = {"tau": round(pooled_tau(rounds), 4), "rounds": sum(r.num_drafts for r in rounds)}
        return out


class CurveLog:
    """The curve's points, appended durably to a JSONL file; a step the file holds is not
    written again (a torn last line, from a kill, is cut off first)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.steps = {int(r.value["step"]) for r in iter_jsonl(self.path, objects=True, repair_torn_tail=True,
                                                                missing_ok=True)}

    def add(self, step: int, sets: Mapping[str, Mapping[str, float]], **extra: Any) -> bool:
        """Append the point of `step` unless it is there already; True when written."""
        if step in self.steps:
            return False
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with DurableAppender(self.path) as out:
            out.append({"step": int(step), "sets": {k: dict(v) for k, v in sets.items()}, **extra})
        self.steps.add(int(step))
        return True


def curve_hook(curve: LearningCurve, log: CurveLog, every: int, drafter_of: Callable[[Any], Any],
               *, primary: bool = True, echo: Callable[[str], None] = print) -> Callable[..., None]:
    """A `Trainer.fit` `on_step` callback: at every `every`-th step not logged yet, the curve's point
    of the drafter `drafter_of(state)` (every process computes it; `primary` writes it)."""
    def on_step(step: int, state: Any, metrics: Any = None, *, force: bool = False) -> None:
        del metrics
        if (step % every and not force) or step in log.steps:
            return
        t0 = time.monotonic()
        sets = curve.taus(drafter_of(state))
        if primary:
            log.add(step, sets, eval_s=round(time.monotonic() - t0, 2))
            echo("curve: step %d: %s" % (step, json.dumps({k: v["tau"] for k, v in sets.items()})))
    return on_step


__all__ = ["CURVE_LOG", "CurveLog", "CurveText", "LearningCurve", "curve_hook", "read_curve_texts",
           "write_curve_texts"]
