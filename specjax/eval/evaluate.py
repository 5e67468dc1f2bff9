"""The DSpark Table-1 evaluation protocol (reference §8.1–8.3, §8.6) on specjax's engine.

Datasets (`specjax.eval.datasets`): the first user turn of each row, capped by the paper's rule;
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
import os
from typing import Any, Sequence

import numpy as np

from specjax.eval import rounds as rd
from specjax.eval.datasets import DEFAULT_MAX_NEW_TOKENS, EVAL_SEED, Dataset, dataset_name, load_dataset
from specjax.eval.metrics import acceptance_metrics, paired_tau_bootstrap, per_request_tau_parts
from specjax.eval.report import table_rows, write_plots, write_results
from specjax.eval.resume import EvalProgress, progress_path
from specjax.scheduling.calibration import apply_sts
from specjax.scheduling.calibration_metrics import confidence_metrics

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
                     progress: bool = True, name: str = "", resume: tuple[str, dict[str, Any]] | None = None,
                     ) -> tuple[dict[str, Any], dict[str, rd.RoundLog]]:
    """Run every dataset through `llm` (its engine must use the fixed policy). Returns
    (per-drafter result dict, per-dataset round logs). `resume` = (out_dir, fingerprint): keep each
    finished request in a progress file (`specjax.eval.resume`) and decode only the ones missing."""
    gamma = int(llm.engine.gamma)
    res: dict[str, Any] = {"gamma": gamma, "datasets": {}}
    logs: dict[str, rd.RoundLog] = {}
    for ds in datasets:
        reqs, skipped = _requests(llm, ds, settings)
        store = None if resume is None else EvalProgress(progress_path(resume[0], name, ds.name),
                                                         {**resume[1], "dataset": _display_path(ds.path),
                                                          "prompts": len(ds.prompts)})
        log, stats = _run_dataset(llm, reqs, f"{name} {ds.name}".strip(), progress, store)
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


def _run_dataset(llm: Any, reqs: list[Any], desc: str, progress: bool, store: EvalProgress | None,
                 ) -> tuple[rd.RoundLog, dict[str, Any]]:
    """Decode `reqs` (those `store` does not hold yet) and record their rounds. With a store, stats'
    generated_tokens count every request, seconds and tokens_per_second this run's."""
    if store is None:
        return rd.run_requests(llm.engine, reqs, progress=progress, desc=desc)
    try:
        todo = [r for r in reqs if r.request_id not in store.done]
        new, stats = rd.run_requests(llm.engine, todo, progress=progress, desc=desc, on_done=store.record)
        todo_ids = {r.request_id for r in todo}
        log = store.stored_log([r.request_id for r in reqs if r.request_id not in todo_ids])
        log.extend(new)
    finally:
        store.close()
    return log, {**stats, "generated_tokens": sum(store.done[r.request_id]["generated"] for r in reqs),
                 "resumed_requests": len(reqs) - len(todo)}


def _load_target(target_dir: str, tokenizer_dir: str | None, dtype: str) -> tuple[Any, Any, str, Any]:
    """(model, target config, tokenizer directory, tokenizer) of a target checkpoint."""
    from specjax import checkpoints

    model, tcfg = checkpoints.load_target(target_dir, dtype=dtype)
    tok_dir = tokenizer_dir or target_dir
    tokenizer = checkpoints.load_tokenizer(tok_dir)
    if tokenizer is None:
        raise ValueError(f"no tokenizer files in {tok_dir} (pass --tokenizer)")
    return model, tcfg, tok_dir, tokenizer


