"""Ops, branches and bytes of the engine's compiled round programs, from abstract shapes (no weights).

    python -m bench.round_ops                       # Qwen3-4B and SmolLM2 shapes, 8 slots
    python -m bench.round_ops --presets tiny --slots 2 --variants plain
    python -m bench.round_ops --families draft verify --draft-vocab 0 32768 --suffix q --slots 128
    python -m bench.round_ops --target h200 --suffix h200   # as XLA's GPU compiler builds them (no GPU needed)
    python -m bench.round_ops --target h200 --attention pallas --suffix h200_pallas   # with the attention kernel
    python -m bench.round_ops --target h200 --attention pallas --mlp pallas --suffix k  # and the MLP kernel
    python -m bench.round_ops --target h200 --xla-option xla_gpu_enable_triton_gemm=false --suffix s  # XLA options

For each shape, the runner itself (decoding/runner.py, built with `allocate=False`: models from
`nnx.eval_shape`, state as ShapeDtypeStructs) lowers each round family (lite, draft, verify, fused)
for a slots bucket and each sampling variant (greedy, plain, filtered: see specjax/sampling.py) from
its own argument layout, so what is counted is what the engine compiles. `--draft-vocab N ...` measures
drafters with a draft vocabulary of each N tokens (0 = none; q travels from draft to verify over N
columns); `--max-logprobs K` builds the runner with log-probabilities and adds each round family's
program with them on (the widest variant's, as the engine compiles it). `--suffix S` writes the
result as round_ops_S (a subsection of this benchmark's section) instead of round_ops.
XLA then compiles it for this machine's backend, or with `--target h200` for a GPU this machine does
not have (bench/compile_target.py: XLA's GPU compiler from JAX's CUDA plugin, `make gpu-compiler`),
and the benchmark reads the optimised HLO: the
top-level ops of the entry computation (parameters, constants, tuples, get-tuple-element and bitcasts
not counted) per decoder layer, the number of `conditional` and `while` ops anywhere in the program,
XLA's `bytes accessed` of one call (`compiled.cost_analysis()`) and the part of it the round touches
(`bytes_breakdown`), against the bytes of the weights and KV caches the program reads (`inputs_read`).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import time
from typing import Any, Mapping, Sequence

# instructions of the entry computation that launch no work
_FREE_OPS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})
_OP_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
# JAX lowers the threefry PRNG as a rolled loop on CPU only (unrolled, or one kernel, on GPU and TPU)
_PRNG_SCOPES = ("threefry", "_uniform", "random_bits")
FAMILY_ORDER = ("lite", "draft", "verify", "fused", "fused_fill")
# the retry of a compile-only GPU program whose Triton matmul tiling failed without autotuning
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


def options_text(options: dict[str, Any]) -> str:
    """XLA compiler options as written on a command line: `name=value` (booleans lower-case), `; `-joined."""
    return "; ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())


NO_TRITON_GEMM_TEXT = options_text(NO_TRITON_GEMM)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A target (TargetConfig fields) and the DSpark drafter of its shape, in one dtype."""

    target: dict[str, Any]
    dtype: str
    taps: tuple[int, ...]
    draft_layers: int
    markov_rank: int
    gamma: int


def presets() -> dict[str, Shape]:
    from bench.common import RANDOM_TARGET_SHAPE
    from bench.gpu_check import PRESETS
    q = PRESETS["qwen3-4b"]
    return {
        "qwen3-4b": Shape(q.target, "bfloat16", q.taps, q.draft_layers, q.markov_rank, q.gamma),
        "smollm2": Shape(dict(RANDOM_TARGET_SHAPE), "float32", (1, 8, 15, 22, 28), 5, 256, 7),
        "tiny": Shape(dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True),
                      "float32", (0,), 1, 8, 3),
    }


