"""Command-line options shared by the serving programs (`specjax.cli.serve`, `specjax.cli.batch`, `serve.profile`)."""
from __future__ import annotations

import argparse
from typing import Any


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return vals


def _variant_list(text: str) -> tuple[str, ...]:
    from specjax.sampling import VARIANTS
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in VARIANTS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected names from {','.join(VARIANTS)}, got {text!r}")
    return names


def add_llm_args(p: argparse.ArgumentParser) -> None:
    """Target, drafter and engine shape options."""
    from specjax.decoding.engine_config import SCHEDULING_POLICIES
    g = p.add_argument_group("model and engine")
    g.add_argument("--target", default=None, help="target: a Hugging Face directory (Qwen3, Llama, Qwen2)"
                   " or a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--engine-config", default=None,
                   help="EngineConfig YAML (configs/serve/*.yaml); replaces the engine shape options below")
    g.add_argument("--drafter", default=None, help='"ngram", a shipped drafter name, or a drafter directory')
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the target's)")
    g.add_argument("--max-num-seqs", type=int, default=8, help="cache slots (requests decoded together)")
    g.add_argument("--max-model-len", type=int, default=1024, help="context length per slot")
    g.add_argument("--max-prefill", type=int, default=256, help="largest prefill chunk")
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="gamma (default: the drafter's)")
    g.add_argument("--policy", default=None, help="verification policy (default: fixed, plain without drafter)")
    g.add_argument("--cost-table", default=None, help="cost table JSON for the confidence policies "
                   "(default: measured at start-up)")
    g.add_argument("--threshold", type=float, default=None, help="per-step confidence threshold (policy threshold)")
    g.add_argument("--dtype", default="float32", help="parameter dtype")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--slots-buckets", type=_int_list, default=None, help="e.g. 1,2,4,8 (last = max-num-seqs)")
    g.add_argument("--tokens-buckets", type=_int_list, default=None, help="tokens per slot buckets, e.g. 1,2,4,5")
    g.add_argument("--prefill-buckets", type=_int_list, default=None, help="prefill length buckets, e.g. 16,32")
    g.add_argument("--attention-buckets", type=_int_list, default=None,
                   help="cache rows a call attends to, e.g. 512,1024 (default: powers of two up to max-model-len)")
    g.add_argument("--sampling-variants", type=_variant_list, default=None,
                   help="round programs compiled per sampling kind, from greedy,plain,filtered (default: all)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most top log-probabilities a request may ask for (0: none computed, a little faster)")
    g.add_argument("--prediction-tokens", type=int, default=0,
                   help="serve OpenAI's predicted outputs (`prediction`) of up to this many tokens: each slot keeps "
                        "them and drafts them while the answer follows them (needs --drafter; ngram for predictions "
                        "and prompt lookup alone)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's prefix caching (default on): a freed slot keeps its cache rows, and a request whose "
                        "prompt begins with them (the next turn of a conversation, a shared system prompt) goes "
                        "there and prefills only the rest")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's chunked prefill (default on): a prompt longer than --max-prefill tokens takes one "
                        "prefill call per engine step after its first, so running requests keep decoding")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="vLLM's: fcfs starts waiting requests in arrival order; priority by each request's "
                        "`priority` (lower first, arrival order among equals), preempting running requests "
                        "they outrank (those continue when readmitted)")
    add_logit_rule_flags(g, "serve ")


def add_logit_rule_flags(group: Any, verb: str) -> None:
    """One --flag per opt-in logit rule (engine_config.LOGIT_RULES), its help `verb` + what it serves."""
    from specjax.decoding.engine_config import LOGIT_RULES
    from specjax.decoding.engine_config import EngineConfig
    for name, (_, serves) in LOGIT_RULES.items():
        group.add_argument("--" + name.replace("_", "-"), action="store_true", help=verb + serves)
    group.add_argument("--automaton-states", type=int, default=EngineConfig.automaton_states,
                       help="states of the automaton table with --guided-regex (int16 + 1 bit x vocab each; vLLM's "
                            "json_object takes ~1,600)")


def add_parser_flags(p: argparse.ArgumentParser) -> None:
    """--tool-call-parser: the tool-call format (`serving.tool_parsers.PARSERS`) that serves tool_choice
    "auto"; --reasoning-parser: the thinking format (`serving.reasoning.PARSERS`) answered as `reasoning`."""
    from specjax.serving.reasoning import PARSERS as REASONING_PARSERS
    from specjax.serving.tool_parsers import PARSERS
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="serve tool_choice \"auto\" (OpenAI's default with tools): read calls in this model "
                        "family's format from the answer (hermes: <tool_call> JSON blocks, Qwen2.5 / Qwen3; "
                        "llama3_json: JSON objects the answer begins with, Llama 3.1-3.3)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="answer chat's thinking (<think> ... </think>: Qwen3, QwQ, DeepSeek-R1) apart from the "
                        "content, as the message's `reasoning` (vLLM's; also `reasoning_content`)")


def logit_rule_args(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed `add_logit_rule_flags` as EngineConfig / LLM keyword arguments (automaton_states
    with --guided-regex only)."""
    from specjax.decoding.engine_config import LOGIT_RULES
    out: dict[str, Any] = {name: getattr(args, name) for name in LOGIT_RULES}
    if out["guided_regex"]:
        out["automaton_states"] = args.automaton_states
    return out


def build_llm(args: argparse.Namespace, *, progress: bool = False) -> Any:
    """An `specjax.LLM` from parsed `add_llm_args` options."""
    from specjax.api import LLM
    from specjax.decoding.engine import EngineConfig

    engine_config = None
    if args.engine_config:
        from specjax.config import load_yaml
        engine_config = load_yaml(EngineConfig, args.engine_config)
    elif (args.slots_buckets or args.tokens_buckets or args.prefill_buckets or args.attention_buckets
          or args.sampling_variants):
        policy = args.policy or ("plain" if args.drafter is None else "fixed")
        engine_config = EngineConfig(
            max_slots=args.max_num_seqs, max_len=args.max_model_len, gamma=args.num_speculative_tokens,
            policy=policy, max_prefill=args.max_prefill, seed=args.seed, threshold=args.threshold,
            slots_buckets=args.slots_buckets,
            tokens_buckets=args.tokens_buckets, prefill_buckets=args.prefill_buckets, max_logprobs=args.max_logprobs,
            attention_buckets=args.attention_buckets, prediction_tokens=args.prediction_tokens,
            prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
            chunked_prefill=args.enable_chunked_prefill, **logit_rule_args(args),
            **({"sampling_variants": args.sampling_variants} if args.sampling_variants else {}))
    return LLM(target=args.target, drafter=args.drafter, tokenizer=args.tokenizer, max_num_seqs=args.max_num_seqs,
               max_model_len=args.max_model_len, num_speculative_tokens=args.num_speculative_tokens,
               policy=args.policy, dtype=args.dtype, seed=args.seed, max_prefill=args.max_prefill,
               engine_config=engine_config, progress=progress, cost_table=args.cost_table,
               threshold=args.threshold, max_logprobs=args.max_logprobs, prediction_tokens=args.prediction_tokens,
               enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
               enable_chunked_prefill=args.enable_chunked_prefill, **logit_rule_args(args))
