"""GPU check: verify cost curve and engine tokens/s of a Qwen3-4B-shaped target (random weights).

    python -m bench.gpu_check              # on a GPU: Qwen3-4B shape, bfloat16, 480 s budget
    python -m bench.gpu_check --tiny       # on CPU: a tiny shape, seconds (what the test runs)
    python -m bench.gpu_check --dry-run    # no model: write the plan, marked "not yet run on GPU"
    python -m bench.gpu_check --draft-vocab 32768 --phases plain,curve
                                           # the drafter over a draft vocabulary: what it saves

Phases, in order; each records its results as soon as it ends:
  build   the target (Qwen3-4B: hidden 2560, 36 layers, 32/8 heads, head_dim 128, MLP 9728, vocab
          151936, tied embeddings) and a DSpark drafter of its shape (5 layers, block 7, Markov rank
          256, confidence head, taps 1/9/17/25/33), random weights;
  plain   an engine without drafter: a plain (lite) round's seconds per slots bucket, then tokens/s
          at each concurrency (closed loop: C requests in flight until 2C are done);
  curve   a DSpark engine under the `confidence` policy: its warm-up measures the cost table the
          scheduler uses (draft + verify seconds for every slots x tokens bucket, median of repeats,
          made monotone; `specjax.decoding.profiling.measure_cost_table`, as `serve.profile
          --policy confidence` does); then tokens/s at each concurrency with that table;
  async   the same drafter under `confidence_async`, the policy `make demo` and the server use: its
          warm-up measures its own table (one fused draft-and-fill call per bucket); it also runs
          upkeep rounds (then lite ones, exactly plain decoding's cost) when drafting does not pay on
          the table: tokens/s;
  fixed   the same drafter under the `fixed` policy (every draft token verified): tokens/s.

Random weights measure cost, not acceptance: the throughput of the speculative engines here says what
the machinery costs at this shape, not what a trained drafter would gain.

A watchdog stops the run when the budget (--budget seconds, counted from the start) runs out and
still writes everything measured so far, marking what is missing; such a run exits with status 3.
Compiling the bucket executables of a 36-layer target is most of the time: --compile-threads of
them compile at once (`Engine.warmup(threads=...)`; 1 compiles one at a time), and they land in
the persistent compilation cache (`specjax.decoding.compile_cache`), so running the command again on the
same machine skips most of it and finishes what a stopped run left out. Every engine compiles the
sampling variants the runs use (greedy and T=1; no top-k / top-p program), so the cost table is
measured on the T=1 rounds that are timed. The tiny preset uses
bfloat16 too, so the CPU test covers the dtype path of the GPU run.
Writes gpu_check.json, gpu_check.md and gpu_check.png (with --draft-vocab N: gpu_check_draft_vocabN.*)
into --out-dir and replaces the GPU section of
--docs (docs/BENCHMARKS.md; the other sections stay as they are).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import threading
import time
from typing import Any, Callable

NAME = "gpu_check"
COMMAND = "python -m bench.gpu_check"
EXIT_STOPPED = 3  # the budget ran out: results are partial


@dataclasses.dataclass(frozen=True)
class Preset:
    """A target shape plus the buckets and load levels to measure."""

    target: dict[str, Any]  # TargetConfig fields
    dtype: str
    taps: tuple[int, ...]
    mask_token_id: int
    draft_layers: int
    markov_rank: int
    gamma: int
    slots: tuple[int, ...]
    tokens: tuple[int, ...]
    concurrency: tuple[int, ...]
    prompt_len: int
    max_tokens: int
    budget_s: float
    draft_vocab_size: int = 0  # > 0: the drafter drafts over that many target ids (ids 0..N-1 here)
    attention: str = "xla"  # the engine's attention over the cache (EngineConfig.attention)
    mlp: str = "xla"  # the engine's gate/up products and SiLU gate (EngineConfig.mlp)


PRESETS: dict[str, Preset] = {
    "qwen3-4b": Preset(
        target=dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                    rope_theta=1_000_000.0, max_position_embeddings=40960),
        dtype="bfloat16", taps=(1, 9, 17, 25, 33), mask_token_id=151669, draft_layers=5, markov_rank=256,
        gamma=7, slots=(1, 8, 32, 128), tokens=(1, 2, 4, 8), concurrency=(1, 32, 128), prompt_len=64,
        max_tokens=64, budget_s=480.0),
    # the fewest executables that still run every phase (compiling dominates on a small CPU);
    # bfloat16 like the GPU preset
    "tiny": Preset(
        target=dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True),
        dtype="bfloat16", taps=(0,), mask_token_id=255, draft_layers=1, markov_rank=8, gamma=3,
        slots=(2,), tokens=(1, 4), concurrency=(1, 2), prompt_len=8, max_tokens=6, budget_s=300.0),
}
ENGINES = ("plain", "dspark-confidence", "dspark-confidence_async", "dspark-fixed")
# the sampling variants the runs ask for (greedy outputs, then T=1 throughput): no top-k / top-p
# program is compiled, and the cost table is measured on the T=1 rounds
RUN_VARIANTS = ("greedy", "plain")
PHASES = ("plain", "curve", "async", "fixed")  # after "build"; --phases picks a subset
NOT_ASKED = "not asked for (--phases)"


def result_name(draft_vocab_size: int, attention: str = "xla", mlp: str = "xla") -> str:
    """The outputs' base name: one set per drafter vocabulary, attention and MLP, so a run with a
    draft vocabulary or a Pallas kernel keeps the default results."""
    return (NAME + (f"_draft_vocab{draft_vocab_size}" if draft_vocab_size else "")
            + ("" if attention == "xla" else f"_{attention}") + ("" if mlp == "xla" else f"_mlp_{mlp}"))


# ------------------------------------------------------------------------------------------ results
class Recorder:
    """The run's results, shared with the watchdog thread (every change under one lock)."""

    def __init__(self, result: dict[str, Any], write: Callable[[dict[str, Any]], None]) -> None:
        self.result = result
        self._write = write
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self.phase = "start"

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def left(self) -> float:
        return self.result["budget_s"] - self.elapsed()

    def begin(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            self.result["phases"][phase] = {"status": "running", "started_s": round(self.elapsed(), 1)}

    def end(self, phase: str, status: str = "done", **extra: Any) -> None:
        with self._lock:
            p = self.result["phases"].setdefault(phase, {"started_s": round(self.elapsed(), 1)})
            p.update(status=status, seconds=round(max(0.0, self.elapsed() - p["started_s"]), 1), **extra)
            self.phase = "between phases"

    def update(self, fn: Callable[[dict[str, Any]], None]) -> None:
        with self._lock:
            fn(self.result)

    def finish(self, stopped: str | None) -> None:
        """Write the outputs once (the main thread or the watchdog, whoever comes first)."""
        with self._lock:
            if self.result.get("finished"):
                return
            self.result["finished"] = True
            self.result["complete"] = stopped is None and all(
                p.get("status") in ("done", NOT_ASKED) for p in self.result["phases"].values())
            self.result["stopped"] = stopped
            self.result["elapsed_s"] = round(self.elapsed(), 1)
            self._write(self.result)


def _markdown(res: dict[str, Any]) -> str:
    """The GPU section of docs/BENCHMARKS.md."""
    from bench.common import md_table
    t = res["target"]
    dv = res["drafter"].get("draft_vocab_size", 0)
    lines = [f"# GPU check: {res['preset']}-shaped target, random weights"
             + (f", draft vocabulary {dv}" if dv else ""), "",
             f"Command: `{res['command']}`", ""]
    if res.get("dry_run"):
        lines += ["**Not yet run on GPU.** On a machine with one GPU and JAX for it (`pip install -e "
                  "'.[cuda]'`), run the command above from the repository root (about "
                  f"{res['budget_s'] / 60:.0f} minutes; `--budget` changes the limit, `--tiny` runs a tiny "
                  "shape on CPU); it rewrites this section with the measured tables and a picture. A run "
                  "stopped by the budget keeps what it measured; running it again on the same machine "
                  "reuses the compiled executables and completes it.", ""]
    else:
        state = ("complete" if res.get("complete") else
                 f"**partial**: {res.get('stopped') or 'a phase failed'}")
        dev = res.get("device", {})
        lines += [f"Measured on {dev.get('kind', '?')} ({dev.get('backend', '?')} x{dev.get('count', '?')}), "
                  f"{res.get('date', '?')}: {state}, {res.get('elapsed_s', 0):.0f} s of a "
                  f"{res['budget_s']:.0f} s budget"
                  + "".join(f", {k} {v}" for k, v in res.get("machine", {}).get("versions", {}).items()
                            if k in ("jax", "flax")) + ".", ""]
    lines += [f"Target: hidden {t['hidden_size']}, {t['num_hidden_layers']} layers, "
              f"{t['num_attention_heads']}/{t['num_key_value_heads']} heads x {t['head_dim']}, MLP "
              f"{t['intermediate_size']}, vocab {t['vocab_size']}, tied embeddings, {res['dtype']}. DSpark "
              f"drafter: {res['drafter']['layers']} layer(s), block {res['drafter']['gamma']}, Markov rank "
              f"{res['drafter']['markov_rank']}, confidence head, taps {list(res['drafter']['taps'])}"
              + (f", drafting over a draft vocabulary of {dv} of the {t['vocab_size']} target ids (its "
                 "lm_head and Markov head cut to those rows; verification stays exact)" if dv else
                 ", drafting over the whole target vocabulary") + ". "
              f"Prompts of {res['prompt_len']} random tokens, {res['max_tokens']} new tokens each "
              "(temperature 1, no stop token). Random weights measure cost, not acceptance.", ""]
    slots, tokens = res["slots"], res["tokens"]
    curve = {(c["slots"], c["tokens"]): c["seconds"] for c in res.get("cost_curve", [])}
    lines += ["## Verify cost curve", "",
              "Milliseconds per speculative round (draft + verify) for every slots x tokens-per-slot "
              "bucket: the cost table the scheduler uses (median of repeats, made monotone), measured "
              "by the engine's warm-up. `plain round` is a round without drafter (plain decoding).", ""]
    plain_s = {int(k): v for k, v in res.get("plain_round_seconds", {}).items()}
    rows = [[s] + [f"{curve[(s, k)] * 1e3:.2f}" if (s, k) in curve else "-" for k in tokens]
            + [f"{plain_s[s] * 1e3:.2f}" if s in plain_s else "-"] for s in slots]
    lines += [md_table(["slots"] + [f"tokens {k}" for k in tokens] + ["plain round"], rows), ""]
    lines += ["## Engine tokens/s", "",
              "Aggregate generated tokens per second, closed loop (C requests in flight until 2C are "
              "done; prefill included); tau = accepted drafts + 1 per drafting round.", ""]
    tput = {(r["engine"], r["concurrency"]): r for r in res.get("throughput", [])}
    cs = res["concurrency"]
    rows = []
    for e in ENGINES:
        cells = []
        for c in cs:
            r = tput.get((e, c))
            cells.append("-" if r is None else f"{r['tokens_per_s']:.1f}" + (
                f" (tau {r['tau']:.2f})" if e != "plain" else ""))
        rows.append([e] + cells)
    lines += [md_table(["engine"] + [f"C={c}" for c in cs], rows, align="l" + "r" * len(cs)), ""]
    lines += _reading(res, curve, plain_s, tput)
    agree = greedy_agreement(res)
    if agree:
        lines += ["## Greedy outputs", "",
                  "Each prompt once at temperature 0 (untimed), each drafting engine's outputs against the "
                  "plain engine's in the same run (same kernels): speculative decoding is lossless, so they "
                  "must match, up to near-ties that a different rounding order breaks the other way.", ""]
        lines += [md_table(["engine", "requests equal to plain", "first differing token (earliest)"],
                           [[e, f"{a['equal']} of {a['requests']}", "-" if a["first_difference"] is None
                             else a["first_difference"]] for e, a in agree.items()], align="lrr"), ""]
    if res.get("phases"):
        lines += ["## Phases", ""]
        rows = [[k, v.get("status", "?"), f"{v.get('seconds', 0):.0f}",
                 f"{v['compile_s']:.0f}" if "compile_s" in v else "", v.get("note", "")]
                for k, v in res["phases"].items()]
        lines += [md_table(["phase", "status", "seconds", "of which compiling", "note"], rows, align="llrrl"), ""]
    return "\n".join(lines)


def greedy_agreement(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per drafting engine of the run: how many of its greedy outputs equal the plain engine's, and
    the earliest token at which one differs (None: all equal). Empty without the plain engine's."""
    outs = res.get("greedy_outputs", {})
    plain = outs.get("plain")
    if plain is None:
        return {}
    agree = {}
    for engine in ENGINES[1:]:
        if engine not in outs:
            continue
        diffs = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                 for a, b in zip(outs[engine], plain) if a != b]
        agree[engine] = {"equal": len(plain) - len(diffs), "requests": len(plain),
                         "first_difference": min(diffs) if diffs else None}
    return agree


def _reading(res: dict[str, Any], curve: dict, plain_s: dict, tput: dict) -> list[str]:
    """Ratios read off the two tables: what drafting adds to a round, how verify cost grows with
    tokens per slot, and each speculative engine's throughput against plain decoding."""
    slots, tokens, lines = res["slots"], res["tokens"], []
    for s in slots:
        lo, hi = curve.get((s, tokens[0])), curve.get((s, tokens[-1]))
        if lo and hi and s in plain_s:
            lines.append(f"- {s} slot(s): a round of {tokens[-1]} tokens per slot costs {hi / lo:.2f}x one of "
                         f"{tokens[0]}; a drafting round of {tokens[0]} costs {lo / plain_s[s]:.2f}x a plain round "
                         f"(what proposing a block adds); break-even τ at {tokens[-1]} tokens: {hi / plain_s[s]:.2f}")
    for c in res["concurrency"]:
        base = tput.get(("plain", c))
        if base:
            rel = [f"{e} {tput[(e, c)]['tokens_per_s'] / base['tokens_per_s']:.2f}x" for e in ENGINES[1:] if (e, c) in tput]
            if rel:
                lines.append(f"- C={c}, tokens/s against plain: " + ", ".join(rel))
    if not lines:
        return []
    return (["## Reading", ""] + lines + [
        "", "Random weights give a degenerate target whose tokens a random drafter sometimes matches "
        "(hence τ above 1) and a confidence head that is not calibrated to that, so which rounds the "
        "cost-aware policies chose to draft here shows their machinery and costs, not what a trained "
        "drafter's confidences would choose; the cost curve and the plain and fixed rows hold for any "
        "weights of this shape.", ""])


def _plot(res: dict[str, Any], path: str) -> None:
    from bench.common import pyplot
    plt = pyplot()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    curve = res.get("cost_curve", [])
    plain_s = res.get("plain_round_seconds", {})
    for s in res["slots"]:
        pts = sorted((c["tokens"], c["seconds"] * 1e3) for c in curve if c["slots"] == s)
        color = None
        if pts:
            color = ax0.plot(*zip(*pts), marker="o", label=f"{s} slots")[0].get_color()
        if str(s) in plain_s:  # a plain round (no drafter) for comparison, at one token per slot
            ax0.plot([1], [plain_s[str(s)] * 1e3], marker="x", ls="", color=color,
                     label=f"{s} slots, plain round")
    ax0.set_xlabel("tokens per slot (bucket)")
    ax0.set_ylabel("ms per draft + verify round")
    ax0.set_title("verify cost curve")
    for e in ENGINES:
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in res.get("throughput", []) if r["engine"] == e)
        if pts:
            ax1.plot(*zip(*pts), marker="o", label=e)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrent requests")
    ax1.set_ylabel("tokens/s (aggregate)")
    ax1.set_title("engine throughput")
    for ax in (ax0, ax1):
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{res['preset']} shape, random weights, {res.get('device', {}).get('kind', 'not run')}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def writer(out_dir: str, docs: str) -> Callable[[dict[str, Any]], None]:
    """JSON + Markdown + PNG into out_dir, then the section of `docs` (skipped when docs is '')."""
    def write(res: dict[str, Any]) -> None:
        from bench import run_all
        from bench.common import write_results
        name = result_name(res["drafter"].get("draft_vocab_size", 0), res.get("attention", "xla"), res.get("mlp", "xla"))
        plot = None if res.get("dry_run") else (lambda p: _plot(res, p))
        if plot is None and os.path.exists(os.path.join(out_dir, f"{name}.png")):
            os.remove(os.path.join(out_dir, f"{name}.png"))  # a picture of an older run would mislead
        write_results(name, res, _markdown(res), out_dir=out_dir, plot=plot)
        if docs:
            run_all.write_section(name, out_dir, docs)
    return write


