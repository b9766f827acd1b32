"""``ktctl``: command-line client of a running ktd (generate, chat, status, health, metrics,
tokenize, bench; ``http`` checks the HTTP gateway). The socket is --socket, else $KTD_SOCKET, else /run/ktd/ktd.sock."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from ktd.ops.load_report import load_summary
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
    o = p.add_mutually_exclusive_group()
    o.add_argument("--schema", metavar="FILE", default=None, help="constrain the output to JSON valid for this "
                   "JSON Schema file")
    o.add_argument("--grammar", metavar="FILE", default=None, help="constrain the output to a grammar file: "
                   "GBNF (llama.cpp's .gbnf) or Lark (.lark)")
    o.add_argument("--regex", default=None, help="constrain the output to a regular expression")
    o.add_argument("--json", action="store_true", help="constrain the output to a JSON object")
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="print each token's log-probability "
                   "and the N (0..20) most likely alternatives to stderr, one JSON line per token")
    p.add_argument("--tools", metavar="FILE", default=None, help="tools the model may call: a JSON array of "
                   "{type: function, function: {name, description, parameters}}; calls are printed as JSON")
    p.add_argument("--tool-choice", default=None, metavar="CHOICE",
                   help="auto, none, required, or the name of the tool to call")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"ktctl: cannot read {path}: {e}") from None


def _grammar(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.schema:
        try:
            return {"json_schema": json.loads(_read(args.schema))}
        except ValueError as e:
            raise SystemExit(f"ktctl: {args.schema} is not JSON: {e}") from None
    if args.grammar:
        return {"lark" if args.grammar.endswith(".lark") else "gbnf": _read(args.grammar)}
    if args.regex:
        return {"regex": args.regex}
    if args.json:
        return {"json_object": True}
    return None


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    out = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
           "top_p": args.top_p, "min_p": args.min_p, "repeat_penalty": args.repeat_penalty,
           "seed": args.seed, "stop": args.stop, "grammar": _grammar(args),
           "cache_prompt": False if args.no_cache_prompt else None}
    if args.logprobs is not None:
        out.update(logprobs=True, top_logprobs=args.logprobs)
    if args.tools:
        try:
            out["tools"] = json.loads(_read(args.tools))
        except ValueError as e:
            raise SystemExit(f"ktctl: {args.tools} is not JSON: {e}") from None
    if args.tool_choice:
        c = args.tool_choice
        out["tool_choice"] = c if c in ("auto", "none", "required") else {"type": "function", "function": {"name": c}}
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ktctl", description="client of the ktd inference daemon")
    parser.add_argument("-s", "--socket", default=None, help=f"daemon socket (default $KTD_SOCKET or {default_socket()})")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for an answer")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    g = sub.add_parser("generate", help="complete a prompt, streaming to the terminal")
    g.add_argument("prompt", help="prompt text ('-' reads stdin)")
    g.add_argument("--suffix", default=None, metavar="TEXT",
                   help="fill in the middle: the text after the gap (the prompt is the text before it)")
    _sampling_args(g)
    c = sub.add_parser("chat", help="chat using the model's template (interactive without -m)")
    c.add_argument("-m", "--message", default=None, help="one user message, then exit")
    c.add_argument("--system", default=None, help="system message")
    _sampling_args(c)
    for name, help in (("status", "daemon, model, slots, memory (JSON)"), ("health", "ok or not (exit status)"),
                       ("metrics", "Prometheus text exposition")):
        sp = sub.add_parser(name, help=help)
        if name == "health":
            sp.add_argument("--wait", action="store_true",
                            help="while the daemon loads its model, wait (up to --timeout) and report the end")
    pr = sub.add_parser("profile", help="MoE routing profile: tokens routed to each expert, summed over runs")
    pr.add_argument("action", nargs="?", choices=("show", "reset"), default="show",
                    help="show (default; --json for the whole document) or reset (root or the daemon's user)")
    pr.add_argument("--json", action="store_true", help="print the profile as JSON")
    t = sub.add_parser("tokenize", help="token ids of a text")
    t.add_argument("text")
    t.add_argument("--no-special", action="store_true", help="do not add BOS")
    b = sub.add_parser("bench", help="N concurrent clients x M requests: tokens/s, TTFT, latency")
    b.add_argument("-c", "--clients", type=int, default=4)
    b.add_argument("-r", "--requests", type=int, default=4, help="requests per client")
    b.add_argument("-p", "--prompt", default="Write a short story about a lighthouse keeper.")
    b.add_argument("-n", "--max-tokens", type=int, default=64)
    b.add_argument("--json", action="store_true", help="print the summary as JSON")
    h = sub.add_parser("http", help="check the HTTP gateway (ktd-http) and print how to point clients at it")
    h.add_argument("--url", default=None,
                   help="the gateway's base URL (default $KTD_HTTP_URL, else http://127.0.0.1:11435)")
    h.add_argument("--api-key", default=None, help="API key (default $KTD_API_KEY), when the gateway wants one")
    return parser


def _stream_to_terminal(client: Client, params: dict[str, Any], no_stream: bool, verbose: bool) -> str:
    if no_stream:
        r = client.call("generate", stream=False, **params)
        text = r["text"]
        sys.stdout.write(text)
        result = r
        logprobs = r.get("logprobs", [])
    else:
        s = client.stream(**params)
        pieces = []
        for piece in s:
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        text, result, logprobs = "".join(pieces), s.result or {}, s.logprobs
    sys.stdout.write("\n")
    for call in result.get("tool_calls", ()):
        print(json.dumps(call, ensure_ascii=False))
    sys.stdout.flush()
    for entry in logprobs:
        print(json.dumps(entry, ensure_ascii=False), file=sys.stderr)
    if verbose:
        print(json.dumps({k: result.get(k) for k in ("finish_reason", "usage", "timings")}), file=sys.stderr)
    return text


def cmd_generate(client: Client, args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    _stream_to_terminal(client, {"prompt": prompt, "suffix": args.suffix, **_sampling(args)}, args.no_stream,
                        args.verbose)
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
    return load_summary(clients=args.clients, requests=args.clients * args.requests, completed=len(latency),
                        errors=errors, tokens=tokens, wall=wall, cpu=cpu, ttft=ttft, latency=latency,
                        decode=decode)


def cmd_profile(p: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(p, indent=2))
        return 0
    if not p.get("enabled"):
        print(f"no routing profile: {p.get('reason', 'disabled')}")
        return 0
    print(f"routing profile {p['path'] or '(not saved)'}: {p['routed']} token routings over "
          f"{p['n_layer']} layers x {p['n_expert']} experts")
    if p.get("last_error"):
        print(f"last write failed: {p['last_error']}")
    for layer in p["layers"]:
        top = ", ".join(f"{e}: {100 * c / layer['routed']:.1f}%" for e, c in layer["top"])
        print(f"  layer {layer['layer']:3d}: {layer['routed']:>10} routed; top experts {top}")
    return 0


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


def cmd_http(args) -> int:
    """GET /health and /v1/models of the gateway (stdlib only), then the client settings."""
    import os
    import urllib.error
    import urllib.request

    from ktd.http import DEFAULT_PORT

    root = (args.url or os.environ.get("KTD_HTTP_URL") or f"http://127.0.0.1:{DEFAULT_PORT}").rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    key = args.api_key or os.environ.get("KTD_API_KEY")

    def get(path: str) -> tuple[int, Any]:
        req = urllib.request.Request(root + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=args.timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    try:
        code, health = get("/health")
        mcode, models = get("/v1/models")
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"ktctl: error: {root}: {getattr(e, 'reason', e)} (is ktd-http running? "
              "systemctl enable --now ktd-http.socket)", file=sys.stderr)
        return 1
    if mcode == 401:
        print(f"ktctl: error: {root}: the gateway wants an API key (--api-key or $KTD_API_KEY)", file=sys.stderr)
        return 1
    model = models["data"][0]["id"] if mcode == 200 and models.get("data") else "?"
    print(f"{root}: {health.get('status') if isinstance(health, dict) else code}, model {model}")
    print(f"OpenAI SDK:  OPENAI_BASE_URL={root}/v1 OPENAI_API_KEY={'<your key>' if key else 'any'}  model={model!r}")
    print(f"Ollama:      OLLAMA_HOST={root}")
    print(f"Open WebUI:  OPENAI_API_BASE_URL={root}/v1 (or OLLAMA_BASE_URL={root}); from its container "
          "use the host's address, not 127.0.0.1")
    return 0 if code == 200 and mcode == 200 else 1


def wait_loaded(client: Client, timeout: float, period_s: float = 0.5) -> dict[str, Any]:
    """Polls ``health`` while the daemon loads its model (docs/PROTOCOL.md, "While the model
    loads"), up to ``timeout`` seconds, showing the progress on a terminal; returns the last answer."""
    deadline = time.monotonic() + timeout
    tty = sys.stderr.isatty()
    while True:
        h = client.health()
        if h.get("status") != "loading" or time.monotonic() >= deadline:
            if tty:
                sys.stderr.write("\r\x1b[K")
            return h
        if tty:
            ld = h.get("loading") or {}
            pct = f" {ld['fraction']:.0%}" if ld.get("fraction") is not None else ""
            sys.stderr.write(f"\r\x1b[Kloading the model: {ld.get('text') or ld.get('phase', '')}{pct}")
            sys.stderr.flush()
        time.sleep(period_s)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = args.socket or default_socket()
    try:
        if args.command == "http":
            return cmd_http(args)
        if args.command == "bench":
            return cmd_bench(path, args.timeout, args)
        with Client(path, timeout=args.timeout) as client:
            if args.command in ("generate", "chat", "tokenize", "profile"):
                # the daemon answers these only once its model is loaded: wait for it, as the
                # same command sent before it accepted used to wait
                wait_loaded(client, args.timeout)
            if args.command == "generate":
                return cmd_generate(client, args)
            if args.command == "chat":
                return cmd_chat(client, args)
            if args.command == "status":
                print(json.dumps(client.status(), indent=2))
                return 0
            if args.command == "health":
                status = (wait_loaded(client, args.timeout) if args.wait else client.health())["status"]
                print(status)
                return 0 if status == "ok" else 1
            if args.command == "metrics":
                sys.stdout.write(client.metrics())
                return 0
            if args.command == "tokenize":
                print(json.dumps(client.tokenize(args.text, add_special=not args.no_special)))
                return 0
            if args.command == "profile":
                return cmd_profile(client.call("profile", reset=args.action == "reset"), args.json)
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
