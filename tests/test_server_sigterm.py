"""`python -m serve.server` as a real process: SIGTERM with streams in flight lets them finish, refuses
new connections, and exits 0 (a tiny random target saved to a temp dir; ~15 s, most of it start-up)."""
from __future__ import annotations

import http.client
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

try:
    from tests.serving_fixtures import export_tiny_target, http_json, sse_events
except ImportError:  # tests/ itself on sys.path
    from serving_fixtures import export_tiny_target, http_json, sse_events

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_TOKENS = 400


def _stream(port: int, prompt: list[int], started: threading.Event, out: dict) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out["status"] = resp.status
    first = resp.readline() + resp.readline()  # "data: {...}\n" + "\n"
    started.set()
    out["body"] = first + resp.read()
    out["finished_at"] = time.monotonic()
    conn.close()


def test_sigterm_drains_in_flight_streams_and_refuses_new_connections(tmp_path):
    target = export_tiny_target(tmp_path / "target")
    cmd = [sys.executable, "-m", "serve.server", "--target", str(target), "--port", "0", "--max-num-seqs", "4",
           "--max-model-len", "512", "--max-prefill", "32", "--slots-buckets", "4", "--tokens-buckets", "1",
           "--prefill-buckets", "32", "--served-model-name", "tiny"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    err = open(tmp_path / "stderr.txt", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        port = None
        deadline = time.time() + 180
        ready = False
        while not ready and time.time() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else port
            if port is not None and m:  # bound before warm-up: not ready yet
                status, body = http_json(f"http://127.0.0.1:{port}/health")
                assert status in (200, 503) and body["status"] in ("ok", "starting"), body
            ready = "specjax server: ready" in line
        assert port is not None and ready, (tmp_path / "stderr.txt").read_text()[-3000:]
        assert http_json(f"http://127.0.0.1:{port}/health") == (200, {"status": "ok"})
        outs = [{} for _ in range(3)]
        starts = [threading.Event() for _ in outs]
        threads = [threading.Thread(target=_stream, args=(port, [5 + i, 6, 7], starts[i], outs[i]), daemon=True)
                   for i in range(len(outs))]
        for t in threads:
            t.start()
        assert all(s.wait(60) for s in starts), outs
        proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        refused_at = None
        while refused_at is None and time.monotonic() - sigterm_at < 30:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                time.sleep(0.02)
            except ConnectionRefusedError:
                refused_at = time.monotonic()
        assert refused_at is not None, "new connections were still accepted 30 s after SIGTERM"
        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()
    for out in outs:  # every stream in flight at SIGTERM ran to its end
        assert out["status"] == 200
        events = sse_events(out["body"])
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == MAX_TOKENS
    assert "stopped" in proc.stdout.read()
    # refused while the streams were still running (measured: ~0.02 s vs ~1.3 s after SIGTERM)
    assert refused_at < min(o["finished_at"] for o in outs)
