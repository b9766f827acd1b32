"""Sampling cost per mode as a share of a real decode step, at n_vocab = 151936 (Qwen2).

    python -m ktd.bench.sampling [--model qwen2.5-coder-0.5b] [--threads 2] [--reps 200]

The issue's budget: sampling takes < 2 % of a decode step at this vocabulary. Every mode of
ktd.text.sampling (greedy, temperature, top-k, top-p, min-p, the penalties over a window, and
combinations) is timed on three logit shapes: "peaked" (Zipf-like: what a language model
usually produces, a few plausible tokens), "flat3" (normal, σ = 3: a nucleus of a few thousand
tokens) and "flat1" (normal, σ = 1: a nucleus of ~100k tokens, the worst case for top-p).

The grammar section (``--grammar``, on by default) decodes with the model under a typical JSON
Schema (``SCHEMA``: an object of strings, an integer, an enum and an array), greedy, the grammar's
mask applied, and times per token on the engine thread: the mask (llguidance, thread CPU time),
the extra cost of the masked sampling over the unmasked one, and the matcher's advance; their sum
as a share of the step (the target: <= 5 % on the 0.5B model at 2 threads). Then the same request
through the Scheduler with the mask computed on a helper thread during the forward and after it
(paired, alternating): the engine thread's time on masks per token outside the forward (the
daemon overlaps; on a machine whose every core runs the forward the helper thread takes its time
from the forward's threads instead, which this does not separate).

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

from ktd import _native
from ktd.bench import finish_decode_prefetch_tuning
from ktd.text.sampling import Sampler, SamplingParams

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
    from ktd.ops import models
    from ktd.server.engine import Engine

    engine = Engine.open(models.fetch(model) if model in models.MODELS else model,
                         n_ctx=n_steps + 16 + _native.kernels.DECODE_PREFETCH_TUNE_STEPS, threads=threads)
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
    finish_decode_prefetch_tuning(step)  # and the decode prefetch tuning, not timed either
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


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "language": {"enum": ["python", "c", "c++", "rust", "go"]},
        "lines": {"type": "integer", "minimum": 1, "maximum": 100000},
        "description": {"type": "string", "maxLength": 300},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 8},
    },
    "required": ["name", "language", "lines", "description", "tags"],
    "additionalProperties": False,
}


def grammar_cost(model: str, threads: int, reps: int, yardstick: str = "wall") -> dict:
    """Per-token cost of a JSON Schema grammar beside the decode step of ``model`` (see the module
    docstring); a greedy decode that starts a new document whenever one is complete."""
    from ktd.text import grammar
    from ktd.ops import models
    from ktd.server.engine import Engine

    engine = Engine.open(models.fetch(model) if model in models.MODELS else model, n_ctx=reps + 256,
                         threads=threads)
    tok = engine.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Describe a small program you like as JSON with "
                                                          "name, language, lines, description and tags."}])
    spec = grammar.parse_spec({"json_schema": SCHEMA})
    t0 = time.thread_time()
    constraint = grammar.compile_grammar(spec, tok)  # the tokenizer table is built here, once
    compile_ms = (time.thread_time() - t0) * 1e3
    t0 = time.thread_time()
    grammar.compile_grammar(spec, tok)
    compile_again_ms = (time.thread_time() - t0) * 1e3
    sampler = Sampler(SamplingParams(temperature=0.0))
    logits = engine.forward(np.asarray(prompt, np.int32), np.arange(len(prompt), dtype=np.int32),
                            np.zeros(len(prompt), np.int32), np.eye(1, len(prompt), len(prompt) - 1, dtype=bool)[0])
    pos, history = len(prompt), list(prompt)
    mask_ms, sample_extra_ms, advance_ms, steps, cpu_steps = [], [], [], [], []
    documents = 0
    for _ in range(reps):
        row = logits[0]
        t0 = time.thread_time()
        words = constraint.mask()
        t1 = time.thread_time()
        token = sampler.sample(row, history, words)
        t2 = time.thread_time()
        sampler.sample(row, history)
        t3 = time.thread_time()
        if token not in tok.eos_ids:
            constraint.advance(token)
        if token in tok.eos_ids or constraint.done:  # a complete document: start the next one
            constraint.matcher.reset()
            documents += 1
        t4 = time.thread_time()
        mask_ms.append((t1 - t0) * 1e3)
        sample_extra_ms.append(((t2 - t1) - (t3 - t2)) * 1e3)
        advance_ms.append((t4 - t3) * 1e3)
        history.append(token)
        w0, c0 = time.perf_counter(), time.process_time()
        logits = engine.forward(np.array([token], np.int32), np.array([pos], np.int32), np.zeros(1, np.int32),
                                np.ones(1, np.bool_))
        steps.append((time.perf_counter() - w0) * 1e3)
        cpu_steps.append((time.process_time() - c0) * 1e3 / threads)
        pos += 1
    step_ms = statistics.median(steps if yardstick == "wall" else cpu_steps)
    total = [a + b + c for a, b, c in zip(mask_ms, sample_extra_ms, advance_ms)]
    out = {"model": model, "threads": threads, "tokens": reps, "documents": documents,
           "compile_ms_first": compile_ms, "compile_ms": compile_again_ms, "step_ms": step_ms,
           "mask_ms_median": statistics.median(mask_ms), "mask_ms_mean": statistics.fmean(mask_ms),
           "mask_ms_max": max(mask_ms),
           "masked_sampling_extra_ms_median": statistics.median(sample_extra_ms),
           "advance_ms_median": statistics.median(advance_ms),
           "grammar_ms_mean": statistics.fmean(total),
           "share_of_step_mean": statistics.fmean(total) / step_ms,
           "share_of_step_median": statistics.median(total) / step_ms}
    print(f"\nJSON Schema grammar, {model}, {threads} threads, {reps} tokens ({documents} complete documents); "
          f"decode step {yardstick} median {step_ms:.2f} ms")
    print(f"  compile: {compile_ms:.1f} ms the first time (with the tokenizer table), {compile_again_ms:.1f} ms after")
    print(f"  mask per token: median {out['mask_ms_median']:.3f} ms, mean {out['mask_ms_mean']:.3f} ms, "
          f"max {out['mask_ms_max']:.3f} ms")
    print(f"  masked sampling, extra: median {out['masked_sampling_extra_ms_median']:.3f} ms; advance: median "
          f"{out['advance_ms_median']:.3f} ms")
    print(f"  grammar per token: mean {out['grammar_ms_mean']:.3f} ms = {out['share_of_step_mean']:.2%} of a step "
          f"(median {out['share_of_step_median']:.2%})", flush=True)
    for overlap in (True, False, True, False):  # paired, alternating
        r = _in_scheduler(engine, prompt, spec, reps, overlap)
        key = "overlap" if overlap else "inline"
        out.setdefault(f"scheduler_{key}_mask_ms", []).append(r)
    for key, what in (("overlap", "on a helper thread during the forward"), ("inline", "after the forward")):
        runs = out[f"scheduler_{key}_mask_ms"]
        print(f"  in the scheduler, mask {what}: the engine thread spent "
              + ", ".join(f"{ms:.3f}" for ms in runs) + " ms per token on it (2 runs)", flush=True)
    return out


def _in_scheduler(engine, prompt: list[int], spec, reps: int, overlap: bool) -> float:
    """The mask's exposed cost in the daemon's path: one constrained greedy request through the
    Scheduler, the mask computed during the forward (overlap) or after it; the engine thread's
    time on it per token (ms)."""
    import threading

    from ktd.text import grammar
    from ktd.server.scheduler import Job, Scheduler

    engine.free_seq(0)
    s = Scheduler(engine, prefill_tokens_per_step=512, max_queue=1, overlap_masks=overlap)
    s.start()
    done = threading.Event()
    try:
        s.submit(Job(client=0, prompt=list(prompt), sampling=SamplingParams(temperature=0.0), max_tokens=reps,
                     stop=(), ignore_eos=False, sink=lambda kind, payload: kind != "chunk" and done.set(),
                     constraint=grammar.compile_grammar(spec, engine.tokenizer)))
        done.wait()
    finally:
        s.stop(timeout=60)
    return s._masks.wait_seconds * 1e3 / max(s._masks.rows, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.sampling", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b",
                    help="model whose decode step is the yardstick (name or path; 'none': sampling only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=200, help="decode steps and sampling calls per mode")
    ap.add_argument("--step", choices=["wall", "cpu"], default="wall",
                    help="yardstick: the step's wall time, or its process CPU time / threads (busy machines)")
    ap.add_argument("--grammar", action=argparse.BooleanOptionalAction, default=True,
                    help="also time a JSON Schema grammar's mask per token (needs --model)")
    ap.add_argument("--only-grammar", action="store_true", help="only the grammar section")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.reps < 1:
        print("--threads and --reps must be >= 1", file=sys.stderr)
        return 1
    model = None if args.model == "none" else args.model
    if not args.only_grammar:
        run(model, args.threads, args.reps, args.step)
    if (args.grammar or args.only_grammar) and model:
        grammar_cost(model, args.threads, args.reps, args.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
