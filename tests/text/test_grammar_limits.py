"""Grammars that cannot run: admission refuses them with ``bad_request`` naming the limit (the
grammar engine's row and item limits, the nesting of a spec), and a grammar that meets a limit
only later, on a path admission did not walk, ends its request with ``bad_request`` too, never
with ``internal``. The tokenizer is the fake engine's byte vocabulary."""

from __future__ import annotations

import json

import pytest

import fake_engine
from grammar_inputs import wide_rows
from ktd.errors import BadRequest
from ktd.server.scheduler import Job, Scheduler
from ktd.text import grammar
from ktd.text.sampling import SamplingParams

TOK = fake_engine.ByteTokenizer()


def test_a_grammar_whose_rows_exceed_the_item_limit_is_refused_at_admission():
    with pytest.raises(BadRequest) as e:
        grammar.compile_grammar(grammar.parse_spec({"lark": wide_rows(2500)}), TOK)
    assert "max_items_in_row" in str(e.value) and "2000" in str(e.value)
    grammar.compile_grammar(grammar.parse_spec({"lark": wide_rows(500)}), TOK)  # under the limit: fine


def _nested_schema(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


@pytest.mark.parametrize("source", [
    "[" * 100_000 + "]" * 100_000,                       # JSON text deeper than Python's parser goes
    json.dumps(_nested_schema(40)),                      # JSON text of a schema past the bound
    _nested_schema(40),                                  # the same as a map
    _nested_schema(2000),                                # a map deeper than json.dumps goes
])
def test_a_json_schema_nested_past_the_bound_is_bad_request(source):
    with pytest.raises(BadRequest) as e:
        grammar.compile_grammar(grammar.parse_spec({"json_schema": source}), TOK)
    assert "nested" in str(e.value) and str(grammar.MAX_SPEC_NESTING) in str(e.value)


def test_a_schema_within_the_bound_still_compiles():
    c = grammar.compile_grammar(grammar.parse_spec({"json_schema": _nested_schema(8)}), TOK)
    assert c.mask().any()


def test_a_limit_met_after_admission_is_bad_request_naming_it(monkeypatch):
    """Admission walks a few paths; a limit on another path is met while generating. The matcher
    then refuses the token: bad_request naming the limit, not a RuntimeError (``internal``)."""
    monkeypatch.setattr(grammar, "PROBE_WALKS", 0, raising=False)  # as if admission missed the path
    c = grammar.compile_grammar(grammar.parse_spec({"lark": wide_rows(2500)}), TOK)
    with pytest.raises(BadRequest) as e:
        c.advance(ord("a"))
    assert "max_items_in_row" in str(e.value)


class _Sink:
    def __init__(self):
        import threading
        self.end = threading.Event()
        self.kind = self.payload = None

    def __call__(self, kind, payload):
        if kind != "chunk":
            self.kind, self.payload = kind, payload
            self.end.set()


def test_the_scheduler_ends_such_a_request_with_bad_request(monkeypatch):
    monkeypatch.setattr(grammar, "PROBE_WALKS", 0, raising=False)
    eng = fake_engine.FakeEngine(n_seq_max=2)
    s = Scheduler(eng, prefill_tokens_per_step=64, max_queue=4)
    s.start()
    try:
        sinks = []
        for spec in ({"lark": wide_rows(2500)}, {"regex": "[a-z]{3}"}):
            sink = _Sink()
            c = grammar.compile_grammar(grammar.parse_spec(spec), TOK)
            s.submit(Job(client=1, prompt=[fake_engine.BOS, 65], sampling=SamplingParams(temperature=0.0),
                         max_tokens=8, stop=(), ignore_eos=False, sink=sink, constraint=c))
            sinks.append(sink)
        for sink in sinks:
            assert sink.end.wait(30)
        hostile, fine = sinks
        assert hostile.kind == "error" and hostile.payload.code == "bad_request", hostile.payload
        assert "max_items_in_row" in hostile.payload.message
        assert fine.kind == "done" and fine.payload["finish_reason"] == "stop"  # the batch went on
    finally:
        s.stop(timeout=10)
