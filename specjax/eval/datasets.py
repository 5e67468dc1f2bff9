"""Evaluation prompt files (reference §8.1): reading, capping, tokenising.

Datasets are JSONL files; the dataset name is the file stem (`gsm8k.jsonl` -> gsm8k). Rows are
`{"turns": [user turn, ...]}` (only the first turn is used; chat template with the generation
prompt, thinking off, no system prompt), `{"conversations": [{"role", "content"}, ...]}` (the first
user message, likewise) or `{"prompt": "..."}` (a plain completion prompt, no template). A file with
more rows than its cap is shuffled with `random.Random(980406)` and the first `cap` rows kept.
"""
from __future__ import annotations

import dataclasses
import os
import random
from typing import Any, Sequence

from specjax.io import iter_jsonl

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
    from specjax.request_builder import encode_chat, encode_text

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
