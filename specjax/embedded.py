"""The embedded default: a tiny Qwen3-architecture target trained on the Python standard library.

Everything here is what `python -m train.pretrain_target` uses to (re)build the shipped assets under
`specjax/assets/pystd/`, and what the rest of the library uses to find them:

    assets/pystd/split.json               modules of the train / held-out split, Python version, rule
    assets/pystd/target/                  config.json, model.safetensors (bf16), tokenizer files,
                                          generation_config.json, training.json (how it was made)
    assets/pystd/prompts/heldout.jsonl    completion prompts from held-out modules
    assets/pystd/prompts/train_prompts.jsonl   prompts from training modules (drafter data)
    assets/pystd/drafters/<name>/         drafters trained for this target (other programs)

Corpus: the running interpreter's standard-library `.py` files (`sysconfig.get_paths()["stdlib"]`)
without site-packages, test packages (`test/`, `tests/`, `idle_test/`), idlelib, turtledemo,
generated files (codec tables made by gencodec.py, pydoc topics, sysconfig data) and files over
200 kB. The split is by top-level module name with a fixed hash rule (`SPLIT_RULE`), so it is the
same on every machine; the recorded lists in split.json take precedence by module name (a module
that a newer Python adds falls back to the rule).

Tokenizer: byte-level BPE (the `tokenizers` library) trained on the training split, 2044 learned
tokens + 4 special tokens appended after them: `<|endoftext|>` (EOS and document separator),
`<|im_start|>`, `<|im_end|>` (ChatML template) and `<|mask|>` (the DSpark mask token; never seen in
training, so its embedding row stays near its random initialisation). The ids are in
`special_token_ids()`; the files load with `transformers.AutoTokenizer` offline.

Target size. CausalLM with hidden 256, 6 layers, 4 query / 2 kv heads of 64, SwiGLU 768,
vocab 2048, tied embeddings, RoPE theta 1e4, 1024 positions: 5.25 M params, 10.5 MB in bfloat16
(a 7th layer would pass 12 MB). Measured on this project's 2-core CPU machine (XLA CPU, float32,
batch 1, jitted step against a 512-slot KV cache, 25th percentile of 300 calls while other jobs
ran): one decode token 1.12 ms and an 8-token verify 2.44 ms, against 0.25 / 0.38 ms for a
one-layer model of the same width (a one-layer drafter's order of cost), so the target's forward
dominates a speculative round. Narrower targets are cheaper to train but lose that margin
(hidden 192: 0.52 ms, hidden 128: 0.46 ms for the same 6 layers, 2.9-3.7x a one-layer step).
Serving computes in float32: bfloat16 decode steps were ~2x slower on this CPU (3.2 vs 1.5 ms).

Training (configs/embedded/target.yaml): next-token cross-entropy on rows of 512 tokens (the
documents joined with `<|endoftext|>`; 512 rather than 256 so that prompt + completion positions
stay inside the trained range), 8 rows per step, AdamW (b2 0.95, weight decay 0.1, clip 1.0),
peak lr 2e-3 with 5% warmup and cosine decay, 3000 steps (12.3 M tokens, 4.7 epochs of the 2.6 M
training tokens). bfloat16 compute with float32 master weights: faster for training on this CPU.
On the idle 2-core machine a step takes ~1.1 s (55 min in all; ~4 s when three other jobs share
the machine); the run and its losses are recorded in `target/training.json`. The shipped target
reaches 1.77 / 2.59 nats per token (train / held-out modules) against a unigram entropy of 6.36
and an in-sample bigram entropy of 3.88. An earlier 240-step run (1 M tokens) stopped at 5.23
held-out and its greedy completions repeated themselves.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import sys
import sysconfig
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from specjax.config import ConfigError, TargetConfig, from_dict, load_yaml, read_json, to_dict
from specjax.io import JsonlError, iter_jsonl

ASSET_NAME = "pystd"
DRAFTER_NAMES = ("dspark", "dspark-rnn", "dflash", "eagle3", "mtp1", "standalone")
PROMPT_SETS = ("heldout", "train")

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN)

# Plain ChatML (no default system prompt); `add_generation_prompt` opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

SPLIT_SALT = "pystd-split-v1"
HELDOUT_PER_MILLE = 80
SPLIT_RULE = (f"heldout iff int(sha256('{SPLIT_SALT}:' + module).hexdigest()[:8], 16) % 1000 < "
              f"{HELDOUT_PER_MILLE}, module = top-level module or package name")

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "idlelib", "turtledemo", "__pycache__", "lib-dynload"})
GENERATED_FILES = frozenset({"pydoc_data/topics.py"})
GENERATED_PREFIXES = ("_sysconfigdata",)
GENERATED_MARKERS = ("gencodec.py",)  # charmap codec tables ("generated ... with gencodec.py")
MAX_FILE_BYTES = 200_000


# ------------------------------------------------------------------------------------------------
# asset paths


def assets_root() -> pathlib.Path:
    """The package's `specjax/assets` directory."""
    return pathlib.Path(__file__).resolve().parent / "assets"


