"""Sampling cost per mode as a share of a real decode step, at n_vocab = 151936 (Qwen2).

    python -m ktd.bench.sampling [--model qwen2.5-coder-0.5b] [--threads 2] [--reps 200]

The issue's budget: sampling takes < 2 % of a decode step at this vocabulary. Every mode of
ktd.sampling (greedy, temperature, top-k, top-p, min-p, the penalties over a window, and
combinations) is timed on three logit shapes: "peaked" (Zipf-like: what a language model
usually produces, a few plausible tokens), "flat3" (normal, σ = 3: a nucleus of a few thousand
tokens) and "flat1" (normal, σ = 1: a nucleus of ~100k tokens, the worst case for top-p).

Both sides are measured in this run, interleaved (a decode step, then one sampling call of
each mode, repeated): a decode step is one forward of one row of ``--model`` at a growing
position; sampling is one ``Sampler.sample`` call. Sampling times are thread CPU time (a busy
machine disturbs it less than wall time), the step is wall time (its threads wait on each other
and on memory), reported as median and minimum, and also as the process CPU time per step
divided by the thread count (what the step would take if its threads were never descheduled:
the yardstick to use on a shared, overloaded machine, ``--step cpu``; the pool spins at most
50 µs before sleeping, so idle threads add little). The share printed is median sampling /
median step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from ktd.sampling import Sampler, SamplingParams

N_VOCAB = 151936
PENALTIES = dict(repeat_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2, penalty_last_n=64)
# Defaults of SamplingParams: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05; "off" values
# below switch the others off so that each line times one filter (plus the draw).
OFF = dict(top_k=0, top_p=1.0, min_p=0.0)
MODES: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy + penalties": SamplingParams(temperature=0.0, **PENALTIES),
    "temperature 0.8": SamplingParams(seed=1, **OFF),
    "top-k 40": SamplingParams(seed=1, **{**OFF, "top_k": 40}),
    "top-k 1000": SamplingParams(seed=1, **{**OFF, "top_k": 1000}),
    "top-p 0.95": SamplingParams(seed=1, **{**OFF, "top_p": 0.95}),
    "top-p 0.5": SamplingParams(seed=1, **{**OFF, "top_p": 0.5}),
    "min-p 0.05": SamplingParams(seed=1, **{**OFF, "min_p": 0.05}),
    "penalties + temperature": SamplingParams(seed=1, **OFF, **PENALTIES),
    "penalties + top-p 0.95": SamplingParams(seed=1, **{**OFF, "top_p": 0.95}, **PENALTIES),
    "top-p 0.95 + min-p 0.05": SamplingParams(seed=1, top_k=0),
    "top-k 1000 + top-p 0.95": SamplingParams(seed=1, top_k=1000, min_p=0.0),
    "default (k 40, p 0.95, min-p 0.05)": SamplingParams(seed=1),
    "default + penalties": SamplingParams(seed=1, **PENALTIES),
}


def logits_peaked(rng: np.random.Generator) -> np.ndarray:
    rank = rng.permutation(N_VOCAB) + 1
    return (-2.0 * np.log(rank) + rng.standard_normal(N_VOCAB) * 0.5 + 20).astype(np.float32)


def logits_normal(sigma: float) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: (rng.standard_normal(N_VOCAB) * sigma).astype(np.float32)


SHAPES = {"peaked": logits_peaked, "flat3": logits_normal(3.0), "flat1": logits_normal(1.0)}


def open_step(model: str, threads: int, n_steps: int) -> Callable[[], tuple[float, float]]:
    """A function that runs the next decode step of ``model`` (one row, positions 0, 1, ...; at
    most ``n_steps`` calls after the warm-up) and returns (wall time, process CPU time /
    threads) in ms."""
    from ktd import models
    from ktd.engine import Engine

    engine = Engine.open(models.fetch(model) if model in models.MODELS else model, n_ctx=n_steps + 16,
                         threads=threads)
    pos = 0

    def step() -> float:
        nonlocal pos
        t0, c0 = time.perf_counter(), time.process_time()
        engine.forward(np.array([1], np.int32), np.array([pos], np.int32), np.zeros(1, np.int32),
                       np.ones(1, np.bool_))
        pos += 1
        return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3 / threads

    for _ in range(8):  # warm-up: caches, page faults of the weights, the pool's threads
        step()
    return step


def run(model: str | None, threads: int, reps: int, yardstick: str = "wall") -> list[dict]:
    step = open_step(model, threads, reps) if model else None
    rng = np.random.default_rng(0)
    history = [int(t) for t in rng.integers(0, N_VOCAB, 512)]
    rows = {shape: make(rng) for shape, make in SHAPES.items()}
    samplers = {(mode, shape): Sampler(p) for mode, p in MODES.items() for shape in SHAPES}
    times: dict[tuple[str, str], list[float]] = {key: [] for key in samplers}
    steps: list[float] = []
    cpu_steps: list[float] = []
    for _ in range(reps):
        if step:
            wall, cpu = step()
            steps.append(wall)
            cpu_steps.append(cpu)
        for (mode, shape), sampler in samplers.items():
            t0 = time.thread_time()
            sampler.sample(rows[shape], history)
            times[(mode, shape)].append((time.thread_time() - t0) * 1e3)
    step_ms = None
    if steps:
        step_ms = statistics.median(steps if yardstick == "wall" else cpu_steps)
        print(f"decode step of {model}, {threads} threads ({len(steps)} steps): wall median "
              f"{statistics.median(steps):.2f} ms, min {min(steps):.2f} ms; CPU/threads median "
              f"{statistics.median(cpu_steps):.2f} ms; shares below are of the {yardstick} median")
    print(f"{'mode':36}" + "".join(f"{shape:>20}" for shape in SHAPES))
    out = []
    for mode in MODES:
        cells = []
        for shape in SHAPES:
            ms = statistics.median(times[(mode, shape)])
            share = ms / step_ms if step_ms else None
            out.append({"mode": mode, "shape": shape, "ms": ms, "share_of_step": share})
            cells.append(f"{ms:7.3f} ms" + (f" {share:6.2%}" if share is not None else " " * 7))
        print(f"{mode:36}" + "".join(f"{c:>20}" for c in cells), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.sampling", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b",
                    help="model whose decode step is the yardstick (name or path; 'none': sampling only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=200, help="decode steps and sampling calls per mode")
    ap.add_argument("--step", choices=["wall", "cpu"], default="wall",
                    help="yardstick: the step's wall time, or its process CPU time / threads (busy machines)")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.reps < 1:
        print("--threads and --reps must be >= 1", file=sys.stderr)
        return 1
    run(None if args.model == "none" else args.model, args.threads, args.reps, args.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
