"""Per-call cost of ktd.sampling at n_vocab = 151936 (Qwen2 vocabulary). Not a test.

Two logit shapes: "peaked" (Zipf-like, what a language model usually produces: a few plausible
tokens) and "flat" (standard normal x 3: thousands of plausible tokens, the worst case for
top-p). Prints the median of repeated calls in milliseconds (thread CPU time, which a busy
machine disturbs less than wall time) and, with ``--model``, the share of that model's decode
step (the median forward of one row; the issue's budget is 2 % at this vocabulary).

    .venv/bin/python bench/sampling.py [--model qwen2.5-coder-0.5b] [--threads N]
"""

from __future__ import annotations

import argparse
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


def decode_step_ms(model: str, threads: int) -> float:
    """Median wall time of one decode forward (one row) of ``model``, in ms."""
    from ktd import models
    from ktd.engine import Engine

    engine = Engine.open(models.fetch(model) if model in models.MODELS else model, n_ctx=512,
                         threads=threads)
    times = []
    for pos in range(64):
        t0 = time.perf_counter()
        engine.forward(np.array([1], np.int32), np.array([pos], np.int32), np.zeros(1, np.int32),
                       np.ones(1, np.bool_))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[8:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description="per-call cost of ktd.sampling at n_vocab 151936")
    ap.add_argument("--model", default=None, help="also measure this model's decode step (name or path)")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    step = decode_step_ms(args.model, args.threads) if args.model else None
    if step is not None:
        print(f"decode step of {args.model}: median {step:.2f} ms")
    rng = np.random.default_rng(0)
    history = [int(t) for t in rng.integers(0, N_VOCAB, 512)]
    for shape, make in (("peaked", logits_peaked), ("flat", logits_flat)):
        logits = make(rng)
        for name, params in CASES.items():
            sampler = Sampler(params)
            times = []
            for _ in range(200):
                t0 = time.thread_time()
                sampler.sample(logits, history)
                times.append(time.thread_time() - t0)
            ms = statistics.median(times) * 1e3
            share = f"  {ms / step:6.2%} of a step" if step else ""
            print(f"{shape:6} {name:42} median {ms:7.3f} ms{share}")


if __name__ == "__main__":
    main()
