"""Shared test helpers: tiny random targets, a bigram test drafter, exact continuation distributions."""
from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats

from specjax.config import TargetConfig
from specjax.decoding.engine import Engine, EngineConfig, EngineRequest
from specjax.sampling import SamplingArrays, probs_from_logits
from specjax.drafters.base import ContextUpdate, DraftBlock
from specjax.drafters.drafting import DraftGuide, draft_loop, loop_q
from specjax.models.decoder import CausalLM


# XLA's default CPU fusion emitters, as compiler options: `make test` compiles the tiny-model tests
# with the older emitters (the Makefile's TINY_XLA_FLAGS), which expand scatters into loops, so a
# test that inspects a compiled program as XLA builds it by default compiles it with these
DEFAULT_CPU_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
# XLA_FLAGS for a test's subprocess: one CPU device, cheap compilation (its numerics are not under test)
SUBPROCESS_XLA_FLAGS = ("--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0 "
                        "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false")


def tiny_target(vocab: int = 16, *, seed: int = 0, layers: int = 2, hidden: int = 32,
                init_scale: float = 1.0) -> CausalLM:
    cfg = TargetConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    m = CausalLM(cfg, rngs=nnx.Rngs(seed))
    if init_scale != 1.0:  # sharper distributions: more structure for the samplers to get right
        g, st = nnx.split(m)
        st = jax.tree.map(lambda x: x * init_scale if x.ndim == 2 else x, st)
        m = nnx.merge(g, st)
    return m


class BigramDrafter(nnx.Module):
    """A real (untrained) drafter for tests: q_k = f(previous sampled token) from a fixed random table.

    With `confidence=True` it also reports a confidence that depends on the previous sampled token (the
    structure of the paper's Appendix A counterexample).
    """

    tap_layers: tuple[int, ...] = ()
    needs_hidden = False

    def __init__(self, vocab: int, gamma: int, *, seed: int = 1, scale: float = 2.0, confidence: bool = False):
        self.gamma = gamma
        self.vocab = vocab
        key = jax.random.key(seed)
        self.table = nnx.Param(scale * jax.random.normal(key, (vocab, vocab)))
        self.conf_table = nnx.Param(jax.random.uniform(jax.random.fold_in(key, 1), (vocab,), minval=0.05,
                                                       maxval=0.95)) if confidence else None

    @property
    def has_confidence(self) -> bool:
        return self.conf_table is not None

    def init_state(self, slots: int, max_len: int):
        return jnp.zeros((slots,), jnp.int32)

    def commit(self, state, update: ContextUpdate):
        return state

    def restart(self, state, start_b):
        return state

    def propose(self, state, anchor_b, position_b, sampling: SamplingArrays, key_b, kv_len=None,
                guide: DraftGuide | None = None) -> DraftBlock:
        """A bigram block (no context state: kv_len is not needed), drawn by the library's drafting
        loop (`drafting.draft_loop`: under the rows' automata with a `guide`)."""
        def step(k, prev, draw):
            tok, q = draw(self.table[...][prev])
            conf = self.conf_table[...][prev] if self.conf_table is not None else jnp.ones_like(prev, jnp.float32)
            return tok, tok, {**({} if q is None else {"q": q}), "conf": conf}
        _, toks, outs = draft_loop(step, anchor_b.astype(jnp.int32), self.gamma, sampling, key_b, jnp.float32, guide)
        conf = outs["conf"] if self.conf_table is not None else None
        return DraftBlock(toks, loop_q(outs, toks, self.vocab, jnp.float32), conf)


def chain_drafter(vocab: int, gamma: int, chain: list[int]) -> "BigramDrafter":
    """A bigram drafter whose greedy draws follow `chain` (a prompt's last token, then the tokens a test
    expects): each token's successor in it, the last one where a token recurs."""
    table = np.zeros((vocab, vocab), np.float32)
    for a, b in zip(chain, chain[1:]):
        table[a] = 0.0
        table[a, b] = 30.0
    drafter = BigramDrafter(vocab, gamma)
    drafter.table[...] = table
    return drafter


Rule = Callable[[np.ndarray, Sequence[int]], np.ndarray]  # (logits [V] float64, output so far) -> logits


