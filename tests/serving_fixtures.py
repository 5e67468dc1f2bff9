"""Shared helpers for the serving tests: a tiny random target, a small-bucket LLM, JSONL and HTTP helpers."""
from __future__ import annotations

import http.client
import json
import pathlib
from typing import Any
from urllib.parse import urlsplit

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def tiny_target(seed: int = 0):
    """A random tiny Qwen3 target: (model, TargetConfig)."""
    from flax import nnx

    from specjax.config import TargetConfig
    from specjax.models.decoder import CausalLM

    cfg = TargetConfig(**TINY)
    return CausalLM(cfg, rngs=nnx.Rngs(seed)), cfg


def tiny_engine_config(*, drafter: bool = True, max_slots: int = 4, max_len: int = 128):
    """Small buckets so that warm-up compiles only a few executables."""
    from specjax.decoding.engine import EngineConfig

    return EngineConfig(max_slots=max_slots, max_len=max_len, max_prefill=32, policy="fixed" if drafter else "plain",
                        slots_buckets=(max_slots,), tokens_buckets=(1, 5) if drafter else (1,),
                        prefill_buckets=(32,), max_logprobs=20)


def tiny_llm(*, drafter: str | None = "ngram", max_num_seqs: int = 4, max_model_len: int = 128, seed: int = 0):
    """An `LLM` over a tiny random target (token-id prompts only: no tokenizer)."""
    from specjax.api import LLM

    return LLM(target=tiny_target(seed), drafter=drafter, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
               max_prefill=32, engine_config=tiny_engine_config(drafter=drafter is not None, max_slots=max_num_seqs,
                                                                max_len=max_model_len))


def export_tiny_target(out_dir: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Save a tiny random target as a Hugging Face checkpoint directory (config.json + safetensors)."""
    from specjax import checkpoints

    model, cfg = tiny_target(seed)
    checkpoints.export_target(model, cfg, out_dir)
    return pathlib.Path(out_dir)


def tiny_chat_tokenizer(renamed: dict[int, str] | None = None, generation_prompt: str = "w9"):
    """A word-level fast tokenizer over the tiny vocabulary ("<unk>", "<s>", "</s>", "w3".."w63"; `renamed`:
    other words for some ids) with a chat template that joins the message contents and adds
    `generation_prompt` (a Jinja expression's text) as the generation prompt."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, TINY["vocab_size"])]
    for i, w in (renamed or {}).items():
        words[i] = w
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}" + generation_prompt + "{% endif %}")
    return fast


def write_jsonl(path: str | pathlib.Path, rows: list[Any]) -> None:
    """Rows may be dicts (dumped) or raw strings (written as-is, for malformed lines)."""
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def read_jsonl(path: str | pathlib.Path) -> list[dict[str, Any]]:
    p = pathlib.Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def http_request(url: str, method: str = "GET", body: Any = None, *, raw: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request -> (status, headers, body bytes). `body` is sent as JSON; `raw` as-is."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, u.path or "/", body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def http_json(url: str, method: str = "GET", body: Any = None, **kw: Any) -> tuple[int, Any]:
    status, _, data = http_request(url, method, body, **kw)
    return status, json.loads(data)


def sse_events(data: bytes) -> list[Any]:
    """Parse a Server-Sent Events body into JSON payloads; the literal "[DONE]" stays a string."""
    text = data.decode()
    assert text.endswith("\n\n"), "every SSE event must end with a blank line"
    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


_SHARED: dict[str, Any] = {}


def shared_tiny_llm():
    """One ngram-drafter tiny LLM per test process (warm-up is the slow part of every serving test).

    Users must leave its engine idle when done (stop any AsyncEngine over it)."""
    if "llm" not in _SHARED:
        _SHARED["llm"] = tiny_llm(drafter="ngram", max_num_seqs=4, max_model_len=128)
    llm = _SHARED["llm"]
    assert not llm.engine.has_work(), "a previous test left work in the shared engine"
    return llm
