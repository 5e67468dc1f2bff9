"""The main job behind `make demo`: decode held-out prompts with a drafter and with plain decoding.

Prints the completions, mean acceptance length (τ), tokens/s and the speedup, and writes a short
report (Markdown + a PNG of acceptance by position) to the output directory. Uses the embedded default
(a tiny Qwen3 trained on the Python standard library, with drafters trained by our pipeline) when its
assets are present; otherwise it says so and runs the same code path on a small random model built on
the spot with the n-gram drafter.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import numpy as np


@dataclasses.dataclass
class DemoRun:
    name: str
    outputs: list[Any]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def acceptance(self) -> tuple[float, list[float]]:
        drafts = sum(o.metrics["num_drafts"] for o in self.outputs)
        acc = sum(o.metrics["num_accepted_tokens"] for o in self.outputs)
        per_pos = np.zeros(max((len(o.metrics["num_accepted_tokens_per_pos"]) for o in self.outputs), default=0))
        for o in self.outputs:
            p = o.metrics["num_accepted_tokens_per_pos"]
            per_pos[:len(p)] += p
        tau = 1.0 + acc / drafts if drafts else 1.0
        return tau, (per_pos / drafts).tolist() if drafts else []


def _embedded_available(drafter: str) -> bool:
    try:
        from specjax import embedded
    except ImportError:
        return False
    try:
        return os.path.exists(os.path.join(embedded.target_dir(), "config.json")) and (
            drafter == "ngram" or os.path.exists(os.path.join(embedded.drafter_dir(drafter), "config.json")))
    except Exception:
        return False


def _load_prompts(n: int) -> list[str]:
    from specjax import embedded
    rows = [json.loads(line) for line in open(embedded.prompts_path()) if line.strip()]
    return [r["prompt"] for r in rows[:n]]


def _random_setup(max_model_len: int):
    """A small random target (no embedded assets yet) and repetitive token-id prompts."""
    from flax import nnx
    from specjax.config import TargetConfig
    from specjax.models.decoder import CausalLM
    cfg = TargetConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = []
    for _ in range(4):
        motif = list(rng.integers(0, 512, size=6))
        prompts.append((motif * 6)[:32])
    return (model, cfg), prompts


def run_demo(out_dir: str = "demo_output", *, drafter: str = "dspark", num_prompts: int = 4, max_tokens: int = 96,
             temperature: float = 0.0, max_model_len: int = 512, progress: bool = True) -> dict[str, Any]:
    """Run the demo and write `report.md`, `report.json` and `acceptance.png` to `out_dir`."""
    from specjax.api import LLM, SamplingParams
    os.makedirs(out_dir, exist_ok=True)
    embedded = _embedded_available(drafter)
    if embedded:
        target, prompts = None, _load_prompts(num_prompts)
        note = f"embedded default (pystd target, '{drafter}' drafter)"
    else:
        target, prompts = _random_setup(max_model_len)
        prompts = prompts[:num_prompts]
        drafter = "ngram"
        note = ("embedded default assets not found: running the real code path on a small random model "
                "built on the spot, with the n-gram drafter (run `make embedded` to build the assets)")
    print(f"specjax demo: {note}")
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
    kw = dict(max_num_seqs=1, max_model_len=max_model_len, max_prefill=256, progress=progress)
    runs = {}
    for name, d in (("plain", None), (drafter, drafter)):
        t0 = time.perf_counter()
        llm = LLM(target=target, drafter=d, **kw)
        warm = time.perf_counter() - t0
        llm.generate(prompts[:1], SamplingParams(temperature=temperature, max_tokens=4))  # first-call effects
        t0 = time.perf_counter()
        outs = [llm.generate([p], sp)[0] for p in prompts]  # batch 1: per-user latency
        runs[name] = DemoRun(name, outs, time.perf_counter() - t0)
        print(f"  {name:10s} warm-up {warm:5.1f}s  {runs[name].tokens_per_second:7.1f} tokens/s")
    plain, spec = runs["plain"], runs[drafter]
    tau, per_pos = spec.acceptance()
    speedup = spec.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else 0.0
    same = [a.token_ids == b.token_ids for a, b in zip(plain.outputs, spec.outputs)]
    for i, (p, o) in enumerate(zip(prompts, spec.outputs)):
        shown = p if isinstance(p, str) else f"<{len(p)} token ids>"
        text = o.text if o.text is not None else str(o.token_ids[:24]) + " ..."
        print(f"\n--- prompt {i} ---\n{shown}\n--- {drafter} completion (τ={o.metrics['mean_acceptance_length']:.2f}) ---\n{text}")
    print(f"\nτ (mean acceptance length incl. bonus) = {tau:.2f}; tokens/s plain {plain.tokens_per_second:.1f}, "
          f"{drafter} {spec.tokens_per_second:.1f}; speedup {speedup:.2f}x; "
          f"{'identical' if all(same) else 'different'} greedy outputs" if temperature == 0 else "")
    report = {"setup": note, "drafter": drafter, "temperature": temperature, "max_tokens": max_tokens,
              "prompts": len(prompts), "tau": tau, "acceptance_by_position": per_pos,
              "tokens_per_second": {"plain": plain.tokens_per_second, drafter: spec.tokens_per_second},
              "speedup": speedup, "greedy_outputs_identical": all(same) if temperature == 0 else None}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    _plot(per_pos, drafter, os.path.join(out_dir, "acceptance.png"))
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(f"# specjax demo\n\nSetup: {note}.\n\n| | plain | {drafter} |\n|---|---|---|\n"
                f"| tokens/s (batch 1) | {plain.tokens_per_second:.1f} | {spec.tokens_per_second:.1f} |\n"
                f"| τ (incl. bonus) | 1.00 | {tau:.2f} |\n\nSpeedup: **{speedup:.2f}x**. "
                f"Acceptance by position: ![acceptance](acceptance.png)\n")
        for i, o in enumerate(spec.outputs):
            f.write(f"\n## Completion {i}\n\n```\n{o.text if o.text is not None else o.token_ids}\n```\n")
    print(f"report written to {out_dir}/report.md")
    return report


def _plot(per_pos: list[float], drafter: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(np.arange(1, len(per_pos) + 1), per_pos, color="tab:blue")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted) per round")
    ax.set_ylim(0, 1)
    ax.set_title(f"{drafter}: acceptance by position")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
