"""Structured output and logprobs through the real daemon process (fake engine), ``ktd.client``
and ``ktctl``: the parameters, their errors, streamed and whole results."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import jsonschema
import numpy as np
import pytest

import fake_engine
from ktd.server import protocol
from ktd.client import AsyncClient, BadRequest

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
WIDE = dict(top_k=0, top_p=1.0, min_p=0.0)


DAEMON = dict(fake={"step_delay_s": 0.001}, model={"n_ctx": 512, "n_seq_max": 4})  # the module's daemon (conftest)


def test_schema_constrained_generate_streamed_and_whole(daemon):
    with daemon.client() as c:
        for seed in range(6):
            r = c.generate("give json", grammar={"json_schema": SCHEMA}, temperature=1.0, seed=seed, max_tokens=300,
                           **WIDE)
            assert r["finish_reason"] == "stop"
            jsonschema.validate(json.loads(r["text"]), SCHEMA)
            s = c.stream("give json", grammar={"json_schema": SCHEMA}, temperature=1.0, seed=seed, max_tokens=300,
                         **WIDE)
            assert s.text() == r["text"]  # the same seed: the same constrained text


def test_gbnf_regex_lark_and_json_object_kinds(daemon):
    with daemon.client() as c:
        for seed in range(6):
            t = c.generate("?", grammar={"gbnf": 'root ::= "yes" | "no"'}, temperature=2.0, seed=seed, **WIDE)["text"]
            assert t in ("yes", "no")
            t = c.generate("?", grammar={"regex": "[0-9]{4}-[0-9]{2}"}, temperature=1.0, seed=seed, **WIDE)["text"]
            assert len(t) == 7 and t[4] == "-" and (t[:4] + t[5:]).isdigit()
            t = c.generate("?", grammar={"lark": 'start: "a" | "b" "c"'}, temperature=1.0, seed=seed, **WIDE)["text"]
            assert t in ("a", "bc")
        r = c.generate("?", grammar={"json_object": True}, temperature=0, max_tokens=400)
        if r["finish_reason"] == "stop":
            assert isinstance(json.loads(r["text"]), dict)


@pytest.mark.parametrize("params, match", [
    ({"grammar": {"json_schema": {"type": "foo"}}}, "grammar json_schema"),
    ({"grammar": {"regex": "(("}}, "grammar regex"),
    ({"grammar": {"gbnf": "root ::= (("}}, "grammar gbnf"),
    ({"grammar": {"lark": "start: nothing"}}, "grammar lark"),
    ({"grammar": {"cfg": "x"}}, "not one of"),
    ({"grammar": "yes|no"}, "exactly one"),
    ({"grammar": {"json_object": True}, "ignore_eos": True}, "ignore_eos"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 2}, "needs logprobs"),
])
def test_bad_parameters_are_bad_requests_and_take_no_slot(daemon, params, match):
    with daemon.client() as c:
        with pytest.raises(BadRequest, match=match):
            c.generate("x", **params)
        st = c.status()["scheduler"]
        assert st["slots_in_use"] == 0 and st["queued"] == 0
        assert c.generate("x", max_tokens=2, temperature=0)["usage"]["completion_tokens"] >= 1


def test_logprobs_streamed_equal_the_whole_result_and_match_the_fake_logits(daemon):
    tok = fake_engine.ByteTokenizer()
    with daemon.client() as c:
        whole = c.generate("logprobs please", logprobs=True, top_logprobs=5, temperature=0.8, seed=3,
                           max_tokens=20, stop=["e"])
        s = c.stream("logprobs please", logprobs=True, top_logprobs=5, temperature=0.8, seed=3, max_tokens=20,
                     stop=["e"])
        text = s.text()
    assert text == whole["text"]
    assert s.logprobs == whole["logprobs"]
    assert len(whole["logprobs"]) == whole["usage"]["completion_tokens"]
    history = tok.encode("logprobs please")
    for e in whole["logprobs"]:
        x = fake_engine.row_logits(history, -4.0).astype(np.float64)
        ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
        assert abs(e["logprob"] - ref[e["id"]]) < 1e-5
        assert len(e["top_logprobs"]) == 5
        assert [t["id"] for t in e["top_logprobs"]] == np.argsort(-ref, kind="stable")[:5].tolist()
        history.append(e["id"])


def test_async_client_stream_carries_logprobs(daemon):
    async def main():
        async with await AsyncClient.connect(daemon.socket, timeout=60) as c:
            s = await c.stream("abc", logprobs=True, temperature=0, max_tokens=8)
            text = "".join([p async for p in s])
            return text, s
    text, s = asyncio.run(main())
    assert len(s.logprobs) == s.result["usage"]["completion_tokens"]
    assert all(e["top_logprobs"] == [] for e in s.logprobs)  # top_logprobs defaults to 0


def test_chunks_carry_a_fourth_element_only_with_logprobs(daemon):
    import socket
    import msgpack
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(daemon.socket)
    try:
        for msgid, extra in ((1, {}), (2, {"logprobs": True})):
            sock.sendall(protocol.pack([0, msgid, "generate", [{"prompt": "hi", "max_tokens": 4, "temperature": 0,
                                                                 **extra}]]))
            unpacker = msgpack.Unpacker(raw=False)
            chunks = []
            while True:
                unpacker.feed(sock.recv(65536))
                done = False
                for m in unpacker:
                    if m[0] == 2:
                        chunks.append(m[2])
                    else:
                        done = True
                if done:
                    break
            assert chunks and all(len(ch) == (3 if msgid == 1 else 4) for ch in chunks)
    finally:
        sock.close()


def ktctl(daemon, *args):
    code = "import sys; from ktd.ctl import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, "--socket", daemon.socket, *args], capture_output=True,
                          text=True, timeout=120)


def test_ktctl_schema_grammar_and_logprobs(daemon, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    r = ktctl(daemon, "generate", "json", "--schema", str(schema), "-t", "1", "--seed", "4", "--top-k", "0",
              "--min-p", "0", "-n", "200")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), SCHEMA)
    gbnf = tmp_path / "yn.gbnf"
    gbnf.write_text('root ::= "yes" | "no"\n')
    r = ktctl(daemon, "generate", "?", "--grammar", str(gbnf), "--logprobs", "2", "-t", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout in ("yes\n", "no\n")
    lines = [json.loads(x) for x in r.stderr.splitlines()]
    assert "".join(e["token"] for e in lines) == r.stdout.strip()
    assert all(len(e["top_logprobs"]) == 2 for e in lines)
    bad = tmp_path / "bad.gbnf"
    bad.write_text("root ::= ((")
    r = ktctl(daemon, "generate", "?", "--grammar", str(bad))
    assert r.returncode != 0 and "grammar gbnf" in r.stderr
