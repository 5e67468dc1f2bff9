"""The DSpark Table-1 evaluation protocol (reference §8.1–8.3, §8.6) on specjax's engine.

Datasets are JSONL files; the dataset name is the file stem (`gsm8k.jsonl` -> gsm8k). Rows are
`{"turns": [user turn, ...]}` (only the first turn is used; chat template with the generation
prompt, thinking off, no system prompt), `{"conversations": [{"role", "content"}, ...]}` (the first
user message, likewise) or `{"prompt": "..."}` (a plain completion prompt, no template). A file with
more rows than its cap is shuffled with `random.Random(980406)` and the first `cap` rows kept;
sample i (0-based, after the shuffle) is decoded with seed 980406 + i. Decoding: temperature 1.0,
`max_new_tokens` (2048), gamma from the drafter, verification policy fixed (every round verifies
min(gamma, room) draft tokens: the scheduler is off). Requests share the engine's slots; with the
fixed policy and per-request seeds each request's rounds do not depend on its batch mates.

Reported per drafter and dataset: tau (accepted draft tokens + the bonus token per drafting round,
Table 1), per-position unconditional (`accept_rate`) and conditional (`cond_accept`) acceptance, and
for drafters with a confidence head the calibration of the predicted prefix survival per position
(ECE, AUROC, Brier) before (all STS temperatures 1) and after calibration (the drafter's
temperatures, when it has any other than 1); per domain the macro average of its datasets' tau, and
`macro` = the mean over datasets (the paper's macro column).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from typing import Any, Iterable, Sequence

import numpy as np

from specjax.eval import rounds as rd
from specjax.eval.metrics import acceptance_metrics, paired_tau_bootstrap, per_request_tau_parts
from specjax.io import iter_jsonl, write_atomic
from specjax.scheduling.calibration import apply_sts
from specjax.scheduling.calibration_metrics import confidence_metrics

EVAL_SEED = 980406
DEFAULT_MAX_NEW_TOKENS = 2048
DEFAULT_CAPS = {"gsm8k": 500, "math500": 500, "aime25": 30, "humaneval": 164, "mbpp": 256,
                "livecodebench": 500, "mt-bench": 80, "alpaca": 500, "arena-hard-v2": 500}
DOMAINS = {"gsm8k": "math", "math500": "math", "aime25": "math", "humaneval": "code", "mbpp": "code",
           "livecodebench": "code", "mt-bench": "chat", "alpaca": "chat", "arena-hard-v2": "chat"}
TABLE_ORDER = ("gsm8k", "math500", "aime25", "mbpp", "humaneval", "livecodebench", "mt-bench", "alpaca",
               "arena-hard-v2")
DOMAIN_ORDER = ("math", "code", "chat")
COMPLETION_DOMAIN = "code"  # our completion prompt files (Python source prefixes)


# ---------------------------------------------------------------------------------------------
# datasets
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Dataset:
    """One evaluation prompt file, tokenised."""

    name: str
    path: str
    kind: str  # "chat" | "completion"
    domain: str
    prompts: list[list[int]]  # token ids per kept sample (after cap/shuffle)
    total_rows: int  # rows in the file


def dataset_name(path: str | os.PathLike) -> str:
    """The file stem: `.../gsm8k.jsonl` -> "gsm8k"."""
    base = os.path.basename(os.fspath(path))
    return base[: -len(".jsonl")] if base.endswith(".jsonl") else os.path.splitext(base)[0]


def domain_of(name: str, kind: str = "chat") -> str:
    """The paper's domain of a dataset name; completion files count as code; else "other"."""
    if name in DOMAINS:
        return DOMAINS[name]
    return COMPLETION_DOMAIN if kind == "completion" else "other"


