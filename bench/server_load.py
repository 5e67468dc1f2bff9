"""Server under load: the OpenAI-compatible server (FastAPI + uvicorn) with closed-loop streaming clients.

    python -m bench.server_load [--concurrency 1,16,64,256] [--requests-per-client 4] [--max-tokens 16]

Starts `python -m serve.server` as its own process on 127.0.0.1 (a port it picks) over a small random
target saved to a temp dir (or `--target DIR`), waits for it, then for each concurrency level C runs C
client threads, each sending streamed /v1/completions requests back to back (closed loop) until the
level's request count is done or its time bound passes. Per level: requests/s, generated tokens/s,
time to first token (TTFT) and inter-token latency (ITL: the gap between two streamed chunks divided
over the tokens of the later chunk) at p50/p99, and errors (non-200 answers, resets, timeouts,
streams without [DONE] or with the wrong token count; the goal is 0). Then the same levels through
the official `openai` async client with n = 2 choices and logprobs on (`--no-openai-client` skips
them). Writes bench/results/server_load.{json,md,png}.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from bench.common import command_line, load_average, log, machine_info, md_table, pyplot, save_figure, write_results

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a small random Qwen3-style target: the server stack, not the model, is what this measures
TINY_SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def export_random_target(out_dir: str, seed: int = 0) -> str:
    """Save a random `TINY_SHAPE` target as a Hugging Face checkpoint directory."""
    from flax import nnx

    from specjax import checkpoints
    from specjax.config import TargetConfig
    from specjax.models.decoder import CausalLM

    cfg = TargetConfig(**TINY_SHAPE)
    checkpoints.export_target(CausalLM(cfg, rngs=nnx.Rngs(seed)), cfg, out_dir)
    return out_dir


def start_server(target: str, args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    """`python -m serve.server` on 127.0.0.1, port 0; returns (process, port) once it is warm."""
    slots = args.max_num_seqs
    cmd = [sys.executable, "-m", "serve.server", "--target", target, "--port", "0", "--served-model-name", "bench",
           "--max-num-seqs", str(slots), "--max-model-len", str(args.max_model_len), "--max-prefill", "32",
           "--prefill-buckets", "32", "--slots-buckets", ",".join(str(s) for s in sorted({4, slots}) if s <= slots),
           "--max-waiting", str(args.max_waiting)]
    if args.drafter:
        cmd += ["--drafter", args.drafter, "--tokens-buckets", "1,5"]
    else:
        cmd += ["--tokens-buckets", "1"]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline, port = time.time() + 600, None
    while time.time() < deadline and proc.poll() is None:  # the port is printed first, "ready" after warm-up
        line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        port = int(m.group(1)) if m else port
        if port is not None and "specjax server: ready" in line:
            return proc, port
    proc.kill()
    raise RuntimeError(f"the server did not start (exit {proc.poll()}): {' '.join(cmd)}")


def one_request(port: int, prompt: list[int], max_tokens: int, timeout: float) -> dict[str, Any]:
    """One streamed completion; its timings (seconds from sending) or its error."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        chunks: list[tuple[float, int]] = []  # (arrival, tokens in the chunk)
        done = False
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break
            ev = json.loads(payload)
            if "error" in ev:
                return {"error": f"stream error: {ev['error'].get('message')}"}
            n = len(ev["choices"][0]["token_ids"]) if ev.get("choices") else 0
            if n:
                chunks.append((time.perf_counter() - t0, n))
        tokens = sum(n for _, n in chunks)
        if not done or tokens != max_tokens:
            return {"error": f"incomplete stream: done={done}, {tokens} of {max_tokens} tokens"}
        itl = [(t1 - t0_) / n for (t0_, _), (t1, n) in zip(chunks, chunks[1:]) for _ in range(n)]
        return {"ttft": chunks[0][0], "e2e": time.perf_counter() - t0, "tokens": tokens, "itl": itl}
    except (OSError, http.client.HTTPException, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()


def run_level(port: int, clients: int, n_requests: int, max_tokens: int, prompt_len: int, bound_s: float,
              timeout: float, vocab_size: int = TINY_SHAPE["vocab_size"]) -> dict[str, Any]:
    """`clients` closed-loop client threads sharing `n_requests` requests (stops early at `bound_s`);
    prompts are random token ids in [3, vocab_size)."""
    lock = threading.Lock()
    issued = [0]
    results: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    deadline = t_start + bound_s

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        while True:
            with lock:
                if issued[0] >= n_requests or time.perf_counter() > deadline:
                    return
                issued[0] += 1
            prompt = [int(t) for t in rng.integers(3, vocab_size, size=prompt_len)]
            r = one_request(port, prompt, max_tokens, timeout)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    load0 = load_average()[0]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline - time.perf_counter(), 0) + timeout + 5)
    wall = time.perf_counter() - t_start
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = np.array([r["ttft"] for r in ok]) * 1e3
    itl = np.array([x for r in ok for x in r["itl"]]) * 1e3
    tokens = sum(r["tokens"] for r in ok)
    pct = lambda a, q: float(np.percentile(a, q)) if a.size else float("nan")  # noqa: E731
    return {"clients": clients, "requests": len(results), "completed": len(ok), "errors": len(errors),
            "error_examples": sorted(set(errors))[:5], "unfinished_threads": sum(t.is_alive() for t in threads),
            "wall_s": round(wall, 3), "requests_per_s": len(ok) / wall, "tokens_per_s": tokens / wall,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
            "load_1min": [load0, load_average()[0]]}


