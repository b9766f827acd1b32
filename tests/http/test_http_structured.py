"""ktd-http's mapping of structured output, tool calls and logprobs onto the OpenAI and Ollama
APIs, through the real client libraries (``openai``, ``ollama``) against the real daemon process
(fake engine, random logits: the output is only valid because the grammar makes it so). The
references are ``jsonschema`` for the outputs and ``ktd.client`` sending the same request to the
same daemon for tool calls and logprobs."""

from __future__ import annotations

import json
import os

import httpx
import jsonschema
import pytest

from http_helpers import TIME, WEATHER
from ktd.client import Client

openai = pytest.importorskip("openai", reason="the openai package (requirements-dev.txt) is not installed")
ollama = pytest.importorskip("ollama", reason="the ollama package (requirements-dev.txt) is not installed")

os.environ.setdefault("LANGSMITH_TRACING", "false")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
WIDE = dict(top_p=1.0)
MSGS = [{"role": "user", "content": "time in Oslo?"}]


DAEMON = dict(fake={"step_delay_s": 0.001}, model={"n_ctx": 1024, "n_seq_max": 4})  # the module's daemon (conftest)


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0)


def test_openai_response_format_json_schema_and_json_object(client):
    for seed in range(4):
        r = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "json"}], temperature=1.0, seed=seed,
            max_tokens=300, response_format={"type": "json_schema", "json_schema": {
                "name": "thing", "schema": SCHEMA, "strict": True}}, **WIDE)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "json"}],
                                           temperature=1.0, seed=seed, max_tokens=300,
                                           response_format={"type": "json_object"}, **WIDE)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_openai_forced_tool_call_whole_and_streamed(daemon, client):
    for seed in range(3):
        kw = dict(messages=MSGS, tools=[WEATHER, TIME], temperature=1.0, seed=seed, max_tokens=300, **WIDE)
        r = client.chat.completions.create(model="fake", tool_choice={"type": "function", "function": {
            "name": "get_time"}}, **kw)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.type == "function" and call.function.name == "get_time" and call.id
        jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
        with Client(daemon.socket, timeout=30) as c:  # the daemon's own answer to the same request
            want = c.call("generate", stream=False, tool_choice={"type": "function", "function": {
                "name": "get_time"}}, **kw)
        assert call.function.arguments == want["tool_calls"][0]["function"]["arguments"]

        # streamed: the deltas assemble (as OpenAI's clients do) into the same call
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(model="fake", tool_choice="required", stream=True, **kw):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for d in ch.delta.tool_calls or ():
                    c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    c["id"] += d.id or ""
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
        whole = client.chat.completions.create(model="fake", tool_choice="required", **kw)
        (w,) = whole.choices[0].message.tool_calls
        assert finish == "tool_calls" and len(calls) == 1
        assert (calls[0]["name"], calls[0]["arguments"]) == (w.function.name, w.function.arguments)
        tool = {"get_weather": WEATHER, "get_time": TIME}[w.function.name]
        jsonschema.validate(json.loads(w.function.arguments), tool["function"]["parameters"])


