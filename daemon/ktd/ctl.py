"""``ktctl``: command-line client of a running ktd (generate, chat, status, health, metrics,
tokenize, bench). The socket is --socket, else $KTD_SOCKET, else /run/ktd/ktd.sock."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from ktd.client import AsyncClient, Client, ConnectionLost, default_socket
from ktd.errors import KtdError


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=None, help="tokens to generate (default: server limit)")
    p.add_argument("-t", "--temperature", type=float, default=None, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repeat-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-cache-prompt", action="store_true",
                   help="neither reuse nor keep cached prompt KV for this request (cache_prompt: false)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--no-stream", action="store_true", help="print the whole text at the end")
    p.add_argument("-v", "--verbose", action="store_true", help="print usage and timings to stderr")


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p, "min_p": args.min_p, "repeat_penalty": args.repeat_penalty,
            "seed": args.seed, "stop": args.stop, "cache_prompt": False if args.no_cache_prompt else None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ktctl", description="client of the ktd inference daemon")
    parser.add_argument("-s", "--socket", default=None, help=f"daemon socket (default $KTD_SOCKET or {default_socket()})")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for an answer")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    g = sub.add_parser("generate", help="complete a prompt, streaming to the terminal")
    g.add_argument("prompt", help="prompt text ('-' reads stdin)")
    _sampling_args(g)
    c = sub.add_parser("chat", help="chat using the model's template (interactive without -m)")
    c.add_argument("-m", "--message", default=None, help="one user message, then exit")
    c.add_argument("--system", default=None, help="system message")
    _sampling_args(c)
    for name, help in (("status", "daemon, model, slots, memory (JSON)"), ("health", "ok or not (exit status)"),
                       ("metrics", "Prometheus text exposition")):
        sub.add_parser(name, help=help)
    t = sub.add_parser("tokenize", help="token ids of a text")
    t.add_argument("text")
    t.add_argument("--no-special", action="store_true", help="do not add BOS")
    b = sub.add_parser("bench", help="N concurrent clients x M requests: tokens/s, TTFT, latency")
    b.add_argument("-c", "--clients", type=int, default=4)
    b.add_argument("-r", "--requests", type=int, default=4, help="requests per client")
    b.add_argument("-p", "--prompt", default="Write a short story about a lighthouse keeper.")
    b.add_argument("-n", "--max-tokens", type=int, default=64)
    b.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def _stream_to_terminal(client: Client, params: dict[str, Any], no_stream: bool, verbose: bool) -> str:
    if no_stream:
        r = client.call("generate", stream=False, **params)
        text = r["text"]
        sys.stdout.write(text)
        result = r
    else:
        s = client.stream(**params)
        pieces = []
        for piece in s:
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        text, result = "".join(pieces), s.result or {}
    sys.stdout.write("\n")
    if verbose:
        print(json.dumps({k: result.get(k) for k in ("finish_reason", "usage", "timings")}), file=sys.stderr)
    return text


def cmd_generate(client: Client, args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    _stream_to_terminal(client, {"prompt": prompt, **_sampling(args)}, args.no_stream, args.verbose)
    return 0


def cmd_chat(client: Client, args) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns = [args.message] if args.message is not None else None
    while True:
        if turns is not None:
            if not turns:
                return 0
            user = turns.pop(0)
        else:
            try:
                user = input("> ")
            except EOFError:
                print()
                return 0
            if not user.strip():
                continue
        messages.append({"role": "user", "content": user})
        reply = _stream_to_terminal(client, {"messages": messages, **_sampling(args)}, args.no_stream,
                                    args.verbose)
        messages.append({"role": "assistant", "content": reply})


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0]}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


class ProgressBar:
    """A one-line bar on stderr (only when stderr is a terminal)."""

    def __init__(self, total: int):
        self.total, self.done, self.enabled = total, 0, sys.stderr.isatty()

    def step(self) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = width * self.done // self.total
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def _bench(path: str, timeout: float, args) -> dict[str, Any]:
    bar = ProgressBar(args.clients * args.requests)
    ttft: list[float] = []
    latency: list[float] = []
    decode: list[float] = []  # per request, as the client sees it: (tokens - 1) / (last - first piece)
    tokens = 0
    errors: dict[str, int] = {}

    async def one_client() -> None:
        nonlocal tokens
        async with await AsyncClient.connect(path, timeout=timeout) as c:
            for _ in range(args.requests):
                t0 = time.monotonic()
                try:
                    s = await c.stream(args.prompt, max_tokens=args.max_tokens, ignore_eos=True)
                    async for _piece in s:
                        pass
                except KtdError as e:
                    errors[e.code] = errors.get(e.code, 0) + 1
                else:
                    latency.append(time.monotonic() - t0)
                    n = (s.result or {}).get("usage", {}).get("completion_tokens", 0)
                    tokens += n
                    if s.t_first is not None:
                        ttft.append(s.t_first - t0)
                        if n > 1 and s.t_last > s.t_first:
                            decode.append((n - 1) / (s.t_last - s.t_first))
                bar.step()

    t0, cpu0 = time.monotonic(), time.process_time()
    await asyncio.gather(*(one_client() for _ in range(args.clients)))
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    ms = lambda d: {k: round(v * 1e3, 1) for k, v in d.items()}  # noqa: E731
    return {"clients": args.clients, "requests": args.clients * args.requests, "completed": len(latency),
            "errors": errors, "generated_tokens": tokens, "wall_s": round(wall, 3), "cpu_s": round(cpu, 4),
            "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "ttft_ms": ms(_percentiles(ttft)), "latency_ms": ms(_percentiles(latency)),
            "decode_tokens_per_s": {k: round(v, 2) for k, v in _percentiles(decode).items()}}


def cmd_bench(path: str, timeout: float, args) -> int:
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        print("ktctl: error: --clients, --requests and --max-tokens must be positive", file=sys.stderr)
        return 2
    r = asyncio.run(_bench(path, timeout, args))
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['completed']}/{r['requests']} requests from {r['clients']} clients in {r['wall_s']} s, "
              f"errors {r['errors'] or 'none'}")
        print(f"generated {r['generated_tokens']} tokens: {r['tokens_per_s']} tokens/s aggregate")
        if r["decode_tokens_per_s"]:
            print(f"decode   p50 {r['decode_tokens_per_s']['p50']} tokens/s per stream")
        for key in ("ttft_ms", "latency_ms"):
            p = r[key]
            if p:
                print(f"{key[:-3]:8} p50 {p['p50']} ms  p90 {p['p90']} ms  p99 {p['p99']} ms")
    return 0 if not r["errors"] else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = args.socket or default_socket()
    try:
        if args.command == "bench":
            return cmd_bench(path, args.timeout, args)
        with Client(path, timeout=args.timeout) as client:
            if args.command == "generate":
                return cmd_generate(client, args)
            if args.command == "chat":
                return cmd_chat(client, args)
            if args.command == "status":
                print(json.dumps(client.status(), indent=2))
                return 0
            if args.command == "health":
                status = client.health()["status"]
                print(status)
                return 0 if status == "ok" else 1
            if args.command == "metrics":
                sys.stdout.write(client.metrics())
                return 0
            if args.command == "tokenize":
                print(json.dumps(client.tokenize(args.text, add_special=not args.no_special)))
                return 0
    except KtdError as e:
        print(f"ktctl: error: {e.code}: {e.message}", file=sys.stderr)
        return 1
    except (ConnectionLost, OSError) as e:
        print(f"ktctl: error: {path}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
