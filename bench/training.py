"""Draft-training throughput: online target features vs a tensorstore cache, and cache sizes.

Times DSpark training steps on the embedded default target (SmolLM2-135M-Instruct; the
configs/embedded/dspark.yaml drafter) with the frozen target run inside each step (online) and with
features read from an offline cache built from the same samples; reports supervised tokens/s (real
tokens per step / step time). Also the cache bytes per token for that target and, from the formula,
for Qwen3-4B/8B/14B next to DeepSpec's, and random batch reads from a cache with and without a
tensorstore cache pool (`--reads-only` measures just these and updates them in an existing
bench/results/training.{json,md}).

    python -m bench.training [--steps 12] [--samples 96] [--read-samples 512]
    python -m bench.training --reads-only
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import time

import numpy as np

from bench.common import command_line, log, machine_info, md_table, pyplot, time_interleaved, write_results

QWEN3 = {"Qwen3-4B": (2560, 5), "Qwen3-8B": (4096, 5), "Qwen3-14B": (5120, 5)}  # hidden, tapped layers
# cache pools compared for random reads: none (tensorstore's default context: every read fetches
# the shard index again), one far smaller than the cache, and the reader's default
READ_POOLS = {"none (before)": 0, "1 MiB": 2**20, "64 MiB (default)": None}
READS_BEGIN, READS_END = "<!-- random-reads -->", "<!-- /random-reads -->"


def _reads_cache(out_dir: str, n_samples: int, max_length: int = 256) -> dict:
    """A target cache for the read benchmark: the default target's (SmolLM2-135M-Instruct) features
    of the first user turns of the first `n_samples` shipped held-out prompts
    (specjax/assets/smollm2/prompts/heldout.jsonl), so it needs no prepared training data."""
    from specjax import checkpoints, default_target
    from specjax.io import read_jsonl
    from specjax.training import cache_build
    from specjax.training import features as feat

    path = default_target.gguf_path()
    target, tcfg = checkpoints.load_target(path, dtype="bfloat16")
    tok = checkpoints.load_tokenizer(path)
    rows = read_jsonl(default_target.heldout_prompts_path(), objects=True)[:n_samples]
    samples = []
    for row in rows:
        ids = np.asarray(tok(row["turns"][0], add_special_tokens=False)["input_ids"][:max_length], np.int32)
        samples.append((ids, np.ones_like(ids, np.uint8)))
    t0 = time.perf_counter()
    cache_build.build_cache(out_dir, target, samples, tap_layers=(1, 14, 27),
                            identity=feat.target_identity(path, tcfg))
    return {"samples": len(samples), "tokens": int(sum(len(s[0]) for s in samples)),
            "bytes_on_disk": feat.stored_tensor_bytes(out_dir), "build_s": time.perf_counter() - t0}


def _time_random_reads(cache_dir: str, batch: int, repeats: int) -> dict:
    """ms to read `batch` random samples (`TargetCache.read`) per pool of READ_POOLS: the same index
    sequence for each, timed round-robin so they share the background load; warm-up reads first."""
    from specjax.training import features as feat

    fns = {}
    for name, pool in READ_POOLS.items():
        cache, rng = feat.TargetCache(cache_dir, cache_pool_bytes=pool), np.random.default_rng(0)
        fns[name] = lambda c=cache, r=rng: c.read(r.integers(0, len(c), batch))
    timings = time_interleaved(fns, warmup=max(1, repeats // 4), repeats=repeats)
    return {name: {"cache_pool_bytes": READ_POOLS[name], "ms_median": 1e3 * t.median, "ms_min": 1e3 * t.min,
                   "load_1min": [t.load_before, t.load_after]} for name, t in timings.items()}


def measure_reads(n_samples: int, batch: int, repeats: int, command: str) -> dict:
    tmp = tempfile.mkdtemp(prefix="specjax-bench-reads-")
    try:
        log(f"reads: building a {n_samples}-sample cache")
        built = _reads_cache(tmp, n_samples)
        log(f"reads: {built['tokens']} tokens, {built['bytes_on_disk'] / 2**20:.0f} MiB; timing {repeats} batches")
        timings = _time_random_reads(tmp, batch, repeats)
        log("reads: " + ", ".join(f"{k} {v['ms_median']:.2f} ms" for k, v in timings.items()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"command": command, "batch": batch, "repeats": repeats, "cache": built, "pools": timings}


def reads_markdown(r: dict) -> str:
    """The random-reads block of training.md (between READS_BEGIN and READS_END)."""
    c = r["cache"]
    rows = [[k, f"{v['ms_median']:.2f}", f"{v['ms_min']:.2f}", f"{v['load_1min'][0]:.1f}"]
            for k, v in r["pools"].items()]
    return (f"{READS_BEGIN}\nRandom reads from an offline cache, with and without a tensorstore cache pool "
            f"(`TargetCache(cache_pool_bytes=...)`; data.cache_pool_bytes in training configs): "
            f"{r['repeats']} timed reads of {r['batch']} random samples per pool, round-robin, from a cache of "
            f"{c['samples']} samples ({c['tokens']} tokens, {c['bytes_on_disk'] / 2**20:.0f} MiB, sharded zarr; "
            f"the OS page cache holds it in every case). Measured with `{r['command']}`.\n\n"
            + md_table(["cache pool", "ms per batch (median)", "ms (min)", "load 1-min"], rows, "lrrr")
            + f"{READS_END}\n")


def _replace_reads(md: str, block: str) -> str:
    """`md` with its random-reads block replaced by `block` (appended when it has none)."""
    pat = re.compile(re.escape(READS_BEGIN) + ".*?" + re.escape(READS_END) + "\n?", re.S)
    return pat.sub(lambda _: block, md) if pat.search(md) else md.rstrip("\n") + "\n\n" + block


def update_reads(out_dir: str, reads: dict) -> None:
    """--reads-only: put new read numbers into an existing training.json / training.md."""
    paths = [os.path.join(out_dir, f"training.{ext}") for ext in ("json", "md")]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise SystemExit(f"--reads-only updates an existing result; missing {missing}: run bench.training first")
    with open(paths[0], encoding="utf-8") as f:
        result = json.load(f)
    with open(paths[1], encoding="utf-8") as f:
        md = f.read()
    result["random_reads"] = reads
    if READS_BEGIN not in md and "load" not in md.lower():  # docs showed the steps' load from the JSON
        md = md.rstrip("\n") + "\n\n" + _steps_load_line(result)
    write_results("training", result, _replace_reads(md, reads_markdown(reads)), out_dir=out_dir)


def _steps_load_line(result: dict) -> str:
    return f"1-minute load average when the training steps were measured: {result['machine']['load_average'][0]:.1f}.\n"


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
    ap.add_argument("--read-samples", type=int, default=512,
                    help="samples in the cache of the read benchmark (at most the shipped held-out prompts)")
    ap.add_argument("--read-batch", type=int, default=8, help="random samples per timed read")
    ap.add_argument("--read-repeats", type=int, default=60, help="timed reads per cache pool")
    ap.add_argument("--reads-only", action="store_true",
                    help="measure only the random reads; update them in an existing training.json/.md")
    ap.add_argument("--out-dir", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    reads = measure_reads(args.read_samples, args.read_batch, args.read_repeats,
                          command_line("bench.training", argv))
    if args.reads_only:
        update_reads(args.out_dir, reads)
        return
    from specjax import checkpoints, default_target
    from specjax.training import cache_build
    from specjax.training import features as feat
    from specjax.training.config import load_train_config
    from specjax.training.run import build

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
        cache_build.build_cache(tmp, target, samples, tap_layers=online.tap_layers,
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
    sizes = [[f"{default_target.NAME} (default target, {tcfg.num_hidden_layers} layers)", h, n_layers,
              feat.bytes_per_token(h, n_layers), "-"]]
    for name, (hh, ll) in QWEN3.items():
        sizes.append([name, hh, ll, feat.bytes_per_token(hh, ll), 6 + 2 * hh * (ll + 1)])
    machine = machine_info()
    md = (f"# Draft training throughput\n\nCommand: `{command_line('bench.training', argv)}`\n\n"
          f"DSpark drafter of `{args.config}` on the embedded target, batch {cfg.data.batch_size} x "
          f"{cfg.data.max_length} tokens, {cfg.model.section.num_anchors} anchors per sequence; {args.steps} timed steps.\n\n"
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
          + "\n" + _steps_load_line({"machine": machine}) + "\n" + reads_markdown(reads))

    def plot(path):
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(["online", "cache"], [res_online["tokens_per_s"], res_cache["tokens_per_s"]], color=["tab:blue", "tab:orange"])
        ax.set_ylabel("supervised tokens/s")
        ax.set_title("DSpark training throughput")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    write_results("training", {"machine": machine, "online": res_online, "cache": res_cache,
                               "cache_tokens": n_tokens, "cache_bytes_on_disk": on_disk, "sizes": sizes,
                               "random_reads": reads}, md,
                  out_dir=args.out_dir, plot=plot)


if __name__ == "__main__":
    main()