def asset_dir(name: str = ASSET_NAME) -> str:
    """`specjax/assets/<name>`."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"invalid asset name {name!r}")
    return str(assets_root() / name)


def target_dir(name: str = ASSET_NAME) -> str:
    """The embedded target's Hugging Face checkpoint directory (also holds the tokenizer)."""
    return os.path.join(asset_dir(name), "target")


def tokenizer_dir(name: str = ASSET_NAME) -> str:
    """The tokenizer files' directory (the target directory)."""
    return target_dir(name)


def drafter_dir(drafter: str, name: str = ASSET_NAME) -> str:
    """`specjax/assets/<name>/drafters/<drafter>` for a drafter in DRAFTER_NAMES."""
    if drafter not in DRAFTER_NAMES:
        raise ValueError(f"unknown embedded drafter {drafter!r}; known: {', '.join(DRAFTER_NAMES)}")
    return os.path.join(asset_dir(name), "drafters", drafter)


def prompts_path(which: str = "heldout", name: str = ASSET_NAME) -> str:
    """JSONL of completion prompts: "heldout" (evaluation) or "train" (drafter data)."""
    if which not in PROMPT_SETS:
        raise ValueError(f"prompt set must be one of {PROMPT_SETS}, got {which!r}")
    fname = "heldout.jsonl" if which == "heldout" else "train_prompts.jsonl"
    return os.path.join(asset_dir(name), "prompts", fname)


def split_path(name: str = ASSET_NAME) -> str:
    """The recorded train / held-out split (`split.json`)."""
    return os.path.join(asset_dir(name), "split.json")


def special_token_ids(path: str | os.PathLike | None = None) -> dict[str, int]:
    """{token: id} of SPECIAL_TOKENS from a `tokenizer.json` (default: the embedded target's)."""
    path = os.fspath(path) if path is not None else target_dir()
    file = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
    data = read_json(file)
    found = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
    missing = [t for t in SPECIAL_TOKENS if t not in found]
    if missing:
        raise ConfigError(f"{file}: special token(s) {missing} not found in added_tokens")
    return {t: found[t] for t in SPECIAL_TOKENS}


def mask_token_id(path: str | os.PathLike | None = None) -> int:
    """The id of `<|mask|>` (the DSpark mask token) in the embedded tokenizer."""
    return special_token_ids(path)[MASK_TOKEN]


# ------------------------------------------------------------------------------------------------
# corpus


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One standard-library file: `path` is posix-style, relative to the stdlib root."""

    module: str
    path: str
    text: str


def stdlib_root() -> pathlib.Path:
    """The running interpreter's standard-library directory."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    return "{}.{}.{}".format(*sys.version_info[:3])


