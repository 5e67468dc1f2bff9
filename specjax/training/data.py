"""Training data (host side: numpy, tokenizers): chat loss masks (`assistant_loss_mask`,
`completion_loss_mask`), fixed-shape batches (`bucket_length`, `pad_batch`, `collate_block_batch`)
and `EpochBatches` (resumable epochs of global batches).

The block layout of DSpark/DFlash training (anchors, labels, positions, attention mask) is the
drafter's: `specjax.drafters.block_layout`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

# ------------------------------------------------------------------------------------------------
# chat / completion loss masks (host side)


def _check_conversation(conversation: Any) -> list[dict[str, str]]:
    if not isinstance(conversation, Sequence) or isinstance(conversation, (str, bytes)):
        raise ValueError("conversation must be a list of {'role', 'content'} messages")
    out = []
    for i, m in enumerate(conversation):
        if not isinstance(m, Mapping):
            raise ValueError(f"conversation[{i}] must be a mapping with 'role' and 'content'")
        for field in ("role", "content"):
            if not isinstance(m.get(field), str):
                raise ValueError(f"conversation[{i}].{field} must be a string, got {m.get(field)!r}")
        out.append(dict(m))
    return out


def _check_tokenizer(tokenizer: Any) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("tokenizer must be a fast (Rust-backed) tokenizer: offsets are needed")


def _render(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool,
            enable_thinking: bool | None) -> str:
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
    if not isinstance(text, str):
        raise ValueError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
    return text


def _try_render(tokenizer: Any, messages: list[dict[str, str]], **kw: Any) -> str | None:
    try:
        return _render(tokenizer, messages, **kw)
    except Exception:  # a template may reject a partial conversation (e.g. empty or assistant-first)
        return None


def assistant_char_spans(tokenizer: Any, conversation: list[dict[str, str]], *,
                         enable_thinking: bool | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation; return (text, [(start, end)) character spans of the assistant turns]).

    A span starts right after the assistant header (the end of the rendered generation prompt for
    the preceding messages) and ends after the end-of-turn marker (what the template writes after
    the content). Found by rendering message prefixes; when the template renders a turn differently
    once later messages follow (e.g. Qwen3 drops earlier think blocks), the turn's content is
    located in the full text instead and the marker is taken from the prefix rendering.
    """
    full = _render(tokenizer, conversation, add_generation_prompt=False,
                   enable_thinking=enable_thinking)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(conversation):
        if msg["role"] != "assistant":
            continue
        before = _try_render(tokenizer, conversation[:i], add_generation_prompt=True,
                             enable_thinking=enable_thinking)
        through = _try_render(tokenizer, conversation[:i + 1], add_generation_prompt=False,
                              enable_thinking=enable_thinking)
        start = len(before) if before is not None and full.startswith(before) and \
            len(before) >= cursor else None
        if start is not None and through is not None and full.startswith(through) and \
                len(through) > start:
            end = len(through)
        else:
            content = msg["content"]
            pos, key = -1, content
            for key in (content, content.strip()):
                pos = full.find(key, start if start is not None else cursor)
                if pos >= 0:
                    break
            if pos < 0:
                raise ValueError(f"conversation[{i}]: assistant content not found in the text "
                                 "rendered by the chat template")
            if start is None:
                start = pos
            content_end = pos + len(key)
            suffix = ""
            if through is not None and key:
                j = through.rfind(key)
                if j >= 0:
                    suffix = through[j + len(key):]
            end = content_end + len(suffix) if suffix and full.startswith(suffix, content_end) \
                else content_end
        spans.append((start, end))
        cursor = end
    return full, spans


