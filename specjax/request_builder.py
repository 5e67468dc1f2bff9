"""The engine requests the Python API, the server and batch jobs build from user input: prompt
encoding (text, chat template), left truncation, and `build_engine_request` (stop strings, bad
words, guides and predictions turned into token ids and automata)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from specjax.decoding.requests import EngineRequest
from specjax.serving.detokenize import StopStringChecker

if TYPE_CHECKING:
    from specjax.api import SamplingParams


def encode_text(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a prompt string (no special tokens added); ValueError without a tokenizer."""
    if tokenizer is None:
        raise ValueError("this target has no tokenizer files: pass prompts as lists of token ids")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt is empty" if isinstance(prompt, str) else
                         f"prompt must be a non-empty string, got {type(prompt).__name__}")
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], *, enable_thinking: bool | None = False,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of one conversation through the tokenizer's chat template: the generation prompt
    added, or (`continue_final_message`, vLLM's) the last message, an assistant's, left open so the
    answer continues it.

    Raises ValueError without a tokenizer, without a chat template, for malformed messages, or for
    both options at once or a continued message that is not the assistant's."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this target has none")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"messages[{i}] must be an object with a string 'role' and a 'content'")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                         "(set add_generation_prompt to false to continue the last message)")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise ValueError(f"continue_final_message continues an assistant message; the last message's role "
                         f"is {messages[-1]['role']!r}")
    kw: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    if continue_final_message:
        kw["continue_final_message"] = True
    if tools:
        kw["tools"] = list(tools)
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **kw)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def build_engine_request(prompt_ids: Sequence[int], sp: SamplingParams, *, request_id: str,
                         tokenizer: Any = None, vocab: int | None = None) -> EngineRequest:
    """An `EngineRequest` from token ids and sampling params; stop strings, bad words and guides
    need `tokenizer`, guided_regex / guided_json the target's `vocab` too (a GrammarError names the
    field of a pattern or schema that cannot guide)."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt is empty (no token ids)")
    stop_check = None
    texts = (("stop strings", sp.stop), ("bad_words", sp.bad_words), ("guided_choice", sp.guided_choice),
             ("guided_regex", sp.guided_regex), ("guided_json", sp.guided_json),
             ("a prediction text", isinstance(sp.prediction, str)))
    needs = [name for name, v in texts if v]
    if needs and tokenizer is None:
        raise ValueError(f"{needs[0]} need a tokenizer; this target has none")
    if sp.stop:
        stop_check = StopStringChecker(tokenizer, sp.stop, include=sp.include_stop_str_in_output)
    return EngineRequest(request_id=request_id, prompt_ids=ids, max_tokens=sp.max_tokens,
                         temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p, seed=sp.seed,
                         stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos, min_tokens=sp.min_tokens,
                         presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
                         repetition_penalty=sp.repetition_penalty, logit_bias=sp.logit_bias,
                         allowed_token_ids=sp.allowed_token_ids, bad_words=bad_word_ids(tokenizer, sp.bad_words),
                         guided_choice=tuple(dict.fromkeys(tuple(encode_text(tokenizer, c))
                                                           for c in sp.guided_choice or ())),
                         automaton=request_automaton(sp, tokenizer, vocab), stop_check=stop_check,
                         max_draft_tokens=sp.num_speculative_tokens, logprobs=sp.logprobs, priority=int(sp.priority),
                         prediction_ids=prediction_ids(tokenizer, sp.prediction))


def truncate_prompt(prompt_ids: Sequence[int], sp: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last `sp.truncate_prompt_tokens` ids (vLLM's left truncation; -1: the last
    max_model_len; None: all); ValueError naming the field when it exceeds max_model_len."""
    k = sp.truncate_prompt_tokens
    ids = [int(t) for t in prompt_ids]
    if k is None:
        return ids
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens is {k}; it must be at most max_model_len ({max_model_len}), "
                         f"or -1 for max_model_len")
    return ids[-(max_model_len if k == -1 else k):]


def prediction_ids(tokenizer: Any, prediction: str | tuple[int, ...] | None) -> tuple[int, ...]:
    """Token ids of a predicted output: its text's (no special tokens added) or the ids given."""
    if isinstance(prediction, str):
        return tuple(encode_text(tokenizer, prediction)) if prediction else ()
    return tuple(prediction or ())


def request_automaton(sp: SamplingParams, tokenizer: Any, vocab: int | None) -> Any:
    """The token automaton of `sp`'s guided_regex or guided_json (compiled once per tokenizer and
    pattern: `grammars.compiler`), or None."""
    if sp.guided_regex is None and sp.guided_json is None:
        return None
    from specjax import grammars
    if vocab is None:
        raise ValueError("guided_regex / guided_json need the target's vocabulary size")
    compiler = grammars.compiler(tokenizer, vocab)
    if sp.guided_regex is not None:
        return compiler.regex(sp.guided_regex)
    return compiler.json_schema(sp.guided_json, whitespace=sp.guided_whitespace_pattern)


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Token ids of bad words as vLLM reads them: each word with its leading spaces stripped, and
    again after one space when that gives as many tokens beginning with another one (the word
    inside a sentence)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode_text(tokenizer, word.lstrip()))
        spaced = tuple(encode_text(tokenizer, " " + word.lstrip()))
        out.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return tuple(out)