def module_of(relpath: str) -> str:
    """Top-level module / package name of a stdlib-relative path ('json/decoder.py' -> 'json')."""
    first = pathlib.PurePosixPath(relpath).parts[0]
    return first[:-3] if first.endswith(".py") else first


def _excluded_dir(part: str) -> bool:
    return part in EXCLUDED_DIRS or part.startswith("config-") or part.startswith(".")


def _is_generated(relpath: str, text: str) -> bool:
    name = pathlib.PurePosixPath(relpath).name
    if relpath in GENERATED_FILES or name.startswith(GENERATED_PREFIXES):
        return True
    head = text[:1000]
    return any(m in head for m in GENERATED_MARKERS)


def iter_corpus(root: str | os.PathLike | None = None) -> Iterator[SourceFile]:
    """Stdlib `.py` files in sorted path order, without tests, IDLE, generated or huge files.

    Files that are not valid UTF-8 are skipped.
    """
    root = pathlib.Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"standard-library directory not found: {root}")
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = pathlib.Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if not _excluded_dir(d))
        if any(_excluded_dir(p) for p in rel_dir.parts):
            continue
        paths += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    for rel in sorted(paths):
        file = root / rel
        if file.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or _is_generated(rel, text):
            continue
        yield SourceFile(module_of(rel), rel, text)


def collect_corpus(root: str | os.PathLike | None = None) -> list[SourceFile]:
    """All corpus files (see `iter_corpus`)."""
    return list(iter_corpus(root))


# ------------------------------------------------------------------------------------------------
# split


def rule_is_heldout(module: str) -> bool:
    """The fixed hash rule (`SPLIT_RULE`): is `module` held out?"""
    h = hashlib.sha256(f"{SPLIT_SALT}:{module}".encode()).hexdigest()
    return int(h[:8], 16) % 1000 < HELDOUT_PER_MILLE


@dataclasses.dataclass(frozen=True)
class Split:
    """Train / held-out module names, the Python version they were listed on, and the rule."""

    train: tuple[str, ...]
    heldout: tuple[str, ...]
    python_version: str
    rule: str = SPLIT_RULE
    stats: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        both = sorted(set(self.train) & set(self.heldout))
        if both:
            raise ConfigError(f"split: module(s) {both[:8]} are in both train and heldout")

    def side(self, module: str) -> str:
        """"train" or "heldout": the recorded lists first, else the rule (modules new to them)."""
        if module in self.heldout:
            return "heldout"
        if module in self.train:
            return "train"
        return "heldout" if rule_is_heldout(module) else "train"

    def to_json(self) -> dict[str, Any]:
        return {"python_version": self.python_version, "rule": self.rule,
                "train": list(self.train), "heldout": list(self.heldout),
                "stats": dict(self.stats)}


def make_split(files: Sequence[SourceFile]) -> Split:
    """Split the corpus's modules with the hash rule; stats count files and characters per side."""
    modules = sorted({f.module for f in files})
    held = tuple(m for m in modules if rule_is_heldout(m))
    train = tuple(m for m in modules if not rule_is_heldout(m))
    return Split(train, held, python_version(), SPLIT_RULE, _split_stats(files, train, held))


def _split_stats(files: Sequence[SourceFile], train: Sequence[str], held: Sequence[str],
                 ) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for side, mods in (("train", set(train)), ("heldout", set(held))):
        sel = [f for f in files if f.module in mods]
        stats[side] = {"modules": len(mods), "files": len(sel),
                       "chars": sum(len(f.text) for f in sel)}
    return stats