# ------------------------------------------------------------------------------------------ phases
def _models(p: Preset):
    import numpy as np
    from flax import nnx

    from specjax.config import TargetConfig
    from specjax.drafters.dspark import BlockDrafterConfig
    from specjax.drafters.dspark import make_block_drafter
    from specjax.models.decoder import CausalLM
    from specjax.models.norm_folding import fold_norm_weights
    cfg = TargetConfig(**p.target)
    target = CausalLM(cfg, rngs=nnx.Rngs(0), dtype=p.dtype, param_dtype=p.dtype)
    fold_norm_weights(target)  # as checkpoints.load_target serves a target
    dcfg = BlockDrafterConfig.from_target(cfg, target_layer_ids=p.taps, mask_token_id=p.mask_token_id,
                                          num_draft_layers=p.draft_layers, block_size=p.gamma,
                                          markov_rank=p.markov_rank, confidence_head=True,
                                          draft_vocab_size=p.draft_vocab_size)
    # random weights: which ids form the subset changes nothing about cost
    ids = np.arange(p.draft_vocab_size) if p.draft_vocab_size else None
    drafter = make_block_drafter(target, cfg, dcfg, nnx.Rngs(1), dtype=p.dtype, param_dtype=p.dtype,
                                 draft_ids=ids)
    return target, drafter


