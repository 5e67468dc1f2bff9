"""Shared benchmark helpers: the benchmark target, timing (warm-up, repeats, median), machine facts,
and writing results as JSON + Markdown + PNG.

Every benchmark records the 1-minute load average next to each figure: the development machines
are small and shared, so a number measured under load is only comparable with the load it had.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Mapping, Sequence

DEFAULT_OUT_DIR = os.path.join("bench", "results")

# The embedded default target's shape (SmolLM2-135M-Instruct, Llama family); used for a random
# stand-in when its package is not installed.
RANDOM_TARGET_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                           max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                           architecture="LlamaForCausalLM", model_type="llama", qk_norm=False)


# ------------------------------------------------------------------------------------------ progress
_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Print a progress line with the seconds since start and the current 1-minute load average."""
    print(f"[{time.perf_counter() - _T0:7.1f}s load {load_average()[0]:4.1f}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ machine
def load_average() -> tuple[float, float, float]:
    """(1, 5, 15)-minute load averages, or NaNs where the OS has none."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())  # type: ignore[return-value]
    except OSError:
        return (float("nan"),) * 3


def _version(module: str) -> str | None:
    mod = sys.modules.get(module)
    if mod is None:
        try:
            mod = __import__(module)
        except Exception:  # noqa: BLE001 - an optional package: report it as absent
            return None
    return str(getattr(mod, "__version__", "unknown"))


def machine_info(*, packages: Sequence[str] = ("jax", "jaxlib", "flax", "numpy")) -> dict[str, Any]:
    """Host and software facts: CPU count, load, platform, Python, package versions, JAX backend."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "load_average": list(load_average()),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in packages},
    }
    if "jax" in sys.modules:
        import jax
        dev = jax.devices()[0]
        info["jax_backend"] = jax.default_backend()
        info["jax_device_kind"] = dev.device_kind
        info["jax_device_count"] = jax.device_count()
    return info


# ------------------------------------------------------------------------------------------ timing
@dataclasses.dataclass
class Timing:
    """Seconds per call over `repeats` timed batches (each the mean over `inner` calls)."""

    samples: list[float]
    inner: int
    load_before: float
    load_after: float

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median of the samples: a noise indicator."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median > 0 else 0.0

    def as_dict(self, scale: float = 1e3, unit: str = "ms") -> dict[str, Any]:
        return {f"median_{unit}": round(self.median * scale, 4), f"min_{unit}": round(self.min * scale, 4),
                "spread": round(self.spread, 3), "repeats": len(self.samples), "inner": self.inner,
                "load_1min": [self.load_before, self.load_after]}


def time_fn(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5, inner: int = 1,
            sync: Callable[[Any], Any] | None = None) -> Timing:
    """Time `fn()`: `warmup` untimed calls, then `repeats` batches of `inner` calls.

    `sync(result)` waits for asynchronous work (e.g. `jax.block_until_ready`) inside the timed region.
    """
    if repeats < 1 or inner < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1, inner >= 1, warmup >= 0; got {repeats}, {inner}, {warmup}")
    sync = sync or (lambda r: r)
    for _ in range(warmup):
        sync(fn())
    load0 = load_average()[0]
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            r = fn()
        sync(r)
        samples.append((time.perf_counter() - t0) / inner)
    return Timing(samples, inner, load0, load_average()[0])


def time_interleaved(fns: Mapping[str, Callable[[], Any]], *, warmup: int = 1, repeats: int = 5,
                     inner: int | Mapping[str, int] = 1,
                     sync: Callable[[Any], Any] | None = None) -> dict[str, Timing]:
    """Time several functions round-robin (A B C A B C ...) so each sees the same background load.

    Differences between them (e.g. a head's overhead) are then far less affected by load drift than
    with one function timed after another. `inner` (calls per sample) may differ per function.
    """
    inners = {k: inner[k] if isinstance(inner, Mapping) else inner for k in fns}
    if repeats < 1 or min(inners.values(), default=1) < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1, inner >= 1, warmup >= 0; got {repeats}, {inner}, {warmup}")
    sync = sync or (lambda r: r)
    for fn in fns.values():
        for _ in range(warmup):
            sync(fn())
    load0 = load_average()[0]
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            n = inners[name]
            t0 = time.perf_counter()
            for _ in range(n):
                r = fn()
            sync(r)
            samples[name].append((time.perf_counter() - t0) / n)
    load1 = load_average()[0]
    return {k: Timing(v, inners[k], load0, load1) for k, v in samples.items()}


# ------------------------------------------------------------------------------------------ target
@dataclasses.dataclass
class BenchTarget:
    """The model a benchmark runs: the embedded default when it exists, else a random stand-in."""

    model: Any  # specjax CausalLM
    config: Any  # TargetConfig
    source: str  # "embedded" or "random"
    description: str
    tokenizer: Any = None  # a transformers tokenizer (embedded target only)
    path: str | None = None


