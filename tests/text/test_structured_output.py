"""Structured output (ktd.text.grammar): grammar masks in the native sampler, the scheduler with the
fake engine (random logits), bad grammars, and the real model.

Oracles: ``jsonschema`` validates every constrained JSON output against its schema; numpy sets
the masked logits to -inf for the native mask's reference; a sequence run alone is the reference
for the same sequence batched with constrained ones.
"""

from __future__ import annotations

import json
import random
import re
import threading

import jsonschema
import numpy as np
import pytest

import fake_engine
from ktd import _native
from ktd.text import grammar
from ktd.errors import BadRequest
from ktd.text.sampling import SamplingParams
from ktd.server.scheduler import Job, Scheduler

EMPTY = np.zeros(0, np.int64)
WIDE = dict(top_k=0, top_p=1.0, min_p=0.0)  # every allowed token can be drawn


def bits_to_mask(allowed: np.ndarray) -> np.ndarray:
    """uint32 words from a bool [n] (bit i % 32 of word i // 32), written independently of
    llguidance."""
    n = allowed.shape[0]
    words = np.zeros((n + 31) // 32, np.uint32)
    for i in np.flatnonzero(allowed):
        words[i // 32] |= np.uint32(1) << np.uint32(i % 32)
    return words


def mask_to_bits(words: np.ndarray, n: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:n].astype(bool)


# --- the native sampler's mask ------------------------------------------------------------------

PARAMS = [
    dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=3, top_p=0.5, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.2),
]


def _args(p, penalties):
    rp, pp, fp = penalties
    return (p["temperature"], p["top_k"], p["top_p"], p["min_p"], rp, pp, fp)


@pytest.mark.parametrize("isa", _native.sampling.kernel_isas())
@pytest.mark.parametrize("n", [1, 31, 33, 1000, 40000])
def test_masked_tokens_are_never_candidates_and_the_rest_match_numpy_minus_inf(isa, n):
    if not _native.kernels.isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} sampling kernels")
    rng = np.random.default_rng(n)
    for trial in range(6):
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        allowed = rng.random(n) < rng.choice([0.001, 0.1, 0.9])
        allowed[rng.integers(n)] = True
        words = bits_to_mask(allowed)
        window = rng.integers(0, n, 16).astype(np.int64)
        penalties = [(1.0, 0.0, 0.0), (1.3, 0.5, 0.2)][trial % 2]
        ref_x = np.where(allowed, x, -np.inf).astype(np.float32)  # the reference: numpy -inf
        for p in PARAMS:
            args = _args(p, penalties)
            if p["temperature"] > 0:
                ids, w, _ = _native.sampling.candidates(x, window, *args, isa=isa, mask=words)
                ref_ids, ref_w, _ = _native.sampling.candidates(ref_x, window, *args, isa=isa)
                assert allowed[ids].all()
                np.testing.assert_array_equal(ids, ref_ids)
                np.testing.assert_array_equal(w, ref_w)
            for u in (0.0, 0.37, 0.999):
                t = _native.sampling.sample(x, window, *args, u, isa=isa, mask=words)
                assert allowed[t]
                assert t == _native.sampling.sample(ref_x, window, *args, u, isa=isa)
        # greedy without penalties: the argmax over the allowed tokens, lowest id of equals
        t = _native.sampling.sample(x, EMPTY, 0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, isa=isa, mask=words)
        assert t == int(np.flatnonzero(allowed)[np.argmax(x[allowed])])


def test_int32_masks_are_taken_bit_for_bit_and_bad_masks_are_value_errors():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(100).astype(np.float32)
    allowed = np.zeros(100, bool)
    allowed[[31, 63, 95]] = True  # the sign bits of int32 words
    words = bits_to_mask(allowed)
    for m in (words, words.view(np.int32)):
        for u in np.linspace(0, 0.99, 7):
            assert allowed[_native.sampling.sample(x, EMPTY, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, u, mask=m)]
    with pytest.raises(ValueError, match="no logit is finite"):
        _native.sampling.sample(x, EMPTY, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, mask=np.zeros(4, np.uint32))
    with pytest.raises(ValueError, match="words"):
        _native.sampling.sample(x, EMPTY, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, mask=np.ones(3, np.uint32))


