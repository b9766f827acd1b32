"""Daemon benchmark: decode through the socket vs in-process, and the continuous-batching gain.

    python -m ktd.bench.daemon [--model NAME|PATH] [--threads N] [--streams 1 2 4 8]
                               [--tokens 128] [--reps 3] [--out bench/results/daemon.json]

One run measures, interleaved per repetition so that a load change on a shared machine hits
every figure of that repetition alike (the quoted ratios are medians of per-repetition ratios):

- ``inproc``: one sequence decoded in this process with ``ktd.server.engine.Engine`` and
  ``ktd.text.sampling.Generation`` (what ``ktd run`` does): forward of one row + sampling +
  detokenization per token. Decode tokens/s = (tokens - 1) / (time from the first to the last
  token); the prompt is not timed.
- ``native[n]``: the native forward alone with n decode rows per step (n sequences in lockstep,
  fed their argmax): rows/s over forward time only — the ceiling of continuous batching.
- ``daemon[n]``: ``ktd serve`` with the same model and threads, driven by ``ktctl bench`` (a
  separate client process) with n concurrent streams × 1 request of ``--tokens`` tokens:
  aggregate tokens/s (generated tokens / wall time, prompts and time-to-first-token included)
  and, per request, the decode rate the client sees (same definition as ``inproc``).
  The daemon's metrics give the engine thread's split: forward, sampling, the rest.

- ``http[n]``: the same daemon through ktd-http (``ktd http`` on 127.0.0.1, a kernel-chosen
  port), driven by ``ktd.bench.http_load`` (a separate process, streamed ``/v1/completions``
  with ``ignore_eos``) with n concurrent streams: the same figures as ``daemon[n]``, plus the
  gateway's CPU per token.
``--prefix-cache`` measures the prefix cache instead: a 5-turn chat re-sent in full
every turn, as chat clients do: the first user turn is a ~2,500-token document (the text of
tests/data/perplexity.txt and the start of the README) to discuss, the next four short questions
about it; replies greedy (48 tokens). Each turn is sent twice, in
alternating order: with ``cache_prompt: false`` (the whole history prefilled) and with the cache
(only what follows the previous turn's KV). Reported per turn: time to first token (the daemon's
``timings.ttft_ms``) of both, ``usage.cached_tokens``, and whether both replies are identical
(greedy; the history continues with the cached run's reply).

Both sides use the same sampling parameters (the protocol defaults, ``ignore_eos``), so the
socket ratio measures the daemon's overhead (scheduler, event loop, framing, client). Goals:
socket decode ≥ 97 % of in-process; aggregate at 4 streams ≥ 3× one stream; HTTP decode
(1 stream) ≥ 95 % of in-process; HTTP aggregate at 8 streams within 5 % of the socket's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ktd import _native
from ktd.bench import finish_tuning_greedy

SCHEMA = "ktd.bench.daemon/1"
DEFAULT_OUT = Path("bench/results/daemon.json")
PROMPT = "Write a short story about a lighthouse keeper."
N_CTX = 1024


def _model_path(name: str) -> str:
    from ktd.ops import models
    try:
        return models.resolve(name)
    except models.FetchError as e:
        raise SystemExit(str(e)) from None


def warm_up(engine: Any) -> int:
    """Untimed one-row steps of ``engine`` until this process's decode prefetch tuning is over;
    how many ran."""
    engine.free_seq(0)
    n = finish_tuning_greedy(engine, 1, 0)[0]
    engine.free_seq(0)
    return n


def inproc_decode(engine: Any, n_tokens: int) -> float:
    """Decode tokens/s of one sequence: forward + Generation.accept (sampling, detokenization)."""
    from ktd.text.sampling import Generation, SamplingParams

    tok = engine.tokenizer
    prompt = tok.encode(PROMPT, add_special=True)
    gen = Generation(SamplingParams(), prompt=prompt, eos_ids=tok.eos_ids, stop=(), max_tokens=n_tokens,
                     decoder=tok.decode_stream(), ignore_eos=True)
    engine.free_seq(0)
    n = len(prompt)
    logits = engine.forward(np.array(prompt, np.int32), np.arange(n, dtype=np.int32),
                            np.zeros(n, np.int32), np.arange(n) == n - 1)
    token, _, finish = gen.accept(logits[0])
    t_first = time.perf_counter()
    pos = n
    while finish is None:
        logits = engine.forward(np.array([token], np.int32), np.array([pos], np.int32),
                                np.zeros(1, np.int32), np.ones(1, np.bool_))
        token, _, finish = gen.accept(logits[0])
        pos += 1
    elapsed = time.perf_counter() - t_first
    engine.free_seq(0)
    return (len(gen.output) - 1) / elapsed


def native_rows(engine: Any, n_rows: int, n_steps: int) -> float:
    """Rows/s of the native forward alone with ``n_rows`` decode rows per step."""
    tok = engine.tokenizer
    prompt = tok.encode(PROMPT, add_special=True)
    n = len(prompt)
    tokens = np.empty(n_rows, np.int32)
    for s in range(n_rows):
        engine.free_seq(s)
        logits = engine.forward(np.array(prompt, np.int32), np.arange(n, dtype=np.int32),
                                np.full(n, s, np.int32), np.arange(n) == n - 1)
        tokens[s] = int(np.argmax(logits[0]))
    seq_ids = np.arange(n_rows, dtype=np.int32)
    want = np.ones(n_rows, np.bool_)
    spent = 0.0
    for step in range(n_steps):
        positions = np.full(n_rows, n + step, np.int32)
        t0 = time.perf_counter()
        logits = engine.forward(tokens, positions, seq_ids, want)
        spent += time.perf_counter() - t0
        tokens = np.argmax(logits, axis=1).astype(np.int32)
    for s in range(n_rows):
        engine.free_seq(s)
    return n_rows * n_steps / spent


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of every thread of process ``pid``, by thread id (``schedstat``: nanoseconds,
    where ``stat`` counts 10 ms ticks)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # the thread ended
            continue
    return out


class DaemonRun:
    """``python -m ktd serve`` on a private socket, for the duration of the benchmark."""

    def __init__(self, model: str, threads: int, n_seq_max: int, n_ctx: int = N_CTX):
        self.dir = tempfile.mkdtemp(prefix="ktd-bench-", dir="/tmp")
        self.socket = os.path.join(self.dir, "ktd.sock")
        # weights_map: arena: the steady state is measured (auto would serve a cache miss from the
        # file until its background build is switched to, in the middle of the run).
        config = {"model": {"path": model, "n_ctx": n_ctx, "n_seq_max": n_seq_max, "threads": threads,
                            "weights_map": "arena"},
                  "server": {"socket": self.socket, "socket_group": None},
                  "logging": {"level": "warning"}}
        self.config = os.path.join(self.dir, "ktd.yaml")
        with open(self.config, "w") as f:
            json.dump(config, f)  # JSON is YAML
        self.log = open(os.path.join(self.dir, "daemon.log"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "ktd", "serve", "--config", self.config],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 300.0) -> None:
        from ktd.client import Client

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"ktd serve exited with {self.proc.returncode}: "
                                 f"{open(self.log.name).read()[-2000:]}")
            try:
                with Client(self.socket, timeout=5) as c:
                    if c.health()["status"] == "ok":
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit("ktd serve did not become ready")

    def metrics(self) -> dict[str, float]:
        from ktd.client import Client

        with Client(self.socket, timeout=30) as c:
            text = c.metrics()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(ktd_\w+)(\{[^}]*\})? (\S+)$", line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def bench(self, streams: int, n_tokens: int) -> dict[str, Any]:
        before = self.metrics()
        cpu_before = _thread_cpu(self.pid)
        r = subprocess.run([sys.executable, "-m", "ktd.ctl", "-s", self.socket, "bench", "-c", str(streams),
                            "-r", "1", "-n", str(n_tokens), "--json"],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SystemExit(f"ktctl bench failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
        cpu_after = _thread_cpu(self.pid)
        result = json.loads(r.stdout)
        after = self.metrics()
        # CPU time per generated token (ms): the event loop (the main thread), the whole daemon
        # (compute threads included), and the ktctl client while its requests ran (its start-up
        # excluded). On a machine whose cores are all compute threads, loop and client time is
        # taken from the forward.
        n = max(1, result["generated_tokens"])
        loop = cpu_after.get(self.pid, 0.0) - cpu_before.get(self.pid, 0.0)
        total = sum(v - cpu_before.get(t, 0.0) for t, v in cpu_after.items())
        result["cpu_ms_per_token"] = {"event_loop": round(loop / n * 1e3, 3),
                                      "daemon": round(total / n * 1e3, 3),
                                      "client": round(result["cpu_s"] / n * 1e3, 3)}
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in
                 ("ktd_steps_total", "ktd_forward_seconds_total", "ktd_sample_seconds_total",
                  "ktd_step_seconds_total")}
        steps = delta["ktd_steps_total"] or 1.0
        result["engine_ms_per_step"] = {
            "step": round(delta["ktd_step_seconds_total"] / steps * 1e3, 3),
            "forward": round(delta["ktd_forward_seconds_total"] / steps * 1e3, 3),
            "sample": round(delta["ktd_sample_seconds_total"] / steps * 1e3, 3),
        }
        result["steps"] = int(delta["ktd_steps_total"])
        return result

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class GatewayRun:
    """``python -m ktd http`` in front of ``daemon`` on 127.0.0.1 (a port the kernel picks)."""

    def __init__(self, daemon: DaemonRun):
        self.daemon = daemon
        self.log = open(os.path.join(daemon.dir, "gateway.log"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "ktd", "http", "--socket", daemon.socket,
                                      "--listen", "127.0.0.1:0", "--log-level", "warning"],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline().strip()  # its base URL, printed once it listens
        if not line.startswith("http://"):
            self.stop()
            raise SystemExit(f"ktd http did not start: {open(self.log.name).read()[-2000:]}")
        self.url = line

    def bench(self, streams: int, n_tokens: int) -> dict[str, Any]:
        before = self.daemon.metrics()
        cpu_before = _thread_cpu(self.daemon.pid)
        gw_before = _thread_cpu(self.proc.pid)
        r = subprocess.run([sys.executable, "-m", "ktd.bench.http_load", self.url, "--streams", str(streams),
                            "--tokens", str(n_tokens), "--prompt", PROMPT],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SystemExit(f"http_load failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
        gw_after = _thread_cpu(self.proc.pid)
        cpu_after = _thread_cpu(self.daemon.pid)
        result = json.loads(r.stdout)
        after = self.daemon.metrics()
        n = max(1, result["generated_tokens"])
        loop = cpu_after.get(self.daemon.pid, 0.0) - cpu_before.get(self.daemon.pid, 0.0)
        gateway = sum(v - gw_before.get(t, 0.0) for t, v in gw_after.items())
        result["cpu_ms_per_token"] = {"event_loop": round(loop / n * 1e3, 3),
                                      "gateway": round(gateway / n * 1e3, 3),
                                      "client": round(result["cpu_s"] / n * 1e3, 3)}
        steps = (after.get("ktd_steps_total", 0.0) - before.get("ktd_steps_total", 0.0)) or 1.0
        result["engine_ms_per_step"] = {
            k: round((after.get(f"ktd_{k}_seconds_total", 0.0) - before.get(f"ktd_{k}_seconds_total", 0.0))
                     / steps * 1e3, 3) for k in ("step", "forward", "sample")}
        return result

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

PREFIX_TURNS = 5
PREFIX_REPLY_TOKENS = 48


PREFIX_QUESTIONS = ["Who kept the light during the great storm, and how did she keep it secret?",
                    "What did the inspector do when he read the log?",
                    "How did the light itself change over the years?",
                    "What does the second essay say about disagreeing measurements?"]


def _turns() -> list[str]:
    root = Path(__file__).resolve().parents[3]
    doc = "\n\n".join(open(root / f, encoding="utf-8").read()
                        for f in ("tests/data/perplexity.txt", "README.md") if (root / f).exists())[:11000]
    return [f"Read this document; I will ask questions about it.\n\n{doc}\n\nFirst: what is the first story about?",
            *PREFIX_QUESTIONS]


def prefix_cache_bench(daemon: DaemonRun, reps: int) -> dict[str, Any]:
    """Per turn, median over ``reps`` conversations: TTFT without and with the prefix cache."""
    from ktd.client import Client

    rows: list[list[dict[str, Any]]] = []
    with Client(daemon.socket, timeout=600) as c:
        for rep in range(reps):
            messages: list[dict[str, str]] = []
            turns = []
            for t, content in enumerate(_turns()):
                # a new conversation per repetition: the first turn differs, nothing is reused across reps
                messages.append({"role": "user", "content": f"[{rep}] {content}" if t == 0 else content})
                out = {}
                for cached in ((False, True) if (rep + t) % 2 == 0 else (True, False)):
                    r = c.generate(messages=messages, max_tokens=PREFIX_REPLY_TOKENS, temperature=0.0,
                                   ignore_eos=True, cache_prompt=cached)
                    out[cached] = r
                turns.append({"same_reply": out[True]["text"] == out[False]["text"],
                              "prompt_tokens": out[True]["usage"]["prompt_tokens"],
                              "cached_tokens": out[True]["usage"].get("cached_tokens", 0),
                              "ttft_ms_uncached": out[False]["timings"]["ttft_ms"],
                              "ttft_ms_cached": out[True]["timings"]["ttft_ms"]})
                messages.append({"role": "assistant", "content": out[True]["text"]})
                print(f"rep {rep + 1}/{reps} turn {t + 1}: {turns[-1]}", file=sys.stderr)
            rows.append(turns)
    med = statistics.median
    summary = []
    for t in range(PREFIX_TURNS):
        un = med(r[t]["ttft_ms_uncached"] for r in rows)
        ca = med(r[t]["ttft_ms_cached"] for r in rows)
        summary.append({"turn": t + 1, "prompt_tokens": rows[0][t]["prompt_tokens"],
                        "cached_tokens": rows[0][t]["cached_tokens"], "ttft_ms_uncached": un,
                        "ttft_ms_cached": ca, "speedup": un / ca if ca else None,
                        "same_reply": all(r[t]["same_reply"] for r in rows)})
    return {"reps": rows, "summary": summary}


def main_prefix_cache(args: argparse.Namespace, argv: list[str] | None) -> int:
    path = _model_path(args.model)
    daemon = DaemonRun(path, args.threads, 1, n_ctx=8192)
    try:
        daemon.wait_ready()
        res = prefix_cache_bench(daemon, args.reps)
    finally:
        daemon.stop()
    out = {"schema": "ktd.bench.prefix_cache/1",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python -m ktd.bench.daemon", *(argv if argv is not None else sys.argv[1:])]),
           "model": os.path.basename(path), "threads": args.threads, "reply_tokens": PREFIX_REPLY_TOKENS,
           "load_avg": os.getloadavg(), **res}
    print(f"model {os.path.basename(path)}, {args.threads or 'all'} threads, replies of {PREFIX_REPLY_TOKENS} "
          f"tokens, median of {args.reps} conversations (load average {os.getloadavg()[0]:.1f})")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT no cache':>14} {'TTFT cache':>11} {'speedup':>8} "
          f"{'same reply':>10}")
    for r in res["summary"]:
        print(f"{r['turn']:4d} {r['prompt_tokens']:7d} {r['cached_tokens']:7d} {r['ttft_ms_uncached']:11.0f} ms "
              f"{r['ttft_ms_cached']:8.0f} ms {r['speedup']:7.1f}x {'yes' if r['same_reply'] else 'NO':>10}")
    target = args.out if args.out != DEFAULT_OUT else DEFAULT_OUT.with_name("prefix_cache.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"-> {target}")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.daemon", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="known model name or GGUF path")
    ap.add_argument("--threads", type=int, default=0, help="compute threads (0: one per physical core)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--no-http", action="store_true", help="skip the HTTP gateway path")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="measure the prefix cache instead: TTFT per turn of a 5-turn chat, with and without "
                         "(bench/results/prefix_cache.json)")
    return ap


def measure_rep(engine: Any, daemon: DaemonRun, gateway: GatewayRun | None, streams: list[int],
                tokens: int) -> dict[str, Any]:
    """One repetition: in-process decode, native rows, then the daemon (and the gateway) at each
    stream count, with the ratios between them."""
    row: dict[str, Any] = {"inproc_decode_tokens_per_s": inproc_decode(engine, tokens),
                           "native_rows_per_s": {}, "daemon": {}}
    for n in streams:
        row["native_rows_per_s"][n] = native_rows(engine, n, tokens // 2)
    for n in streams:  # socket and HTTP alternate per stream count: a load change hits both
        row["daemon"][n] = daemon.bench(n, tokens)
        if gateway:
            row.setdefault("http", {})[n] = gateway.bench(n, tokens)
    base = row["daemon"][streams[0]]["tokens_per_s"]
    row["socket_decode_ratio"] = (row["daemon"][streams[0]]["decode_tokens_per_s"]["p50"]
                                  / row["inproc_decode_tokens_per_s"])
    row["daemon_gain"] = {n: row["daemon"][n]["tokens_per_s"] / base for n in streams}
    row["native_gain"] = {n: row["native_rows_per_s"][n] / row["native_rows_per_s"][streams[0]] for n in streams}
    if gateway:
        row["http_decode_ratio"] = (row["http"][streams[0]]["decode_tokens_per_s"]["p50"]
                                    / row["inproc_decode_tokens_per_s"])
        row["http_aggregate_ratio"] = {n: row["http"][n]["tokens_per_s"] / row["daemon"][n]["tokens_per_s"]
                                       for n in streams}
    return row


def _rep_line(row: dict[str, Any], rep: int, n_reps: int) -> str:
    http = "http_decode_ratio" in row
    return (f"rep {rep + 1}/{n_reps}: in-process {row['inproc_decode_tokens_per_s']:.1f} tok/s, "
            f"socket {row['socket_decode_ratio']:.1%}, daemon gain "
            + " ".join(f"{n}:{g:.2f}x" for n, g in row["daemon_gain"].items())
            + (f", http {row['http_decode_ratio']:.1%} of in-process, http/socket aggregate "
               + " ".join(f"{n}:{g:.1%}" for n, g in row["http_aggregate_ratio"].items())
               if http else ""))


def summarise(reps: list[dict[str, Any]], streams: list[int], http: bool) -> dict[str, Any]:
    """Medians over the repetitions (the per-step and per-token CPU figures: the last one's)."""
    med = statistics.median
    summary = {
        "inproc_decode_tokens_per_s": med(r["inproc_decode_tokens_per_s"] for r in reps),
        "socket_decode_ratio": med(r["socket_decode_ratio"] for r in reps),
        "daemon_tokens_per_s": {n: med(r["daemon"][n]["tokens_per_s"] for r in reps) for n in streams},
        "daemon_gain": {n: med(r["daemon_gain"][n] for r in reps) for n in streams},
        "native_rows_per_s": {n: med(r["native_rows_per_s"][n] for r in reps) for n in streams},
        "native_gain": {n: med(r["native_gain"][n] for r in reps) for n in streams},
        "engine_ms_per_step": {n: reps[-1]["daemon"][n]["engine_ms_per_step"] for n in streams},
        "cpu_ms_per_token": {n: reps[-1]["daemon"][n]["cpu_ms_per_token"] for n in streams},
    }
    if http:
        summary["http_decode_ratio"] = med(r["http_decode_ratio"] for r in reps)
        summary["http_tokens_per_s"] = {n: med(r["http"][n]["tokens_per_s"] for r in reps) for n in streams}
        summary["http_aggregate_ratio"] = {n: med(r["http_aggregate_ratio"][n] for r in reps) for n in streams}
        summary["http_cpu_ms_per_token"] = {n: reps[-1]["http"][n]["cpu_ms_per_token"] for n in streams}
    return summary


def _print_socket(summary: dict[str, Any], streams: list[int]) -> None:
    """The socket path's table; adds serving_overhead_of_forward to ``summary``."""
    print(f"in-process decode          {summary['inproc_decode_tokens_per_s']:8.1f} tok/s")
    print(f"socket decode (1 stream)   {summary['socket_decode_ratio']:8.1%} of in-process   (goal >= 97%)")
    # the same question in CPU terms, which a busy machine disturbs less: per token at one
    # stream, the engine thread's work outside the forward plus the event loop's and client's CPU
    e, c = summary["engine_ms_per_step"][streams[0]], summary["cpu_ms_per_token"][streams[0]]
    if e["forward"] > 0:
        extra = (e["step"] - e["forward"]) + c["event_loop"] + c["client"]
        summary["serving_overhead_of_forward"] = extra / e["forward"]
        print(f"serving overhead           {extra:8.3f} ms/token = {extra / e['forward']:.2%} of the forward "
              f"(engine thread outside forward {e['step'] - e['forward']:.3f}, event loop {c['event_loop']:.3f}, "
              f"client {c['client']:.3f} ms)")
    print(f"{'streams':>8} {'daemon tok/s':>13} {'gain':>7} {'native gain':>12} "
          f"{'step ms':>8} {'forward':>8} {'sample':>8}   cpu ms/token: {'loop':>6} {'client':>6}")
    for n in streams:
        e = summary["engine_ms_per_step"][n]
        c = summary["cpu_ms_per_token"][n]
        print(f"{n:8d} {summary['daemon_tokens_per_s'][n]:13.1f} {summary['daemon_gain'][n]:6.2f}x "
              f"{summary['native_gain'][n]:11.2f}x {e['step']:8.2f} {e['forward']:8.2f} {e['sample']:8.2f}"
              f"                 {c['event_loop']:6.3f} {c['client']:6.3f}")
    print("(goal: gain >= 3x at 4 streams)")


def _print_http(summary: dict[str, Any], streams: list[int]) -> None:
    """The HTTP gateway's table; adds http_gateway_cpu_of_forward to ``summary``."""
    print(f"HTTP decode (1 stream)     {summary['http_decode_ratio']:8.1%} of in-process   (goal >= 95%)")
    # in CPU terms (less disturbed by a busy machine): the gateway's CPU per token at one
    # stream against the forward's time per token
    fwd = summary["engine_ms_per_step"][streams[0]]["forward"]
    if fwd > 0:
        g = summary["http_cpu_ms_per_token"][streams[0]]["gateway"]
        summary["http_gateway_cpu_of_forward"] = g / fwd
        print(f"gateway CPU (1 stream)     {g:8.3f} ms/token = {g / fwd:.2%} of the forward")
    print(f"{'streams':>8} {'http tok/s':>11} {'http/socket':>12}   cpu ms/token: {'gateway':>8} {'client':>7}")
    for n in streams:
        c = summary["http_cpu_ms_per_token"][n]
        print(f"{n:8d} {summary['http_tokens_per_s'][n]:11.1f} {summary['http_aggregate_ratio'][n]:11.1%}"
              f"                 {c['gateway']:8.3f} {c['client']:7.3f}")
    print(f"(goal: http/socket aggregate at {streams[-1]} streams >= 95%)")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.prefix_cache:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        return main_prefix_cache(args, argv)
    if min(args.streams) < 1 or args.tokens < 2 or args.reps < 1:
        ap.error("--streams, --tokens (>= 2) and --reps must be positive")
    streams = sorted(set(args.streams))

    from ktd.server.engine import Engine

    # a stop (timeout, kill) still stops the daemon: SIGTERM unwinds like Ctrl-C
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    path = _model_path(args.model)
    engine = Engine.open(path, n_ctx=N_CTX, n_seq_max=max(streams), threads=args.threads)
    info = engine.info()
    daemon = DaemonRun(path, args.threads, max(streams))
    reps: list[dict[str, Any]] = []
    gateway: GatewayRun | None = None
    try:
        daemon.wait_ready()
        if not args.no_http:
            gateway = GatewayRun(daemon)
        # Untimed: the first one-row steps of each process tune the decode prefetch (ktd.bench.
        # finish_decode_prefetch_tuning), here and in the daemon (one request of one stream, its
        # steps one row each), so the first repetition does not time the tuning.
        warm_up(engine)
        daemon.bench(1, _native.kernels.DECODE_PREFETCH_TUNE_STEPS + 2)
        for rep in range(args.reps):
            reps.append(measure_rep(engine, daemon, gateway, streams, args.tokens))
            print(_rep_line(reps[-1], rep, args.reps), file=sys.stderr)
    finally:
        if gateway:
            gateway.stop()
        daemon.stop()

    summary = summarise(reps, streams, gateway is not None)
    print(f"model {info['name']}, {info['threads']} threads, {args.tokens} tokens/request, "
          f"median of {args.reps} reps")
    _print_socket(summary, streams)
    if gateway:
        _print_http(summary, streams)
    out = {"schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python -m ktd.bench.daemon", *(argv if argv is not None else sys.argv[1:])]),
           "model": info, "threads": args.threads, "tokens": args.tokens, "reps": reps, "summary": summary}
    print(f"-> {args.out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