def _engine(target, drafter, policy: str, p: Preset, tokens: tuple[int, ...], progress: bool):
    from specjax.decoding.engine import Engine, EngineConfig
    from specjax.models.pallas_attention import MIN_KEY_BLOCK
    max_len = p.prompt_len + p.max_tokens + p.gamma + 2
    if p.attention == "pallas":  # its attention buckets are multiples of its key block
        max_len = -(-max_len // MIN_KEY_BLOCK) * MIN_KEY_BLOCK
    cfg = EngineConfig(max_slots=p.slots[-1], max_len=max_len,
                       gamma=None if drafter is None else p.gamma, policy=policy, slots_buckets=p.slots,
                       tokens_buckets=tokens, prefill_buckets=(p.prompt_len,), max_prefill=p.prompt_len,
                       prefill_batch_buckets=(min(8, p.slots[-1]),), attention=p.attention, mlp=p.mlp,
                       sampling_variants=RUN_VARIANTS,
                       prefix_caching=False)  # runs repeat the prompts: decoding is timed, not the cache
    # a fixed identity: hashing 4B random weights on the host would only cost time
    return Engine(target, drafter, cfg, progress=progress,
                  target_id=f"random-{p.target['num_hidden_layers']}-layers")


def _throughput(rec: Recorder, engine, name: str, p: Preset, prompts) -> None:
    from bench.frontier import closed_loop
    # greedy outputs of every prompt once (untimed), against the plain engine's: a drafting engine's
    # must equal them (lossless) whatever kernels the run uses, up to ties the rounding breaks apart
    greedy = closed_loop(engine, prompts, min(len(prompts), p.concurrency[-1]), len(prompts), p.max_tokens,
                         temperature=0.0, keep_outputs=True)["outputs"]
    in_order = [greedy[k] for k in sorted(greedy, key=int)]
    rec.update(lambda res: res.setdefault("greedy_outputs", {}).update({name: in_order}))
    for c in p.concurrency:  # untimed, one wave: first calls of every bucket it uses stay out
        closed_loop(engine, prompts, c, c, p.max_tokens)
    for c in p.concurrency:
        r = closed_loop(engine, prompts, c, 2 * c, p.max_tokens)
        row = {"engine": name, "concurrency": c, "requests": r["requests"], "tokens": r["tokens"],
               "seconds": round(r["seconds"], 3), "tokens_per_s": round(r["aggregate_tokens_per_s"], 2),
               "per_user_tokens_per_s": round(r["per_user_tokens_per_s"], 2),
               "per_user_e2e_tokens_per_s": round(r["per_user_e2e_tokens_per_s"], 2), "tau": round(r["tau"], 3),
               "mean_verification_length": round(r["mean_verification_length"], 3)}
        rec.update(lambda res: res["throughput"].append(row))
        print(f"  {name:24s} C={c:4d}: {row['tokens_per_s']:10.1f} tok/s (tau {row['tau']:.2f}, "
              f"{rec.elapsed():.0f} s)", flush=True)


def run(rec: Recorder, p: Preset, progress: bool, threads: int, phases: tuple[str, ...] = PHASES) -> None:
    """The phases in `phases`; each skipped with a note when the budget left is below its estimate."""
    import gc

    import jax
    import numpy as np
    from flax import nnx

    from specjax.decoding.profiling import measure_plain_seconds
    dev = jax.devices()[0]
    rec.update(lambda r: r.update(device={"backend": jax.default_backend(), "kind": dev.device_kind,
                                          "count": jax.device_count()}))
    rec.begin("build")
    target, drafter = _models(p)
    jax.block_until_ready(jax.tree.leaves((nnx.state(target), nnx.state(drafter))))
    rec.end("build")
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, p.mask_token_id, size=(16, p.prompt_len)).tolist()
    per_key: float | None = None  # seconds per compiled executable, from the first engine

    def phase(name: str, engine_name: str, drafter_, policy: str, tokens: tuple[int, ...],
              measure: Callable[[Any], None] = lambda eng: None) -> None:
        """Build the phase's engine, compile it, run `measure(engine)` and the throughput loop
        (nothing when the phase was not asked for or does not fit the time left)."""
        nonlocal per_key
        if name not in phases:
            rec.end(name, NOT_ASKED)
            return
        eng = _engine(target, drafter_, policy, p, tokens, progress)
        try:
            need = 0.0 if per_key is None else 1.5 * per_key * len(eng.warm_keys())
            if rec.left() < need:
                rec.end(name, "skipped", note=f"about {need:.0f} s of compiling needed, {rec.left():.0f} s left")
                return
            rec.begin(name)
            warm = eng.warmup(threads=threads)  # a cost-aware policy then measures its cost table
            per_key = per_key or warm / len(eng.warm_keys())
            measure(eng)
            _throughput(rec, eng, engine_name, p, prompts)
            rec.end(name, compile_s=round(warm, 1))
        finally:
            del eng
            gc.collect()

    def plain_rounds(eng) -> None:
        plain = measure_plain_seconds(eng)
        rec.update(lambda r: r.update(plain_round_seconds={str(k): v for k, v in plain.items()}))

    def curve(eng) -> None:  # the cost table the engine's warm-up measured is the curve
        rows = [{"slots": s, "tokens": t, "seconds": sec} for (s, t), sec in sorted(eng.cost_table.as_dict().items())]
        rec.update(lambda r: r.update(cost_curve=rows))

    phase("plain", "plain", None, "plain", (1,), plain_rounds)
    phase("curve", "dspark-confidence", drafter, "confidence", p.tokens, curve)
    # the shipped serving policy: capacity from old confidences, and upkeep (then lite) rounds when
    # drafting does not pay; its table times its own round (a fused draft-and-fill call)
    phase("async", "dspark-confidence_async", drafter, "confidence_async", p.tokens)
    phase("fixed", "dspark-fixed", drafter, "fixed", (1, p.gamma + 1))