def test_openai_conversation_with_tool_calls_and_results(client):
    r = client.chat.completions.create(model="fake", messages=MSGS, tools=[TIME], tool_choice="required",
                                       temperature=0, max_tokens=300)
    call = r.choices[0].message.tool_calls[0]
    r2 = client.chat.completions.create(model="fake", tools=[TIME], temperature=0, max_tokens=8, messages=MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"}])
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result were rendered


def test_openai_logprobs_equal_ktd_client(daemon, client):
    kw = dict(temperature=0, max_tokens=12)
    with Client(daemon.socket, timeout=30) as c:
        want = c.call("generate", stream=False, messages=MSGS, logprobs=True, top_logprobs=3, **kw)
        want_c = c.call("generate", stream=False, prompt="Once", parse_special=True, logprobs=True,
                        top_logprobs=2, **kw)
    r = client.chat.completions.create(model="fake", messages=MSGS, logprobs=True, top_logprobs=3, **kw)
    got = r.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in got] == [(e["token"], e["logprob"]) for e in want["logprobs"]]
    assert [[(t.token, t.logprob) for t in x.top_logprobs] for x in got] == \
        [[(t["token"], t["logprob"]) for t in e["top_logprobs"]] for e in want["logprobs"]]
    assert all(x.bytes == list(x.token.encode()) for x in got)
    streamed = []
    for chunk in client.chat.completions.create(model="fake", messages=MSGS, logprobs=True, top_logprobs=3,
                                                stream=True, **kw):
        for ch in chunk.choices:
            streamed += [(x.token, x.logprob) for x in (ch.logprobs.content if ch.logprobs else ()) or ()]
    assert streamed == [(e["token"], e["logprob"]) for e in want["logprobs"]]
    # /v1/completions: the legacy shape
    rc = client.completions.create(model="fake", prompt="Once", logprobs=2, **kw)
    lp = rc.choices[0].logprobs
    assert lp.tokens == [e["token"] for e in want_c["logprobs"]]
    assert lp.token_logprobs == [e["logprob"] for e in want_c["logprobs"]]
    assert lp.top_logprobs == [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in want_c["logprobs"]]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    toks, vals, offs = [], [], []
    for chunk in client.completions.create(model="fake", prompt="Once", logprobs=2, stream=True, **kw):
        for ch in chunk.choices:
            if ch.logprobs:
                toks += ch.logprobs.tokens
                vals += ch.logprobs.token_logprobs
                offs += ch.logprobs.text_offset
    assert (toks, vals, offs) == (lp.tokens, lp.token_logprobs, lp.text_offset)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}}}, "response_format"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [TIME], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_openai_bad_structured_input_is_a_400_in_openai_shape(gateway, body, param):
    r = httpx.post(f"{gateway.url}/chat/completions", timeout=30,
                   json={"model": "fake", "messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_openai_bad_schema_is_the_daemons_400(gateway):
    r = httpx.post(f"{gateway.url}/chat/completions", timeout=30, json={
        "model": "fake", "messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "no-such-type"}}}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_ollama_format_tools_and_logprobs(daemon, gateway):
    c = ollama.Client(host=gateway.root)
    for seed in range(3):
        r = c.chat(model="fake", messages=[{"role": "user", "content": "json"}], format=SCHEMA,
                   options={"temperature": 1.0, "seed": seed, "num_predict": 300, "top_p": 1.0})
        jsonschema.validate(json.loads(r.message.content), SCHEMA)
        g = c.generate(model="fake", prompt="json", format=SCHEMA,
                       options={"temperature": 1.0, "seed": seed, "num_predict": 300, "top_p": 1.0})
        jsonschema.validate(json.loads(g.response), SCHEMA)
    # tools: the fake model writes no call by itself (random text parses as text); the tools and a
    # conversation continuing a call must reach the template
    r = c.chat(model="fake", messages=MSGS, tools=[WEATHER], options={"temperature": 0, "num_predict": 16})
    assert r.message.tool_calls is None and r.done_reason in ("stop", "length")
    r2 = c.chat(model="fake", tools=[TIME], options={"temperature": 0, "num_predict": 8}, messages=MSGS + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time",
                                                                         "arguments": {"tz": "CET"}}}]},
        {"role": "tool", "tool_name": "get_time", "content": "12:00"}])
    r1 = c.chat(model="fake", messages=MSGS, tools=[TIME], options={"temperature": 0, "num_predict": 8})
    assert r2.prompt_eval_count > r1.prompt_eval_count  # the call and its result were rendered
    # logprobs equal ktd.client's
    with Client(daemon.socket, timeout=30) as k:
        want = k.call("generate", stream=False, messages=MSGS, temperature=0, max_tokens=10, logprobs=True,
                      top_logprobs=2)
    r = c.chat(model="fake", messages=MSGS, logprobs=True, top_logprobs=2,
               options={"temperature": 0, "num_predict": 10})
    assert [(x.token, x.logprob) for x in r.logprobs] == [(e["token"], e["logprob"]) for e in want["logprobs"]]
    streamed = []
    for part in c.chat(model="fake", messages=MSGS, logprobs=True, top_logprobs=2, stream=True,
                       options={"temperature": 0, "num_predict": 10}):
        streamed += [(x.token, x.logprob) for x in part.logprobs or ()]
    assert streamed == [(e["token"], e["logprob"]) for e in want["logprobs"]]


def test_ollama_forced_tool_call_shape(gateway):
    """Ollama has no tool_choice; a model that calls is answered in Ollama's shape. The fake
    model calls only when forced, so the forced call is made over the OpenAI route and its
    rendering in Ollama's shape checked through ktd.http.ollama's converter on the same call."""
    from ktd.http.ollama import _ollama_calls

    oc = openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
    r = oc.chat.completions.create(model="fake", messages=MSGS, tools=[TIME], tool_choice="required",
                                   temperature=0, max_tokens=300)
    call = r.choices[0].message.tool_calls[0].model_dump()
    (o,) = _ollama_calls([call])
    msg = ollama.Message(role="assistant", content="", tool_calls=[o])  # Ollama's own type accepts it
    assert msg.tool_calls[0].function.name == "get_time"
    assert dict(msg.tool_calls[0].function.arguments) == json.loads(call["function"]["arguments"])
    jsonschema.validate(dict(msg.tool_calls[0].function.arguments), TIME["function"]["parameters"])


def test_ollama_bad_format_is_a_400(gateway):
    r = httpx.post(f"{gateway.root}/api/chat", timeout=30,
                   json={"model": "fake", "messages": MSGS, "format": "yaml", "stream": False})
    assert r.status_code == 400 and "format" in r.json()["error"]


def test_ollama_stream_and_whole_render_calls_that_ollamas_types_parse():
    """The Ollama dialect's streamed (NDJSON) and whole answers for an outcome holding a call (the
    daemon's OpenAI-shaped call) parse with the ollama package's own response types."""
    from ktd.http.generation import Outcome
    from ktd.http.ollama import ChatDialect

    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}
    out = Outcome(text="", finish_reason="tool_calls", usage={"prompt_tokens": 3, "completion_tokens": 9},
                  timings={}, tool_calls=[call])
    d = ChatDialect("fake")
    lines = [json.loads(x) for x in d.end(out).decode().splitlines()]
    parts = [ollama.ChatResponse(**x) for x in lines]
    calls = [c for p in parts for c in p.message.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_time", {"tz": "CET"})]
    assert parts[-1].done and parts[-1].done_reason == "stop"
    whole = ollama.ChatResponse(**d.whole(out))
    assert dict(whole.message.tool_calls[0].function.arguments) == {"tz": "CET"}
