"""Fill-in-the-middle through ktd-http: the gateway sends the text before the gap as ``prompt``
and the text after it as ``suffix`` in one ``generate`` (the daemon builds the prompt from the
model's FIM tokens). The daemon runs the fake engine with FIM tokens (fake_engine.FIM_IDS); the
reference is ktd.client sending the prompt as token ids written out here,
[BOS] <fim_pre> prefix <fim_suf> suffix <fim_mid>, and the daemon's request counters (metrics)
show the gateway's round trips."""

from __future__ import annotations

import os
import re

import pytest

import fake_engine
from ktd.client import Client

openai = pytest.importorskip("openai", reason="the openai package (requirements-dev.txt) is not installed")
ollama = pytest.importorskip("ollama", reason="the ollama package (requirements-dev.txt) is not installed")

os.environ.setdefault("LANGSMITH_TRACING", "false")

DAEMON = dict(model={"n_ctx": 256, "n_seq_max": 2}, fake={"fim": True, "eos_bias": -8.0})  # the module's daemon (conftest)
N = 16


def _requests(daemon) -> dict[str, int]:
    """The daemon's requests_total by method."""
    with Client(daemon.socket, timeout=30) as c:
        text = c.metrics()
    return {m: int(n) for m, n in re.findall(r'^ktd_requests_total\{method="(\w+)"\} (\d+)$', text, re.M)}


@pytest.mark.parametrize("prefix, suffix", [("def f(", "):\n    pass\n"), ("", "tail"), ("head", "")])
def test_fim_is_one_generate_with_prompt_and_suffix(daemon, gateway, prefix, suffix):
    fim = fake_engine.FIM_IDS
    ids = [fake_engine.BOS, fim["pre"], *prefix.encode(), fim["suf"], *suffix.encode(), fim["mid"]]
    with Client(daemon.socket, timeout=30) as c:
        assert c.hello()["fim"] == {"prefix": fim["pre"], "suffix": fim["suf"], "middle": fim["mid"]}
        want = c.generate(tokens=ids, temperature=0, max_tokens=N)
    assert want["text"] and want["usage"]["prompt_tokens"] == len(ids)
    before = _requests(daemon)
    client = openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
    r = client.completions.create(model="fake", prompt=prefix, suffix=suffix, temperature=0, max_tokens=N)
    assert r.choices[0].text == want["text"] and r.usage.prompt_tokens == len(ids)
    after = _requests(daemon)
    assert after.get("tokenize", 0) == before.get("tokenize", 0)
    assert after["generate"] == before["generate"] + 1
    if suffix:  # Ollama: an empty suffix is no fill-in-the-middle
        o = ollama.Client(host=gateway.root)
        r = o.generate(model="fake", prompt=prefix, suffix=suffix, options={"temperature": 0, "num_predict": N})
        assert r.response == want["text"]
        final = _requests(daemon)
        assert final.get("tokenize", 0) == before.get("tokenize", 0) and final["generate"] == before["generate"] + 2