def save_split(split: Split, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(split.to_json(), f, indent=1)
        f.write("\n")


def load_split(path: str | os.PathLike | None = None) -> Split:
    """The recorded split (default: the embedded assets' split.json)."""
    path = os.fspath(path) if path is not None else split_path()
    d = read_json(path)
    for k in ("train", "heldout", "python_version"):
        if k not in d:
            raise ConfigError(f"{path}: missing field '{k}'")
    for k in ("train", "heldout"):
        if not isinstance(d[k], list) or not all(isinstance(m, str) for m in d[k]):
            raise ConfigError(f"{path}: field '{k}' must be a list of module names")
    try:
        return Split(tuple(d["train"]), tuple(d["heldout"]), str(d["python_version"]),
                     str(d.get("rule", SPLIT_RULE)), dict(d.get("stats", {})))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def resolve_split(files: Sequence[SourceFile], recorded: Split | None = None) -> Split:
    """The split of the present corpus: `recorded` decides by module name (the rule decides for
    modules it does not list); without one, `make_split`. Stats are recomputed."""
    if recorded is None:
        return make_split(files)
    modules = sorted({f.module for f in files})
    train = tuple(m for m in modules if recorded.side(m) == "train")
    held = tuple(m for m in modules if recorded.side(m) == "heldout")
    same = (train, held) == (tuple(recorded.train), tuple(recorded.heldout))
    return Split(train, held, recorded.python_version if same else python_version(),
                 recorded.rule, _split_stats(files, train, held))


def split_files(files: Sequence[SourceFile], split: Split,
                ) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train files, held-out files) by each file's module."""
    train = [f for f in files if split.side(f.module) == "train"]
    held = [f for f in files if split.side(f.module) == "heldout"]
    return train, held


# ------------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048):
    """A byte-level BPE `tokenizers.Tokenizer` with vocab_size - 4 learned tokens (256 byte tokens
    included) and SPECIAL_TOKENS appended after them (so `<|mask|>` is id vocab_size - 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    n_learned = vocab_size - len(SPECIAL_TOKENS)
    if n_learned < 256 + 1:
        raise ValueError(f"vocab_size must be > {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_learned, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    got = tok.get_vocab_size()
    if got != n_learned:
        raise ValueError(f"BPE training produced {got} tokens, expected {n_learned} "
                         f"(corpus too small?)")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(tok: Any, out_dir: str | os.PathLike, *, model_max_length: int = 1024) -> None:
    """Write tokenizer.json, tokenizer_config.json (eos, ChatML chat_template) and
    special_tokens_map.json so `transformers.AutoTokenizer.from_pretrained(out_dir)` loads it."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    decoder = {}
    for t in SPECIAL_TOKENS:
        i = tok.token_to_id(t)
        decoder[str(i)] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN],
        "mask_token": MASK_TOKEN,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "model_max_length": int(model_max_length),
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    specials = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "mask_token": MASK_TOKEN,
                "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN]}
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(specials, f, indent=1)


def write_generation_config(out_dir: str | os.PathLike, eos_token_id: int, *,
                            pad_token_id: int | None = None) -> None:
    """`generation_config.json` (greedy by default, EOS = `<|endoftext|>`)."""
    data = {"eos_token_id": int(eos_token_id),
            "pad_token_id": int(eos_token_id if pad_token_id is None else pad_token_id),
            "do_sample": False, "transformers_version": _transformers_version()}
    with open(os.path.join(os.fspath(out_dir), "generation_config.json"), "w") as f:
        json.dump(data, f, indent=1)


def _transformers_version() -> str:
    try:
        from importlib.metadata import version
        return version("transformers")
    except Exception:  # noqa: BLE001 - metadata is optional here
        return "unknown"


# ------------------------------------------------------------------------------------------------
# training data


def encode_documents(tok: Any, texts: Sequence[str], *, batch: int = 256) -> list[np.ndarray]:
    """Token ids (int32) of each text with a `tokenizers.Tokenizer` (no special tokens added)."""
    out: list[np.ndarray] = []
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(list(texts[i:i + batch]), add_special_tokens=False):
            out.append(np.asarray(enc.ids, np.int32))
    return out