def first_user_turn(obj: Any, where: str) -> tuple[str, str]:
    """(kind, text) of one evaluation row: ("chat", first user turn) or ("completion", prompt).

    ValueError naming `where` (file:line) and the field for a malformed row."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: row must be a JSON object, got {type(obj).__name__}")
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
            raise ValueError(f"{where}: field 'turns' must be a non-empty list of non-empty strings")
        return "chat", turns[0]
    if "conversations" in obj:
        conv = obj["conversations"]
        if not isinstance(conv, list):
            raise ValueError(f"{where}: field 'conversations' must be a list of {{role, content}} objects")
        for m in conv:
            if isinstance(m, dict) and m.get("role") in ("user", "human") and isinstance(m.get("content"), str) \
                    and m["content"]:
                return "chat", m["content"]
        raise ValueError(f"{where}: field 'conversations' has no non-empty user message")
    if "prompt" in obj:
        p = obj["prompt"]
        if not isinstance(p, str) or not p:
            raise ValueError(f"{where}: field 'prompt' must be a non-empty string")
        return "completion", p
    raise ValueError(f"{where}: row needs a 'turns', 'conversations' or 'prompt' field (got {sorted(obj)})")


def read_prompt_file(path: str | os.PathLike) -> tuple[str, list[str]]:
    """(kind, texts) of every row of an evaluation file; one kind per file (ValueError otherwise)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"dataset file does not exist: {path}")
    kinds, texts = set(), []
    for row in iter_jsonl(path):
        kind, text = first_user_turn(row.value, f"{path}:{row.line}")
        kinds.add(kind)
        texts.append(text)
    if not texts:
        raise ValueError(f"{path}: no rows")
    if len(kinds) > 1:
        raise ValueError(f"{path}: mixes chat rows ('turns'/'conversations') and completion rows ('prompt')")
    return kinds.pop(), texts


def cap_rows(rows: Sequence[Any], cap: int | None, seed: int = EVAL_SEED) -> list[Any]:
    """Rows kept under a cap: all (in order) if within it, else the first `cap` after a
    `random.Random(seed)` shuffle (DeepSpec's rule)."""
    rows = list(rows)
    if cap is None or len(rows) <= cap:
        return rows
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    random.Random(seed).shuffle(rows)
    return rows[:cap]


def encode_prompt(tokenizer: Any, kind: str, text: str, *, enable_thinking: bool | None = False) -> list[int]:
    """Token ids: the chat template on [user text] with the generation prompt, or the raw text."""
    from specjax.api import encode_chat, encode_text

    if kind == "chat":
        return encode_chat(tokenizer, [{"role": "user", "content": text}], enable_thinking=enable_thinking)
    return encode_text(tokenizer, text)


def load_dataset(path: str | os.PathLike, tokenizer: Any, *, cap: int | None = None,
                 enable_thinking: bool | None = False) -> Dataset:
    """Read, cap (default: the paper's cap for known names, else all rows) and tokenise a file."""
    path = os.fspath(path)
    name = dataset_name(path)
    kind, texts = read_prompt_file(path)
    if cap is None:
        cap = DEFAULT_CAPS.get(name)
    kept = cap_rows(texts, cap)
    prompts = [encode_prompt(tokenizer, kind, t, enable_thinking=enable_thinking) for t in kept]
    return Dataset(name=name, path=path, kind=kind, domain=domain_of(name, kind), prompts=prompts,
                   total_rows=len(texts))


