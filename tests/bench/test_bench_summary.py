"""The load-run summary shared by ``ktctl bench`` and ``ktd.bench.http_load`` (ktd.ops.load_report):
its percentiles against numpy.percentile, its units, and both tools' JSON against one real daemon
(fake engine) — the same keys, the counts of what was asked."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ktd.ops.load_report import load_summary, percentiles

DAEMON = dict(model={"n_ctx": 256, "n_seq_max": 4}, fake={"eos_bias": -8.0})  # the module's daemon (conftest)


@pytest.mark.parametrize("n", [2, 3, 10, 101, 1000])
def test_percentiles_match_numpy(n):
    values = list(np.random.default_rng(n).exponential(size=n))
    got = percentiles(values)
    want = np.percentile(values, [50, 90, 99])  # linear interpolation, numpy's default
    np.testing.assert_allclose([got["p50"], got["p90"], got["p99"]], want, rtol=1e-12)


def test_percentiles_of_none_and_one():
    assert percentiles([]) == {}
    assert percentiles([0.25]) == {"p50": 0.25, "p90": 0.25, "p99": 0.25}


def test_load_summary_units():
    s = load_summary(clients=2, requests=4, completed=3, errors={"busy": 1}, tokens=30, wall=1.5, cpu=0.25,
                     ttft=[0.010, 0.020, 0.030], latency=[0.5, 0.5, 0.5], decode=[10.0, 20.0, 30.0])
    assert s["ttft_ms"] == {"p50": 20.0, "p90": 28.0, "p99": 29.8}  # seconds in, ms out
    assert s["latency_ms"] == {"p50": 500.0, "p90": 500.0, "p99": 500.0}
    assert s["decode_tokens_per_s"]["p50"] == 20.0
    assert s["tokens_per_s"] == 20.0 and s["wall_s"] == 1.5 and s["cpu_s"] == 0.25
    assert (s["clients"], s["requests"], s["completed"], s["errors"]) == (2, 4, 3, {"busy": 1})
    assert load_summary(clients=1, requests=1, completed=0, errors=[], tokens=0, wall=0.0, cpu=0.0,
                        ttft=[], latency=[], decode=[])["tokens_per_s"] == 0.0


def test_http_load_and_ktctl_bench_report_alike(daemon, gateway):
    r = subprocess.run([sys.executable, "-m", "ktd.bench.http_load", gateway.url, "--streams", "2",
                        "--tokens", "8"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    http = json.loads(r.stdout)
    r = subprocess.run([sys.executable, "-m", "ktd.ctl", "--socket", daemon.socket, "bench", "-c", "2", "-r", "1",
                        "-n", "8", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    sock = json.loads(r.stdout)
    assert list(http) == list(sock)
    for out in (http, sock):
        assert (out["clients"], out["requests"], out["completed"], out["generated_tokens"]) == (2, 2, 2, 16)
        assert not out["errors"]
        for key in ("ttft_ms", "latency_ms", "decode_tokens_per_s"):
            assert set(out[key]) == {"p50", "p90", "p99"}
        assert out["ttft_ms"]["p50"] <= out["latency_ms"]["p50"]
