"""Structured output: a grammar constrains which tokens a sequence may draw (docs/PROTOCOL.md,
generate ``grammar``).

The constrained-decoding engine is llguidance (JSON Schema, Lark, regular expressions; GBNF
through its converter to Lark). Here:

- ``GrammarSpec``: what the request asked for (``{"json_schema": {...}}``, ``{"json_object":
  true}``, ``{"regex": str}``, ``{"lark": str}`` or ``{"gbnf": str}``), shape-checked by
  ``ktd.server.protocol``;
- ``compile_grammar(spec, tokenizer)``: the llguidance grammar and a ``Constraint`` for one
  sequence, or ``BadRequest`` naming what is wrong. It runs at admission, in a worker thread,
  before the request takes a KV slot;
- ``Constraint``: the matcher of one sequence. ``fill(words)`` writes the bitmask of the tokens
  allowed next (bit ``i % 32`` of word ``i // 32``; llguidance releases the GIL while it computes,
  so the scheduler computes it while the forward runs), the native sampler gives masked tokens
  ``-inf`` before penalties and temperature, and ``advance(token)`` moves the matcher on. The
  end-of-generation tokens are allowed only where the grammar accepts; once it can take nothing
  more the sequence ends (``finish_reason`` "stop").

llguidance's tokenizer is built once per model tokenizer from the token byte strings (token id →
the bytes it adds to the text; control tokens marked special, so no grammar can produce them)
and the end-of-generation ids; that takes about a second for a 152k vocabulary and is cached.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ktd.errors import BadRequest

# llguidance is imported on first use (~80 ms): a daemon that never sees a grammar does not pay.

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")

# JSON from a small model at temperature 0 can loop on whitespace: between tokens of JSON at most
# this much (a pretty-printed document still fits).
_JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"}


@dataclass(frozen=True)
class GrammarSpec:
    kind: str       # one of KINDS
    source: Any     # json_schema: a map (the schema); json_object: True; others: the grammar text


# Arrays and maps a JSON Schema may nest (a schema nests two per level of properties): deeper ones
# would only meet a recursion limit later, in json.dumps or in llguidance's schema compiler.
MAX_SPEC_NESTING = 64


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value``'s arrays and maps nest more than ``limit`` levels (iterative: any depth)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def parse_spec(value: Any) -> GrammarSpec:
    """The ``grammar`` parameter's shape (not its content: ``compile_grammar`` checks that)."""
    if not isinstance(value, dict) or len(value) != 1:
        raise BadRequest("generate: grammar must be a map with exactly one of " + ", ".join(KINDS))
    (kind, source), = value.items()
    if kind not in KINDS:
        raise BadRequest(f"generate: grammar kind {kind!r} is not one of " + ", ".join(KINDS))
    if kind == "json_schema":
        too_deep = BadRequest(f"generate: grammar json_schema is nested more than {MAX_SPEC_NESTING} levels "
                              "(arrays and maps)")
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except RecursionError:
                raise too_deep from None
            except ValueError as e:
                raise BadRequest(f"generate: grammar json_schema is not valid JSON: {e}") from None
        if not isinstance(source, (dict, bool)):
            raise BadRequest("generate: grammar json_schema must be a map (a JSON Schema)")
        if _nested_deeper_than(source, MAX_SPEC_NESTING):
            raise too_deep
    elif kind == "json_object":
        if source is not True:
            raise BadRequest("generate: grammar json_object must be true")
    elif not isinstance(source, str) or not source.strip():
        raise BadRequest(f"generate: grammar {kind} must be a non-empty string")
    return GrammarSpec(kind, source)


# The grammar engine's limits, stated (llguidance's defaults): admission checks a grammar against
# them, and a limit met later is named in the request's bad_request. Verbose errors off: a message
# carries no parser state or grammar text to the client or the log.
LIMITS = {"max_items_in_row": 2000, "step_max_items": 50_000, "step_lexer_fuel": 200_000,
          "initial_lexer_fuel": 1_000_000, "max_lexer_states": 250_000, "max_grammar_size": 500_000}
