"""ktd-http in front of the daemon running the real engine: a tiny generated llama model (fast
suite) and the real Qwen2.5-Coder-0.5B-Instruct (realmodel, slow). The reference is ktd.client
sending the same request to the same daemon at temperature 0; for fill-in-the-middle it is
ktd.client with the FIM prompt written out as text (Qwen's documented
``<|fim_prefix|>…<|fim_suffix|>…<|fim_middle|>`` form, parsed with parse_special), an independent
construction of what the gateway builds from the token ids ``hello`` reports.
"""

from __future__ import annotations

import os

import httpx
import pytest

from daemon_helpers import RealServe
from http_helpers import start_gateway
from ktd.client import Client

openai = pytest.importorskip("openai", reason="the openai package (requirements-dev.txt) is not installed")
ollama = pytest.importorskip("ollama", reason="the ollama package (requirements-dev.txt) is not installed")

os.environ.setdefault("LANGSMITH_TRACING", "false")


@pytest.fixture(scope="module")
def served(request, tiny_model, real_model, tmp_path_factory):
    """The daemon with the real engine (daemon_helpers.RealServe) on the model request.param names
    ("tiny-llama": the shared tiny Q8_0 llama; else a real model), the gateway in front of it:
    (daemon socket, gateway, model name). Both must exit 0 when stopped."""
    model = tiny_model("llama", "Q8_0") if request.param == "tiny-llama" else real_model(request.param)
    workdir = str(tmp_path_factory.mktemp("h"))
    sock = os.path.join(workdir, "ktd.sock")
    env = {"KTD_MODEL__N_CTX": "512", "KTD_MODEL__N_SEQ_MAX": "2", "KTD_MODEL__THREADS": "2"}
    with RealServe(model, sock, env, timeout=120):
        g = start_gateway(sock, workdir)
        yield sock, g, os.path.basename(str(model))[: -len(".gguf")]
        assert g.stop() == 0


def reference(sock, **params) -> dict:
    with Client(sock, timeout=120) as c:
        return c.generate(**params)


@pytest.mark.parametrize("served", ["tiny-llama"], indirect=True)
def test_tiny_model_completions(served):
    sock, g, model = served
    prompt = "hello world"
    want = reference(sock, prompt=prompt, parse_special=True, temperature=0, max_tokens=16)
    assert want["usage"]["completion_tokens"] > 0
    client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0)
    r = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=16)
    assert r.choices[0].text == want["text"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want["usage"]["prompt_tokens"],
                                                                 want["usage"]["completion_tokens"])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=16, stream=True) if c.choices)
    assert streamed == want["text"]
    o = ollama.Client(host=g.root)
    assert o.generate(model=model, prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 16}
                      ).response == want["text"]
    # the tiny vocabulary has no FIM tokens: a clear 400
    r = httpx.post(f"{g.url}/completions", json={"model": model, "prompt": "a", "suffix": "b"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "fim_unsupported"


CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.parametrize("served", ["qwen2.5-coder-0.5b"], indirect=True)
def test_qwen_chat_and_fim_through_the_gateway(served):
    sock, g, model = served
    want = reference(sock, messages=CHAT, temperature=0, max_tokens=48)
    assert "def " in want["text"]  # a sensible answer
    client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=48)
    assert r.choices[0].message.content == want["text"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want["usage"]["prompt_tokens"],
                                                                 want["usage"]["completion_tokens"])
    usage, pieces = None, []
    for c in client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=48,
                                            stream=True, stream_options={"include_usage": True}):
        usage = c.usage or usage
        pieces += [ch.delta.content or "" for ch in c.choices]
    assert "".join(pieces) == want["text"] and usage.completion_tokens == want["usage"]["completion_tokens"]
    o = ollama.Client(host=g.root)
    assert o.chat(model=model, messages=CHAT, options={"temperature": 0, "num_predict": 48}
                  ).message.content == want["text"]
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    llm = lc.ChatOpenAI(model=model, base_url=g.url, api_key="unused", temperature=0, max_tokens=48,
                        max_retries=0)
    assert llm.invoke(CHAT[0]["content"]).content == want["text"]

    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(2, 3))\n"
    fim_text = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    want = reference(sock, prompt=fim_text, parse_special=True, temperature=0, max_tokens=16)
    assert "a + b" in want["text"]
    r = client.completions.create(model=model, prompt=prefix, suffix=suffix, temperature=0, max_tokens=16)
    assert r.choices[0].text == want["text"]
    assert r.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    r = o.generate(model=model, prompt=prefix, suffix=suffix, options={"temperature": 0, "num_predict": 16})
    assert r.response == want["text"]
    show = o.show(model)
    assert "insert" in show.capabilities


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.parametrize("served", ["qwen2.5-coder-0.5b"], indirect=True)
def test_qwen_structured_output_tools_and_logprobs_through_the_gateway(served):
    import json

    import jsonschema

    sock, g, model = served
    client = openai.OpenAI(base_url=g.url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Invent a person; answer in JSON with name and age."}]
    r = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=60,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)

    weather = [{"role": "user", "content": "What is the weather in Paris in celsius?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=model, messages=weather, tools=[WEATHER], tool_choice=named,
                                       temperature=0, max_tokens=80)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    with Client(sock, timeout=120) as c:
        want = c.call("generate", stream=False, messages=weather, tools=[WEATHER], tool_choice=named,
                      temperature=0, max_tokens=80)
    assert call.function.arguments == want["tool_calls"][0]["function"]["arguments"]
    args = ""
    for chunk in client.chat.completions.create(model=model, messages=weather, tools=[WEATHER],
                                                tool_choice=named, temperature=0, max_tokens=80, stream=True):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or ():
                assert d.index == 0 and (d.function.name in (None, "get_weather"))
                args += d.function.arguments or ""
    assert args == call.function.arguments

    # logprobs: the gateway's equal ktd.client's for the same request
    with Client(sock, timeout=120) as c:
        want = c.call("generate", stream=False, messages=CHAT, temperature=0, max_tokens=8, logprobs=True,
                      top_logprobs=3)
    r = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=8, logprobs=True,
                                       top_logprobs=3)
    got = r.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in got] == [(e["token"], e["logprob"]) for e in want["logprobs"]]
    assert [[t.token for t in x.top_logprobs] for x in got] == \
        [[t["token"] for t in e["top_logprobs"]] for e in want["logprobs"]]
    assert all(x.top_logprobs[0].token == x.token for x in got)  # temperature 0: the top-1 is drawn

    o = ollama.Client(host=g.root)
    r = o.chat(model=model, messages=ask, format=PERSON, options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(r.message.content), PERSON)
    r = o.chat(model=model, messages=weather, tools=[WEATHER], options={"temperature": 0, "num_predict": 80})
    for call in r.message.tool_calls or ():  # Ollama has no tool_choice: the 0.5B model may answer in text
        jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])

    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    llm = lc.ChatOpenAI(model=model, base_url=g.url, api_key="unused", temperature=0, max_tokens=80,
                        max_retries=0)
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke(weather[0]["content"])
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER["function"]["parameters"])
