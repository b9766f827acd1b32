"""The summary of a load run (N concurrent clients x M requests): ``ktctl bench``'s over the socket
and ``ktd.bench.http_load``'s over HTTP print the same JSON object."""

from __future__ import annotations

import statistics
from typing import Any


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