def test_llguidance_masks_mean_what_the_sampler_reads():
    """The bitmask of a Constraint over the fake vocabulary (bytes + 4 control tokens) allows
    exactly the bytes the regex can continue with."""
    tok = fake_engine.ByteTokenizer()
    c = grammar.compile_grammar(grammar.parse_spec({"regex": "[a-c][0-9]"}), tok)
    bits = mask_to_bits(c.mask(), tok.n_vocab)
    assert set(np.flatnonzero(bits).tolist()) == set(b"abc")
    c.advance(ord("b"))
    bits = mask_to_bits(c.mask(), tok.n_vocab)
    assert set(np.flatnonzero(bits).tolist()) == set(b"0123456789")
    c.advance(ord("7"))
    assert c.done
    bits = mask_to_bits(c.mask(), tok.n_vocab)  # complete: only the end-of-generation tokens
    assert set(np.flatnonzero(bits).tolist()) == set(tok.eos_ids)


# --- the parameter and bad grammars --------------------------------------------------------------

@pytest.mark.parametrize("value, match", [
    ("x", "exactly one"), ({}, "exactly one"), ({"regex": "a", "lark": "b"}, "exactly one"),
    ({"yaml": "a"}, "not one of"), ({"json_schema": 3}, "JSON Schema"), ({"json_schema": "{"}, "not valid JSON"),
    ({"json_object": False}, "must be true"), ({"regex": ""}, "non-empty"), ({"gbnf": 7}, "non-empty string"),
])
def test_grammar_parameter_shape_errors(value, match):
    with pytest.raises(BadRequest, match=match):
        grammar.parse_spec(value)


@pytest.mark.parametrize("value, match", [
    ({"json_schema": {"type": "foo"}}, "json_schema"),
    ({"json_schema": {"$ref": "#/nowhere"}}, "json_schema"),
    ({"regex": "(("}, "regex"),
    ({"lark": "start: ("}, "lark"),
    ({"lark": "start: undefined_rule"}, "lark"),
    ({"gbnf": "root ::= (("}, "gbnf"),
    ({"gbnf": 'root ::= "a" other'}, "gbnf"),
])
def test_bad_grammars_are_bad_requests(value, match):
    with pytest.raises(BadRequest, match=f"grammar {match}"):
        grammar.compile_grammar(grammar.parse_spec(value), fake_engine.ByteTokenizer())


# --- through the scheduler (fake engine: random logits) -------------------------------------------

class Collector:
    def __init__(self):
        self.parts: list[str] = []
        self.end = threading.Event()
        self.kind = self.payload = None

    def __call__(self, kind, payload):
        if kind == "chunk":
            self.parts.append(payload if isinstance(payload, str) else payload[0])
        else:
            self.kind, self.payload = kind, payload
            self.end.set()

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def wait(self, timeout=120):
        assert self.end.wait(timeout), "job did not end"
        return self


@pytest.fixture
def run_jobs():
    """run_jobs([(prompt, sampling, constraint_or_None, max_tokens)], n_seq_max) → collectors."""
    made = []

    def run(specs, n_seq_max=4, n_ctx=2048, overlap=True):
        eng = fake_engine.FakeEngine(n_ctx=n_ctx, n_seq_max=n_seq_max)
        s = Scheduler(eng, prefill_tokens_per_step=64, max_queue=len(specs) + 1, overlap_masks=overlap)
        made.append(s)
        s.start()
        sinks = []
        for prompt, sampling, constraint, max_tokens in specs:
            c = Collector()
            s.submit(Job(client=len(sinks) % 3, prompt=prompt, sampling=sampling, max_tokens=max_tokens, stop=(),
                         ignore_eos=False, sink=c, constraint=constraint))
            sinks.append(c)
        for c in sinks:
            c.wait()
        return sinks

    yield run
    for s in made:
        s.stop(timeout=10)