def pack_documents(docs: Sequence[np.ndarray], seq_len: int, eos_id: int) -> np.ndarray:
    """Documents joined with `eos_id` (one after each) and cut into rows int32 [N, seq_len];
    the incomplete last row is dropped."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if not docs:
        raise ValueError("no documents to pack")
    eos = np.asarray([eos_id], np.int32)
    stream = np.concatenate([x for d in docs for x in (np.asarray(d, np.int32), eos)])
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"{len(stream)} tokens are fewer than one row of {seq_len}")
    return stream[:n * seq_len].reshape(n, seq_len)


class PackedRows:
    """Dataset of packed rows for `EpochBatches`: item i is {"input_ids": int32 [S]}."""

    def __init__(self, rows_ns: np.ndarray):
        self.rows = np.asarray(rows_ns, np.int32)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.rows[i]

    def read(self, indices: Sequence[int]) -> list[np.ndarray]:
        return list(self.rows[np.asarray(indices, np.int64)])


def collate_rows(items: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Stack packed rows -> {"input_ids": int32 [B, S]}."""
    return {"input_ids": np.stack([np.asarray(x, np.int32) for x in items])}


def lm_loss(model: Any, batch: Mapping[str, Any], rng: Any = None, aux: Any = None):
    """Next-token cross-entropy over packed rows: predict ids[:, 1:] from ids[:, :-1].

    Trainer loss signature `(model, batch, rng, aux) -> (loss, metrics)`; float32 log-softmax.
    """
    import jax
    import jax.numpy as jnp

    del rng, aux
    ids = jnp.asarray(batch["input_ids"], jnp.int32)  # [B, S]
    b, s = ids.shape
    positions = jnp.broadcast_to(jnp.arange(s - 1, dtype=jnp.int32), (b, s - 1))
    logits = model.forward(ids[:, :-1], positions).logits  # [B, S-1, V] float32
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    loss = jnp.mean(nll)
    acc = jnp.mean((jnp.argmax(logits, axis=-1) == ids[:, 1:]).astype(jnp.float32))
    return loss, {"accuracy": acc}


def evaluate_loss(model: Any, rows_ns: np.ndarray, *, batch_size: int = 16) -> dict[str, float]:
    """Mean next-token CE (nats/token) and top-1 accuracy of `model` over packed rows."""
    import jax
    from flax import nnx

    if len(rows_ns) == 0:
        raise ValueError("no rows to evaluate")
    graphdef, state = nnx.split(model)

    @jax.jit
    def one(state, ids):
        m = nnx.merge(graphdef, state)
        loss, metrics = lm_loss(m, {"input_ids": ids})
        return loss, metrics["accuracy"]

    tot_loss = tot_acc = 0.0
    n = 0
    for i in range(0, len(rows_ns) - batch_size + 1, batch_size):
        loss, acc = jax.device_get(one(state, rows_ns[i:i + batch_size]))
        tot_loss += float(loss)
        tot_acc += float(acc)
        n += 1
    if n == 0:  # fewer rows than one batch: one smaller batch
        loss, acc = jax.device_get(one(state, rows_ns))
        tot_loss, tot_acc, n = float(loss), float(acc), 1
    return {"loss": tot_loss / n, "accuracy": tot_acc / n, "rows": n * min(batch_size, len(rows_ns))}


