"""HTTP load for ``ktd.bench.daemon``: N concurrent streamed ``/v1/completions`` requests through
ktd-http, measured as ``ktctl bench`` measures the socket (one JSON object on stdout, same keys).

    python -m ktd.bench.http_load URL --streams N --tokens T [--prompt TEXT]

Standard library only (http.client, one thread per stream): what a client costs stays small and
is reported (``cpu_s``). Each request asks for ``ignore_eos`` (a ktd-http extension, as in
llama-server) so that it generates exactly T tokens; the token count is the usage chunk's
(``stream_options.include_usage``); decode tokens/s per request = (tokens - 1) / (last - first
text piece), as ``ktctl bench``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse

from ktd.ops.load_report import load_summary


def one(url: str, prompt: str, tokens: int, out: list, barrier: threading.Barrier) -> None:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    model = json.loads(_get(conn, u.path + "/models"))["data"][0]["id"]  # also opens the connection
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}})
    barrier.wait()
    t0 = time.monotonic()
    conn.request("POST", u.path + "/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        out.append({"error": f"{r.status}: {r.read()[:200]!r}"})
        return
    t_first = t_last = None
    n = 0
    for raw in r:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            n = event["usage"]["completion_tokens"]
        if any(c.get("text") for c in event.get("choices", ())):
            t_last = time.monotonic()
            t_first = t_first or t_last
    out.append({"latency": time.monotonic() - t0, "tokens": n, "ttft": (t_first or t0) - t0,
                "decode": (n - 1) / (t_last - t_first) if n > 1 and t_last and t_last > t_first else None})
    conn.close()


def _get(conn: http.client.HTTPConnection, path: str) -> bytes:
    conn.request("GET", path)
    return conn.getresponse().read()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktd.bench.http_load")
    ap.add_argument("url", help="base URL, http://HOST:PORT/v1")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    args = ap.parse_args(argv)
    out: list = []
    barrier = threading.Barrier(args.streams + 1)
    threads = [threading.Thread(target=one, args=(args.url, args.prompt, args.tokens, out, barrier))
               for _ in range(args.streams)]
    for t in threads:
        t.start()
    barrier.wait()
    t0, cpu0 = time.monotonic(), time.process_time()
    for t in threads:
        t.join()
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    ok = [r for r in out if "tokens" in r]
    errors = [r["error"] for r in out if "error" in r]
    tokens = sum(r["tokens"] for r in ok)
    print(json.dumps(load_summary(
        clients=args.streams, requests=args.streams, completed=len(ok), errors=errors, tokens=tokens,
        wall=wall, cpu=cpu, ttft=[r["ttft"] for r in ok], latency=[r["latency"] for r in ok],
        decode=[r["decode"] for r in ok if r["decode"]])))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
