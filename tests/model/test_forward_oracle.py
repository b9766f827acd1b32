"""The native forward against llama.cpp (llama-cpp-python) on the real models: teacher-forced
logits over a ~200-token text and a greedy continuation; for Gemma 3 also on a copy of the file
dequantized to F32, where neither engine quantizes activations.

Both engines quantize activations (llama.cpp to Q8_0/Q8_K per op, ktd the same way) but not
bit-identically (summation order, F16 KV rounding), so logits differ by a small absolute amount;
the bounds below were measured on the pinned llama.cpp and hold with margin.
"""

from __future__ import annotations

import numpy as np
import pytest

from ktd.server.engine import Engine

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
# Measured (2 threads) over the 213-token TEXT:
# - qwen2.5-coder-0.5b: top-1 0.995 (one near-tie), max |Δlogit| 0.72 over logits of -26..36.
# - gemma-3-270m: top-1 0.958 (9 positions, all where llama.cpp's own top-2 margin is < 0.4),
#   max |Δlogit| 5.3 over logits of -47..38. This is the noise floor of the quantized file, not a
#   modelling difference: llama.cpp disagrees with itself as much. Its own settings, top-1
#   agreement with its default (one batched prefill; n_batch 8, 32 or 512 and 1 or 2 threads all
#   give identical logits): token by token 0.977, flash attention on 0.962 (ktd: 0.958; ktd
#   against those two: 0.962 and 0.967). The exact float64 forward (numpy reference, dequantized
#   weights) agreed with llama.cpp at 0.967 and with ktd at 0.972 (first 48 tokens).
#   Cause: Gemma's residual stream reaches 1e5 and the FFN-down input has outliers
#   ~2000x its median (layer 0: max 156, median 0.08), so a Q8 activation step (block max / 127)
#   is many times the typical value; any upstream difference, down to F32 rounding (summation
#   order; llama.cpp also rounds GELU through an F16 table and Q and the softmax to F16 in
#   attention, which ktd keeps in F32), flips roundings that each move a row's output by up to ~1%.
#   Per op, llama.cpp's layer-0 outputs equal a numpy emulation of its Q8_0/Q8_K activation
#   quantization to 1e-7 (relative), so both engines compute the same model.
# Hence top-1 is bounded per model below, and additionally over the "decided" positions, where
# llama.cpp's top-1 leads its runner-up by more than DECIDED_MARGIN logits (170 of 213 for Gemma,
# all agree), and ktd's argmax must be within MAX_REGRET logits of llama.cpp's best everywhere
# (Gemma: 0.39 measured).
MIN_TOP1 = {"qwen2.5-coder-0.5b": 0.99, "gemma-3-270m": 0.95}
DECIDED_MARGIN = 0.5
MIN_TOP1_DECIDED = 0.99
MAX_REGRET = 1.0
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
    agree = got.argmax(-1) == ref.argmax(-1)
    top1 = float(agree.mean())
    max_abs = float(np.abs(got - ref).max())
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > DECIDED_MARGIN
    top1_decided = float(agree[decided].mean())
    regret = float((ref.max(-1) - ref[np.arange(len(toks)), got.argmax(-1)]).max())
    print(f"\n{name}: top-1 agreement {top1:.4f} ({top1_decided:.4f} on the {decided.sum()} positions with "
          f"llama.cpp margin > {DECIDED_MARGIN}), max regret {regret:.3f}, max |Δlogit| {max_abs:.3f}, "
          f"logit range {ref.min():.1f}..{ref.max():.1f}")
    assert top1 >= MIN_TOP1[name]
    assert top1_decided >= MIN_TOP1_DECIDED
    assert regret < MAX_REGRET
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


# ---- the same model without activation quantization -------------------------------------------
# With every weight dequantized to F32 (by gguf-py), neither engine quantizes activations (F32
# weights take F32 inputs), so the Q8 rounding noise above is gone and only the modelling is
# compared. Measured on gemma-3-270m: top-1 1.000, max |Δlogit| 0.052 (ktd vs the exact float64
# numpy forward: 0.046); what remains is F16 KV cache and llama.cpp's F16 GELU/attention roundings.
MIN_TOP1_F32 = 0.99
MAX_ABS_F32 = 0.2


def _write_dequantized(reader, dst):
    """A copy of the GGUF file gguf-py's reader has open with every tensor dequantized to F32 by
    gguf-py."""
    import gguf
    from gguf.quants import dequantize

    w = gguf.GGUFWriter(str(dst), arch=str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            w.add_uint32(key, int(gguf.LlamaFileType.ALL_F32))
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        data = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape.tolist())]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_dequantized_gemma_logits_match_llama_cpp(real_model_reader, tmp_path):
    llama_cpp = _oracle()
    path = tmp_path / "gemma-3-270m-f32.gguf"
    _write_dequantized(real_model_reader("gemma-3-270m"), path)
    eng = Engine.open(path, n_ctx=512, threads=2, pin=False)
    toks = eng.tokenizer.encode(TEXT)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, n_threads=2, verbose=False)
    llm.eval(toks)
    ref = np.array(llm.scores[: len(toks)], dtype=np.float32)
    got = eng.forward(np.array(toks), np.arange(len(toks)), np.zeros(len(toks)), np.ones(len(toks), bool))
    top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
    max_abs = float(np.abs(got - ref).max())
    print(f"\ngemma-3-270m dequantized to F32: top-1 agreement {top1:.4f}, max |Δlogit| {max_abs:.4f}")
    assert top1 >= MIN_TOP1_F32
    assert max_abs < MAX_ABS_F32