def exact_continuations(model: CausalLM, prompt: list[int], n: int, temperature: float = 1.0,
                        top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                        rule: Rule | None = None) -> dict[tuple[int, ...], float]:
    """P(x_1..x_n | prompt) for every n-token continuation, by enumeration: one full forward over
    the prompt followed by every (n-1)-token sequence, whose logits at depth d (the position after
    the prompt and x_1..x_d; causal, so it sees nothing later) give P(x_{d+1} | prompt, x_1..x_d).
    `rule` (a float64 reference of a request's logit rules: min_tokens hold, penalties, bias) maps
    the logits at depth d and x_1..x_d to the logits sampled there."""
    v = model.config.vocab_size
    heads = list(itertools.product(range(v), repeat=n - 1))  # x_1..x_{n-1}; () when n == 1
    graphdef, state = nnx.split(model)
    toks_et = jnp.array([list(prompt) + list(h) for h in heads], jnp.int32)
    logits_edv = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t)[:, len(prompt) - 1:])(state, toks_et)
    if rule is not None:
        raw = np.asarray(logits_edv, np.float64)
        logits_edv = jnp.asarray(np.stack([[rule(raw[e, d], head[:d]) for d in range(n)]
                                           for e, head in enumerate(heads)]), jnp.float32)
    rows = len(heads) * n
    sa = SamplingArrays.broadcast(rows, temperature, top_k, top_p, min_p)
    probs_edv = np.asarray(probs_from_logits(logits_edv.reshape(rows, v), sa), np.float64).reshape(-1, n, v)
    out = {}
    for e, head in enumerate(heads):
        prefix = float(np.prod([probs_edv[e, d, x] for d, x in enumerate(head)]))
        for x in range(v):
            out[head + (x,)] = prefix * probs_edv[e, n - 1, x]
    return out


def ruled_greedy(model: CausalLM, prompt: list[int], n: int, rule: Rule) -> list[int]:
    """The greedy continuation under `rule` (see `exact_continuations`) applied at every position."""
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))
    seq = list(prompt) + [0] * n
    for i in range(n):
        logits = np.asarray(fwd(state, jnp.array([seq]))[0, len(prompt) + i - 1], np.float64)
        seq[len(prompt) + i] = int(np.argmax(rule(logits, seq[len(prompt):len(prompt) + i])))
    return seq[len(prompt):]


def hold_logits(ids: Sequence[int], m: int) -> Rule:
    """min_tokens m: `ids` at -inf while the output is shorter than m."""
    def rule(logits_v: np.ndarray, output: Sequence[int]) -> np.ndarray:
        out = logits_v.copy()
        if len(output) < m:
            out[list(ids)] = -np.inf
        return out
    return rule


def bias_logits(logits_v: np.ndarray, output: Sequence[int], *, logit_bias: dict[int, float] | None = None,
                allowed: Sequence[int] | None = None, bad_words: Sequence[Sequence[int]] = ()) -> np.ndarray:
    """vLLM's allowed_token_ids, logit_bias and bad words on one position's logits [V] (float64
    reference): -inf outside `allowed`; the bias added; a bad word's last token at -inf when the
    output ends with its other tokens (a one-token word always)."""
    out = logits_v.copy()
    if allowed is not None:
        out[np.setdiff1d(np.arange(out.shape[0]), list(allowed))] = -np.inf
    for t, b in (logit_bias or {}).items():
        out[t] += b
    for w in bad_words:
        k = len(w) - 1
        if k == 0 or (len(output) >= k and tuple(output[len(output) - k:]) == tuple(w[:-1])):
            out[w[-1]] = -np.inf
    return out


def penalize_logits(logits_v: np.ndarray, prompt: list[int], output: Sequence[int], presence: float,
                    frequency: float, repetition: float) -> np.ndarray:
    """vLLM's penalties of one position's logits [V] (float64 reference): repetition divides a positive
    logit (multiplies a negative one) of a token in the prompt or the output, frequency subtracts its
    output count, presence subtracts once if it is in the output."""
    v = logits_v.shape[-1]
    counts = np.bincount(np.asarray(list(output), np.int64), minlength=v)[:v].astype(np.float64)
    seen = np.zeros(v, bool)
    seen[list(prompt)] = True
    seen |= counts > 0
    out = np.where(seen, np.where(logits_v > 0, logits_v / repetition, logits_v * repetition), logits_v)
    return out - frequency * counts - presence * (counts > 0)