def greedy_generate(model: Any, prompt_ids: Sequence[int], max_new_tokens: int, *,
                    eos_token_id: int | None = None, max_len: int | None = None) -> list[int]:
    """Greedy continuation of one prompt with the target's KV cache (prefill padded to a power of
    two, then one-token decode steps); stops after `eos_token_id` (included) or max_new_tokens."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    n = len(prompt_ids)
    if n == 0:
        raise ValueError("prompt_ids must not be empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    p = max(16, 1 << (n - 1).bit_length())
    limit = max_len or model.config.max_position_embeddings
    if n + max_new_tokens > limit:
        raise ValueError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceed {limit} positions")
    cache = model.init_cache(1, max(p, n + max_new_tokens))
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, cache, tokens_bt, positions_bt, valid_b):
        m = nnx.merge(graphdef, state)
        out = m.forward(tokens_bt, positions_bt, cache, valid_b, logits="last")
        return jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32), out.cache

    toks = np.zeros((1, p), np.int32)
    toks[0, :n] = np.asarray(prompt_ids, np.int32)
    nxt, cache = run(state, cache, toks, np.arange(p, dtype=np.int32)[None], np.asarray([n], np.int32))
    out = [int(nxt[0])]
    while len(out) < max_new_tokens and (eos_token_id is None or out[-1] != eos_token_id):
        pos = np.asarray([[n + len(out) - 1]], np.int32)
        nxt, cache = run(state, cache, np.asarray([[out[-1]]], np.int32), pos,
                         np.asarray([1], np.int32))
        out.append(int(nxt[0]))
    return out


# ------------------------------------------------------------------------------------------------
# prompts


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A completion prompt and where it came from."""

    prompt: str
    module: str
    path: str
    kind: str  # "def" (a signature + docstring) or "file_head" (the first lines of a file)
    name: str = ""

    def to_json(self) -> dict[str, str]:
        d = {"prompt": self.prompt, "module": self.module, "path": self.path, "kind": self.kind}
        if self.name:
            d["name"] = self.name
        return d


def _def_prompts(f: SourceFile, lines: list[str], tree: ast.Module) -> Iterator[Prompt]:
    """Function / method signature + docstring prompts (methods get their class header line)."""
    def emit(node: ast.AST, header: str, qual: str) -> Prompt | None:
        body = getattr(node, "body", [])
        if not body or not isinstance(body[0], ast.Expr):
            return None
        doc = body[0].value
        if not (isinstance(doc, ast.Constant) and isinstance(doc.value, str)):
            return None
        if getattr(node, "decorator_list", None):
            start = min(d.lineno for d in node.decorator_list)
        else:
            start = node.lineno
        end = body[0].end_lineno
        if len(body) < 2 or end is None:  # a docstring-only function has nothing to complete
            return None
        text = header + "".join(lines[start - 1:end])
        if not text.endswith("\n"):
            return None
        return Prompt(text, f.module, f.path, "def", qual)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            p = emit(node, "", node.name)
            if p:
                yield p
        elif isinstance(node, ast.ClassDef):
            first = lines[node.lineno - 1] if node.lineno - 1 < len(lines) else ""
            if node.decorator_list or not first.rstrip().endswith(":"):
                continue  # multi-line or decorated class header: no clean one-line context
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    p = emit(sub, first, f"{node.name}.{sub.name}")
                    if p:
                        yield p


def _file_head_prompt(f: SourceFile, lines: list[str], n_tokens: Callable[[str], int],
                      target_tokens: int, max_tokens: int) -> Prompt | None:
    """The first lines of a file, cut at a line boundary once >= target_tokens tokens."""
    text = ""
    for ln in lines:
        cand = text + ln
        if n_tokens(cand) > max_tokens:
            break
        text = cand
        if n_tokens(text) >= target_tokens and ln.strip() == "":
            break
    if not text.endswith("\n") or n_tokens(text) < 16 or len(text.strip().splitlines()) < 3:
        return None
    if len(f.text[len(text):].strip()) < 40:  # (almost) the whole file: nothing left to complete
        return None
    return Prompt(text, f.module, f.path, "file_head")


