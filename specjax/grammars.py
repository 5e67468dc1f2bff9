"""Regular expressions and JSON schemas as token automata over a tokenizer (guided_regex, guided_json).

outlines-core compiles a regular expression into an index over the tokenizer's vocabulary (each
state's allowed tokens and the state after each); `GrammarCompiler` turns that index into a
`decoding.automata.TokenAutomaton` (state 0 initial, states renumbered densely, dead ends pruned),
and a JSON schema into its regular expression first (outlines-core's, with `JSON_WHITESPACE`).
Each token is matched by its bytes: byte-level BPE symbols are mapped back to bytes, SentencePiece's
"▁" is a space and its <0xNN> tokens are bytes; special tokens are never allowed (eos ends an output
in an accepting state). \\d means an ASCII digit. Compiled automata are cached per expression (up to
1 GiB of tables: vLLM's json_object is 171 MB over SmolLM2's vocabulary).
"""
from __future__ import annotations

import collections
import functools
import hashlib
import json
import math
import re
import threading
import weakref
from typing import Any

import numpy as np

from specjax.decoding.automata import TokenAutomaton
from specjax.decoding.engine_config import MAX_AUTOMATON_STATES
from specjax.serving.detokenize import backend_tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# whitespace allowed between JSON tokens: none, one space, or a line break and an indentation (models
# pretty-print JSON; outlines-core's default allows one space only)
JSON_WHITESPACE = r"([ ]|\n *)?"


class GrammarError(ValueError):
    """A regular expression or JSON schema that cannot guide generation; `field` names the request field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable symbol of each byte (GPT-2's convention), inverted: symbol -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in symbols:
            symbols[b], extra = chr(256 + extra), extra + 1
    return {s: b for b, s in symbols.items()}


def token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """The bytes each ordinary (not special) token of `tokenizer` stands for in decoded text."""
    backend = backend_tokenizer(tokenizer)
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    alphabet = _byte_level_alphabet()
    out: dict[int, bytes] = {}
    for piece, i in backend.get_vocab(with_added_tokens=True).items():
        if i in special:
            continue
        if "ByteLevel" in kinds:
            if any(c not in alphabet for c in piece):
                continue  # not a byte-level symbol string: never produced by this tokenizer's text
            out[i] = bytes(alphabet[c] for c in piece)
        elif "ByteFallback" in kinds and _BYTE_TOKEN.fullmatch(piece):
            out[i] = bytes([int(piece[3:5], 16)])
        else:
            out[i] = piece.replace("\u2581", " ").encode() if "Metaspace" in kinds or "Replace" in kinds \
                else piece.encode()
    return out


def ascii_digits(pattern: str) -> str:
    """`pattern` with \\d as [0-9]: outlines-core's regular expressions read \\d as any Unicode digit
    (e.g. U+1FBF8, four tokens), where users and JSON mean ASCII digits."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(("0-9" if in_class else "[0-9]") if pattern[i + 1] == "d" else pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            head = 2 if pattern[i + 1:i + 2] == "^" else 1
            if pattern[i + head:i + head + 1] == "]":  # a leading ] is literal
                head += 1
            out.append(pattern[i:i + head])
            i += head
            continue
        in_class = in_class and c != "]"
        out.append(c)
        i += 1
    return "".join(out)


# keywords outlines-core's regular expressions would silently not enforce: refused instead
UNENFORCED_KEYWORDS = ("multipleOf", "uniqueItems", "minProperties", "maxProperties")
INTEGER_RANGE_ENUM = 1000  # an integer's minimum..maximum is enforced as an enum of at most this many values
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains")