# What llguidance's messages say when a limit is met, and which limit that is.
_LIMIT_MESSAGES = (("Current row has", "max_items_in_row"), ("Too many items", "step_max_items"),
                   ("lex fuel", "step_lexer_fuel"), ("initial_lexer_fuel", "initial_lexer_fuel"),
                   ("relevance", "initial_lexer_fuel"), ("initial lexer configuration", "max_lexer_states"),
                   ("grammar size", "max_grammar_size"))


def _parser_limits() -> Any:
    import llguidance
    return llguidance.LLParserLimits(**LIMITS, verbose_errors=False)


def grammar_failure(spec: GrammarSpec, message: str, where: str = "") -> BadRequest:
    """The bad_request of a grammar the engine cannot run, naming the limit it met when it is one."""
    text = _one_line(message)
    for pattern, name in _LIMIT_MESSAGES:
        if pattern in message:
            return BadRequest(f"generate: grammar {spec.kind} exceeds the grammar engine's limit {name} "
                              f"({LIMITS[name]}){where}: {text}")
    return BadRequest(f"generate: grammar {spec.kind}{where}: {text}")


def _to_llguidance(spec: GrammarSpec) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec.source), defaults=_JSON_OPTIONS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    try:  # gbnf: llama.cpp's format, converted to Lark (a file already in Lark passes through)
        lark = any_to_lark(spec.source)
    except Exception as e:  # the converter raises its own and plain exceptions
        raise BadRequest(f"generate: grammar gbnf: {_one_line(e)}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _one_line(e: Exception | str) -> str:
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split())[:500]


class _TokenTable:
    """What llguidance's TokenizerWrapper reads of a tokenizer."""

    def __init__(self, tok: Any):
        n = tok.n_vocab
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(n):
            if tok.is_control(i):
                self.tokens.append(tok.token_bytes(i, special=True))
                self.special_token_ids.append(i)
            else:
                self.tokens.append(tok.token_bytes(i))
        eos = sorted(tok.eos_ids)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = tok.bos_id
        self._tok = tok

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special=False)


_cache: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def ll_tokenizer(tok: Any) -> Any:
    """llguidance's LLTokenizer for a model tokenizer (built once, ~1 s at 152k tokens)."""
    import llguidance
    with _cache_lock:
        llt = _cache.get(tok)
        if llt is None:
            eos = sorted(tok.eos_ids)
            llt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tok)), n_vocab=tok.n_vocab,
                                         eos_token=eos or None)
            _cache[tok] = llt
        return llt


# The first token mask is computed at admission (in the worker thread that compiles): the lexer
# builds its states for the vocabulary then (a pathological regex such as a{1000}{1000} takes
# seconds there, later steps are fast), so no grammar can stall the engine thread on its first
# step. A grammar whose first mask takes longer than this is refused.
MAX_FIRST_MASK_S = 2.0


class Constraint:
    """The grammar state of one sequence (used by one thread at a time)."""

    def __init__(self, matcher: Any, n_vocab: int, spec: GrammarSpec):
        self.matcher = matcher
        self.n_words = (n_vocab + 31) // 32
        self.spec = spec
        self._first: np.ndarray | None = None  # the first step's mask, computed at admission

    def fill(self, words: np.ndarray) -> None:
        """The bitmask of the tokens allowed next into ``words`` (int32 or uint32 [n_words],
        contiguous); the GIL is released while llguidance computes it. BadRequest when the
        grammar meets one of the engine's limits here (the request ends, not the batch)."""
        assert words.shape == (self.n_words,) and words.flags["C_CONTIGUOUS"] and words.itemsize == 4
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self.matcher.is_error():
            raise grammar_failure(self.spec, self.matcher.get_error(), " while generating")

    def mask(self) -> np.ndarray:
        if self._first is not None:
            words, self._first = self._first, None
            return words
        words = np.empty(self.n_words, np.uint32)
        self.fill(words)
        return words

    def advance(self, token: int) -> None:
        """Move on past ``token`` (one the mask allowed). A refusal is the grammar's (a limit met
        on this path: the mask allowed the token): BadRequest naming the limit."""
        self._first = None
        if not self.matcher.consume_token(token):
            raise grammar_failure(self.spec, self.matcher.get_error(), f" after token {token}")

    @property
    def done(self) -> bool:
        """Nothing but end-of-generation can follow (the grammar is complete)."""
        return self.matcher.is_stopped()

    def accepting(self) -> bool:
        return self.matcher.is_accepting()