def hlo_counts(hlo_text: str) -> dict[str, int]:
    """Counts in an HLO module's text: top-level ops of the ENTRY computation (free ops excluded),
    and `conditional` and `while` instructions in every computation; `whiles` excludes, and
    `prng_whiles` counts, the loops of the threefry PRNG (CPU lowering only, see _PRNG_SCOPES)."""
    top, cond, loops, prng, in_entry = 0, 0, 0, 0, False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
            continue
        if in_entry and line.startswith("}"):
            in_entry = False
        m = _OP_RE.match(line)
        if m is None:
            continue
        op = m.group(1)
        cond += op == "conditional"
        if op == "while":
            scope = _OP_NAME_RE.search(line)
            is_prng = scope is not None and any(s in scope.group(1) for s in _PRNG_SCOPES)
            prng += is_prng
            loops += not is_prng
        top += in_entry and op not in _FREE_OPS
    return {"top_level_ops": top, "conditionals": cond, "whiles": loops, "prng_whiles": prng}


_SHAPE_RE = re.compile(r"\b(pred|bf16|[fsu](?:8|16|32|64))\[([\d,]*)\]")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_DTYPE_CHANGES = frozenset({"parameter", "convert", "bitcast", "copy"})
_IN_PLACE_ROOTS = frozenset({"scatter", "dynamic-update-slice"})
_PICKS = frozenset({"gather", "slice", "dynamic-slice"})  # ops that read their operand 0 at some positions
_ELEMENTWISE = _DTYPE_CHANGES - {"parameter"} | frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "exponential", "log", "negate", "abs",
    "rsqrt", "sqrt", "tanh", "select", "compare", "clamp", "and", "or", "not", "xor", "is-finite", "floor",
    "ceil", "sign", "power", "exponential-minus-one", "log-plus-one"})


