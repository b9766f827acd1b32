"""ktctl and the client library against a real daemon process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fake_engine
from paths import ROOT

ROOT = str(ROOT)
DAEMON = dict(fake={"step_delay_s": 0.002}, model={"n_seq_max": 4})  # the module's daemon (conftest)


def ktctl(daemon, *args, input=None):
    code = "import sys; from ktd.ctl import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, "--socket", daemon.socket, *args], capture_output=True,
                          text=True, input=input, timeout=120)


def test_generate_streams_the_greedy_text(daemon):
    r = ktctl(daemon, "generate", "hello", "-n", "12", "-t", "0", "-v")
    assert r.returncode == 0, r.stderr
    tok = fake_engine.ByteTokenizer()
    ref = fake_engine.reference_greedy(tok.encode("hello"), 12)
    assert r.stdout == tok.decode([t for t in ref if t not in tok.eos_ids]) + "\n"
    assert json.loads(r.stderr)["usage"]["prompt_tokens"] == 6


def test_chat_status_health_metrics_tokenize(daemon):
    r = ktctl(daemon, "chat", "-m", "hi", "-n", "4", "--system", "be brief")
    assert r.returncode == 0 and r.stdout.endswith("\n")
    r = ktctl(daemon, "chat", "-n", "3", input="one\ntwo\n")
    assert r.returncode == 0 and r.stdout.count("> ") == 3
    r = ktctl(daemon, "status")
    assert json.loads(r.stdout)["scheduler"]["slots_total"] == 4
    assert ktctl(daemon, "health").stdout == "ok\n"
    assert "# TYPE ktd_slots_in_use gauge" in ktctl(daemon, "metrics").stdout
    assert json.loads(ktctl(daemon, "tokenize", "ab").stdout) == [fake_engine.BOS, 97, 98]


def test_errors_are_one_line(daemon, tmp_path):
    r = ktctl(daemon, "generate", "x", "-n", "0")
    assert r.returncode == 1 and r.stderr.startswith("ktctl: error: bad_request: generate: max_tokens")
    r = ktctl(daemon, "generate", "def f(", "--suffix", ")", "-n", "4")  # the fake model has no FIM tokens
    assert r.returncode == 1 and r.stderr.startswith("ktctl: error: bad_request: generate: suffix")
    code = "import sys; from ktd.ctl import main; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", code, "--socket", str(tmp_path / "none.sock"), "health"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "ktctl: error:" in r.stderr and "Traceback" not in r.stderr


def test_bench_reports_aggregates(daemon):
    r = ktctl(daemon, "bench", "-c", "3", "-r", "2", "-n", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["completed"] == 6 and out["generated_tokens"] == 48 and out["errors"] == {}
    assert out["latency_ms"]["p50"] > 0 and set(out["ttft_ms"]) == {"p50", "p90", "p99"}
    # per-stream decode rate as the client sees it (tokens after the first / their time)
    assert set(out["decode_tokens_per_s"]) == {"p50", "p90", "p99"} and out["decode_tokens_per_s"]["p50"] > 0
    assert out["cpu_s"] > 0
