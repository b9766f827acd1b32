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
CHATML_PROMPT = "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n"
PLAIN_PROMPT = "The history of the city of Rome begins"
# Gemma-3-270M: both engines are about 1.5 logits (max 3) from the exact float64 forward (numpy
# reference, first 48 tokens of TEXT), so free-running greedy decodes part at the first near-tie
# (after 2 tokens on PLAIN_PROMPT). Checked instead along llama.cpp's greedy path: ktd's argmax
# must equal llama.cpp's wherever llama.cpp's top-1 leads its runner-up by more than
# GREEDY_TIE_MARGIN logits.
STRICT_GREEDY = {"qwen2.5-coder-0.5b"}
GREEDY_TIE_MARGIN = 2.0
MIN_GREEDY_PATH_AGREEMENT = 0.9  # measured 30/32 on PLAIN_PROMPT
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


def _llama_greedy(llm, prompt):
    llm.reset()
    llm.eval(prompt)
    toks, margins = [], []
    for _ in range(N_GREEDY):
        row = np.asarray(llm.scores[llm.n_tokens - 1])
        top2 = np.sort(row)[-2:]
        toks.append(int(np.argmax(row)))
        margins.append(float(top2[1] - top2[0]))
        llm.eval([toks[-1]])
    return toks, margins


def test_greedy_continuation_matches_llama_cpp(pair):
    name, llm, eng = pair
    tok = eng.tokenizer
    if name in STRICT_GREEDY:
        # ChatML without the template's default system prompt (with it, the two engines part at a
        # near-tie after 3 tokens: "Here's a" + " Python" vs " simple").
        prompt = tok.encode(CHATML_PROMPT, parse_special=True)
    else:
        prompt = tok.encode(PLAIN_PROMPT)
    ref, margins = _llama_greedy(llm, prompt)
    eng.free_seq(0)
    n = len(prompt)
    logits = eng.forward(np.array(prompt), np.arange(n), np.zeros(n), np.arange(n) == n - 1)
    got = []
    for i in range(N_GREEDY):
        got.append(int(logits[0].argmax()))
        # Free-running for the strict models; along llama.cpp's path for the others.
        nxt = got[-1] if name in STRICT_GREEDY else ref[i]
        logits = eng.forward(np.array([nxt]), np.array([n + i]), np.zeros(1), np.ones(1, bool))
    print(f"\n{name}: {tok.decode(got)!r}")
    if name in STRICT_GREEDY:
        assert got == ref, f"ktd: {tok.decode(got)!r}\nllama.cpp: {tok.decode(ref)!r}"
    else:
        clear = [i for i in range(N_GREEDY) if margins[i] > GREEDY_TIE_MARGIN]
        assert [got[i] for i in clear] == [ref[i] for i in clear]
        agree = sum(g == r for g, r in zip(got, ref))
        assert agree >= MIN_GREEDY_PATH_AGREEMENT * N_GREEDY, f"{agree}/{N_GREEDY}"