def _mask_from_spans(offsets_t2: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for tokens whose character range overlaps a span (empty tokens: start inside a span)."""
    a = offsets_t2[:, 0][:, None]
    b = offsets_t2[:, 1][:, None]
    if not spans:
        return np.zeros(len(offsets_t2), np.uint8)
    s = np.asarray([sp[0] for sp in spans])[None, :]
    e = np.asarray([sp[1] for sp in spans])[None, :]
    hit = ((a < e) & (b > s)) | ((a == b) & (a >= s) & (a < e))
    return hit.any(axis=1).astype(np.uint8)


def _tokenize_with_mask(tokenizer: Any, text: str, spans: list[tuple[int, int]], max_length: int,
                        ) -> tuple[np.ndarray, np.ndarray]:
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], np.int32)
    offsets = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
    mask = _mask_from_spans(offsets, spans)
    return ids[:max_length], mask[:max_length]


def assistant_loss_mask(tokenizer: Any, conversation: list[dict[str, str]], *,
                        enable_thinking: bool | None = None, max_length: int = 4096,
                        system_prompt: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise a chat with the tokenizer's own template; mask the assistant turns.

    Returns (input_ids int32 [S], loss_mask uint8 [S]), S <= max_length (truncated). The mask is 1
    on every token of an assistant turn after its header, through the end-of-turn marker inclusive.
    `enable_thinking` is passed to the template only when not None. `system_prompt` is prepended as
    a system message when the conversation has none (DeepSpec's Qwen recipe uses
    "You are a helpful assistant.").
    """
    _check_tokenizer(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat_template; use completion_loss_mask for plain text")
    conv = _check_conversation(conversation)
    if system_prompt is not None and not any(m["role"] == "system" for m in conv):
        conv = [{"role": "system", "content": system_prompt}] + conv
    text, spans = assistant_char_spans(tokenizer, conv, enable_thinking=enable_thinking)
    return _tokenize_with_mask(tokenizer, text, spans, max_length)


def completion_loss_mask(tokenizer: Any, prompt: str, completion: str, *, max_length: int = 4096,
                         add_eos: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise prompt + completion (+ EOS); the mask covers the completion and the EOS token.

    Returns (input_ids int32 [S], loss_mask uint8 [S]).
    """
    _check_tokenizer(tokenizer)
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ValueError("prompt and completion must be strings")
    eos = ""
    if add_eos:
        eos = getattr(tokenizer, "eos_token", None) or ""
        if not eos:
            raise ValueError("tokenizer has no eos_token; pass add_eos=False")
    text = prompt + completion + eos
    return _tokenize_with_mask(tokenizer, text, [(len(prompt), len(text))], max_length)


# ------------------------------------------------------------------------------------------------
# fixed-shape batches (host side)


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n."""
    if not buckets:
        raise ValueError("buckets must be a non-empty list of lengths")
    for b in sorted(int(x) for x in buckets):
        if b >= n:
            return b
    raise ValueError(f"length {n} exceeds the largest bucket {max(buckets)}")


def pad_batch(seqs: Sequence[Any], bucket: int, *, pad_value: int = 0, rows: int | None = None,
              dtype: Any = None) -> np.ndarray:
    """Right-pad 1-D sequences to `bucket` columns (and to `rows` rows if given) -> [rows, bucket]."""
    arrs = [np.asarray(s) for s in seqs]
    for i, a in enumerate(arrs):
        if a.ndim != 1:
            raise ValueError(f"seqs[{i}] must be 1-D, got shape {a.shape}")
        if len(a) > bucket:
            raise ValueError(f"seqs[{i}] has length {len(a)} > bucket {bucket}")
    n_rows = len(arrs) if rows is None else rows
    if n_rows < len(arrs):
        raise ValueError(f"rows={rows} is smaller than the number of sequences {len(arrs)}")
    if dtype is None:
        dtype = np.result_type(*arrs) if arrs else np.int32
    out = np.full((n_rows, bucket), pad_value, dtype=dtype)
    for i, a in enumerate(arrs):
        out[i, :len(a)] = a
    return out


def collate_block_batch(samples: Sequence[Mapping[str, Any]], buckets: Sequence[int], *,
                        max_length: int | None = None, longest: int | None = None,
                        ) -> dict[str, np.ndarray]:
    """Right-pad samples (dicts with input_ids, loss_mask and, from a cache, taps and hidden)
    to the smallest bucket that fits the longest -> input_ids int32 [B,S], loss_mask uint8 [B,S],
    valid int32 [B] (+ taps [B,S,L*H], hidden [B,S,H] in their stored dtype). Padding has
    loss_mask 0, so it is never an anchor or a label (reference §6.3). `longest`: the longest
    sample of the global batch when these samples are one process's slice of it (all processes
    then pad to the same bucket)."""
    if not samples:
        raise ValueError("cannot collate an empty batch")
    cut = (lambda a: a[:max_length]) if max_length else (lambda a: a)
    ids = [cut(np.asarray(s["input_ids"])) for s in samples]
    n = max(len(a) for a in ids)
    if longest is not None:
        n = max(n, min(longest, max_length) if max_length else longest)
    s_pad = bucket_length(n, buckets)
    out = {"input_ids": np.zeros((len(ids), s_pad), np.int32),
           "loss_mask": np.zeros((len(ids), s_pad), np.uint8),
           "valid": np.asarray([len(a) for a in ids], np.int32)}
    for r, smp in enumerate(samples):
        k = len(ids[r])
        out["input_ids"][r, :k] = ids[r]
        out["loss_mask"][r, :k] = cut(np.asarray(smp["loss_mask"]))
    for name in ("taps", "hidden"):
        if name in samples[0]:
            first = np.asarray(samples[0][name])
            arr = np.zeros((len(ids), s_pad, first.shape[-1]), first.dtype)
            for r, smp in enumerate(samples):
                arr[r, :len(ids[r])] = cut(np.asarray(smp[name]))
            out[name] = arr
    return out


# ------------------------------------------------------------------------------------------------
# resumable epochs of global batches (host side)


class EpochBatches:
    """Global batches of `batch_size` samples over a deterministic per-epoch permutation.

    Epoch e uses `np.random.default_rng(seed + e).permutation(N)` (or 0..N-1 without shuffle) and
    yields floor(N / batch_size) batches (the remainder is dropped), then streams into epoch e+1.
    Position = {"epoch", "index"}: the next sample index into epoch e's order. `dataset` needs
    `__len__` and `__getitem__` (or `read(indices) -> list`); `collate(list) -> batch`.

    Data-parallel over processes: `rows` (`Trainer.process_rows(batch_size)`) are the positions of
    each global batch that this process reads and feeds; every process walks the same order. When
    the dataset has `lengths` (tokens per sample), the collate is called as
    `collate(items, longest=L)` with L the longest sample of the whole global batch, so that every
    process pads to the same shape. `global_batch_size` is then `batch_size` (None otherwise).
    """

    def __init__(self, dataset: Any, batch_size: int, *, seed: int = 42,
                 collate: Callable[..., Any] | None = None, shuffle: bool = True,
                 rows: Sequence[int] | None = None):
        n = len(dataset)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if n < batch_size:
            raise ValueError(f"the data set has {n} samples, fewer than one batch ({batch_size})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.collate = collate or (lambda xs: xs)
        self.steps_per_epoch = n // batch_size
        self.epoch = 0
        self.index = 0
        self._order: np.ndarray | None = None
        self._order_epoch = -1
        self.rows: np.ndarray | None = None
        self.global_batch_size: int | None = None
        self._lengths: np.ndarray | None = None
        if rows is not None:
            self.rows = np.asarray(rows, np.int64)
            if self.rows.ndim == 1 and not len(self.rows):
                raise ValueError("this process feeds no row of the global batch: the training "
                                 "mesh holds none of its devices (mesh sizes vs devices per host)")
            if self.rows.ndim != 1 or self.rows.min() < 0 or self.rows.max() >= batch_size:
                raise ValueError(f"rows must be positions in a batch of {batch_size}, got "
                                 f"{self.rows.tolist()}")
            self.global_batch_size = batch_size
            lengths = getattr(dataset, "lengths", None)
            self._lengths = None if lengths is None else np.asarray(lengths, np.int64)

    def order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = len(self.dataset)
            self._order = (np.random.default_rng(self.seed + epoch).permutation(n)
                           if self.shuffle else np.arange(n))
            self._order_epoch = epoch
        return self._order

    def position(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "index": int(self.index)}

    def restore(self, position: Mapping[str, int]) -> None:
        epoch, index = int(position["epoch"]), int(position["index"])
        if epoch < 0 or not 0 <= index <= self.steps_per_epoch * self.batch_size:
            raise ValueError(f"invalid data position {dict(position)}")
        self.epoch, self.index = epoch, index

    def next_indices(self) -> np.ndarray:
        if self.index + self.batch_size > self.steps_per_epoch * self.batch_size:
            self.epoch += 1
            self.index = 0
        idx = self.order(self.epoch)[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        return idx

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        idx = self.next_indices()
        mine = idx if self.rows is None else idx[self.rows]
        read = getattr(self.dataset, "read", None)
        items = read(list(mine)) if callable(read) else [self.dataset[int(i)] for i in mine]
        if self._lengths is not None:
            return self.collate(items, longest=int(self._lengths[idx].max()))
        return self.collate(items)