def enforceable_schema(schema: Any, path: str = "") -> Any:
    """`schema` with each bounded integer (minimum / maximum, exclusive ones too) as an enum of its
    values (outlines-core's regular expressions ignore bounds); ValueError naming the keyword's path
    for a bound it cannot enforce (a number's, an open or wider integer range) or a keyword of
    UNENFORCED_KEYWORDS."""
    if isinstance(schema, list):
        return [enforceable_schema(x, f"{path}[{i}]") for i, x in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    at = (path + ".") if path else ""
    for key in UNENFORCED_KEYWORDS:
        if key in out:
            raise ValueError(f"'{at}{key}' is not enforced by this server's JSON-schema automata")
    bounds = {k: out.pop(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in out}
    if bounds:
        lo = bounds.get("minimum", -math.inf)
        hi = bounds.get("maximum", math.inf)
        lo = max(lo, bounds["exclusiveMinimum"] + 1) if "exclusiveMinimum" in bounds else lo
        hi = min(hi, bounds["exclusiveMaximum"] - 1) if "exclusiveMaximum" in bounds else hi
        if out.get("type") != "integer" or not all(isinstance(b, (int, float)) for b in bounds.values()) \
                or not math.isfinite(lo) or not math.isfinite(hi) or hi - lo >= INTEGER_RANGE_ENUM:
            raise ValueError(f"'{at}{next(iter(bounds))}' is enforced on integers with both bounds and at most "
                             f"{INTEGER_RANGE_ENUM} values only")
        values = list(range(math.ceil(lo), math.floor(hi) + 1))
        if "enum" in out:
            values = [v for v in out["enum"] if v in values]
        if not values:
            raise ValueError(f"'{at}{next(iter(bounds))}' leaves no integer")
        out["enum"] = values
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: enforceable_schema(v, f"{at}{key}.{k}") for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS + _SUBSCHEMAS:
        if key in out:
            out[key] = enforceable_schema(out[key], at + key)
    return out


def json_schema_regex(schema: Any, field: str = "guided_json", whitespace: str | None = None) -> str:
    """The regular expression of a JSON schema (a dict or its JSON text, `enforceable_schema`) with
    `whitespace` between its tokens (a regular expression; default JSON_WHITESPACE); GrammarError
    naming `field`."""
    try:
        return _schema_regex(schema if isinstance(schema, str) else json.dumps(schema), whitespace)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a request's schema: outlines-core's panics derive from BaseException
        raise GrammarError(f"{field}: not a JSON schema this server can follow: {e}", field) from e


@functools.lru_cache(maxsize=256)
def _schema_regex(text: str, whitespace: str | None) -> str:
    """A schema's (JSON text) regular expression, built once per text: a request's schema is checked
    where it is parsed and compiled where its request is built."""
    import outlines_core
    schema = json.dumps(enforceable_schema(json.loads(text)))
    return outlines_core.json_schema.build_regex_from_schema(schema, JSON_WHITESPACE if whitespace is None
                                                             else f"({whitespace})")


class GrammarCompiler:
    """Token automata over one tokenizer and a target vocabulary of `vocab` ids (>= the tokenizer's)."""

    def __init__(self, tokenizer: Any, vocab: int, *, cache_bytes: int = 1 << 30):
        import outlines_core
        pieces = token_bytes(tokenizer)
        by_bytes: dict[bytes, list[int]] = collections.defaultdict(list)
        for i, b in pieces.items():
            if i < vocab and b:
                by_bytes[b].append(i)
        self._marker = vocab  # outlines-core's eos id: outside the target's ids, so never in a table
        self._vocabulary = outlines_core.Vocabulary(self._marker, dict(by_bytes))
        self.vocab = vocab
        self._cache: collections.OrderedDict[str, TokenAutomaton] = collections.OrderedDict()
        self._cache_bytes, self._lock = cache_bytes, threading.Lock()  # least recently used dropped past it

    def regex(self, pattern: str, field: str = "guided_regex") -> TokenAutomaton:
        """The token automaton of a regular expression (outputs are its full matches)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"{field} must be a non-empty regular expression", field)
        pattern = ascii_digits(pattern)
        key = hashlib.sha256(pattern.encode()).hexdigest()
        with self._lock:
            got = self._cache.get(key)
        if got is None:
            got = self._compile(pattern, key, field)  # outside the lock: a long compile blocks no other
        with self._lock:
            self._cache[key] = got
            self._cache.move_to_end(key)
            while len(self._cache) > 1 and sum(a.next_nv.nbytes for a in self._cache.values()) > self._cache_bytes:
                self._cache.popitem(last=False)
        return got if got.field == field else TokenAutomaton(got.next_nv, got.final_n, got.key, field)

    def json_schema(self, schema: Any, field: str = "guided_json", whitespace: str | None = None) -> TokenAutomaton:
        """The token automaton of a JSON schema's regular expression (`json_schema_regex`)."""
        return self.regex(json_schema_regex(schema, field, whitespace), field)

    def _compile(self, pattern: str, key: str, field: str) -> TokenAutomaton:
        import outlines_core
        try:
            index = outlines_core.Index(pattern, self._vocabulary)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a request's pattern: outlines-core's panics derive from BaseException
            raise GrammarError(f"{field}: cannot compile {pattern[:80]!r} over the vocabulary: {e}", field) from e
        edges = index.get_transitions()
        for out in edges.values():
            out.pop(self._marker, None)  # eos: allowed in accepting states by the engine itself
        finals, initial = set(index.get_final_states()), index.get_initial_state()
        live = _live_states({s: set(out.values()) for s, out in edges.items()}, finals, initial)
        if initial not in live:
            raise GrammarError(f"{field}: no output of this vocabulary's tokens matches {pattern[:80]!r}", field)
        order = [initial] + sorted(live - {initial})
        if len(order) > MAX_AUTOMATON_STATES:
            raise GrammarError(f"{field} compiles to {len(order)} automaton states; at most {MAX_AUTOMATON_STATES} "
                               f"are served", field)
        raw = np.array(sorted(live), np.int64)  # outlines-core's state ids, sorted, and their ids in `order`
        dense = np.zeros(len(raw), np.int64)
        dense[raw != initial] = np.arange(1, len(order))
        next_nv = np.full((len(order), self.vocab), -1, np.int16)
        for i, s in enumerate(order):
            out = edges.get(s)
            if out:
                cols = np.fromiter(out.keys(), np.int64, len(out))
                dest = np.fromiter(out.values(), np.int64, len(out))
                at = np.clip(np.searchsorted(raw, dest), 0, len(raw) - 1)
                kept = raw[at] == dest  # transitions into pruned states are dropped
                next_nv[i, cols[kept]] = dense[at[kept]]
        final_n = np.array([s in finals for s in order])
        return TokenAutomaton(next_nv, final_n, key, field)


def _live_states(successors: dict[int, set[int]], finals: set[int], initial: int) -> set[int]:
    """States reachable from `initial` from which an accepting state is reachable."""
    reach, todo = {initial}, [initial]
    while todo:
        for n in successors.get(todo.pop(), ()):
            if n not in reach:
                reach.add(n)
                todo.append(n)
    back: dict[int, set[int]] = collections.defaultdict(set)
    for s, out in successors.items():
        for n in out:
            back[n].add(s)
    live, todo = finals & reach, list(finals & reach)
    while todo:
        for p in back[todo.pop()]:
            if p in reach and p not in live:
                live.add(p)
                todo.append(p)
    return live


_COMPILERS: weakref.WeakKeyDictionary[Any, dict[int, GrammarCompiler]] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler(tokenizer: Any, vocab: int) -> GrammarCompiler:
    """The `GrammarCompiler` of `tokenizer` over `vocab` ids, made once per tokenizer object."""
    with _COMPILERS_LOCK:
        per = _COMPILERS.setdefault(tokenizer, {})
        if vocab not in per:
            per[vocab] = GrammarCompiler(tokenizer, vocab)
        return per[vocab]
