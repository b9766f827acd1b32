"""``ktd run`` end to end on the real 0.5B model: greedy text equals the engine's own greedy decode,
and the speed line is printed on stderr."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ktd import cli
from ktd.server.engine import Engine

pytestmark = pytest.mark.realmodel


def test_run_streams_greedy_text_and_reports_speed(real_model, capsys):
    path = real_model("qwen2.5-coder-0.5b")
    rc = cli.main(["run", str(path), "--prompt", "def fibonacci(n):", "--max-tokens", "12", "--threads", "2"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert re.fullmatch(r"prefill: [0-9.]+ tok/s, decode: [0-9.]+ tok/s\n", err)

    eng = Engine.open(path, n_ctx=64, threads=2, pin=False)
    ids = eng.tokenizer.encode("def fibonacci(n):")
    n = len(ids)
    logits = eng.forward(np.array(ids), np.arange(n), np.zeros(n), np.arange(n) == n - 1)
    gen = []
    for i in range(12):
        t = int(logits[0].argmax())
        if t in eng.tokenizer.eos_ids:
            break
        gen.append(t)
        logits = eng.forward(np.array([t]), np.array([n + i]), np.zeros(1), np.ones(1, bool))
    assert out == eng.tokenizer.decode(gen) + "\n"


def test_run_rejects_bad_model_path(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "nope.gguf"), "--prompt", "x"]) == 1
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["gemma-3-270m", "qwen2.5-coder-0.5b"])
def test_chat_prompt_has_exactly_the_bos_the_model_wants(real_model, name):
    from ktd.commands.run import chat_prompt_ids
    from ktd.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(real_model(name))
    ids = chat_prompt_ids(tok, tok.render_chat([{"role": "user", "content": "hi"}]))
    n_bos = ids.count(tok.bos_id) if tok.bos_id is not None else 0
    assert n_bos == (1 if tok.add_bos else 0)
    assert ids[0] == tok.bos_id or not tok.add_bos