def _fixed_engine_config(engine_config: Any, datasets: Sequence[Dataset], tcfg: Any, settings: EvalSettings,
                         max_num_seqs: int, max_model_len: int | None, max_prefill: int, why: str) -> Any:
    """The given engine config, else one sized for the longest prompt + max_new_tokens (at most
    the target's max_position_embeddings) whose rounds compile the one sampling variant every request
    uses; its policy must be "fixed" (`why` says why)."""
    if engine_config is None:
        from specjax.decoding.engine import EngineConfig
        from specjax.sampling import sampling_variant
        longest = max(len(p) for d in datasets for p in d.prompts)
        mlen = max_model_len or min(tcfg.max_position_embeddings, longest + settings.max_new_tokens + 1)
        variant = sampling_variant(settings.temperature, settings.top_k, settings.top_p)
        # each prompt decoded as if alone: no rows or n-gram text of the prompts before it (prefix caching off)
        engine_config = EngineConfig(max_slots=max_num_seqs, max_len=mlen, policy="fixed", seed=settings.seed,
                                     max_prefill=min(max_prefill, mlen), sampling_variants=(variant,),
                                     prefix_caching=False)
    if engine_config.policy != "fixed":
        raise ValueError(f"{why}: policy must be 'fixed', got {engine_config.policy!r}")
    return engine_config


def _display_path(path: str | os.PathLike) -> str:
    """A path as recorded in results: relative to the working directory (`../shared/...` for one
    beside the checkout), so results name no machine-specific absolute path."""
    try:
        return os.path.relpath(os.fspath(path))
    except ValueError:  # another drive (Windows): the file name is all that is portable
        return os.path.basename(os.fspath(path))


def _protocol(settings: EvalSettings, engine_config: Any, enable_thinking: bool | None) -> dict[str, Any]:
    return {"temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p,
            "max_new_tokens": settings.max_new_tokens, "seed": settings.seed, "policy": "fixed",
            "first_turn_only": True, "enable_thinking": enable_thinking, "ece_bins": settings.bins,
            "max_model_len": engine_config.max_len, "max_num_seqs": engine_config.max_slots,
            "tau": "accepted draft tokens + bonus per drafting round"}