def chi_square_pvalue(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float],
                      min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit; cells with small expected counts are pooled into one. A sample that
    the exact distribution gives probability zero (e.g. a token a top-k filter removes) makes it 0."""
    n = len(samples)
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    if any(exact.get(k, 0.0) <= 0.0 for k in counts):
        return 0.0  # an impossible outcome was observed; pooling would hide it
    obs, exp = [], []
    pool_o, pool_e = 0.0, 0.0
    for k, p in exact.items():
        e = p * n
        if e >= min_expected:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            pool_o += counts.get(k, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    obs, exp = np.asarray(obs, float), np.asarray(exp, float)
    exp *= obs.sum() / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


def sample_continuations(engine: Engine, prompt: list[int], n_samples: int, n_tokens: int, *,
                         temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                         caps: list[int | None] | None = None, seed0: int = 0,
                         extra: int = 3) -> list[tuple[int, ...]]:
    """Run n_samples seeded requests; return each one's first n_tokens. Per-request draft caps cycle
    through `caps`. Requests ask for `extra` more tokens than are kept, so the rounds that produce the
    kept tokens may verify up to gamma drafts (the engine never verifies more than a request still wants).
    """
    caps = caps or [None]
    reqs = [EngineRequest(str(i), list(prompt), max_tokens=n_tokens + extra, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=seed0 + i, max_draft_tokens=caps[i % len(caps)])
            for i in range(n_samples)]
    done = engine.run(reqs, progress=False)
    assert len(done) == n_samples
    return [tuple(r.output_ids[:n_tokens]) for r in reqs]


def small_engine(model, drafter=None, *, slots: int = 4, max_len: int = 64, policy: str = "fixed",
                 gamma: int | None = None, tokens_buckets=None, prefill: int = 16, mesh=None,
                 prefill_batch: int | None = None, variants: tuple[str, ...] = ("greedy", "plain"),
                 config: dict | None = None, **kw) -> Engine:
    """A warmed engine of one slots bucket (unless `config` names them); rounds compiled for the sampling `variants` only (a
    top-k or top-p request needs "filtered": the engine refuses it otherwise); `config`: more
    EngineConfig fields, `kw`: Engine's."""
    cfg = EngineConfig(**{**dict(max_slots=slots, max_len=max_len, policy=policy, gamma=gamma,
                                 slots_buckets=(slots,), tokens_buckets=tokens_buckets, prefill_buckets=(prefill,),
                                 max_prefill=prefill, prefill_batch_buckets=(prefill_batch or min(slots, 8),),
                                 sampling_variants=variants), **(config or {})})
    eng = Engine(model, drafter, cfg, mesh=mesh, progress=False, **kw)
    eng.warmup()
    return eng


def drafter_pvalue(model, drafter, prompt: list[int], exact: dict[tuple[int, ...], float], *,
                   temperature: float, n_samples: int = 6000, seed0: int = 0) -> float:
    """Chi-square p-value of the engine's first three tokens with `drafter` at fixed gamma against
    `exact` (the target's enumerated distribution at `temperature`), after checking that full blocks
    were verified. The engine has one tokens bucket, gamma + 1: every round runs at full width (a
    round that verifies fewer drafts is padded), so one round program compiles instead of three
    (mixed widths are the subject of test_engine_lossless)."""
    g = drafter.gamma
    # sampled rows only: the round programs of the "plain" variant (no greedy ones compiled)
    eng = small_engine(model, drafter, slots=256, max_len=16, prefill=8, gamma=g, tokens_buckets=(g + 1,),
                       prefill_batch=256, variants=("plain",))
    ells = []
    eng.on_round = lambda info: ells.extend(info["ell"])
    samples = sample_continuations(eng, prompt, n_samples, 3, temperature=temperature, extra=g, seed0=seed0)
    assert max(ells) == g, f"no round verified a full block of {g} drafts"
    return chi_square_pvalue(samples, exact)


def greedy_outputs(model, drafter=None, **config) -> tuple[list[list[int]], int, Engine]:
    """Greedy outputs of three prompts through a small engine (plain decoding, or fixed verification
    of `drafter`; `config`: more EngineConfig fields, e.g. attention="pallas"), the number of drafted
    tokens, and the engine."""
    cfg = EngineConfig(max_slots=2, max_len=32, policy="fixed" if drafter else "plain", slots_buckets=(2,),
                       prefill_buckets=(8,), max_prefill=8, prefill_batch_buckets=(2,),
                       sampling_variants=("greedy",), **config)
    eng = Engine(model, drafter, cfg, progress=False)
    eng.warmup()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [7, 8, 9, 7, 8, 9, 7]]
    reqs = [EngineRequest(str(i), p, max_tokens=8, temperature=0.0) for i, p in enumerate(prompts)]
    eng.run(reqs, progress=False)
    return [r.output_ids for r in reqs], sum(r.metrics.num_draft_tokens for r in reqs), eng


def compiled_text(eng) -> str:
    """The optimised HLO of every program the engine compiled (a Pallas kernel, interpreted on CPU,
    keeps its name in the ops' metadata)."""
    return "\n".join(exe.as_text() for family in eng.runner.exes.values() for exe in family._compiled.values())


