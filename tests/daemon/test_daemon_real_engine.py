"""The daemon process with the real engine on a tiny generated model: concurrent greedy requests
through the socket give the text the engine produces in-process (continuous batching changes
nothing in the result), and status reports the real model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from daemon_helpers import spawn_real_serve
from ktd.client import Client
from ktd.server.engine import Engine
from models.tiny_dense import make_model

PROMPTS = ["hello world", "the quick brown fox", "abc", "ktd serves models", "0123456789", "z"]
MAX_TOKENS = 8


def greedy_in_process(engine: Engine, prompt: str) -> str:
    tok = engine.tokenizer
    ids = tok.encode(prompt, add_special=True)
    out: list[int] = []
    pos = 0
    batch = ids
    for _ in range(MAX_TOKENS):
        n = len(batch)
        logits = engine.forward(np.array(batch, np.int32), np.arange(pos, pos + n, dtype=np.int32),
                                np.zeros(n, np.int32), np.eye(1, n, n - 1, dtype=bool)[0])
        pos += n
        nxt = int(np.argmax(logits[-1]))
        if nxt in tok.eos_ids:
            break
        out.append(nxt)
        batch = [nxt]
    engine.free_seq(0)
    return tok.decode(out)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_model("llama", tmp_path_factory.mktemp("m") / "tiny-llama.gguf", wtype="Q8_0")


@pytest.fixture()
def daemon(tiny_model, tmp_path):
    sock = tmp_path / "ktd.sock"
    proc = spawn_real_serve(tiny_model, sock, {"KTD_MODEL__N_CTX": "256", "KTD_MODEL__N_SEQ_MAX": "4"})
    yield str(sock)
    proc.terminate()
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out


def test_concurrent_greedy_matches_in_process(tiny_model, daemon):
    engine = Engine.open(tiny_model, n_ctx=256, n_seq_max=1, threads=1)
    want = {p: greedy_in_process(engine, p) for p in PROMPTS}
    assert len(set(want.values())) == len(PROMPTS)  # the model really generates, differently per prompt

    def ask(prompt: str) -> str:
        with Client(daemon, timeout=60) as c:
            return "".join(c.stream(prompt, temperature=0, max_tokens=MAX_TOKENS))

    with ThreadPoolExecutor(len(PROMPTS)) as ex:  # more requests than the 4 slots: some queue
        got = dict(zip(PROMPTS, ex.map(ask, PROMPTS)))
    assert got == want

    with Client(daemon) as c:
        status = c.status()
    assert status["model"]["architecture"] == "llama"
    assert status["scheduler"]["slots_in_use"] == 0