def _shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape (a tuple's elements summed; layouts ignored)."""
    total = 0
    for dtype, dims in _SHAPE_RE.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * (1 if dtype == "pred" else int(dtype.lstrip("bfsu")) // 8)
    return total


def _computations(hlo_text: str) -> tuple[dict[str, list[tuple[str, int, str, list[str], str]]], str]:
    """Each computation's instructions (name, result bytes, op, operand names, the whole line), and
    the entry computation's name."""
    comps: dict[str, list[tuple[str, int, str, list[str], str]]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        head = _COMP_RE.match(line)
        if head is not None:  # computation headers start the line; instructions are indented
            current = comps.setdefault(head.group(1), [])
            entry = head.group(1) if line.startswith("ENTRY") else entry
            continue
        m = _INSTR_RE.match(line)
        if m is not None and current is not None:
            name, shape, op, rest = m.groups()
            operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
            current.append((name, _shape_bytes(shape), op, operands, line))
    return comps, entry


def _shape_elements(shape_text: str) -> int:
    """Elements of an HLO array shape (its first array shape)."""
    m = _SHAPE_RE.search(shape_text)
    return 0 if m is None else math.prod(int(d) for d in filter(None, m.group(2).split(",")))


def _partial_reads(body: list[tuple[str, int, str, list[str], str]], params: dict[str, int]) -> dict[int, int]:
    """{parameter number: bytes read} for the parameters of a fused computation that it reads only
    through gathers or slices, directly or through elementwise ops (dtype changes, arithmetic,
    selects): a fusion computes its output per element, so an elementwise expression gathered at a
    few positions reads its inputs at those positions only."""
    shapes = {name: _INSTR_RE.match(line).group(2) for name, _, _, _, line in body}
    ops = {name: op for name, _, op, _, _ in body}
    users: dict[str, list[tuple[str, int]]] = {}
    for name, _, _, operands, _ in body:
        for i, o in enumerate(operands):
            users.setdefault(o, []).append((name, i))
    memo: dict[str, int | None] = {}

    def elements_read(name: str) -> int | None:  # of `name`'s value, None: all of it
        if name not in memo:
            total: int | None = 0
            for user, i in users.get(name, [("", -1)]):
                if ops.get(user) in _PICKS and i == 0:  # what it picks, or less where a pick of it reads less
                    got = elements_read(user)
                    got = _shape_elements(shapes[user]) if got is None else min(got, _shape_elements(shapes[user]))
                elif ops.get(user) in _ELEMENTWISE and _shape_elements(shapes[user]) == _shape_elements(shapes[name]):
                    got = elements_read(user)
                else:
                    got = None
                if got is None:
                    total = None
                    break
                total += got
            memo[name] = total
        return memo[name]
    reads: dict[int, int] = {}
    for name, number in params.items():
        n, whole = elements_read(name), _shape_elements(shapes[name])
        if n is not None and whole and n < whole:
            reads[number] = n * _shape_bytes(shapes[name]) // whole
    return reads


def _fusion_kind(body: list[tuple[str, int, str, list[str], str]], operand_bytes: list[int]
                 ) -> tuple[str, dict[int, int], dict[int, int]]:
    """What a fused computation does to its operands: 'convert' (it only changes their dtype or
    layout), 'scatter' or 'dynamic-update-slice' (its root updates parameter 0's buffer in place), or
    'other'; {parameter number: bytes read} for the parameters read only at gathered or sliced
    positions (`_partial_reads`); and {parameter number: bytes} for the parameters sliced directly
    (which XLA's count already takes at the bytes they read)."""
    ops = {op for _, _, op, _, _ in body}
    if "convert" in ops and ops <= _DTYPE_CHANGES:
        return "convert", {}, {}
    by_name = {name: (op, operands, line) for name, _, op, operands, line in body}
    params = {name: int(re.search(r"parameter\((\d+)\)", line).group(1))
              for name, (op, _, line) in by_name.items() if op == "parameter"}
    root = body[-1]
    if root[2] in _IN_PLACE_ROOTS and params.get(root[3][0]) == 0 and operand_bytes and operand_bytes[0] == root[1]:
        return root[2], {}, {}
    slices: dict[int, int] = {}
    for _, nbytes, op, operands, _ in body:
        src = operands[0] if op in ("slice", "dynamic-slice") else None
        while src is not None and src not in params and by_name.get(src, ("",))[0] in _DTYPE_CHANGES:
            src = by_name[src][1][0]
        if src in params:
            slices[params[src]] = slices.get(params[src], 0) + nbytes
    return "other", _partial_reads(body, params), slices


def _op_kind(comps: dict[str, list[tuple[str, int, str, list[str], str]]], op: str, line: str,
             operand_bytes: list[int]) -> tuple[str, dict[int, int], dict[int, int]]:
    """`_fusion_kind` of a top-level op: of its fused computation for a fusion; an unfused in-place
    op (scatter, dynamic-update-slice) is its own kind; anything else "other"."""
    called = re.search(r"calls=%([\w.\-]+)", line)
    if op == "fusion" and called:
        return _fusion_kind(comps[called.group(1)], operand_bytes)
    return (op if op in _IN_PLACE_ROOTS else "other"), {}, {}


def _aliased_output_bytes(line: str, operand_bytes: list[int]) -> int:
    """Bytes of a custom call's outputs that alias an operand (`output_to_operand_aliasing`): a
    kernel that updates a buffer in place, e.g. the attention kernel writing its new keys and values
    into the cache (counted as the reads of the operand; the rows it writes are left out)."""
    attr = re.search(r"output_to_operand_aliasing=\{(.*?\))\}", line)
    if attr is None:
        return 0
    return sum(operand_bytes[int(i)] for i in re.findall(r"\}: \((\d+),", attr.group(1)))


def bytes_breakdown(hlo_text: str) -> dict[str, int]:
    """XLA's bytes accessed of a compiled program (each top-level op's operands and result, as its
    cost analysis counts them: `xla`) split into `touched`, what the round reads and writes, and what
    the count or the backend adds: `convert`, ops that only change a dtype (XLA:CPU has no bf16 dot:
    it writes f32 copies of bf16 weights and cache each call, which a GPU's dot reads as stored; their
    consumers are counted at the stored bytes) and `whole_buffer`, the excess of in-place updates
    (a scatter into a buffer: XLA counts it whole in and out, it touches its update) and gathers
    (counted at the whole table, they read their rows; also where they pick from an elementwise
    expression of the input, `_partial_reads`), and custom calls' outputs that alias an operand (a
    kernel writing into a buffer in place, `_aliased_output_bytes`). Slices, e.g. of the key/value
    halves of the cache, count at the part they read, as XLA's own count takes them. A `while` loop
    counts its body's ops once per iteration (its known trip count; XLA's own count takes one
    iteration). xla = touched + convert + whole_buffer."""
    comps, entry = _computations(hlo_text)
    return _computation_bytes(comps, entry)


def _trip_count(line: str) -> int:
    """A `while` op's known trip count (1 when XLA did not record one)."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    return 1 if m is None else int(m.group(1))


def _computation_bytes(comps: dict[str, list[tuple[str, int, str, list[str], str]]], comp: str) -> dict[str, int]:
    """`bytes_breakdown` of one computation (the entry, or a loop's body)."""
    sizes: dict[str, int] = {}
    stored: dict[str, int] = {}  # outputs of dtype-only ops -> bytes of what they convert
    out = {"xla": 0, "touched": 0, "convert": 0, "whole_buffer": 0}
    for name, nbytes, op, operands, line in comps.get(comp, []):
        sizes[name] = nbytes
        if op in _FREE_OPS:
            continue
        if op == "while":  # each iteration's body, and its condition
            n = _trip_count(line)
            for part in ("body", "condition"):
                called = re.search(part + r"=%([\w.\-]+)", line)
                for k, b in (_computation_bytes(comps, called.group(1)).items() if called else ()):
                    out[k] += n * b
            continue
        in_bytes = [sizes.get(o, 0) for o in operands]
        kind, reads, sliced = _op_kind(comps, op, line, in_bytes)
        in_bytes = [min(b, sliced[i]) if i in sliced else b for i, b in enumerate(in_bytes)]
        in_place = sum(in_bytes[1:]) + max(in_bytes[1:], default=0)  # update and indices in, update out
        raw = in_place if kind == "dynamic-update-slice" else nbytes + sum(in_bytes)  # as XLA counts them
        out["xla"] += raw
        if kind == "convert":
            stored[name] = sum(stored.get(o, b) for o, b in zip(operands, in_bytes))
            out["convert"] += raw
            continue
        if kind in _IN_PLACE_ROOTS:
            touched = in_place
            out["whole_buffer"] += raw - touched
            if operands[0] in stored:  # an update of a converted buffer: still the stored buffer
                stored[name] = stored[operands[0]]
        else:
            aliased = _aliased_output_bytes(line, in_bytes) if op == "custom-call" else 0
            touched = nbytes - aliased
            out["whole_buffer"] += aliased
            for i, (o, b) in enumerate(zip(operands, in_bytes)):
                as_stored = min(stored.get(o, b), b)
                read = min(reads.get(i, as_stored), as_stored)
                out["convert"] += b - as_stored
                out["whole_buffer"] += as_stored - read
                touched += read
        out["touched"] += touched
    return out


# the round programs' arguments by the name JAX gives their entry parameters: weights and KV caches
_INPUT_GROUPS = {"t_params": "weights", "d_params": "weights", "cache_kv": "kv", "dstate_kv": "kv"}


def inputs_read(hlo_text: str) -> dict[str, int]:
    """Bytes of the weights and of the KV caches a compiled round program reads ({"weights", "kv"}):
    its entry parameters named after the target's and drafter's parameters (`t_params`, `d_params`)
    and caches (`cache_kv`, `dstate_kv`) that some op reads, directly or after in-place updates of
    them (a cache written then attended over is read); a cache the program only updates in place
    and returns (the drafter's context cache in a verify round: its new rows) is not read."""
    comps, entry = _computations(hlo_text)
    body = comps.get(entry, [])
    users: dict[str, list[tuple[str, str, int, str]]] = {}
    for name, _, op, operands, line in body:
        for i, o in enumerate(operands):
            users.setdefault(o, []).append((name, op, i, line))

    def read(value: str, nbytes: int) -> bool:  # some op reads the buffer `value` or an update of it
        for user, op, i, line in users.get(value, []):
            kind = _op_kind(comps, op, line, [nbytes])[0]
            if op == "tuple" and line.lstrip().startswith("ROOT"):  # returned (another tuple feeds a loop)
                continue
            if op in ("get-tuple-element", "bitcast") or (i == 0 and kind in _IN_PLACE_ROOTS):
                if read(user, nbytes):
                    return True
                continue
            return True
        return False
    out = {"weights": 0, "kv": 0}
    for name, nbytes, op, _, _ in body:
        group = next((g for prefix, g in _INPUT_GROUPS.items() if re.match(prefix + r"[_.]", name)), None)
        if op == "parameter" and group and read(name, nbytes):
            out[group] += nbytes
    return out


def compiled_report(lowered: Any, compiler_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compile a jax `Lowered` (with XLA `compiler_options`) and report its HLO counts, the platform
    compiled for, XLA's bytes accessed, what it touches, the weights and KV caches it reads
    (`inputs_read`) and compile seconds."""
    import jax
    t0 = time.perf_counter()
    compiled = lowered.compile(compiler_options=compiler_options)
    seconds = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per device program
        cost = cost[0] if cost else {}
    text = compiled.as_text()
    split = bytes_breakdown(text)
    # a compile-only (deviceless) executable has no cost analysis: XLA's count redone from the HLO
    accessed = float(cost["bytes accessed"]) if cost and "bytes accessed" in cost else float(split["xla"])
    platforms = sorted({d.platform for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set})
    read = inputs_read(text)
    return {**hlo_counts(text), "platform": ",".join(platforms), "bytes_accessed": accessed,
            "weight_bytes": read["weights"], "kv_cache_bytes": read["kv"],
            "touched_bytes": split["touched"], "convert_bytes": split["convert"],
            "whole_buffer_bytes": split["whole_buffer"], "compile_s": round(seconds, 2)}


def abstract_runner(shape: Shape, slots: int, max_len: int, draft_vocab: int = 0, max_logprobs: int = 0,
                    mesh: Any = None, attention: str = "xla", mlp: str = "xla", rules: Mapping[str, Any] | None = None) -> Any:
    """The runner of an engine with this target and drafter shape (a draft vocabulary of
    `draft_vocab` tokens, 0 = none; `rules`: the EngineConfig options of logit rules on, e.g.
    {"penalties": True, "logit_bias": True}), its state abstract (no
    memory), placed on `mesh` when given (e.g. a compile-only GPU's, `compile_target.compile_only_mesh`)."""
    import numpy as np
    from flax import nnx

    from specjax.config import TargetConfig
    from specjax.decoding.runner import Runner
    from specjax.decoding.verify import verify_chain
    from specjax.drafters.dspark import BlockDrafterConfig, make_block_drafter
    from specjax.models.decoder import CausalLM
    from specjax.models.norm_folding import fold_norm_weights
    cfg = TargetConfig(**shape.target)

    def build():
        target = CausalLM(cfg, rngs=nnx.Rngs(0), dtype=shape.dtype, param_dtype=shape.dtype)
        fold_norm_weights(target)  # as checkpoints.load_target serves a target
        dcfg = BlockDrafterConfig.from_target(cfg, target_layer_ids=shape.taps, mask_token_id=cfg.vocab_size - 1,
                                              num_draft_layers=shape.draft_layers, block_size=shape.gamma,
                                              markov_rank=shape.markov_rank, confidence_head=True,
                                              draft_vocab_size=draft_vocab)
        return target, make_block_drafter(target, cfg, dcfg, nnx.Rngs(1), dtype=shape.dtype,
                                          param_dtype=shape.dtype,
                                          draft_ids=np.arange(draft_vocab) if draft_vocab else None)
    target, drafter = nnx.eval_shape(build)
    return Runner(target, drafter, slots=slots, max_len=max_len, gamma=shape.gamma, stop_ids=(0,),
                  verifier=verify_chain, cache_dtype=shape.dtype, max_logprobs=max_logprobs, mesh=mesh,
                  attention=attention, mlp=mlp, allocate=False, **(rules or {}))


def bucket_key(runner: Any, family: str, slots: int, variant: str, logprobs: bool = False) -> tuple[Any, ...]:
    """A round family's bucket key at `slots` rows (verify and fused with every draft verified)."""
    from specjax.decoding.runner import bucket_key as key
    return key(family, rows=slots, tokens=runner.gamma + 1, logprobs=logprobs, attn=runner.max_len, variant=variant)


def measure(shape: Shape, slots: int, max_len: int, families: Sequence[str] = FAMILY_ORDER,
            variants: Sequence[str] = ("greedy", "plain", "filtered"), draft_vocab: int = 0,
            max_logprobs: int = 0, mesh: Any = None, attention: str = "xla", mlp: str = "xla",
            compiler_options: dict[str, Any] | None = None,
            rules: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per family and variant (and, with max_logprobs > 0, per round family in the widest
    variant with log-probabilities on): HLO counts, bytes accessed per call and the bytes it is
    measured against; compiled for `mesh`'s devices when given, else the default backend, with XLA
    `compiler_options` (e.g. {"xla_gpu_enable_triton_gemm": False})."""
    import jax

    from bench.common import log
    from specjax.decoding.runner import FAMILIES
    runner = abstract_runner(shape, slots, max_len, draft_vocab, max_logprobs, mesh, attention, mlp, rules)
    options = dict(compiler_options or {})
    layers = shape.target["num_hidden_layers"]
    rows = []
    for family in families:
        combos = [(v, False) for v in variants]
        if max_logprobs > 0 and "logprobs" in FAMILIES[family].bucket:
            combos.append((variants[-1], True))
        for variant, lp in combos:
            key = bucket_key(runner, family, slots, variant, lp)
            row = {"family": family, "variant": variant + (" +logprobs" if lp else ""), "bucket": list(key),
                   "slots": slots, "draft_vocab": draft_vocab}
            try:
                rep = compiled_report(runner.lower(family, key), options)
            except jax.errors.JaxRuntimeError as e:
                if mesh is None or NO_TRITON_GEMM.items() <= options.items():
                    raise
                # a compile-only target's compiler can fail where the device's would autotune another
                # tiling (XLA's Triton matmuls): once more with cuBLAS for every matmul, marked in the
                # row; a second failure is recorded in the row and the other programs still measured
                first = str(e).splitlines()[0][:300]
                log(f"{family} {variant}: the compiler failed ({first[:120]}); again without Triton matmuls")
                try:
                    rep = compiled_report(runner.lower(family, key), {**options, **NO_TRITON_GEMM})
                    row.update(compiler_options=NO_TRITON_GEMM_TEXT, first_error=first)
                except jax.errors.JaxRuntimeError as e2:
                    row["error"] = f"{first}; without Triton matmuls: {str(e2).splitlines()[0][:200]}"
                    rows.append(row)
                    continue
            rows.append({**row, **rep,
                         "ops_per_layer": round(rep["top_level_ops"] / layers, 1),
                         "bytes_over_weights": round(rep["bytes_accessed"] / rep["weight_bytes"], 3),
                         "touched_over_weights_kv": round(rep["touched_bytes"] / (rep["weight_bytes"]
                                                                                  + rep["kv_cache_bytes"]), 3)})
    return rows


def _markdown(res: dict[str, Any]) -> str:
    from bench.common import md_table
    title = "Round programs: ops per layer, branches and bytes (compiled, abstract shapes)"
    lines = [f"# {title}" + (f" — {res['suffix']}" if res.get("suffix") else ""), "",
             f"Command: `{res['command']}`", "",
             f"Compiled for `{res['backend']}`; attention `{res.get('attention', 'xla')}`; mlp `{res.get('mlp', 'xla')}`"
             + ("; penalties on" if res.get("penalties") else "") + ("; logit bias on" if res.get("logit_bias") else "")
             + ("; guided choice on" if res.get("guided_choice") else "")
             + (f"; predictions of up to {res['prediction_tokens']} tokens" if res.get("prediction_tokens") else "")
             + f"; max_len {res['max_len']}"
             + "".join(f"; `{options_text({k: v})}`" for k, v in res.get("compiler_options", {}).items()) + ". Each row is one compiled program of the "
             "engine's runner at that slots bucket and sampling variant (verify and fused with gamma + 1 tokens per slot; `filtered` is the variant of a round in which some row uses top-k or top-p, its one conditional the exact fallback for a kept set past the top-k cap). `ops/layer` "
             "= top-level HLO ops of the entry computation / the target's decoder layers (draft: also divided "
             "by the target's layers, for comparison); `cond` and `while` count every `conditional` and `while` "
             "op in the program, except that `PRNG while` counts apart the loops of the threefry random-bit "
             "generator, which JAX lowers as a rolled loop on CPU only (unrolled, or one kernel, on GPU and TPU). "
             "`bytes accessed` is XLA's count for one call; `touched` is the part of it the round reads and writes "
             "(`bench.round_ops.bytes_breakdown`): without `CPU converts`, the fusions that only change a dtype "
             "(XLA:CPU has no bf16 dot, so it writes f32 copies of the bf16 weights and cache every call; their "
             "consumers are counted at the stored bytes, as a GPU's dot reads them), and with in-place cache "
             "writes and gathers (also of elementwise expressions of an input) counted at the rows they touch "
             "instead of the whole buffer XLA counts. "
             "`touched/(W+KV)` = touched / (the weights the program reads + the KV caches it reads, "
             "`bench.round_ops.inputs_read`): the target's cache in lite and verify, the drafter's context cache "
             "in draft, both in fused (verify writes the drafter's new rows, it does not read its cache), each "
             "whole (every slot at max_len, the attention bucket these programs are built for); the weights are "
             "the parameters the program takes (verify: the target's and the drafter's context projections). "
             "A `while` loop's ops count once per iteration. Goals (issue #36): "
             "<= 12 ops per layer, 0 conditionals and 0 loops in a greedy or unfiltered round, bytes accessed "
             "<= 1.3x (weights + live KV) at 128 slots.", ""]
    if res.get("target", "host") != "host":
        lines += [f"Compiled for a GPU this machine does not have (`--target {res['target']}`, "
                  "bench/compile_target.py): each top-level op is a kernel or library call the GPU runs "
                  "(XLA's fusions chosen by its heuristics, as without autotuning); `bytes accessed` is "
                  "XLA's count redone from the optimised HLO (a compile-only executable has no cost "
                  "analysis); there are no CPU converts (the GPU's dots read bf16 as stored).", ""]
    if any(res.get("draft_vocabs", [0])) or res.get("max_logprobs"):
        lines += ["`draft vocab`: the drafter's draft vocabulary (0: the whole vocabulary; q travels from draft "
                  f"to verify over its columns); `+logprobs`: the round with log-probabilities (top "
                  f"{res.get('max_logprobs', 0)}) on.", ""]
    for name, rows in res["shapes"].items():
        lines += [f"## {name} ({rows[0]['layers']} layers, {rows[0]['dtype']})", ""]
        lines.append(md_table(
            ["program", "sampling", "slots", "draft vocab", "top-level ops", "ops/layer", "cond", "while", "PRNG while",
             "bytes accessed (MB)", "touched (MB)", "CPU converts (MB)", "weights read (MB)", "KV read (MB)",
             "touched/(W+KV)", "compile (s)"],
            [_table_row(r) for r in rows], align="ll" + "r" * 14))
        failed = [r for r in rows if "error" in r]
        if failed:
            lines += ["", "Compiler failures (no row figures): " + "; ".join(
                f"{r['family']} {r['variant']}: `{r['error']}`" for r in failed), ""]
        retried = [r for r in rows if r.get("compiler_options")]
        if retried:
            lines += ["", f"`*`: compiled with `{retried[0]['compiler_options']}` (cuBLAS for every matmul) after "
                      f"XLA's Triton matmul tiling failed without autotuning: `{retried[0]['first_error']}`", ""]
    return "\n".join(lines)


def _table_row(r: dict[str, Any]) -> list[Any]:
    head = [r["family"] + ("*" if r.get("compiler_options") else ""), r["variant"], r["slots"], r.get("draft_vocab", 0)]
    if "error" in r:  # the compiler failed on this program
        return head + ["compile failed"] + ["-"] * 11
    return head + [r["top_level_ops"], r["ops_per_layer"], r["conditionals"], r["whiles"], r["prng_whiles"],
                   f"{r['bytes_accessed'] / 1e6:.1f}", f"{r['touched_bytes'] / 1e6:.1f}", f"{r['convert_bytes'] / 1e6:.1f}",
                   f"{r['weight_bytes'] / 1e6:.1f}", f"{r['kv_cache_bytes'] / 1e6:.1f}", r["touched_over_weights_kv"],
                   r["compile_s"]]


def run(names: Sequence[str], slots: Sequence[int], max_len: int, command: str,
        families: Sequence[str] = FAMILY_ORDER, variants: Sequence[str] = ("greedy", "plain", "filtered"),
        draft_vocabs: Sequence[int] = (0,), max_logprobs: int = 0, target: str = "host",
        attention: str = "xla", mlp: str = "xla", compiler_options: dict[str, Any] | None = None,
        rules: Mapping[str, Any] | None = None) -> dict[str, Any]:
    import jax

    from bench import compile_target
    from bench.common import log, machine_info
    mesh = None if target == compile_target.HOST else compile_target.compile_only_mesh(target)
    backend = jax.default_backend() if mesh is None else f"{target} (compile-only, XLA's GPU compiler, no autotuning)"
    shapes = presets()
    res: dict[str, Any] = {"command": command, "backend": backend, "target": target, "attention": attention,
                           "mlp": mlp, **(rules or {}), "max_len": max_len, "compiler_options": dict(compiler_options or {}),
                           "draft_vocabs": list(draft_vocabs), "max_logprobs": max_logprobs, "machine": machine_info(),
                           "shapes": {}}
    for name in names:
        rows = []
        for s in slots:
            for n in draft_vocabs:
                log(f"{name}: compiling {', '.join(families)} x {', '.join(variants)} at {s} slot(s), draft vocab {n}")
                for r in measure(shapes[name], s, max_len, families, variants, n, max_logprobs, mesh, attention,
                                 mlp, compiler_options, rules):
                    rows.append({**r, "layers": shapes[name].target["num_hidden_layers"], "dtype": shapes[name].dtype})
        res["shapes"][name] = rows
    return res


def xla_options(pairs: Sequence[str]) -> dict[str, Any]:
    """`--xla-option NAME=VALUE` pairs as XLA compiler options (true/false and integers typed)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.startswith("xla_"):
            raise SystemExit(f"--xla-option must be NAME=VALUE with an XLA option name (xla_...), got {pair!r}")
        low = value.lower()
        out[name] = True if low == "true" else False if low == "false" else int(value) if value.lstrip("-").isdigit() else value
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from bench import compile_target
    from bench.common import DEFAULT_OUT_DIR, command_line, write_results
    from specjax.serving.cli import add_logit_rule_flags, logit_rule_args
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["qwen3-4b", "smollm2"], choices=sorted(presets()))
    ap.add_argument("--slots", nargs="+", type=int, default=[8])
    ap.add_argument("--variants", nargs="+", default=["greedy", "plain", "filtered"],
                    choices=["greedy", "plain", "filtered"])
    ap.add_argument("--families", nargs="+", default=list(FAMILY_ORDER), choices=FAMILY_ORDER)
    ap.add_argument("--draft-vocab", nargs="+", type=int, default=[0], help="draft vocabulary sizes (0 = none)")
    ap.add_argument("--suffix", default="", help="write the result as round_ops_SUFFIX")
    ap.add_argument("--max-logprobs", type=int, default=0, help="> 0: also the round programs with log-probabilities")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--attention", default="xla", choices=["xla", "pallas"],
                    help="the target's attention over the cache in rounds (EngineConfig.attention)")
    ap.add_argument("--mlp", default="xla", choices=["xla", "pallas"],
                    help="the target's gate/up product and SiLU gate (EngineConfig.mlp)")
    add_logit_rule_flags(ap, "an engine serving ")
    ap.add_argument("--prediction-tokens", type=int, default=0,
                    help="an engine serving predicted outputs of up to this many tokens (EngineConfig.prediction_tokens)")
    ap.add_argument("--target", default="host", choices=compile_target.targets(),
                    help="compile for this machine's backend (host) or for a GPU it does not have (make gpu-compiler)")
    ap.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                    help="an XLA compiler option for every program, e.g. xla_gpu_enable_triton_gemm=false")
    ap.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    ap.add_argument("--docs", default="docs/BENCHMARKS.md", help="section rewritten in this page ('' = none)")
    args = ap.parse_args(argv)
    options = xla_options(args.xla_option)
    res = run(args.presets, args.slots, args.max_len, command_line("bench.round_ops", argv),
              families=args.families, variants=args.variants, draft_vocabs=args.draft_vocab,
              max_logprobs=args.max_logprobs, target=args.target, attention=args.attention,
              mlp=args.mlp, compiler_options=options,
              rules={**logit_rule_args(args), **({"prediction_tokens": args.prediction_tokens}
                                                  if args.prediction_tokens else {})})
    res["suffix"] = args.suffix
    name = "round_ops" + (f"_{args.suffix}" if args.suffix else "")
    for p in write_results(name, res, _markdown(res), out_dir=args.out_dir):
        print(p)
    if args.docs:
        from bench import run_all
        run_all.write_section(name, results_dir=args.out_dir, docs_path=args.docs)


if __name__ == "__main__":
    main()