def block_drafter_blocks(**propose_kw) -> tuple[CausalLM, nnx.Module, dict[str, DraftBlock],
                                              Callable[..., DraftBlock]]:
    """A tiny target (vocab 16), a DSpark drafter on it (2 layers, block 3, Markov head, confidence
    head) whose context holds two rows' prompts, the drafter's blocks for both rows with XLA's ops
    and with the Pallas kernel ({"xla": ..., "pallas": ...} from `propose(**propose_kw)` with the
    one key whose value is None, e.g. attention=None, set to each), and `propose(**kw)`, the
    drafter's proposal for those rows."""
    from specjax.drafters.dspark import BlockDrafterConfig, make_block_drafter
    vocab = 16
    model = tiny_target(vocab, seed=5, init_scale=2.0)
    cfg = model.config
    drafter = make_block_drafter(model, cfg, BlockDrafterConfig.from_target(
        cfg, target_layer_ids=(0, 1), mask_token_id=vocab - 1, num_draft_layers=2, block_size=3, markov_rank=8,
        confidence_head=True), nnx.Rngs(4))
    toks = jnp.asarray(np.random.default_rng(2).integers(0, vocab, (2, 12)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    n_valid = jnp.array([12, 9], jnp.int32)
    out = model.forward(toks, pos, valid_b=n_valid, tap_layers=drafter.tap_layers)
    state = drafter.commit(drafter.init_state(2, 32), ContextUpdate(toks, pos, jnp.concatenate(out.taps, -1),
                                                                    out.hidden, n_valid))
    sa, keys = SamplingArrays.broadcast(2, 1.0), jax.random.split(jax.random.key(0), 2)

    def propose(**kw) -> DraftBlock:
        return drafter.propose(state, toks[:, 0], n_valid, sa, keys, **kw)
    choice = next(k for k, v in propose_kw.items() if v is None)
    return model, drafter, {impl: propose(**{**propose_kw, choice: impl}) for impl in ("xla", "pallas")}, propose


def greedy_beside_free(eng: Engine, prompt: list[int], n: int, ruled: dict[str, dict]) -> dict[str, EngineRequest]:
    """Greedy requests of `prompt` for `n` tokens, one per entry of `ruled` (name: its request fields)
    and "free" without them, run together on `eng`; by name."""
    reqs = {name: EngineRequest(name, prompt, max_tokens=n, temperature=0.0, **kw) for name, kw in ruled.items()}
    reqs["free"] = EngineRequest("free", prompt, max_tokens=n, temperature=0.0)
    eng.run(list(reqs.values()), progress=False)
    return reqs


def sampled_with_rules(model: CausalLM, n: int, seed0: int, fields: dict, config: dict, gamma: int = 3,
                       full_share: int = 20, drafter: Any = None, **engine_kw) -> list[EngineRequest]:
    """`n` requests of [1, 5, 2] for 3 + gamma tokens at temperature 1 (seed seed0 + i, at most i % (gamma
    + 1) drafts verified) with the request `fields`, on a 256-slot engine of `model` with `drafter`
    (default a bigram drafter) and the EngineConfig `config` (`engine_kw`: Engine's); asserts that more than n /
    `full_share` rounds verified full blocks. Returns the finished requests."""
    drafter = BigramDrafter(model.config.vocab_size, gamma) if drafter is None else drafter
    eng = small_engine(model, drafter, slots=256, max_len=16, prefill=4,
                       gamma=gamma, tokens_buckets=(1, 2, 4), prefill_batch=256, variants=("plain",), config=config,
                       **engine_kw)
    ells = []
    eng.on_round = lambda info: ells.extend(info["ell"])
    reqs = [EngineRequest(str(i), [1, 5, 2], max_tokens=3 + gamma, temperature=1.0, seed=seed0 + i,
                          max_draft_tokens=i % (gamma + 1), **fields) for i in range(n)]
    eng.run(reqs, progress=False)
    assert sum(e == gamma for e in ells) > n // full_share  # full blocks were verified
    return reqs


def refused_field(model: CausalLM, config: dict, prompt: list[int], request: dict, message: str,
                  eos: Sequence[int] = (2,)) -> str | None:
    """Asserts that an unwarmed 2-slot plain engine of `model` (more EngineConfig fields: `config`)
    refuses a request with the fields `request`, its message matching `message`; returns the
    refusal's field (RequestFieldError), else None."""
    import pytest
    eng = Engine(model, None, EngineConfig(max_slots=2, max_len=32, policy="plain", **config), eos_token_ids=eos,
                 progress=False)
    with pytest.raises(ValueError, match=message) as e:
        eng.add_request(EngineRequest("a", prompt, max_tokens=4, **request))
    return getattr(e.value, "field", None)