# ------------------------------------------------------------------------------------------ main
def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not out or any(x < 1 for x in out) or list(out) != sorted(set(out)):
        raise SystemExit(f"{flag} must be increasing positive integers, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-4b")
    ap.add_argument("--tiny", action="store_true", help="= --preset tiny: CPU, seconds")
    ap.add_argument("--dry-run", action="store_true", help="build nothing; write the plan marked not yet run")
    ap.add_argument("--budget", type=float, help="seconds for the whole run (preset default: 480 on GPU)")
    ap.add_argument("--slots", help="slots buckets, e.g. 1,8,32,128")
    ap.add_argument("--tokens", help="tokens-per-slot buckets, e.g. 1,2,4,8 (largest <= gamma + 1)")
    ap.add_argument("--concurrency", help="concurrent requests, e.g. 1,32,128 (largest <= largest slots)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft over this many target ids (0: the whole vocabulary); outputs are named "
                         "gpu_check_draft_vocabN")
    ap.add_argument("--attention", choices=["xla", "pallas"], default="xla",
                    help="the engine's attention over the cache (pallas: the kernel of specjax.models."
                         "pallas_attention); outputs of pallas are named gpu_check_pallas")
    ap.add_argument("--mlp", choices=["xla", "pallas"], default="xla",
                    help="the engine's gate/up products and SiLU gate (pallas: the kernel of specjax.models."
                         "pallas_mlp); outputs are then named ..._mlp_pallas")
    ap.add_argument("--phases", help=f"comma-separated subset of {','.join(PHASES)} (default: all)")
    ap.add_argument("--out-dir", help="default bench/results (--tiny: runs/gpu_check_tiny)")
    ap.add_argument("--docs", help="Markdown page whose GPU section to rewrite; '' skips it "
                                   "(default docs/BENCHMARKS.md; --tiny: '')")
    ap.add_argument("--allow-cpu", action="store_true", help="run the qwen3-4b preset without a GPU")
    ap.add_argument("--compile-threads", type=int, default=min(8, os.cpu_count() or 1),
                    help="threads compiling bucket executables at once (default: min(8, CPUs))")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    name = "tiny" if args.tiny else args.preset
    p = PRESETS[name]
    over: dict[str, Any] = {}
    for flag in ("slots", "tokens", "concurrency"):
        if getattr(args, flag):
            over[flag] = _ints(getattr(args, flag), f"--{flag}")
    if args.compile_threads < 1:
        ap.error(f"--compile-threads must be >= 1, got {args.compile_threads}")
    if args.budget is not None:
        if not args.budget > 0:
            ap.error(f"--budget must be > 0 seconds, got {args.budget}")
        over["budget_s"] = args.budget
    if args.draft_vocab:
        if not 0 < args.draft_vocab < p.target["vocab_size"]:
            ap.error(f"--draft-vocab must be in 1..{p.target['vocab_size'] - 1} (the target vocabulary "
                     f"is {p.target['vocab_size']}), got {args.draft_vocab}")
        over["draft_vocab_size"] = args.draft_vocab
    over["attention"], over["mlp"] = args.attention, args.mlp
    phases = PHASES
    if args.phases:
        phases = tuple(x.strip() for x in args.phases.split(","))
        bad = [x for x in phases if x not in PHASES]
        if bad:
            ap.error(f"--phases: unknown phase(s) {bad} (choose from {', '.join(PHASES)})")
    p = dataclasses.replace(p, **over)
    if p.tokens[-1] > p.gamma + 1:
        ap.error(f"--tokens: largest bucket {p.tokens[-1]} exceeds gamma + 1 = {p.gamma + 1}")
    if p.concurrency[-1] > p.slots[-1]:
        ap.error(f"--concurrency: {p.concurrency[-1]} exceeds the largest slots bucket {p.slots[-1]}")
    out_dir = args.out_dir or (os.path.join("runs", "gpu_check_tiny") if name == "tiny"
                               else os.path.join("bench", "results"))
    docs = args.docs if args.docs is not None else ("" if name == "tiny" else os.path.join("docs", "BENCHMARKS.md"))

    shown = [COMMAND] + (["--tiny"] if name == "tiny" else [])
    shown += [f"--{k} {','.join(map(str, over[k]))}" for k in ("slots", "tokens", "concurrency") if k in over]
    shown += [f"--draft-vocab {p.draft_vocab_size}"] if p.draft_vocab_size else []
    shown += [f"--attention {p.attention}"] if p.attention != "xla" else []
    shown += [f"--mlp {p.mlp}"] if p.mlp != "xla" else []
    shown += [f"--phases {','.join(phases)}"] if phases != PHASES else []
    shown += [f"--budget {p.budget_s:g}"] if "budget_s" in over else []
    result: dict[str, Any] = {
        "benchmark": NAME, "preset": name, "command": " ".join(shown), "dry_run": args.dry_run,
        "target": p.target, "dtype": p.dtype, "slots": list(p.slots), "tokens": list(p.tokens),
        "concurrency": list(p.concurrency), "prompt_len": p.prompt_len, "max_tokens": p.max_tokens,
        "budget_s": p.budget_s, "attention": p.attention, "mlp": p.mlp, "compile_threads": args.compile_threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "drafter": {"layers": p.draft_layers, "gamma": p.gamma, "markov_rank": p.markov_rank, "taps": list(p.taps),
                    "draft_vocab_size": p.draft_vocab_size},
        "phases": {}, "cost_curve": [], "plain_round_seconds": {}, "throughput": []}
    rec = Recorder(result, writer(out_dir, docs))
    if args.dry_run:
        rec.finish("dry run: nothing measured")
        print(f"wrote the plan to {out_dir}" + (f" and {docs}" if docs else ""))
        return 0

    import jax
    if jax.default_backend() != "gpu" and name != "tiny" and not args.allow_cpu:
        raise SystemExit(f"the {name} preset needs a GPU (JAX backend is {jax.default_backend()!r}); "
                         "use --tiny on CPU, or --allow-cpu to insist")
    from bench.common import machine_info
    rec.update(lambda r: r.update(machine=machine_info()))

    def stop() -> None:
        rec.update(lambda r: r["phases"].get(rec.phase, {}).update(status="stopped by the budget"))
        rec.finish(f"the {p.budget_s:.0f} s budget ran out during phase '{rec.phase}'")
        print(f"budget of {p.budget_s:.0f} s ran out during {rec.phase}: wrote the partial results", flush=True)
        os._exit(EXIT_STOPPED)

    timer = threading.Timer(max(0.0, rec.left()), stop)
    timer.daemon = True
    timer.start()
    try:
        run(rec, p, progress=not args.quiet, threads=args.compile_threads, phases=phases)
    except Exception as e:  # noqa: BLE001 - record what failed, keep what was measured, then re-raise
        timer.cancel()
        failure = f"{type(e).__name__}: {e}"
        rec.update(lambda r: r["phases"].get(rec.phase, {}).update(status=f"failed: {failure}"))
        rec.finish(f"phase '{rec.phase}' failed: {failure}")
        raise
    timer.cancel()
    rec.finish(None)
    print(f"wrote {out_dir}/{result_name(p.draft_vocab_size, p.attention, p.mlp)}.json, .md, .png" + (f" and the section of {docs}" if docs else ""))
    return 0 if result["complete"] else EXIT_STOPPED


if __name__ == "__main__":
    raise SystemExit(main())