def random_schema(r: random.Random, depth: int = 0) -> dict:
    """A JSON Schema whose instances are bounded in size (so random logits finish them)."""
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "anyOf"]
    if depth < 3:
        kinds += ["object", "object", "array"]
    k = r.choice(kinds) if depth > 0 or r.random() < 0.2 else "object"  # mostly objects at the top
    if k == "string":
        s = {"type": "string", "maxLength": r.randint(0, 6)}
        if r.random() < 0.3:
            s["minLength"] = r.randint(0, s["maxLength"])
        if r.random() < 0.2:
            s = {"type": "string", "pattern": r.choice(["^[a-z]{1,4}$", "^[0-9]{3}-[0-9]{2}$", "^(ab|cd)+x?$"])}
            if "+" in s["pattern"]:
                s["maxLength"] = 7
        if r.random() < 0.1:
            s = {"type": "string", "format": "date"}
        return s
    if k == "integer":
        lo = r.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 5000)}
    if k == "number":
        lo = r.uniform(-100, 100)
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + r.uniform(0, 100), 2)}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "null":
        return {"type": "null"}
    if k == "enum":
        return {"enum": r.sample(["red", "green", "blue", 1, 2.5, None, True, "a b", "é"], r.randint(1, 4))}
    if k == "const":
        return {"const": r.choice(["fixed", 42, False, None])}
    if k == "anyOf":
        return {"anyOf": [random_schema(r, depth + 1) for _ in range(r.randint(1, 3))]}
    if k == "array":
        lo = r.randint(0, 2)
        return {"type": "array", "items": random_schema(r, depth + 1), "minItems": lo, "maxItems": lo + r.randint(0, 2)}
    names = r.sample(["id", "name", "tags", "x", "y", "deep", "a_b", "value", "ok", "ünï"], r.randint(0, 4))
    props = {n: random_schema(r, depth + 1) for n in names}
    required = [n for n in names if r.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def test_200_fuzzed_json_schemas_with_random_logits_give_valid_json(run_jobs):
    r = random.Random(16)
    tok = fake_engine.ByteTokenizer()
    schemas = [random_schema(r) for _ in range(200)]
    specs = []
    for i, schema in enumerate(schemas):
        c = grammar.compile_grammar(grammar.parse_spec({"json_schema": schema}), tok)
        sampling = SamplingParams(temperature=r.choice([0.0, 0.7, 1.0, 2.0]), seed=i, **WIDE)
        specs.append(([fake_engine.BOS, *f"schema {i}: ".encode()], sampling, c, 1500))
    results = run_jobs(specs, n_seq_max=8)
    for schema, res in zip(schemas, results):
        assert res.kind == "done", res.payload
        assert res.payload["finish_reason"] == "stop", (schema, res.text)
        value = json.loads(res.text)
        jsonschema.validate(value, schema)


def test_json_object_mode_gives_an_object(run_jobs):
    tok = fake_engine.ByteTokenizer()
    # without a schema the object can nest and grow; max_tokens only bounds a draw that is long
    specs = [([fake_engine.BOS, 123], SamplingParams(temperature=0.0, seed=i),
              grammar.compile_grammar(grammar.parse_spec({"json_object": True}), tok), 600) for i in range(4)]
    for res in run_jobs(specs):
        if res.payload["finish_reason"] == "stop":
            assert isinstance(json.loads(res.text), dict)
        else:  # cut by max_tokens: a prefix of an object
            assert res.text.startswith("{")


def test_gbnf_yes_or_no_gives_only_those(run_jobs):
    tok = fake_engine.ByteTokenizer()
    specs = []
    for i in range(40):
        c = grammar.compile_grammar(grammar.parse_spec({"gbnf": 'root ::= "yes" | "no"'}), tok)
        specs.append(([fake_engine.BOS, *f"q{i}?".encode()], SamplingParams(temperature=[0.0, 1.0, 3.0][i % 3], seed=i,
                                                                             **WIDE), c, 50))
    results = run_jobs(specs)
    texts = {res.text for res in results}
    assert texts <= {"yes", "no"} and all(res.payload["finish_reason"] == "stop" for res in results)
    assert texts == {"yes", "no"}  # random logits reach both


def test_regex_and_lark_grammars(run_jobs):
    tok = fake_engine.ByteTokenizer()
    regex = "[A-Z][a-z]{2,5} [0-9]{1,3}"
    lark = 'start: item ("," item)*\nitem: /[a-z]/ | "<" NUMBER ">"\nNUMBER: /[0-9]{1,2}/'
    specs = []
    for i in range(8):
        specs.append(([fake_engine.BOS, 65 + i], SamplingParams(temperature=1.0, seed=i, **WIDE),
                      grammar.compile_grammar(grammar.parse_spec({"regex": regex}), tok), 100))
        specs.append(([fake_engine.BOS, 97 + i], SamplingParams(temperature=1.0, seed=i, **WIDE),
                      grammar.compile_grammar(grammar.parse_spec({"lark": lark}), tok), 30))
    results = run_jobs(specs)
    for i, res in enumerate(results):
        if i % 2 == 0:
            assert re.fullmatch(regex, res.text), res.text
        elif res.payload["finish_reason"] == "stop":  # the list may go on to max_tokens
            assert re.fullmatch(r"([a-z]|<[0-9]{1,2}>)(,([a-z]|<[0-9]{1,2}>))*", res.text), res.text
        else:
            assert re.fullmatch(r"([a-z]|<[0-9]{1,2}>)(,([a-z]|<[0-9]{1,2}>))*,?<?[0-9]{0,2}", res.text), res.text


@pytest.mark.parametrize("overlap", [True, False])
def test_unconstrained_sequences_batched_with_constrained_ones_are_bit_identical(run_jobs, overlap):
    tok = fake_engine.ByteTokenizer()
    free = [([fake_engine.BOS, *f"free {i}".encode()], SamplingParams(temperature=[0.0, 0.8, 1.2][i % 3], seed=i),
             None, 40) for i in range(6)]
    alone = run_jobs(free, n_seq_max=1)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    constrained = [([fake_engine.BOS, *f"c {i}".encode()], SamplingParams(temperature=1.0, seed=100 + i, **WIDE),
                    grammar.compile_grammar(grammar.parse_spec({"json_schema": schema}), tok), 40) for i in range(6)]
    mixed = [x for pair in zip(constrained, free) for x in pair]
    together = run_jobs(mixed, n_seq_max=4, overlap=overlap)
    for a, b in zip(alone, together[1::2]):
        assert a.text == b.text and a.payload["finish_reason"] == b.payload["finish_reason"]
        assert a.payload["usage"] == b.payload["usage"]
    for res in together[0::2]:
        jsonschema.validate(json.loads(res.text), schema)
    alone_c = run_jobs([(p, smp, grammar.compile_grammar(grammar.parse_spec({"json_schema": schema}), tok), n)
                        for p, smp, _, n in constrained], n_seq_max=1, overlap=not overlap)
    assert [r.text for r in alone_c] == [r.text for r in together[0::2]]  # and the constrained ones too


# --- the real model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_engine_05b(real_model):
    from ktd.server.engine import Engine
    return Engine.open(real_model("qwen2.5-coder-0.5b"), n_ctx=2048, n_seq_max=2, threads=2, pin=False)


@pytest.mark.realmodel
@pytest.mark.slow
def test_real_model_at_temperature_0_with_a_schema_gives_valid_json(real_engine_05b):
    from ktd.server.scheduler import Scheduler as S
    eng = real_engine_05b
    tok = eng.tokenizer
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "language": {"enum": ["python", "c", "rust"]},
        "lines": {"type": "integer", "minimum": 1, "maximum": 1000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}},
        "required": ["name", "language", "lines", "tags"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Describe a small Python script that checks whether a number is prime, "
                                        "as JSON with name, language, lines and tags."}]
    prompt = tok.encode_chat(msgs)
    s = S(eng, prefill_tokens_per_step=512, max_queue=4)
    s.start()
    try:
        c = Collector()
        s.submit(Job(client=1, prompt=prompt, sampling=SamplingParams(temperature=0.0), max_tokens=200, stop=(),
                     ignore_eos=False, sink=c,
                     constraint=grammar.compile_grammar(grammar.parse_spec({"json_schema": schema}), tok)))
        c.wait(600)
    finally:
        s.stop(timeout=30)
    assert c.kind == "done" and c.payload["finish_reason"] == "stop", (c.payload, c.text)
    value = json.loads(c.text)
    jsonschema.validate(value, schema)
    assert value["language"] == "python"


