"""Benchmarks (``make bench-*``): report throughput and ratios, never assert timings."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def write_results(results: Any, out: Path) -> None:
    """Write ``results`` as indented JSON to ``out`` (its directory created), atomically: a reader
    sees the previous file or the new one, never a half-written one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, out)


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90 and p99 of ``values`` (linear interpolation between the order statistics, as
    numpy.percentile's default); {} when there are none."""
    if not values:
        return {}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0]}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def load_summary(*, clients: int, requests: int, completed: int, errors: Any, tokens: int, wall: float,
                 cpu: float, ttft: list[float], latency: list[float], decode: list[float]) -> dict[str, Any]:
    """The one JSON object of a load run, ``ktctl bench``'s and ``ktd.bench.http_load``'s alike:
    counts, wall and client CPU seconds, aggregate tokens/s, and percentiles of the time to first
    token and the request latency (seconds in, milliseconds out: ``*_ms``) and of each request's
    decode tokens/s."""
    def ms(values: list[float]) -> dict[str, float]:
        return {k: round(v * 1e3, 1) for k, v in percentiles(values).items()}

    return {"clients": clients, "requests": requests, "completed": completed, "errors": errors,
            "generated_tokens": tokens, "wall_s": round(wall, 3), "cpu_s": round(cpu, 4),
            "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "ttft_ms": ms(ttft), "latency_ms": ms(latency),
            "decode_tokens_per_s": {k: round(v, 2) for k, v in percentiles(decode).items()}}


def finish_decode_prefetch_tuning(step: Callable[[], Any]) -> int:
    """Run ``step`` (one untimed one-row forward of an in-process engine) until the decode prefetch
    tuning is over, and return how many ran.

    The process's first one-row forwards tune the x86 decode prefetch (native/src/kernels/kernels.h):
    they take the modes in turn, one of them up to ~1.3x slower than the one that stays on some
    CPUs, so a benchmark that times them measures the tuning, not the decode. Stops as soon as the
    setting is fixed (KTD_DECODE_PREFETCH, set_decode_prefetch), tuned, or after one step that did
    not start a tuning (a build or CPU where nothing reads the setting), and at the latest after
    the steps a whole tuning takes."""
    from ktd import _native

    def pending() -> bool:
        return _native.kernels.decode_prefetch_state()["source"] in ("default", "tuning")

    n = 0
    while n < _native.kernels.DECODE_PREFETCH_TUNE_STEPS and pending():
        step()
        n += 1
        if _native.kernels.decode_prefetch_state()["source"] == "default":
            break
    return n


def finish_tuning_greedy(engine: Any, token: int, pos: int, seq: int = 0) -> tuple[int, int, int]:
    """``finish_decode_prefetch_tuning`` with greedy one-row forwards of ``engine`` (a
    ``ktd.server.engine.Engine``): sequence ``seq`` is fed ``token`` at position ``pos``, then each step's
    argmax at the next position. Returns (steps run, the token and position the next step would
    take), so a caller that decodes on from there continues the same sequence."""
    tok = np.array([token], np.int32)
    p = np.array([pos], np.int32)
    sq = np.array([seq], np.int32)
    want = np.ones(1, np.bool_)

    def step() -> None:
        logits = engine.forward(tok, p, sq, want)
        tok[0] = int(np.argmax(logits[0]))
        p[0] += 1

    n = finish_decode_prefetch_tuning(step)
    return n, int(tok[0]), int(p[0])