def run_openai_level(port: int, clients: int, n_requests: int, max_tokens: int, prompt_len: int, bound_s: float,
                     timeout: float, n: int = 2, logprobs: int = 1, model: str = "bench",
                     vocab_size: int = TINY_SHAPE["vocab_size"]) -> dict[str, Any]:
    """The same closed loop through the official `openai` async client: `clients` asyncio tasks on one
    event loop, streamed completions with `n` choices and `logprobs` on. TTFT and ITL are per choice
    (its first token; the gaps between its chunks over their tokens); an answer missing a choice's
    tokens or logprobs is an error."""
    import asyncio

    import openai

    async def main() -> tuple[list[dict[str, Any]], float]:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                    timeout=timeout)
        issued, results = [0], []
        t_start = time.perf_counter()
        deadline = t_start + bound_s

        async def one(prompt: list[int]) -> dict[str, Any]:
            t0 = time.perf_counter()
            chunks: dict[int, list[tuple[float, int]]] = {i: [] for i in range(n)}
            try:
                stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                         temperature=0, n=n, logprobs=logprobs, stream=True)
                async for ev in stream:
                    for ch in ev.choices:
                        k = len(ch.model_extra.get("token_ids") or [])
                        if ch.logprobs is None or len(ch.logprobs.token_logprobs) != k:
                            return {"error": "a chunk without its tokens' logprobs"}
                        if k:
                            chunks[ch.index].append((time.perf_counter() - t0, k))
            except openai.OpenAIError as e:
                return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            tokens = [sum(k for _, k in c) for c in chunks.values()]
            if tokens != [max_tokens] * n:
                return {"error": f"incomplete stream: {tokens} of {max_tokens} tokens per choice"}
            itl = [(t1 - t0_) / k for c in chunks.values() for (t0_, _), (t1, k) in zip(c, c[1:]) for _ in range(k)]
            return {"ttft": [c[0][0] for c in chunks.values()], "tokens": sum(tokens), "itl": itl}

        async def client_task(k: int) -> None:
            rng = np.random.default_rng(k)
            while issued[0] < n_requests and time.perf_counter() <= deadline:
                issued[0] += 1
                results.append(await one([int(t) for t in rng.integers(3, vocab_size, size=prompt_len)]))

        await asyncio.gather(*(client_task(k) for k in range(clients)))
        await client.close()
        return results, time.perf_counter() - t_start

    results, wall = asyncio.run(main())
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = np.array([x for r in ok for x in r["ttft"]]) * 1e3
    itl = np.array([x for r in ok for x in r["itl"]]) * 1e3
    pct = lambda a, q: float(np.percentile(a, q)) if a.size else float("nan")  # noqa: E731
    return {"clients": clients, "n": n, "logprobs": logprobs, "requests": len(results), "completed": len(ok),
            "errors": len(errors), "error_examples": sorted(set(errors))[:5], "wall_s": round(wall, 3),
            "requests_per_s": len(ok) / wall, "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99)}


def markdown(levels: list[dict[str, Any]], meta: dict[str, Any], sdk_levels: list[dict[str, Any]] = ()) -> str:
    rows = [[lv["clients"], f"{lv['completed']}/{lv['requests']}", f"{lv['requests_per_s']:.1f}",
             f"{lv['tokens_per_s']:.0f}", f"{lv['ttft_ms_p50']:.1f}", f"{lv['ttft_ms_p99']:.1f}",
             f"{lv['itl_ms_p50']:.2f}", f"{lv['itl_ms_p99']:.2f}", lv["errors"],
             f"{lv['load_1min'][0]:.1f}..{lv['load_1min'][1]:.1f}"] for lv in levels]
    table = md_table(["clients", "done/sent", "req/s", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                      "ITL p99 ms", "errors", "load 1-min"], rows)
    total_err = sum(lv["errors"] for lv in levels)
    return (f"# Server under load\n\nCommand: `{meta['command']}`\n\n"
            f"`python -m serve.server` (FastAPI + uvicorn, one continuous-batching engine thread) on 127.0.0.1 "
            f"in its own process; {meta['model']}; {meta['engine']}. Closed loop: each client thread sends "
            f"streamed completions ({meta['prompt_len']}-token random prompts, max_tokens {meta['max_tokens']}, "
            f"greedy) back to back on fresh connections; client threads run in the benchmark process on the "
            f"same 2 CPUs as the server. TTFT is measured from sending to the first streamed token; ITL "
            f"is the gap between streamed chunks divided over the chunk's tokens. Goal: 0 errors at every "
            f"level ({'met' if total_err == 0 else f'NOT met: {total_err} errors'}).\n\n" + table + sdk_table(sdk_levels))


def sdk_table(levels: list[dict[str, Any]]) -> str:
    """The `openai` async client levels (n choices, logprobs on), or nothing when none ran."""
    if not levels:
        return ""
    rows = [[lv["clients"], f"{lv['completed']}/{lv['requests']}", f"{lv['requests_per_s']:.1f}",
             f"{lv['tokens_per_s']:.0f}", f"{lv['ttft_ms_p50']:.1f}", f"{lv['ttft_ms_p99']:.1f}",
             f"{lv['itl_ms_p50']:.2f}", f"{lv['itl_ms_p99']:.2f}", lv["errors"]] for lv in levels]
    return (f"\nThe same load through the official `openai` async client (one event loop, one task per client), "
            f"n = {levels[0]['n']} choices per request and logprobs = {levels[0]['logprobs']}; TTFT and ITL per "
            f"choice; tok/s counts both choices.\n\n"
            + md_table(["clients", "done/sent", "req/s", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                        "ITL p99 ms", "errors"], rows))


def plot(levels: list[dict[str, Any]], path: str) -> None:
    plt = pyplot()
    c = [lv["clients"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(c, [lv["requests_per_s"] for lv in levels], "o-", label="requests/s")
    ax2 = axes[0].twinx()
    ax2.plot(c, [lv["tokens_per_s"] for lv in levels], "s--", color="C1", label="tokens/s")
    axes[0].set_ylabel("requests/s")
    ax2.set_ylabel("tokens/s")
    axes[0].set_title("throughput")
    for ax, key, title in ((axes[1], "ttft", "time to first token"), (axes[2], "itl", "inter-token latency")):
        ax.plot(c, [lv[f"{key}_ms_p50"] for lv in levels], "o-", label="p50")
        ax.plot(c, [lv[f"{key}_ms_p99"] for lv in levels], "s--", label="p99")
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
    save_figure(fig, path)


def _int_list(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=_int_list, default=[1, 16, 64, 256], help="client counts, e.g. 1,16,64")
    p.add_argument("--requests-per-client", type=int, default=4, help="requests per level = this x clients")
    p.add_argument("--min-requests", type=int, default=32, help="at least this many requests per level")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--level-seconds", type=float, default=120.0, help="time bound per level")
    p.add_argument("--request-timeout", type=float, default=120.0, help="client timeout per request")
    p.add_argument("--target", default=None, help="checkpoint directory (default: a random tiny target)")
    p.add_argument("--drafter", default="ngram", help='drafter ("" for plain decoding)')
    p.add_argument("--max-num-seqs", type=int, default=16, help="engine slots")
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--max-waiting", type=int, default=512)
    p.add_argument("--out-dir", default=os.path.join("bench", "results"))
    p.add_argument("--no-openai-client", dest="openai_client", action="store_false",
                   help="skip the levels through the openai async client (n=2, logprobs on)")
    args = p.parse_args(argv)
    if args.prompt_len + args.max_tokens > args.max_model_len:
        p.error("--prompt-len + --max-tokens must fit --max-model-len")

    tmp = tempfile.TemporaryDirectory(prefix="specjax-bench-server-")
    target = args.target or export_random_target(os.path.join(tmp.name, "target"))
    model = (f"target {os.path.basename(os.path.normpath(args.target))}" if args.target else
             "random target ({hidden_size} hidden, {num_hidden_layers} layers, vocab {vocab_size})".format(**TINY_SHAPE))
    engine = (f"{args.max_num_seqs} slots, {'drafter ' + args.drafter if args.drafter else 'plain decoding'}, "
              f"waiting-queue limit {args.max_waiting}")
    log(f"starting the server ({model}; {engine})")
    proc, port = start_server(target, args)
    levels, sdk_levels = [], []
    try:
        one_request(port, [5, 6, 7], args.max_tokens, args.request_timeout)  # first request: warm paths
        for c in args.concurrency:
            n = max(args.min_requests, args.requests_per_client * c)
            log(f"{c} clients, {n} requests")
            lv = run_level(port, c, n, args.max_tokens, args.prompt_len, args.level_seconds, args.request_timeout)
            log(f"  {lv['completed']}/{lv['requests']} ok, {lv['requests_per_s']:.1f} req/s, "
                f"{lv['tokens_per_s']:.0f} tok/s, TTFT p50 {lv['ttft_ms_p50']:.1f} ms p99 {lv['ttft_ms_p99']:.1f} ms, "
                f"ITL p50 {lv['itl_ms_p50']:.1f} ms p99 {lv['itl_ms_p99']:.1f} ms, errors {lv['errors']}")
            levels.append(lv)
        if args.openai_client:
            for c in args.concurrency:
                n = max(args.min_requests, args.requests_per_client * c)
                log(f"openai client: {c} clients, {n} requests, n=2, logprobs on")
                lv = run_openai_level(port, c, n, args.max_tokens, args.prompt_len, args.level_seconds,
                                      args.request_timeout)
                log(f"  {lv['completed']}/{lv['requests']} ok, {lv['tokens_per_s']:.0f} tok/s, TTFT p50 "
                    f"{lv['ttft_ms_p50']:.1f} ms p99 {lv['ttft_ms_p99']:.1f} ms, ITL p50 {lv['itl_ms_p50']:.1f} ms "
                    f"p99 {lv['itl_ms_p99']:.1f} ms, errors {lv['errors']}")
                sdk_levels.append(lv)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        tmp.cleanup()
    meta = {"command": command_line("bench.server_load", argv), "model": model, "engine": engine,
            "max_tokens": args.max_tokens, "prompt_len": args.prompt_len}
    result = {"benchmark": "server_load", **meta, "levels": levels, "openai_client_levels": sdk_levels,
              "server_exit_code": rc, "errors_total": sum(lv["errors"] for lv in levels + sdk_levels),
              "machine": machine_info()}
    md = markdown(levels, meta, sdk_levels)
    print(md)
    write_results("server_load", result, md, out_dir=args.out_dir, plot=lambda path: plot(levels, path))
    return 0 if result["errors_total"] == 0 and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
