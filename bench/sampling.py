"""Per-call cost of ktd.sampling at n_vocab = 151936 (Qwen2 vocabulary). Not a test.

Two logit shapes: "peaked" (Zipf-like, what a language model usually produces: a few plausible
tokens) and "flat" (standard normal x 3: thousands of plausible tokens, the worst case for
top-p). Prints the median of repeated calls in milliseconds.

    .venv/bin/python bench/sampling.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ktd.sampling import Sampler, SamplingParams

N_VOCAB = 151936


def logits_peaked(rng: np.random.Generator) -> np.ndarray:
    rank = rng.permutation(N_VOCAB) + 1
    return (-2.0 * np.log(rank) + rng.standard_normal(N_VOCAB) * 0.5 + 20).astype(np.float32)


def logits_flat(rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal(N_VOCAB) * 3).astype(np.float32)


CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "default (T=0.8 k=40 p=0.95 min_p=0.05)": SamplingParams(seed=1),
    "default + penalties": SamplingParams(seed=1, repeat_penalty=1.1, presence_penalty=0.2,
                                          frequency_penalty=0.2),
    "top-p 0.95 only": SamplingParams(seed=1, top_k=0, min_p=0.0),
    "temperature only": SamplingParams(seed=1, top_k=0, top_p=1.0, min_p=0.0),
}


def main() -> None:
    rng = np.random.default_rng(0)
    history = [int(t) for t in rng.integers(0, N_VOCAB, 512)]
    for shape, make in (("peaked", logits_peaked), ("flat", logits_flat)):
        logits = make(rng)
        for name, params in CASES.items():
            sampler = Sampler(params)
            times = []
            for _ in range(200):
                t0 = time.perf_counter()
                sampler.sample(logits, history)
                times.append(time.perf_counter() - t0)
            print(f"{shape:6} {name:42} median {statistics.median(times) * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
