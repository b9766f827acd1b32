"""Benchmarks (``make bench-*``): report throughput and ratios, never assert timings."""

from __future__ import annotations

import json
import os
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
