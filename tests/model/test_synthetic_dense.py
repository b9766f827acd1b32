"""The benchmark-sized dense file's generator (tests/models/synthetic_dense.py), checked small: its
Q4_K_M type rule against llama.cpp's own Q4_K_M of Qwen2.5-Coder-1.5B (same architecture and
depth), its random blocks through gguf-py's dequantization, and a small file of the same layout
through ktd and llama.cpp (the same blocks, so the same logits within the activation rounding)."""

from __future__ import annotations

import inspect
from collections import Counter

import gguf
import numpy as np
import pytest

from ktd.server.engine import Engine
from models import synthetic_dense as SD

SMALL = SD.DenseShape(n_layer=9, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=384)


def test_the_type_rule_is_llama_cpps_q4_k_m(real_model_reader):
    """Every tensor of the real Q4_K_M file (llama.cpp's quantizer) has the type q4_k_m_type gives
    it: 29 Q6_K (output, 14 attn_v, 14 ffn_down) and 169 Q4_K over its 28 layers."""
    r = real_model_reader("qwen2.5-coder-1.5b")
    n_layer = int(r.fields["qwen2.block_count"].parts[-1][0])
    got = {t.name: SD.q4_k_m_type(t.name, n_layer) for t in r.tensors if len(t.shape) == 2}
    want = {t.name: t.tensor_type.name for t in r.tensors if len(t.shape) == 2}
    assert got == want
    assert Counter(want.values()) == {"Q4_K": 169, "Q6_K": 29}


@pytest.mark.parametrize("qt", ["Q4_K", "Q6_K"])
def test_random_blocks_decode_to_the_intended_scale(qt):
    rng = np.random.default_rng(3)
    blocks = SD.random_k_blocks(qt, 64, 1024, rng, 1 / 32)
    assert blocks.shape == (64, 4 * SD._K_BLOCKS[qt][0])
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qt])
    assert w.shape == (64, 1024) and np.isfinite(w).all()
    assert 0.7 / 32 < float(w.std()) < 1.3 / 32


def test_a_small_file_runs_in_ktd_and_llama_cpp_alike(tmp_path):
    """The layout (tensor table, metadata, biases, tokenizer) is one both engines read the same way:
    teacher-forced logits within 3% of the row's largest (the Q8_K activation rounding of two
    implementations over 9 random layers), the same argmax wherever llama.cpp's lead is clear."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp (llama-cpp-python, tools/oracle.sh) is the reference")
    path = SD.make_model(tmp_path / "d.gguf", shape=SMALL)
    r = gguf.GGUFReader(str(path))
    types = Counter(t.tensor_type.name for t in r.tensors)
    assert types["Q6_K"] == 1 + 2 * sum(SD.use_more_bits(i, SMALL.n_layer) for i in range(SMALL.n_layer))
    tokens = np.random.default_rng(5).integers(3, SMALL.n_vocab, 12)
    eng = Engine.open(str(path), n_ctx=32, threads=2)
    n = len(tokens)
    got = np.asarray(eng.forward(tokens, np.arange(n), np.zeros(n), np.ones(n, bool)))
    kwargs = dict(model_path=str(path), n_ctx=32, n_batch=32, n_threads=2, logits_all=True, verbose=False)
    accepted = inspect.signature(llama_cpp.Llama.__init__).parameters
    llm = llama_cpp.Llama(**{k: v for k, v in kwargs.items() if k in accepted})
    llm.eval(tokens.tolist())
    want = np.array(llm.scores[:n])
    llm.close()
    assert np.isfinite(got).all() and got.shape == want.shape
    scale = np.max(np.abs(want), axis=1, keepdims=True)
    assert float(np.max(np.abs(got - want) / scale)) <= 3e-2
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.06 * scale[:, 0]
    assert clear.any()
    np.testing.assert_array_equal(np.argmax(got, axis=1)[clear], np.argmax(want, axis=1)[clear])