def parse_caps(text: str | None) -> tuple[int | None, dict[str, int]]:
    """'--cap' values: "5" (every dataset) or "gsm8k=100,mt-bench=5" (per dataset), or a mix."""
    default, per = None, {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, _, val = part.rpartition("=")
        try:
            v = int(val)
        except ValueError:
            raise ValueError(f"cap {part!r} must be N or name=N with an integer N") from None
        if v < 1:
            raise ValueError(f"cap {part!r} must be >= 1")
        if key:
            per[key.strip()] = v
        else:
            default = v
    return default, per


# ---------------------------------------------------------------------------------------------
# drafters
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class DrafterSpec:
    """A drafter to evaluate: its display name, where it came from, and the loaded module."""

    name: str
    source: str
    module: Any
    directory: str | None = None


def resolve_drafter(spec: str, target_model: Any, *, gamma: int | None = None,
                    embedded: bool = False) -> DrafterSpec:
    """"ngram" (prompt lookup, gamma default 4), an embedded drafter name (when the target is the
    embedded default), or a drafter directory (`specjax.drafters.registry.load_drafter`, then any
    `calibration.json` in it is applied)."""
    spec = spec.strip()
    if not spec:
        raise ValueError("empty drafter name")
    if spec == "ngram":
        from specjax.drafters.ngram import NGramDrafter
        return DrafterSpec("ngram", "ngram", NGramDrafter(target_model.config.vocab_size, gamma=gamma or 4))
    path = spec
    if embedded and not os.path.isdir(spec):
        from specjax import default_target
        if spec in default_target.DRAFTER_NAMES:
            path = default_target.drafter_dir(spec)  # a clear error naming `make embedded` if unbuilt
    if not os.path.isdir(path):
        raise ValueError(f"drafter {spec!r} is neither 'ngram' nor a drafter directory")
    from specjax.drafters.registry import load_drafter
    module = load_drafter(path, target=target_model, gamma=gamma if _gamma_is_free(path) else None)
    rd.apply_calibration(module, path)
    return DrafterSpec(os.path.basename(os.path.normpath(spec)), path, module, directory=path)


def _gamma_is_free(path: str) -> bool:
    from specjax.drafters.registry import drafter_kind
    return drafter_kind(path) not in ("dspark", "mtp")


def unique_names(specs: list[DrafterSpec]) -> None:
    """Make display names unique in place (name, name-2, ...)."""
    seen: dict[str, int] = {}
    for s in specs:
        k = seen.get(s.name, 0) + 1
        seen[s.name] = k
        if k > 1:
            s.name = f"{s.name}-{k}"


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """Protocol knobs (defaults = the paper's)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    seed: int = EVAL_SEED
    bins: int = 20


def _requests(llm: Any, ds: Dataset, st: EvalSettings) -> tuple[list[Any], int]:
    """Engine requests of a dataset (prompts that leave no room to generate are skipped)."""
    from specjax.api import SamplingParams

    max_len = llm.engine.cfg.max_len
    reqs, skipped = [], 0
    for i, ids in enumerate(ds.prompts):
        room = max_len - len(ids)
        if room < 1:
            skipped += 1
            continue
        sp = SamplingParams(temperature=st.temperature, top_k=st.top_k, top_p=st.top_p,
                            max_tokens=min(st.max_new_tokens, room), seed=st.seed + i)
        reqs.append(llm.make_request(ids, sp, request_id=f"{ds.name}:{i}"))
    return reqs, skipped


def confidence_report(log: rd.RoundLog, collect_t: float, temps: np.ndarray | None, bins: int = 20,
                      ) -> dict[str, Any] | None:
    """confidence_metrics of a log before (T = 1) and, when `temps` is given, after calibration."""
    a = log.arrays()
    if a["confidence"] is None or a["accepted"].size == 0:
        return None
    z = rd.confidence_logits(a["confidence"], collect_t)
    out = {"before": confidence_metrics(apply_sts(z, np.ones(z.shape[1])), a["accepted"], a["proposed"], bins=bins)}
    if temps is not None:
        out["after"] = confidence_metrics(apply_sts(z, temps), a["accepted"], a["proposed"], bins=bins)
    return out


def reliability_data(log: rd.RoundLog, collect_t: float, temps: np.ndarray | None,
                     ) -> dict[str, Any] | None:
    """Per-position predicted prefix survival and outcomes for reliability diagrams:
    {"before": [(pred, label) per position], "after": ...}."""
    from specjax.scheduling.calibration_metrics import prefix_survival_labels

    a = log.arrays()
    if a["confidence"] is None or a["accepted"].size == 0:
        return None
    z = rd.confidence_logits(a["confidence"], collect_t)
    y, valid = prefix_survival_labels(a["accepted"], a["proposed"], z.shape[1])
    out = {}
    variants = {"before": np.ones(z.shape[1])}
    if temps is not None:
        variants["after"] = temps
    for key, t in variants.items():
        surv = np.cumprod(apply_sts(z, t), axis=1)
        out[key] = [(surv[valid[:, k], k], y[valid[:, k], k].astype(np.float64)) for k in range(z.shape[1])]
    return out


def _acc_summary(log: rd.RoundLog, gamma: int) -> dict[str, Any]:
    a = log.arrays()
    m = acceptance_metrics(a["accepted"], a["proposed"], max(gamma, 1), a["bonus"])
    return {"tau": m["tau"], "num_rounds": m["num_rounds"], "mean_proposal": m["mean_proposal"],
            "verify_rate": m["verify_rate"], "accept_rate": m["accept_rate"], "cond_accept": m["cond_accept"],
            "num_draft_tokens": m["num_draft_tokens"], "num_accepted_tokens": m["num_accepted_tokens"],
            "acceptance_histogram": m["acceptance_histogram"]}


def _request_parts(log: rd.RoundLog) -> dict[str, list[int]]:
    """request id -> [drafting rounds, committed tokens] (`metrics.per_request_tau_parts`)."""
    a = log.arrays()
    return {k: list(v) for k, v in per_request_tau_parts(a["request"].tolist(), a["accepted"], a["bonus"]).items()}


def evaluate_drafter(llm: Any, datasets: Sequence[Dataset], settings: EvalSettings, *,
                     collect_t: float = 1.0, calibration: np.ndarray | None = None, has_confidence: bool = False,
                     progress: bool = True, name: str = "") -> tuple[dict[str, Any], dict[str, rd.RoundLog]]:
    """Run every dataset through `llm` (its engine must use the fixed policy). Returns
    (per-drafter result dict, per-dataset round logs)."""
    gamma = int(llm.engine.gamma)
    res: dict[str, Any] = {"gamma": gamma, "datasets": {}}
    logs: dict[str, rd.RoundLog] = {}
    for ds in datasets:
        reqs, skipped = _requests(llm, ds, settings)
        log, stats = rd.run_requests(llm.engine, reqs, progress=progress, desc=f"{name} {ds.name}".strip())
        logs[ds.name] = log
        entry = {"num_samples": len(reqs), "skipped_too_long": skipped, **stats, **_acc_summary(log, gamma),
                 "requests": _request_parts(log)}
        entry["confidence"] = confidence_report(log, collect_t, calibration, settings.bins) if has_confidence else None
        res["datasets"][ds.name] = entry
    taus = {n: e["tau"] for n, e in res["datasets"].items() if e["num_rounds"] > 0}
    domains: dict[str, list[float]] = {}
    for ds in datasets:
        if ds.name in taus:
            domains.setdefault(ds.domain, []).append(taus[ds.name])
    res["domains"] = {d: float(np.mean(v)) for d, v in domains.items()}
    res["macro"] = float(np.mean(list(taus.values()))) if taus else float("nan")
    pooled = rd.RoundLog()
    for log in logs.values():
        pooled.extend(log)
    res["overall"] = _acc_summary(pooled, gamma)
    parts = {k: v for e in res["datasets"].values() for k, v in e["requests"].items()}  # ids are per set
    if parts:
        ci = paired_tau_bootstrap({"tau": parts}, lambda t: t["tau"])
        res["overall"]["tau_ci95"] = [ci["lo"], ci["hi"]]
    res["confidence"] = confidence_report(pooled, collect_t, calibration, settings.bins) if has_confidence else None
    return res, logs


def _engine_config(max_num_seqs: int, max_model_len: int, max_prefill: int, seed: int):
    from specjax.decoding.engine import EngineConfig
    return EngineConfig(max_slots=max_num_seqs, max_len=max_model_len, policy="fixed", seed=seed,
                        max_prefill=max_prefill)


def _display_path(path: str | os.PathLike) -> str:
    """A path as recorded in results: relative to the working directory (`../shared/...` for one
    beside the checkout), so results name no machine-specific absolute path."""
    try:
        return os.path.relpath(os.fspath(path))
    except ValueError:  # another drive (Windows): the file name is all that is portable
        return os.path.basename(os.fspath(path))


def run_evaluation(target_dir: str | None, drafters: Sequence[str], data_paths: Sequence[str], out_dir: str, *,
                   tokenizer_dir: str | None = None, settings: EvalSettings = EvalSettings(),
                   cap: int | None = None, caps: dict[str, int] | None = None, gamma: int | None = None,
                   max_num_seqs: int = 8, max_model_len: int | None = None, max_prefill: int = 256,
                   dtype: str = "float32", engine_config: Any = None, progress: bool = True,
                   enable_thinking: bool | None = False) -> dict[str, Any]:
    """The whole evaluation: load the target once, every drafter in turn, every dataset; write
    results.json, results.md, acceptance_by_position.png and reliability_<drafter>.png to out_dir.

    target_dir: a Hugging Face directory or `.gguf` file (Qwen3 / Llama / Qwen2), or None for the
    embedded default (SmolLM2-135M-Instruct). cap: every
    dataset's cap (default: the paper's per-dataset caps; all rows for unknown names); caps: per
    dataset name. max_model_len: default the longest prompt + max_new_tokens (at most the target's
    max_position_embeddings). engine_config: overrides the engine shape entirely (its policy must
    be "fixed")."""
    from specjax import checkpoints
    from specjax.api import LLM
    from specjax.eval import plots

    if not drafters:
        raise ValueError("no drafter given")
    if not data_paths:
        raise ValueError("no dataset given")
    embedded = target_dir is None
    if embedded:
        from specjax import default_target
        target_dir = default_target.gguf_path()
    model, tcfg = checkpoints.load_target(target_dir, dtype=dtype)
    tok_dir = tokenizer_dir or target_dir
    tokenizer = checkpoints.load_tokenizer(tok_dir)
    if tokenizer is None:
        raise ValueError(f"no tokenizer files in {tok_dir} (pass --tokenizer)")
    caps = dict(caps or {})
    datasets = [load_dataset(p, tokenizer, cap=caps.get(dataset_name(p), cap), enable_thinking=enable_thinking)
                for p in data_paths]
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        raise ValueError(f"two dataset files share a name: {names}")
    if engine_config is None:
        longest = max(len(p) for d in datasets for p in d.prompts)
        mlen = max_model_len or min(tcfg.max_position_embeddings, longest + settings.max_new_tokens + 1)
        engine_config = _engine_config(max_num_seqs, mlen, min(max_prefill, mlen), settings.seed)
    if engine_config.policy != "fixed":
        raise ValueError(f"the Table-1 protocol verifies every draft position: policy must be 'fixed', "
                         f"got {engine_config.policy!r}")
    specs = [resolve_drafter(s, model, gamma=gamma, embedded=embedded) for s in drafters]
    unique_names(specs)
    os.makedirs(out_dir, exist_ok=True)
    results: dict[str, Any] = {
        "protocol": {"temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p,
                     "max_new_tokens": settings.max_new_tokens, "seed": settings.seed, "policy": "fixed",
                     "first_turn_only": True, "enable_thinking": enable_thinking, "ece_bins": settings.bins,
                     "max_model_len": engine_config.max_len, "max_num_seqs": engine_config.max_slots,
                     "tau": "accepted draft tokens + bonus per drafting round"},
        "target": _display_path(target_dir),
        "datasets": {d.name: {"path": _display_path(d.path), "kind": d.kind, "domain": d.domain, "rows": d.total_rows,
                              "evaluated": len(d.prompts)} for d in datasets},
        "drafters": {}}
    series, reliability = {}, {}
    for spec in specs:
        drafter = spec.module
        has_conf = rd.drafter_has_confidence(drafter)
        original = rd.confidence_temperatures(drafter) if has_conf else None
        calib = None if original is None or np.allclose(original, 1.0) else original
        collect_t = rd.prepare_for_collection(drafter) if has_conf else 1.0
        cfg = engine_config if gamma is None else dataclasses.replace(engine_config, gamma=gamma)
        try:
            llm = LLM(target=(model, tcfg), drafter=drafter, tokenizer=tok_dir, engine_config=cfg,
                      progress=progress)
            res, logs = evaluate_drafter(llm, datasets, settings, collect_t=collect_t, calibration=calib,
                                         has_confidence=has_conf, progress=progress, name=spec.name)
        finally:
            if original is not None:  # leave the drafter as it was loaded
                rd.set_temperatures(drafter, original)
        res["source"] = _display_path(spec.source) if os.path.exists(spec.source) else spec.source
        res["has_confidence_head"] = has_conf
        res["calibration"] = None if calib is None else [float(t) for t in calib]
        results["drafters"][spec.name] = res
        for ds in datasets:
            e = res["datasets"][ds.name]
            series[f"{spec.name} / {ds.name}"] = (e["accept_rate"], e["cond_accept"])
        if has_conf:
            pooled = rd.RoundLog()
            for log in logs.values():
                pooled.extend(log)
            rel = reliability_data(pooled, collect_t, calib)
            if rel is not None:
                reliability[spec.name] = rel
    results["table"] = table_rows(results)
    write_results(results, out_dir)
    results["files"] = {"results.json": os.path.join(out_dir, "results.json"),
                        "results.md": os.path.join(out_dir, "results.md")}
    png = os.path.join(out_dir, "acceptance_by_position.png")
    plots.plot_acceptance_by_position(series, png)
    results["files"]["acceptance_by_position.png"] = png
    for name, rel in reliability.items():
        p = os.path.join(out_dir, f"reliability_{_safe(name)}.png")
        plots.plot_reliability(rel, p, title=f"{name}: predicted vs observed prefix survival")
        results["files"][f"reliability_{_safe(name)}.png"] = p
    write_results(results, out_dir)
    return results


def run_calibration(target_dir: str | None, drafter_dir: str, prompt_paths: Sequence[str], *,
                    tokenizer_dir: str | None = None, settings: EvalSettings = EvalSettings(seed=EVAL_SEED + 7),
                    cap: int | None = None, max_num_seqs: int = 8, max_model_len: int | None = None,
                    max_prefill: int = 256, dtype: str = "float32", engine_config: Any = None,
                    grid: Any = None, save: bool = True, progress: bool = True,
                    enable_thinking: bool | None = False) -> tuple[rd.CalibrationResult, str | None]:
    """Fit STS temperatures for the confidence head of the drafter in `drafter_dir`.

    Decodes the held-out prompts (first user turn / completion prompt, like the evaluation) with
    the full gamma verified every round (policy fixed), records per round the confidences and the
    accepted prefix, fits `fit_sts`, and (with `save`) writes calibration.json beside the drafter
    and its config.json `confidence_temperatures`, so loading the directory applies them.
    Returns (result, path of calibration.json or None)."""
    from specjax import checkpoints
    from specjax.api import LLM
    from specjax.drafters.registry import load_drafter

    if not prompt_paths:
        raise ValueError("no prompts file given")
    if target_dir is None:  # the embedded default target and, by name, its shipped drafters
        from specjax import default_target
        if not os.path.isdir(drafter_dir) and drafter_dir in default_target.DRAFTER_NAMES:
            drafter_dir = default_target.drafter_dir(drafter_dir)
        target_dir = default_target.gguf_path()
    if not os.path.isdir(drafter_dir):
        raise ValueError(f"drafter directory does not exist: {drafter_dir}")
    model, tcfg = checkpoints.load_target(target_dir, dtype=dtype)
    tok_dir = tokenizer_dir or target_dir
    tokenizer = checkpoints.load_tokenizer(tok_dir)
    if tokenizer is None:
        raise ValueError(f"no tokenizer files in {tok_dir} (pass --tokenizer)")
    drafter = load_drafter(drafter_dir, target=model)
    if not rd.drafter_has_confidence(drafter):
        raise ValueError(f"{drafter_dir}: the drafter has no confidence head: nothing to calibrate")
    if rd.confidence_temperatures(drafter) is None:
        raise ValueError(f"{drafter_dir}: the drafter's confidences have no temperatures to calibrate")
    datasets = [load_dataset(p, tokenizer, cap=cap if cap is not None else 10**9, enable_thinking=enable_thinking)
                for p in prompt_paths]
    if engine_config is None:
        longest = max(len(p) for d in datasets for p in d.prompts)
        mlen = max_model_len or min(tcfg.max_position_embeddings, longest + settings.max_new_tokens + 1)
        engine_config = _engine_config(max_num_seqs, mlen, min(max_prefill, mlen), settings.seed)
    if engine_config.policy != "fixed":
        raise ValueError(f"calibration verifies every draft position: policy must be 'fixed', "
                         f"got {engine_config.policy!r}")
    collect_t = rd.prepare_for_collection(drafter)
    llm = LLM(target=(model, tcfg), drafter=drafter, tokenizer=tok_dir, engine_config=engine_config,
              progress=progress)
    log = rd.RoundLog()
    for ds in datasets:
        reqs, _ = _requests(llm, ds, settings)
        part, _ = rd.run_requests(llm.engine, reqs, progress=progress, desc=f"calibrate {ds.name}")
        log.extend(part)
    result = rd.calibrate_rounds(log, collect_t, grid=grid, bins=settings.bins)
    path = None
    if save:
        meta = {"prompts": [os.fspath(p) for p in prompt_paths],
                "samples": sum(len(d.prompts) for d in datasets), "temperature": settings.temperature,
                "max_new_tokens": settings.max_new_tokens, "seed": settings.seed, "bins": settings.bins,
                **result.summary()}
        meta.pop("temperatures")
        path = rd.save_calibration(drafter_dir, result.temperatures, meta)
    return result, path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# ---------------------------------------------------------------------------------------------
# tables and files
# ---------------------------------------------------------------------------------------------

def ordered_datasets(names: Iterable[str]) -> list[str]:
    """Datasets in the paper's Table-1 order, then the others in the given order."""
    names = list(names)
    known = [n for n in TABLE_ORDER if n in names]
    return known + [n for n in names if n not in TABLE_ORDER]


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per drafter: tau per dataset, per domain, and the macro average."""
    rows = []
    for name, r in results["drafters"].items():
        row = {"drafter": name}
        for ds in ordered_datasets(r["datasets"]):
            row[ds] = r["datasets"][ds]["tau"]
        for dom in _domains(results):
            row[f"domain:{dom}"] = r["domains"].get(dom, float("nan"))
        row["macro"] = r["macro"]
        rows.append(row)
    return rows


def _domains(results: dict[str, Any]) -> list[str]:
    present = {d["domain"] for d in results["datasets"].values()}
    return [d for d in DOMAIN_ORDER if d in present] + sorted(present - set(DOMAIN_ORDER))


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "–"
    x = float(x)
    return "–" if math.isnan(x) else f"{x:.{digits}f}"


def results_markdown(results: dict[str, Any]) -> str:
    """Table 1 (tau per dataset, domain means, macro) plus per-position acceptance and calibration."""
    dsets = ordered_datasets(results["datasets"])
    doms = _domains(results)
    p = results["protocol"]
    lines = ["# Evaluation (DSpark Table-1 protocol)", "",
             f"Target `{os.path.basename(os.path.normpath(results['target']))}`; temperature {p['temperature']}, "
             f"max new tokens {p['max_new_tokens']}, seed {p['seed']} + sample index, first turn only, thinking off, "
             f"fixed verification of gamma draft tokens (scheduler off). τ = accepted draft tokens + bonus per "
             f"drafting round.", "",
             "## τ (Table 1)", "",
             "| Drafter | " + " | ".join(dsets + doms + ["macro"]) + " |",
             "|---|" + "---|" * (len(dsets) + len(doms) + 1)]
    for row in results["table"]:
        cells = [_fmt(row[d]) for d in dsets] + [_fmt(row[f"domain:{d}"]) for d in doms] + [_fmt(row["macro"])]
        lines.append(f"| {row['drafter']} | " + " | ".join(cells) + " |")
    lines += ["", "Samples per dataset: " + ", ".join(
        f"{d} {results['datasets'][d]['evaluated']}/{results['datasets'][d]['rows']}" for d in dsets), ""]
    for name, r in results["drafters"].items():
        g = r["gamma"]
        ks = list(range(1, g + 1))
        ov = r["overall"]
        lines += [f"## {name} (gamma {g})", ""]
        if ov.get("tau_ci95"):
            lo, hi = ov["tau_ci95"]
            lines += [f"τ over every prompt: {_fmt(ov['tau'], 3)} (95% interval {_fmt(lo, 3)}–{_fmt(hi, 3)}, "
                      "bootstrap over prompts).", ""]
        lines += ["Per-position acceptance (all datasets pooled): "
                  "unconditional = P(n ≥ k); conditional = P(n ≥ k | n ≥ k−1).", "",
                  "| | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * g]
        lines.append("| unconditional | " + " | ".join(_fmt(x, 3) for x in ov["accept_rate"]) + " |")
        lines.append("| conditional | " + " | ".join(_fmt(x, 3) for x in ov["cond_accept"]) + " |")
        conf = r.get("confidence")
        if conf:
            lines += ["", "Confidence calibration of the predicted prefix survival (pooled):", "",
                      "| | " + " | ".join(f"k={k}" for k in ks) + " | weighted |", "|---|" + "---|" * (g + 1)]
            for when in ("before", "after"):
                if when not in conf:
                    continue
                c = conf[when]
                for key, label in (("ece", "ECE"), ("auroc", "AUROC"), ("brier", "Brier")):
                    lines.append(f"| {label} {when} | " + " | ".join(_fmt(x, 3) for x in c[key]) +
                                 f" | {_fmt(c[key + '_weighted'], 3)} |")
            if "after" not in conf:
                lines.append("")
                lines.append("(no STS calibration on this drafter: run `python -m train.calibrate`)")
        lines.append("")
    return "\n".join(lines) + "\n"


def jsonable(x: Any) -> Any:
    """numpy arrays/scalars -> lists/numbers; NaN/inf -> None; tuples -> lists (recursively)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    return x


def write_results(results: dict[str, Any], out_dir: str) -> None:
    """results.json (NaN -> null) and results.md, each written atomically."""
    for name, text in (("results.json", json.dumps(jsonable(results), indent=2) + "\n"),
                       ("results.md", results_markdown(results))):
        write_atomic(os.path.join(out_dir, name), text)


__all__ = ["DEFAULT_CAPS", "DOMAINS", "EVAL_SEED", "Dataset", "DrafterSpec", "EvalSettings", "cap_rows",
           "confidence_report", "dataset_name", "domain_of", "encode_prompt", "evaluate_drafter",
           "first_user_turn", "jsonable", "load_dataset", "parse_caps", "read_prompt_file", "reliability_data",
           "resolve_drafter", "results_markdown", "run_calibration", "run_evaluation", "table_rows", "write_results"]
