"""The native forward against llama.cpp (llama-cpp-python) on the real models: teacher-forced
logits over a ~200-token text and a greedy continuation.

Both engines quantize activations (llama.cpp to Q8_0/Q8_K per op, ktd the same way) but not
bit-identically (summation order, F16 KV rounding), so logits differ by a small absolute amount;
the bounds below were measured on the pinned llama.cpp and hold with margin.
"""

from __future__ import annotations

import numpy as np
import pytest

from ktd.engine import Engine

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

TEXT = (
    "def is_prime(n: int) -> bool:\n"
    '    """Return True if n is a prime number."""\n'
    "    if n < 2:\n        return False\n"
    "    for d in range(2, int(n ** 0.5) + 1):\n"
    "        if n % d == 0:\n            return False\n    return True\n\n\n"
    "The sieve of Eratosthenes is an ancient algorithm for finding all prime numbers up to any "
    "given limit. It does so by iteratively marking as composite the multiples of each prime, "
    "starting with the first prime number, 2. The multiples of a given prime are generated as a "
    "sequence of numbers starting from that prime, with constant difference between them that is "
    "equal to that prime. This is the sieve's key distinction from using trial division to "
    "sequentially test each candidate number for divisibility by each prime.\n\n"
    "def sieve(limit):\n    flags = [True] * (limit + 1)\n    flags[0] = flags[1] = False\n"
)
QUESTION = "Write a Python function that reverses a string."
N_GREEDY = 32
# Measured (2 threads, AVX2) over the 213-token TEXT:
# - qwen2.5-coder-0.5b: top-1 0.995 (one near-tie), max |Δlogit| 0.72 over logits of -26..36.
# - gemma-3-270m: top-1 0.967, max |Δlogit| 4.3 over logits up to ~28. Gemma's residual stream is
#   large (embeddings × sqrt(n_embd)), so the per-op Q8 activation rounding that both engines do
#   (differently) moves its logits far more. Against the exact float64 numpy forward on the first
#   48 tokens, ktd and llama.cpp are equally far (max 3.02 vs 2.96) and ktd agrees better on top-1
#   (0.979 vs 0.938): the gap is rounding noise of the quantized file, not a modelling difference.
MIN_TOP1 = {"qwen2.5-coder-0.5b": 0.99, "gemma-3-270m": 0.95}
MAX_ABS = {"qwen2.5-coder-0.5b": 1.0, "gemma-3-270m": 6.0}


def _oracle():
    try:
        import llama_cpp
    except ImportError as e:
        pytest.skip(f"llama-cpp-python (the llama.cpp oracle) is not installed: {e}; run tools/oracle.sh")
    return llama_cpp


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "gemma-3-270m"])
def pair(request, real_model):
    llama_cpp = _oracle()
    path = real_model(request.param)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, n_threads=2, verbose=False)
    eng = Engine.open(path, n_ctx=512, threads=2, pin=False)
    return request.param, llm, eng


def test_teacher_forced_logits_match_llama_cpp(pair):
    name, llm, eng = pair
    toks = eng.tokenizer.encode(TEXT)
    assert 150 <= len(toks) <= 300
    llm.reset()
    llm.eval(toks)
    ref = np.array(llm.scores[: len(toks)], dtype=np.float32)
    got = eng.forward(np.array(toks), np.arange(len(toks)), np.zeros(len(toks)), np.ones(len(toks), bool))
    top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
    max_abs = float(np.abs(got - ref).max())
    print(f"\n{name}: top-1 agreement {top1:.4f}, max |Δlogit| {max_abs:.3f}, "
          f"logit range {ref.min():.1f}..{ref.max():.1f}")
    assert top1 >= MIN_TOP1[name]
    assert max_abs < MAX_ABS[name]


def test_greedy_continuation_matches_llama_cpp(pair):
    name, llm, eng = pair
    tok = eng.tokenizer
    text = tok.render_chat([{"role": "user", "content": QUESTION}])
    bos = tok.decode([tok.bos_id]) if tok.bos_id is not None else ""
    prompt = tok.encode(text, add_special=not (bos and text.startswith(bos)), parse_special=True)
    llm.reset()
    llm.eval(prompt)
    ref = []
    for _ in range(N_GREEDY):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        ref.append(t)
        llm.eval([t])
    eng.free_seq(0)
    n = len(prompt)
    logits = eng.forward(np.array(prompt), np.arange(n), np.zeros(n), np.eye(1, n, n - 1, dtype=bool)[0])
    got = []
    for i in range(N_GREEDY):
        t = int(logits[0].argmax())
        got.append(t)
        logits = eng.forward(np.array([t]), np.array([n + i]), np.zeros(1), np.ones(1, bool))
    print(f"\n{name}: {eng.tokenizer.decode(got)!r}")
    assert got == ref, f"ktd: {eng.tokenizer.decode(got)!r}\nllama.cpp: {eng.tokenizer.decode(ref)!r}"