def compile_grammar(spec: GrammarSpec, tok: Any) -> Constraint:
    """A fresh ``Constraint`` for ``spec`` over ``tok``'s vocabulary, or BadRequest with the
    library's message (an invalid schema, regex or grammar). Takes up to about a second for a
    large grammar (the GIL is released meanwhile); run it off the event loop."""
    import llguidance
    llt = ll_tokenizer(tok)
    try:
        grammar = _to_llguidance(spec)
    except ValueError as e:
        raise grammar_failure(spec, str(e)) from None
    except RecursionError:  # the GBNF converter on deeply nested input
        raise BadRequest(f"generate: grammar {spec.kind} is nested too deeply") from None
    limits = _parser_limits()
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, llt, limits=limits)
    if is_error:
        raise grammar_failure(spec, messages[0] if messages else "invalid")
    matcher = llguidance.LLMatcher(llt, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        raise grammar_failure(spec, matcher.get_error())
    c = Constraint(matcher, tok.n_vocab, spec)
    t0 = time.monotonic()
    first = c.mask()
    took = time.monotonic() - t0
    if took > MAX_FIRST_MASK_S:
        raise BadRequest(f"generate: grammar {spec.kind} is too complex: its first token mask took {took:.1f} s "
                         f"(the limit is {MAX_FIRST_MASK_S:g} s)")
    if not first.any():
        raise BadRequest(f"generate: grammar {spec.kind} allows no token of this model's vocabulary")
    _probe(c, first, tok.n_vocab)
    c._first = first
    return c


# Admission walks a few seeded random paths of the grammar, PROBE_STEPS tokens each, on copies of
# the matcher: a limit met a few tokens in (a row of more than max_items_in_row Earley items once
# a shared prefix is read) is refused before the request takes a KV slot. A limit hidden deeper,
# on a path the walks do not take, is met while generating and ends that request as bad_request.
# Cost: one token mask per step, 1-2 ms each on a 152k-token vocabulary (measured on two busy
# cores: 8-25 ms per request for Qwen2.5's vocabulary, where compiling a JSON Schema takes 1 ms).
PROBE_WALKS = 2
PROBE_STEPS = 6
PROBE_BUDGET_S = 0.5   # the walks stop (nothing refused) once they have taken this long


def _allowed(words: np.ndarray, n_vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:n_vocab])


def _probe(c: Constraint, first: np.ndarray, n_vocab: int) -> None:
    rng = np.random.default_rng(0)
    t0 = time.monotonic()
    for _ in range(PROBE_WALKS):
        m = c.matcher.deep_copy()
        allowed = _allowed(first, n_vocab)
        for _ in range(PROBE_STEPS):
            if not len(allowed) or time.monotonic() - t0 > PROBE_BUDGET_S:
                break
            token = int(rng.choice(allowed))
            if not m.consume_token(token) or m.is_error():
                raise grammar_failure(c.spec, m.get_error())
            if m.is_stopped():
                break
            allowed = _allowed(np.frombuffer(m.compute_bitmask(), np.uint32), n_vocab)
            if m.is_error():
                raise grammar_failure(c.spec, m.get_error())