def extract_prompts(files: Sequence[SourceFile], n_tokens: Callable[[str], int], *,
                    max_tokens: int = 200, min_tokens: int = 12, head_tokens: int = 96,
                    ) -> list[Prompt]:
    """All candidate prompts of `files`: each function / method with a docstring and a body
    (signature line(s) + docstring, ending with a newline) and each file's first lines; prompts
    outside [min_tokens, max_tokens] tokens (by `n_tokens`) are dropped; duplicates removed."""
    out: list[Prompt] = []
    seen: set[str] = set()
    for f in files:
        try:
            tree = ast.parse(f.text)
        except (SyntaxError, ValueError):
            continue
        lines = f.text.splitlines(keepends=True)
        cands = list(_def_prompts(f, lines, tree))
        head = _file_head_prompt(f, lines, n_tokens, head_tokens, max_tokens)
        if head:
            cands.append(head)
        for p in cands:
            if p.prompt in seen or not min_tokens <= n_tokens(p.prompt) <= max_tokens:
                continue
            seen.add(p.prompt)
            out.append(p)
    return out


def _stable_key(p: Prompt, salt: str) -> str:
    return hashlib.sha256(f"{salt}:{p.path}:{p.name}:{p.kind}".encode()).hexdigest()


def select_prompts(cands: Sequence[Prompt], n: int, *, per_file: int = 4, head_fraction: float = 0.2,
                   max_module_fraction: float = 0.4, salt: str = "pystd-prompts-v1") -> list[Prompt]:
    """A deterministic, diverse subset of min(n, len(cands)) prompts: first at most `per_file` per
    file and `max_module_fraction * n` per module (about `head_fraction` of them file heads), then
    without the per-file cap, then without any cap if still too few. Candidates are visited in a
    hash order independent of the input order."""
    if n <= 0:
        return []
    order = sorted(cands, key=lambda p: _stable_key(p, salt))
    heads = [p for p in order if p.kind == "file_head"]
    defs = [p for p in order if p.kind != "file_head"]
    module_cap = max(1, int(max_module_fraction * n))
    per_file_n: dict[str, int] = {}
    per_module_n: dict[str, int] = {}
    chosen: list[Prompt] = []
    taken: set[int] = set()

    def take(pool: list[Prompt], limit: int, file_cap: int | None, mod_cap: int | None) -> None:
        for p in pool:
            if len(chosen) >= limit:
                return
            if id(p) in taken:
                continue
            if file_cap is not None and per_file_n.get(p.path, 0) >= file_cap:
                continue
            if mod_cap is not None and per_module_n.get(p.module, 0) >= mod_cap:
                continue
            per_file_n[p.path] = per_file_n.get(p.path, 0) + 1
            per_module_n[p.module] = per_module_n.get(p.module, 0) + 1
            taken.add(id(p))
            chosen.append(p)

    take(heads, min(n, int(round(n * head_fraction))), per_file, module_cap)
    take(defs, n, per_file, module_cap)
    take(defs + heads, n, None, module_cap)
    take(defs + heads, n, None, None)
    return sorted(chosen, key=lambda p: _stable_key(p, salt + ":out"))


def write_jsonl(records: Iterable[Mapping[str, Any]], path: str | os.PathLike) -> int:
    """Write records one JSON object per line; returns the count."""
    n = 0
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n


def load_prompts(which: str = "heldout", name: str = ASSET_NAME) -> list[dict[str, Any]]:
    """The shipped prompt records (each has "prompt" and "module")."""
    return read_prompts(prompts_path(which, name))


def read_prompts(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Prompt records of a `{"prompt": ...}` JSONL file (other fields kept)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"prompt file not found: {path}")
    out = []
    try:
        for row in iter_jsonl(path):
            if not isinstance(row.value, dict) or not isinstance(row.value.get("prompt"), str):
                raise ConfigError(f"{path}:{row.line}: each line needs a string field 'prompt'")
            out.append(row.value)
    except JsonlError as e:
        raise ConfigError(str(e)) from None
    return out


# ------------------------------------------------------------------------------------------------
# the pre-training recipe (configs/embedded/target.yaml)


