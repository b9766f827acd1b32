"""The daemon process with the real engine on a tiny generated model: concurrent greedy requests
through the socket give the text the engine produces in-process (continuous batching changes
nothing in the result), and status reports the real model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from daemon_helpers import RealServe
from engine_probes import greedy_in_process
from ktd.client import Client
from ktd.server.engine import Engine

PROMPTS = ["hello world", "the quick brown fox", "abc", "ktd serves models", "0123456789", "z"]
MAX_TOKENS = 8


def test_concurrent_greedy_matches_in_process(tiny_model, tmp_path):
    model, sock = tiny_model("llama", "Q8_0"), str(tmp_path / "ktd.sock")
    engine = Engine.open(model, n_ctx=256, n_seq_max=1, threads=1)
    want = {p: greedy_in_process(engine, p, MAX_TOKENS) for p in PROMPTS}
    assert len(set(want.values())) == len(PROMPTS)  # the model really generates, differently per prompt

    def ask(prompt: str) -> str:
        with Client(sock, timeout=60) as c:
            return "".join(c.stream(prompt, temperature=0, max_tokens=MAX_TOKENS))

    with RealServe(model, sock, {"KTD_MODEL__N_CTX": "256", "KTD_MODEL__N_SEQ_MAX": "4"}):
        with ThreadPoolExecutor(len(PROMPTS)) as ex:  # more requests than the 4 slots: some queue
            got = dict(zip(PROMPTS, ex.map(ask, PROMPTS)))
        assert got == want

        with Client(sock) as c:
            status = c.status()
        assert status["model"]["architecture"] == "llama"
        assert status["scheduler"]["slots_in_use"] == 0