def _evaluate_spec(spec: DrafterSpec, target: tuple[Any, Any], tok_dir: str, datasets: Sequence[Dataset],
                   settings: EvalSettings, engine_config: Any, gamma: int | None, progress: bool,
                   resume: tuple[str, dict[str, Any]] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One drafter over every dataset: (its result entry, its reliability data or None). The
    drafter's confidence temperatures are restored afterwards. `resume` = (out_dir, what the
    evaluation's progress files must match besides the drafter and gamma)."""
    from specjax.api import LLM

    source = _display_path(spec.source) if os.path.exists(spec.source) else spec.source
    if resume is not None:
        resume = (resume[0], {**resume[1], "drafter": source, "gamma": gamma})

    drafter = spec.module
    has_conf = rd.drafter_has_confidence(drafter)
    original = rd.confidence_temperatures(drafter) if has_conf else None
    calib = None if original is None or np.allclose(original, 1.0) else original
    collect_t = rd.prepare_for_collection(drafter) if has_conf else 1.0
    cfg = engine_config if gamma is None else dataclasses.replace(engine_config, gamma=gamma)
    try:
        llm = LLM(target=target, drafter=drafter, tokenizer=tok_dir, engine_config=cfg, progress=progress)
        res, logs = evaluate_drafter(llm, datasets, settings, collect_t=collect_t, calibration=calib,
                                     has_confidence=has_conf, progress=progress, name=spec.name, resume=resume)
    finally:
        if original is not None:  # leave the drafter as it was loaded
            rd.set_temperatures(drafter, original)
    res["source"] = source
    res["has_confidence_head"] = has_conf
    res["calibration"] = None if calib is None else [float(t) for t in calib]
    rel = None
    if has_conf:
        pooled = rd.RoundLog()
        for log in logs.values():
            pooled.extend(log)
        rel = reliability_data(pooled, collect_t, calib)
    return res, rel


def run_evaluation(target_dir: str | None, drafters: Sequence[str], data_paths: Sequence[str], out_dir: str, *,
                   tokenizer_dir: str | None = None, settings: EvalSettings = EvalSettings(),
                   cap: int | None = None, caps: dict[str, int] | None = None, gamma: int | None = None,
                   max_num_seqs: int = 8, max_model_len: int | None = None, max_prefill: int = 256,
                   dtype: str = "float32", engine_config: Any = None, progress: bool = True,
                   enable_thinking: bool | None = False) -> dict[str, Any]:
    """The whole evaluation: load the target once, every drafter in turn, every dataset; write
    results.json, results.md, acceptance_by_position.png and reliability_<drafter>.png to out_dir.
    Each finished request is kept in out_dir/progress/ (`specjax.eval.resume`): a rerun into the
    same out_dir after a kill decodes only the requests that had not finished.

    target_dir: a Hugging Face directory or `.gguf` file (Qwen3 / Llama / Qwen2), or None for the
    embedded default (SmolLM2-135M-Instruct). cap: every
    dataset's cap (default: the paper's per-dataset caps; all rows for unknown names); caps: per
    dataset name. max_model_len: default the longest prompt + max_new_tokens (at most the target's
    max_position_embeddings). engine_config: overrides the engine shape entirely (its policy must
    be "fixed")."""
    if not drafters:
        raise ValueError("no drafter given")
    if not data_paths:
        raise ValueError("no dataset given")
    embedded = target_dir is None
    if embedded:
        from specjax import default_target
        target_dir = default_target.gguf_path()
    model, tcfg, tok_dir, tokenizer = _load_target(target_dir, tokenizer_dir, dtype)
    caps = dict(caps or {})
    datasets = [load_dataset(p, tokenizer, cap=caps.get(dataset_name(p), cap), enable_thinking=enable_thinking)
                for p in data_paths]
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        raise ValueError(f"two dataset files share a name: {names}")
    engine_config = _fixed_engine_config(engine_config, datasets, tcfg, settings, max_num_seqs, max_model_len,
                                         max_prefill, "the Table-1 protocol verifies every draft position")
    specs = [resolve_drafter(s, model, gamma=gamma, embedded=embedded) for s in drafters]
    unique_names(specs)
    os.makedirs(out_dir, exist_ok=True)
    results: dict[str, Any] = {
        "protocol": _protocol(settings, engine_config, enable_thinking),
        "target": _display_path(target_dir),
        "datasets": {d.name: {"path": _display_path(d.path), "kind": d.kind, "domain": d.domain, "rows": d.total_rows,
                              "evaluated": len(d.prompts)} for d in datasets},
        "drafters": {}}
    series, reliability = {}, {}
    for spec in specs:
        res, rel = _evaluate_spec(spec, (model, tcfg), tok_dir, datasets, settings, engine_config, gamma, progress,
                                  resume=(out_dir, {"protocol": results["protocol"], "target": results["target"]}))
        results["drafters"][spec.name] = res
        for ds in datasets:
            e = res["datasets"][ds.name]
            series[f"{spec.name} / {ds.name}"] = (e["accept_rate"], e["cond_accept"])
        if rel is not None:
            reliability[spec.name] = rel
    results["table"] = table_rows(results)
    write_results(results, out_dir)
    results["files"] = {"results.json": os.path.join(out_dir, "results.json"),
                        "results.md": os.path.join(out_dir, "results.md")}
    results["files"].update(write_plots(series, reliability, out_dir))
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
    model, tcfg, tok_dir, tokenizer = _load_target(target_dir, tokenizer_dir, dtype)
    drafter = load_drafter(drafter_dir, target=model)
    if not rd.drafter_has_confidence(drafter):
        raise ValueError(f"{drafter_dir}: the drafter has no confidence head: nothing to calibrate")
    if rd.confidence_temperatures(drafter) is None:
        raise ValueError(f"{drafter_dir}: the drafter's confidences have no temperatures to calibrate")
    datasets = [load_dataset(p, tokenizer, cap=cap if cap is not None else 10**9, enable_thinking=enable_thinking)
                for p in prompt_paths]
    engine_config = _fixed_engine_config(engine_config, datasets, tcfg, settings, max_num_seqs, max_model_len,
                                         max_prefill, "calibration verifies every draft position")
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