def batch1_decode(llm: Any, prompts: Sequence[Sequence[int]], sampling_params: Any) -> tuple[list[Any], dict[str, Any]]:
    """Decode `prompts` one after another at batch 1 with `llm` (a specjax.LLM, warm) and
    `sampling_params` (one SamplingParams, or one per prompt): (the outputs, {tokens, seconds,
    tokens_per_s, load (1-minute, at the start), tau, token_ids})."""
    per_prompt = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
    load0 = load_average()[0]
    t0 = time.perf_counter()
    outs = [llm.generate([p], sp)[0] for p, sp in zip(prompts, per_prompt)]
    sec = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    drafts = sum(o.metrics["num_drafts"] for o in outs)
    acc = sum(o.metrics["num_accepted_tokens"] for o in outs)
    return outs, {"tokens": toks, "seconds": sec, "tokens_per_s": toks / sec, "load": load0,
                  "tau": 1 + acc / drafts if drafts else 1.0, "token_ids": [o.token_ids for o in outs]}


def run_arrivals(engine: Any, requests: Sequence[Any], every: int) -> int:
    """Run `requests` on `engine`, one added every `every` engine steps (queued while the slots are
    busy), until all end; returns the steps taken."""
    waiting, step = list(requests), 0
    while waiting or engine.has_work():
        if waiting and step % every == 0:
            engine.add_request(waiting.pop(0))
        engine.step()
        step += 1
    return step


def require_shipped(drafters: Sequence[str]) -> None:
    """Exit naming --drafters when one of `drafters` (shipped names; "ngram" needs none) is not shipped."""
    from specjax import default_target
    missing = sorted(set(drafters) - set(default_target.available_drafters()) - {"ngram"})
    if missing:
        raise SystemExit(f"--drafters: {missing} not shipped (run `make embedded` first)")


def load_bench_target(*, use_embedded: bool = True, seed: int = 0) -> BenchTarget:
    """The embedded default target (SmolLM2-135M-Instruct from its GGUF, dequantized to float32,
    with its tokenizer) when its package is installed and `use_embedded`; otherwise a random model
    of the same shape (RANDOM_TARGET_SHAPE)."""
    from specjax import checkpoints, default_target
    if use_embedded and default_target.is_installed():
        path = default_target.gguf_path()
        model, cfg = checkpoints.load_target(path, dtype="float32")
        tok = checkpoints.load_tokenizer(path)
        desc = (f"{default_target.NAME} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                f"vocab {cfg.vocab_size}) from the {default_target.PACKAGE} GGUF (Q4_1) dequantized to float32")
        return BenchTarget(model, cfg, "embedded", desc, tok, path)
    from flax import nnx

    from specjax.config import TargetConfig
    from specjax.models.decoder import CausalLM
    cfg = TargetConfig(**RANDOM_TARGET_SHAPE)
    model = CausalLM(cfg, rngs=nnx.Rngs(seed))
    why = f"{default_target.PACKAGE} is not installed" if use_embedded else "--random-target"
    desc = (f"random {cfg.model_type} model of {default_target.NAME}'s shape built on the spot ({why}): "
            f"hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
            f"{cfg.num_key_value_heads} kv heads, head_dim {cfg.head_dim}, intermediate "
            f"{cfg.intermediate_size}, vocab {cfg.vocab_size}, tied, float32, seed {seed}")
    return BenchTarget(model, cfg, "random", desc)


# ------------------------------------------------------------------------------------------ output
def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A Markdown table; `align` is one char per column ('l' or 'r'; default: right)."""
    align = align or "r" * len(headers)
    sep = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", sep]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces a run: `python -m <module> <args>`, without `--docs PAGE` (which
    page the section is written to does not change what is measured)."""
    given, args = list(sys.argv[1:] if argv is None else argv), []
    skip = False
    for a in given:
        if skip or a.startswith("--docs="):
            skip = False
            continue
        skip = a == "--docs"
        if not skip:
            args.append(a)
    return " ".join(["python", "-m", module] + args)


def write_results(name: str, result: Mapping[str, Any], markdown: str, *, out_dir: str = DEFAULT_OUT_DIR,
                  plot: Callable[[str], None] | None = None) -> list[str]:
    """Write `<name>.json`, `<name>.md` and (with `plot(path)`) `<name>.png` into `out_dir`.

    The Markdown file should start with a `# Title` line and name the command that made it: run_all
    builds docs/BENCHMARKS.md from these files. Returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    p = os.path.join(out_dir, f"{name}.json")
    with open(p, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=_json_default)
        f.write("\n")
    paths.append(p)
    p = os.path.join(out_dir, f"{name}.md")
    with open(p, "w", encoding="utf-8") as f:
        f.write(markdown if markdown.endswith("\n") else markdown + "\n")
    paths.append(p)
    if plot is not None:
        p = os.path.join(out_dir, f"{name}.png")
        plot(p)
        paths.append(p)
    return paths


def _json_default(x: Any) -> Any:
    import numpy as np
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def pyplot():
    """matplotlib.pyplot with the non-interactive Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig: Any, path: str) -> None:
    """Lay a benchmark's figure out, write it to `path` (PNG, 100 dpi) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


__all__ = ["BenchTarget", "DEFAULT_OUT_DIR", "RANDOM_TARGET_SHAPE", "Timing", "command_line",
           "load_average", "load_bench_target", "log", "machine_info", "md_table",
           "pyplot", "save_figure", "time_fn", "time_interleaved", "write_results"]