@dataclasses.dataclass(frozen=True)
class PretrainModel:
    """Target architecture (TargetConfig fields; vocab_size comes from the tokenizer)."""

    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """Tokenizer, target and training hyper-parameters of the embedded target."""

    model: PretrainModel = PretrainModel()
    vocab_size: int = 2048
    seq_len: int = 256
    batch_size: int = 32
    total_steps: int = 600
    learning_rate: float = 2.5e-3
    warmup_ratio: float = 0.05
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    b2: float = 0.95
    compute_dtype: str = "float32"
    seed: int = 0
    save_every: int = 100
    log_every: int = 10
    heldout_prompts: int = 160
    train_prompts: int = 1000
    prompt_max_tokens: int = 200
    export_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "float" and isinstance(v, str):  # YAML 1.1 reads '2e-3' as a string
                try:
                    object.__setattr__(self, f.name, float(v))
                except ValueError:
                    raise ConfigError(f"field '{f.name}' must be a number, got {v!r}") from None
            elif f.type == "float" and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ConfigError(f"field '{f.name}' must be a number, got {v!r}")
        for n in ("vocab_size", "seq_len", "batch_size", "total_steps", "save_every", "log_every",
                  "prompt_max_tokens"):
            if getattr(self, n) <= 0:
                raise ConfigError(f"field '{n}' must be > 0, got {getattr(self, n)!r}")
        if self.seq_len > self.model.max_position_embeddings:
            raise ConfigError(f"field 'seq_len' ({self.seq_len}) exceeds "
                              f"model.max_position_embeddings ({self.model.max_position_embeddings})")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"field 'compute_dtype' must be float32 or bfloat16, got "
                              f"{self.compute_dtype!r}")
        if not self.learning_rate > 0:
            raise ConfigError(f"field 'learning_rate' must be > 0, got {self.learning_rate!r}")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            raise ConfigError(f"field 'warmup_ratio' must be in [0, 1], got {self.warmup_ratio!r}")
        if self.export_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"field 'export_dtype' must be float32 or bfloat16, got "
                              f"{self.export_dtype!r}")

    def target_config(self, vocab_size: int, eos_token_id: int) -> TargetConfig:
        m = self.model
        return TargetConfig(
            vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
            num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
            rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=True,
            max_position_embeddings=m.max_position_embeddings, eos_token_ids=(eos_token_id,))


def load_pretrain_config(path: str | os.PathLike | None = None,
                         overrides: Mapping[str, Any] | None = None) -> PretrainConfig:
    """The recipe from YAML (default: built-in defaults), with top-level field overrides."""
    cfg = load_yaml(PretrainConfig, path) if path is not None else PretrainConfig()
    if overrides:
        data = to_dict(cfg)
        data.update({k: v for k, v in overrides.items() if v is not None})
        cfg = from_dict(PretrainConfig, data, source=os.fspath(path) if path else "overrides")
    return cfg


def machine_description() -> dict[str, Any]:
    """Host facts recorded with a training run."""
    return {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or "unknown", "cpu_count": os.cpu_count(),
            "python": python_version()}


__all__ = [
    "ASSET_NAME", "CHAT_TEMPLATE", "DRAFTER_NAMES", "EOS_TOKEN", "IM_END_TOKEN", "IM_START_TOKEN",
    "MASK_TOKEN", "PROMPT_SETS", "SPECIAL_TOKENS", "SPLIT_RULE", "asset_dir", "assets_root",
    "collate_rows", "collect_corpus", "drafter_dir", "encode_documents", "evaluate_loss",
    "extract_prompts", "greedy_generate", "iter_corpus", "lm_loss", "load_pretrain_config",
    "load_prompts", "load_split", "make_split", "mask_token_id", "module_of", "pack_documents",
    "PackedRows", "PretrainConfig", "PretrainModel", "Prompt", "prompts_path", "python_version",
    "read_prompts", "resolve_split", "rule_is_heldout", "save_split", "save_tokenizer",
    "select_prompts", "SourceFile", "special_token_ids", "Split", "split_files", "split_path",
    "stdlib_root", "target_dir", "tokenizer_dir", "train_tokenizer", "write_generation_config",
    "write_jsonl",
]
