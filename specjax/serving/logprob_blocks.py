"""The shapes log-probabilities take in responses: OpenAI's `logprobs` object (chat's `content`
list, completions' parallel lists) and vLLM's `prompt_logprobs` list. Entries are the engine's
(log-probability, top ids, their log-probabilities); -inf (a token outside top-k / top-p, or one a
logit rule bans) is sent as -9999, vLLM's value (JSON has no infinities)."""
from __future__ import annotations

from typing import Any, Sequence

LOGPROB_FLOOR = -9999.0
Entry = tuple[float, list[int], list[float]]


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token's text (`token_id:N` without a tokenizer)."""
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])


def _num(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


def logprobs_block(tokenizer: Any, ids: Sequence[int], entries: Sequence[Entry | None], chat: bool,
                   text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's `logprobs` object for tokens `ids` and their `entries` (None: a first prompt token,
    echoed without a log-probability): chat's `content`; completions' `tokens`, `token_logprobs`,
    `top_logprobs` and `text_offset` (where each token's text starts in the tokens' texts joined,
    from `text_offset`)."""
    if chat:
        def item(t: int, lp: float) -> dict[str, Any]:
            text = token_text(tokenizer, t)
            return {"token": text, "logprob": _num(lp), "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(t, lp), "top_logprobs": [item(u, v) for u, v in zip(top_ids, top_lps)]}
                            for t, (lp, top_ids, top_lps) in zip(ids, entries)]}
    tokens = [token_text(tokenizer, t) for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": [None if e is None else _num(e[0]) for e in entries],
            "top_logprobs": [None if e is None else {token_text(tokenizer, u): _num(v) for u, v in zip(e[1], e[2])}
                             for e in entries],
            "text_offset": offsets}


def prompt_logprobs_list(tokenizer: Any, ids: Sequence[int], entries: Sequence[Entry], ranks: Sequence[int],
                         k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then for each later token a dict
    from token id (a string) to {logprob, rank (1 = the most likely), decoded_token}: the prompt's
    own token and the top `k` alternatives (ranked 1..k)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for t, (lp, top_ids, top_lps), rank in zip(ids[1:], entries, ranks):
        d = {str(t): {"logprob": _num(lp), "rank": int(rank), "decoded_token": token_text(tokenizer, t)}}
        for j, (u, v) in enumerate(zip(top_ids[:k], top_lps[:k])):
            d.setdefault(str(u), {"logprob": _num(v), "rank": j + 1, "decoded_token": token_text(tokenizer, u)})
        out.append(d)
    return out