@pytest.mark.realmodel
@pytest.mark.slow
def test_bench_grammar_section_runs_on_the_real_model(real_model, capsys):
    # the plumbing of make bench-sampling's grammar section; no timing is asserted
    from ktd.bench import sampling as bench
    out = bench.grammar_cost(str(real_model("qwen2.5-coder-0.5b")), threads=2, reps=40)
    assert out["tokens"] == 40 and out["documents"] >= 0 and out["step_ms"] > 0
    assert "of a step" in capsys.readouterr().out


@pytest.mark.realmodel
@pytest.mark.slow
def test_a_grammar_whose_first_mask_takes_too_long_is_refused_at_admission(real_model, monkeypatch):
    # a{1000}{1000} makes llguidance's lexer build states for a million-'a' regex over the 152k
    # vocabulary: seconds, in the admission's worker thread, never on the engine thread
    from ktd.text.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(real_model("qwen2.5-coder-0.5b"))
    monkeypatch.setattr(grammar, "MAX_FIRST_MASK_S", 0.05)
    with pytest.raises(BadRequest, match="too complex"):
        grammar.compile_grammar(grammar.parse_spec({"regex": "a{1000}{1000}"}), tok)
    grammar.compile_grammar(grammar.parse_spec({"regex": "[a-z]{1,8}"}), tok)  # a small one passes
