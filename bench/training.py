"""Draft-training throughput: online target features vs a tensorstore cache, and cache sizes.

Times DSpark training steps on the embedded target (the configs/embedded/dspark.yaml drafter) with
the frozen target run inside each step (online) and with features read from an offline cache built
from the same samples; reports supervised tokens/s (real tokens per step / step time). Also the cache
bytes per token for our target and, from the formula, for Qwen3-4B/8B/14B next to DeepSpec's.

    python -m bench.training [--steps 12] [--samples 96]
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from bench.common import command_line, log, machine_info, md_table, pyplot, write_results

QWEN3 = {"Qwen3-4B": (2560, 5), "Qwen3-8B": (4096, 5), "Qwen3-14B": (5120, 5)}  # hidden, tapped layers


def _time_steps(run, steps: int) -> dict:
    trainer, data = run.trainer, run.data
    state = trainer.init_state()
    batch = next(data)
    state, _ = trainer.step(state, batch)  # compile
    tokens, times = 0, []
    for _ in range(steps):
        batch = next(data)
        t0 = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        float(metrics["loss"])
        times.append(time.perf_counter() - t0)
        tokens += int(np.asarray(batch["loss_mask"]).sum()) if "loss_mask" in batch else 0
    sec = float(np.sum(times))
    return {"steps": steps, "seconds": sec, "step_ms_median": 1e3 * float(np.median(times)),
            "supervised_tokens": tokens, "tokens_per_s": tokens / sec if sec else 0.0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/embedded/dspark.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--samples", type=int, default=96, help="samples in the cache built for the comparison")
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    from specjax import checkpoints
    from specjax.training import features as feat
    from specjax.training.config import load_train_config
    from train.train_draft import build

    cfg = load_train_config(args.config, [f"schedule.total_steps={args.steps + 1}"])
    log("online: building")
    online = build(cfg)
    res_online = _time_steps(online, args.steps)
    log(f"online: {res_online['tokens_per_s']:.0f} supervised tokens/s")

    tmp = tempfile.mkdtemp(prefix="specjax-bench-cache-")
    try:
        target, tcfg = checkpoints.load_target(cfg.model.target, dtype=cfg.model.target_dtype)
        tok = checkpoints.load_tokenizer(cfg.model.target)
        samples = feat.read_jsonl_samples(cfg.data.train_jsonl, tok, max_length=cfg.data.max_length,
                                          min_loss_tokens=cfg.data.min_loss_tokens)[:args.samples]
        t0 = time.perf_counter()
        report = feat.build_cache(tmp, target, samples, tap_layers=online.tap_layers,
                                  identity=feat.target_identity(cfg.model.target, tcfg))
        build_s = time.perf_counter() - t0
        n_tokens = int(sum(len(s[0]) for s in samples))
        on_disk = feat.stored_tensor_bytes(tmp)
        log(f"cache: {n_tokens} tokens, {on_disk / n_tokens:.0f} bytes/token on disk, built in {build_s:.1f}s")
        cached_cfg = load_train_config(args.config, [f"schedule.total_steps={args.steps + 1}", "data.mode=cache",
                                                     f"data.cache_dir={tmp}"])
        cached = build(cached_cfg)
        res_cache = _time_steps(cached, args.steps)
        log(f"cache: {res_cache['tokens_per_s']:.0f} supervised tokens/s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    h, n_layers = tcfg.hidden_size, len(online.tap_layers)
    sizes = [["specjax pystd target (ours)", h, n_layers, feat.bytes_per_token(h, n_layers), "-"]]
    for name, (hh, ll) in QWEN3.items():
        sizes.append([name, hh, ll, feat.bytes_per_token(hh, ll), 6 + 2 * hh * (ll + 1)])
    md = (f"# Draft training throughput\n\nCommand: `{command_line('bench.training', argv)}`\n\n"
          f"DSpark drafter of `{args.config}` on the embedded target, batch {cfg.data.batch_size} x "
          f"{cfg.data.max_length} tokens, {cfg.model.num_anchors} anchors per sequence; {args.steps} timed steps.\n\n"
          + md_table(["features", "step ms (median)", "supervised tokens/s"],
                     [["online (target inside the step)", f"{res_online['step_ms_median']:.0f}",
                       f"{res_online['tokens_per_s']:.0f}"],
                      ["offline tensorstore cache", f"{res_cache['step_ms_median']:.0f}",
                       f"{res_cache['tokens_per_s']:.0f}"]], "lrr")
          + f"\nCache of {len(samples)} samples ({n_tokens} tokens): {on_disk / n_tokens:.0f} bytes/token on disk "
            f"(formula {feat.bytes_per_token(h, n_layers)}), built in {build_s:.1f} s.\n\n"
          + "Cache bytes per token (ours: 5 + 2H(L+1): ids, loss mask, bf16 taps, bf16 final hidden; DeepSpec's "
            "6 + 2H(L+1) also stores an all-ones attention mask):\n\n"
          + md_table(["model", "H", "L (taps)", "specjax bytes/token", "DeepSpec bytes/token"], sizes, "lrrrr")
          )

    def plot(path):
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(["online", "cache"], [res_online["tokens_per_s"], res_cache["tokens_per_s"]], color=["tab:blue", "tab:orange"])
        ax.set_ylabel("supervised tokens/s")
        ax.set_title("DSpark training throughput")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    write_results("training", {"machine": machine_info(), "online": res_online, "cache": res_cache,
                               "cache_tokens": n_tokens, "cache_bytes_on_disk": on_disk, "sizes": sizes}, md,
                  out_dir=args.out_dir, plot=plot)


if __name__ == "__main__":
    main()
