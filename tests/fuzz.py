"""The project's fuzz campaigns: the daemon's wire protocol, the model loader and the HTTP gateway.

    python tests/fuzz.py [--frames N] [--files N] [--http-requests N] [--http-slow N] [--seed S]
    (`make fuzz`: the full campaign)

``protocol_campaign`` runs the real daemon (``ktd serve`` with the fake engine,
tests/daemon_launcher.py) and sends it seeded hostile frames over its socket: valid requests with
confused types and values, mutated frames (bit flips, truncation, insertion), raw msgpack headers
(deep nesting, lengths past the end, ext types), oversized frames, pipelined batches and reused
generate msgids. Each connection writes its batch, shuts down its writing side and reads until
the daemon closes. What is counted, per campaign:

- crash: the daemon process exited;
- hang: a connection the daemon neither answered to the end nor closed within ``HANG_S``;
- unanswered: a connection that sent bytes and got no message at all back (the protocol
  answers every message, and a stream it cannot decode with an ``error`` notification);
- untyped: an error whose code is ``internal`` or not one of the protocol's codes, or a
  traceback in the daemon's log.

The daemon's RSS is read before and after; ``RSS_BUDGET`` is the stated bound on its growth.

``gguf_campaign`` mutates a generated tiny llama model (bit flips, bytes set to interesting
integers in the header, truncation, insertion, deletion, a metadata value's type byte changed)
and loads each file with ``Engine.open`` in one child process under an address-space limit and
a timeout; a file either loads (and then tokenizes and runs one forward step) or raises
``GGUFError``/``ResourceError``. Anything else is untyped; a signal is a crash; the timeout a hang.

``gateway_campaign`` runs the gateway (``python -m ktd.http``, short header and body timeouts, a
small connection cap) in front of that daemon: seeded hostile requests from keep-alive clients
(routes and methods, bodies with hostile JSON values — integers past 64 bits, 5,000 digits, lone
surrogates, deep nesting — invalid JSON, chunked bodies, huge and many headers, Expect, mutated
bytes), then rounds of slow and abandoned connections (silent, trickling headers or body, leaving
at every stage of a request and of a streamed answer, reading slowly), each round with a normal
request that must be answered meanwhile, and a round past the connection cap. Counted as above,
plus 5xx (every request is a client mistake or valid: none may be a server error) and untyped
(an error answer that is not JSON); RSS of the gateway and the daemon; and both must be back at
rest (no request in flight, no extra connection, no KV slot or queue entry) at the end.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import msgpack  # noqa: E402

from daemon_helpers import DaemonProcess  # noqa: E402
from ktd.server import protocol  # noqa: E402
from ktd.errors import ERRORS  # noqa: E402

HANG_S = 20.0               # a connection not closed by then is a hang (the daemon answers in ms)
RSS_BUDGET = 64 << 20       # the daemon's RSS growth over the protocol campaign may not exceed this
HOLD_ROUNDS, HOLD_PEERS = 4, 32   # rounds of peers that leave in the middle of a nested frame
MAX_FRAME = 1 << 16         # the campaign daemon's server.max_frame_bytes (oversize frames stay cheap)

# Values that have broken parsers before: type confusion, edges of ranges, invalid UTF-8.
HOSTILE = [None, True, False, 0, -1, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, -(2**63),
           2**64 - 1, 0.0, -0.0, 1e-300, 1e-40, 1e300, float("nan"), float("inf"), float("-inf"),
           "", "x", "\udcff\udcfe", "<|im_end|>", "a" * 300, b"", b"\xff", [], [1], {}, {"": 1},
           {1: 2}, [[[[[]]]]], msgpack.ExtType(5, b"ext")]
PARAMS = ["prompt", "messages", "tokens", "max_tokens", "stop", "stream", "ignore_eos", "add_special",
          "parse_special", "deadline_s", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
          "presence_penalty", "frequency_penalty", "penalty_last_n", "seed", "text", "id", "bogus"]


@dataclasses.dataclass
class Report:
    name: str
    inputs: int = 0              # frames sent / files loaded
    connections: int = 0
    crashes: int = 0
    hangs: int = 0
    unanswered: int = 0
    untyped: int = 0
    accepted: int = 0            # gguf: files that loaded
    rss_before: int | None = 0   # None: not measured (the loader's children: only their peak)
    rss_after: int = 0           # protocol: the larger of the end and mid-frame rounds
    server_errors: int = 0       # gateway: 5xx answers (every request is a client mistake or valid)
    slow: int = 0                # gateway: slow or abandoned connections
    other_rss: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # name: (before, after)
    rss_budget: int = 0          # allowed growth of rss_after over rss_before (0: RSS_BUDGET)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.crashes or self.hangs or self.unanswered or self.untyped or self.server_errors)


# --- the protocol -------------------------------------------------------------------------------

def _value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.6:
        return rng.choice(HOSTILE)
    if r < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(PARAMS): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _request(rng: random.Random, msgid: int) -> list:
    method = rng.choice(protocol.METHODS + ("bogus",))
    params: dict = {}
    if method == "generate":
        params = {rng.choice(("prompt", "messages", "tokens")): None}
        params["prompt" if rng.random() < 0.5 else "tokens"] = (
            "fuzz" if rng.random() < 0.5 else [65, 66, 67])
        if rng.random() < 0.3:
            params = {"messages": [{"role": "user", "content": rng.choice(["hi", "<|im_end|>", "\udcff"])}]}
        params["max_tokens"] = rng.choice([1, 2, 8])
    elif method in ("tokenize",):
        params = {"text": "fuzz text"}
    elif method == "detokenize":
        params = {"tokens": [65, 66]}
    elif method == "cancel":
        params = {"id": rng.randrange(4)}
    for _ in range(rng.randrange(3)):  # type and value confusion in the parameters
        params[rng.choice(PARAMS)] = _value(rng)
    msg = [0, msgid, method, [params] if params or rng.random() < 0.5 else []]
    if rng.random() < 0.1:  # the envelope itself
        msg[rng.randrange(4)] = _value(rng)
    return msg


def _pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True, unicode_errors="surrogatepass")


def _raw_headers(rng: random.Random) -> bytes:
    """msgpack that is not a plausible message: nesting, lengths past the end, bad bytes."""
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice([b"\x91", b"\xdd\x00\x00\x20\x00", b"\xdf\x00\x01\x00\x00\x00", b"\x81\xa0"]) \
            * rng.randrange(1, 1200) + rng.choice([b"", b"\xc0"])
    if kind == 1:
        return rng.choice([b"\xdb", b"\xc6", b"\xdd", b"\xdf"]) + struct.pack(">I", rng.choice(
            [0xFFFFFFFF, MAX_FRAME, MAX_FRAME + 1, 2**31])) + b"x" * rng.randrange(64)
    if kind == 2:
        return bytes([rng.choice([0xc1, 0xd4, 0xd8, 0xc7, 0xc9])]) + os.urandom(rng.randrange(16))
    if kind == 3:
        return _pack([0, rng.randrange(8), "tokenize", [{"text": "y" * (MAX_FRAME + 10)}]])
    if kind == 4:
        return os.urandom(rng.randrange(1, 64))
    return _pack([0, 1, "health", []] * rng.randrange(1, 200))


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    b = bytearray(frame)
    for _ in range(rng.randint(1, 3)):
        if not b:
            break
        pos = rng.randrange(len(b))
        op = rng.randrange(4)
        if op == 0:
            b[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            del b[pos:]
        elif op == 2:
            b[pos:pos] = os.urandom(rng.randint(1, 8))
        else:
            b[pos] = rng.choice([0xc1, 0xdc, 0xdd, 0xde, 0xdf, 0xd9, 0xda, 0xdb, 0xff, 0x00])
    return bytes(b)


def _batch(rng: random.Random) -> list[bytes]:
    frames = []
    for i in range(rng.randint(1, 19)):
        r = rng.random()
        if r < 0.55:
            frames.append(_pack(_request(rng, rng.choice([i, i, 0, 2**32 - 1]))))
        elif r < 0.75:
            frames.append(_mutate(rng, _pack(_request(rng, i))))
        elif r < 0.85:
            frames.append(_raw_headers(rng))
        else:  # the same generate msgid pipelined
            g = _pack([0, 7, "generate", [{"prompt": "dup", "max_tokens": 3}]])
            frames.extend([g, g])
    return frames


def _exchange(path: str, data: bytes) -> tuple[list, str]:
    """Send ``data``, shut down writing, read until the daemon closes: (messages, outcome) with
    outcome "closed", "hang" or "reset"."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(HANG_S)
    unpacker = msgpack.Unpacker(raw=False, unicode_errors="surrogateescape", strict_map_key=False)
    msgs: list = []
    try:
        s.connect(path)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        while chunk := s.recv(1 << 16):
            unpacker.feed(chunk)
            msgs.extend(unpacker)
        return msgs, "closed"
    except TimeoutError:
        return msgs, "hang"
    except (ConnectionResetError, BrokenPipeError):
        msgs.extend(unpacker)
        return msgs, "reset"
    finally:
        s.close()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def protocol_campaign(n_frames: int, seed: int = 0) -> Report:
    rep = Report("protocol")
    rng = random.Random(seed)
    known = set(ERRORS) - {"internal"}
    with DaemonProcess(server={"max_frame_bytes": MAX_FRAME}, limits={"max_tokens": 16},
                       model={"n_ctx": 128}) as d:
        _exchange(d.socket, _pack([0, 1, "health", []]))  # warm
        rep.rss_before = _rss(d.proc.pid)
        while rep.inputs < n_frames:
            frames = _batch(rng)
            rep.inputs += len(frames)
            rep.connections += 1
            data = b"".join(frames)
            msgs, outcome = _exchange(d.socket, data)
            if d.proc.poll() is not None:
                rep.crashes += 1
                rep.notes.append(f"daemon exited {d.proc.returncode} at connection {rep.connections}")
                break
            if outcome == "hang":
                rep.hangs += 1
                rep.notes.append(f"hang: connection {rep.connections}, frames {frames[:3]!r:.300}")
            if data and not msgs and outcome != "hang":  # (a mutation can delete everything)
                rep.unanswered += 1
                rep.notes.append(f"unanswered: {data[:120]!r}")
            for m in msgs:
                err = m[2] if isinstance(m, list) and len(m) == 4 and m[0] == 1 else (
                    m[2][0] if isinstance(m, list) and len(m) == 3 and m[1] == "error" else None)
                if err is not None and err.get("code") not in known:
                    rep.untyped += 1
                    rep.notes.append(f"untyped: {err!r:.200}")
        # Finding 1's attack: peers each send 1,000 nested array32 headers and leave mid-frame.
        for _ in range(HOLD_ROUNDS):
            peers = []
            for _ in range(HOLD_PEERS):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(d.socket)
                s.sendall(b"\xdd\x00\x00\x20\x00" * 1000)
                peers.append(s)
            rep.inputs += len(peers)
            rep.connections += len(peers)
            # a round trip on another connection: the event loop has read the peers' bytes
            # (ready before it) by the time it answers
            _exchange(d.socket, _pack([0, 1, "health", []]))
            held = _rss(d.proc.pid)
            rep.rss_after = max(rep.rss_after, held)
            for s in peers:
                s.close()
            rep.notes.append(f"{HOLD_PEERS} peers mid-frame: RSS {held >> 20} MiB")
        rep.rss_after = max(rep.rss_after, _rss(d.proc.pid))  # the peak of the two
        tracebacks = d.log().count("Traceback")
        if tracebacks:
            rep.untyped += tracebacks
            rep.notes.append(f"{tracebacks} tracebacks in the daemon log")
    if rep.rss_after - rep.rss_before > RSS_BUDGET:
        rep.notes.append(f"RSS grew by {(rep.rss_after - rep.rss_before) >> 20} MiB, over the budget")
    return rep


def rss_ok(rep: Report) -> bool:
    budget = rep.rss_budget or RSS_BUDGET
    others = all(after - before <= RSS_BUDGET for before, after in rep.other_rss.values())
    return others and (rep.rss_before is None or rep.rss_after - rep.rss_before <= budget)


# --- the model loader ---------------------------------------------------------------------------

_LOADER_CHILD = textwrap.dedent("""
    import random, struct, sys
    import numpy as np
    from ktd import GGUFError, ResourceError
    from ktd.server.engine import Engine

    src, scratch, first, count, header_end = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    orig = open(src, "rb").read()
    INTERESTING = [0, 1, 2, 3, 4, 6, 7, 8, 9, 12, 31, 32, 33, 0x7F, 0x80, 0xFF, 0xFFFF, 2**31 - 1,
                   2**31, 2**32 - 1, 2**62, 2**63 - 1, 2**64 - 1, len(orig), 0x7FC00000]

    def mutate(rng):
        b = bytearray(orig)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(min(header_end, len(b)) if rng.random() < 0.9 else len(b))
            op = rng.randrange(7)
            if op == 0:
                b[pos] ^= 1 << rng.randrange(8)
            elif op == 1:
                b[pos:pos + 4] = struct.pack("<I", rng.choice(INTERESTING) & 0xFFFFFFFF)
            elif op == 2:
                b[pos:pos + 8] = struct.pack("<Q", rng.choice(INTERESTING) & (2**64 - 1))
            elif op == 3:
                del b[pos:]
            elif op == 4:
                b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            elif op == 5:
                del b[pos:pos + rng.randint(1, 16)]
            else:  # type confusion: a small value at a value-type position is likely a type byte
                b[pos:pos + 4] = struct.pack("<I", rng.randrange(13))
            if not b:
                break
        return bytes(b)

    for seed in range(first, first + count):
        data = mutate(random.Random(seed))
        with open(scratch, "wb") as fh:
            fh.write(data)
        print("seed", seed, flush=True)  # the last seed printed is the one that crashed or hung
        try:
            e = Engine.open(scratch, n_ctx=32, threads=1, pin=False)
        except (GGUFError, ResourceError):
            print("rejected", flush=True)
            continue
        except BaseException as ex:
            print("untyped", seed, type(ex).__name__, str(ex)[:200].replace("\\n", " "), flush=True)
            continue
        try:
            ids = e.tokenizer.encode("hello world") or [0]
            logits = e.forward(np.asarray(ids, np.int32), np.arange(len(ids), dtype=np.int32),
                               np.zeros(len(ids), np.int32), np.ones(len(ids), np.bool_))
            e.tokenizer.decode(ids)
            print("accepted", flush=True)
        except BaseException as ex:  # loaded, then failed: the file should have been refused
            print("untyped", seed, "after load:", type(ex).__name__, str(ex)[:200].replace("\\n", " "),
                  flush=True)
    print("end", flush=True)
""")

ADDRESS_SPACE_LIMIT = 4 << 30


def gguf_campaign(n_files: int, seed: int = 0, timeout_s: float = 1800) -> Report:
    import gguf

    from models.tiny_dense import make_model
    rep = Report("gguf", rss_before=None)
    with tempfile.TemporaryDirectory(prefix="ktd-fuzz-") as tmp:
        src = make_model("llama", os.path.join(tmp, "llama.gguf"))
        header_end = gguf.GGUFReader(str(src)).data_offset
        first = seed * 1_000_000
        remaining = n_files
        while remaining > 0:  # a crash or a hang ends one child; the rest go to the next
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
            try:
                p = subprocess.run(
                    [sys.executable, "-c", _LOADER_CHILD, str(src), os.path.join(tmp, "m.gguf"),
                     str(first), str(remaining), str(header_end)],
                    capture_output=True, text=True, timeout=timeout_s, env=env,
                    preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT,) * 2))
                out, rc, hung = p.stdout, p.returncode, False
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                rc, hung = None, True
            lines = out.splitlines()
            seeds = [int(x.split()[1]) for x in lines if x.startswith("seed ")]
            rep.inputs += len(seeds)
            rep.accepted += sum(x == "accepted" for x in lines)
            untyped = [x for x in lines if x.startswith("untyped")]
            rep.untyped += len(untyped)
            rep.notes += untyped[:10]
            rep.rss_after = max(rep.rss_after, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
            if "end" in lines:
                break
            last = seeds[-1] if seeds else first
            if hung:
                rep.hangs += 1
                rep.notes.append(f"hang at seed {last}")
            else:
                rep.crashes += 1
                rep.notes.append(f"child exited {rc} at seed {last}: {p.stderr[-300:]!r}")
            remaining -= last - first + 1
            first = last + 1
    return rep


# --- the HTTP gateway ---------------------------------------------------------------------------

GW_TIMEOUT_S = 1.0          # the campaign gateway's --header-timeout-s and --body-timeout-s
GW_MAX_CONNECTIONS = 400    # its --max-connections (the over-cap round goes past it)
GW_WORKERS = 24             # client threads, each on its keep-alive connection
SLOW_ROUND = 100            # slow or abandoned connections per round
GW_RSS_BUDGET = 96 << 20    # the gateway's RSS growth over the campaign (Python heap, h11 buffers)

ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/api/chat"),
          ("POST", "/api/generate"), ("POST", "/api/show"), ("GET", "/v1/models"), ("GET", "/v1/models/fake"),
          ("GET", "/api/tags"), ("GET", "/api/ps"), ("GET", "/api/version"), ("GET", "/health"), ("GET", "/"),
          ("POST", "/api/pull"), ("GET", "/v1/chat/completions"), ("GET", "/nope"), ("DELETE", "/v1/models")]
# JSON texts that have broken parsers and encoders before: ranges, digits, surrogates, nesting.
JSON_HOSTILE = ["null", "true", "0", "-1", "1.5", "1e308", "-1e999", "NaN", "Infinity", str(2**63), str(2**64),
                str(-(2**64)), "9" * 5000, '""', '"x"', '"\\ud800"', '"a\\udcff"', '"\\ud83d\\ude00"',
                '"<|im_end|>"', '"' + "a" * 3000 + '"', "[]", "{}", "[[[[[]]]]]", "[" * 200 + "]" * 200,
                '{"type": "object"}', '{"a": "\\ud800"}', '[1, "x", null]']
BODY_FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
               "response_format", "tools", "tool_choice", "logprobs", "top_logprobs", "suffix", "format",
               "options", "n", "stream_options", "user", "\\ud800", "keep_alive", "images", "raw", "system"]
GOOD = {"/v1/chat/completions": '{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3',
        "/v1/completions": '{"model": "fake", "prompt": "hi", "max_tokens": 3',
        "/api/chat": '{"model": "fake", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 3}',
        "/api/generate": '{"model": "fake", "prompt": "hi", "options": {"num_predict": 3}',
        "/api/show": '{"model": "fake"'}


def _http_body(rng: random.Random, path: str) -> bytes:
    """A body for ``path``: its valid request with hostile fields added, or raw hostile JSON."""
    r = rng.random()
    if r < 0.12:
        return rng.choice([b"", b"{", b"[1, 2]", b"\xff\xfe{}", "{\"a\": \"é\"}".encode("latin-1"),
                           b"{" * 3000, b'{"model": ' + b"[" * 100_000, b"\xef\xbb\xbf{}"])
    text = GOOD.get(path, '{"model": "fake"')
    for _ in range(rng.randrange(4)):
        text += f', "{rng.choice(BODY_FIELDS)}": {rng.choice(JSON_HOSTILE)}'
    if rng.random() < 0.3:
        text += ', "stream": ' + rng.choice(["true", "false"])
    return (text + "}").encode()


def _http_request(rng: random.Random) -> tuple[str, bytes]:
    """(method, request bytes): a route, a body, headers that confuse (and sometimes bytes
    mutated: then the gateway answers 400 or 408, or closes)."""
    method, path = rng.choice(ROUTES)
    body = _http_body(rng, path) if method == "POST" else b""
    headers = ["Host: ktd", "Content-Type: " + rng.choice(["application/json", "text/plain", "x/\xe9"])]
    chunked = rng.random() < 0.1 and body
    if chunked:
        headers.append("Transfer-Encoding: chunked")
        body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[:7], body[7:]) if c) + b"0\r\n\r\n"
    else:
        headers.append(f"Content-Length: {len(body)}")
    extra = rng.random()
    if extra < 0.05:
        headers.append("Authorization: Bearer " + "x" * rng.randrange(1, 9000))
    elif extra < 0.1:
        headers.append("X-Junk: " + "y" * rng.randrange(20000, 70000))  # over h11's 16 KiB: 400
    elif extra < 0.13:
        headers.append("Expect: 100-continue")
    elif extra < 0.16:
        headers += [f"X-{i}: {i}" for i in range(300)]
    target = path
    if rng.random() < 0.1:
        target += rng.choice(["?a=1", "?" + "%ff" * 50, "/%ED%A0%80", "%00", "/../../etc/passwd"])
    data = f"{method} {target} HTTP/1.1\r\n".encode() + "\r\n".join(headers).encode("latin-1") + b"\r\n\r\n" + body
    if rng.random() < 0.03:
        data = _mutate(rng, data)
    return method, data


def _read_http(s: socket.socket, method: str, buf: bytes) -> tuple[int, dict, bytes, bytes]:
    """One response: (status, headers, body, bytes after it); status 0: closed before a whole
    response. Content-Length, chunked and close-delimited bodies; 1xx responses skipped."""
    def more() -> bytes:
        chunk = s.recv(1 << 16)
        if not chunk:
            raise EOFError
        return chunk

    try:
        while True:
            while b"\r\n\r\n" not in buf:
                buf += more()
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
            if status >= 200:
                break
        if method == "HEAD" or status in (204, 304):
            return status, headers, b"", buf
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(buf) < n:
                buf += more()
            return status, headers, buf[:n], buf[n:]
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                while b"\r\n" not in buf:
                    buf += more()
                size_line, _, buf = buf.partition(b"\r\n")
                n = int(size_line.split(b";")[0], 16)
                while len(buf) < n + 2:
                    buf += more()
                body, buf = body + buf[:n], buf[n + 2:]
                if n == 0:
                    return status, headers, body, buf
        try:
            while True:
                buf += more()
        except EOFError:
            return status, headers, buf, b""
    except EOFError:
        return 0, {}, b"", b""


@dataclasses.dataclass
class _Tally:
    requests: int = 0
    connections: int = 0
    slow: int = 0
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    server_errors: list = dataclasses.field(default_factory=list)
    untyped: list = dataclasses.field(default_factory=list)
    hangs: list = dataclasses.field(default_factory=list)
    unanswered: list = dataclasses.field(default_factory=list)


def _judge(t: _Tally, data: bytes, status: int, headers: dict, body: bytes) -> None:
    t.statuses[status] += 1
    if status == 501 and b"offline" in body:
        return  # Ollama's model management (/api/pull ...): the documented "not here", not a failure
    if status >= 500:
        t.server_errors.append(f"{status} for {data[:160]!r}: {body[:200]!r}")
    elif status >= 400:
        try:
            ok = "error" in json.loads(body)
        except ValueError:
            ok = False
        if not ok or not headers.get("content-type", "").startswith("application/json"):
            t.untyped.append(f"{status} {headers.get('content-type')} {body[:120]!r} for {data[:120]!r}")


def _http_worker(address: tuple[str, int], seed: int, n: int, t: _Tally, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    s, buf = None, b""
    sent = 0
    while sent < n:
        method, data = _http_request(rng)
        if not data:
            continue  # a mutation deleted every byte: nothing to answer
        sent += 1
        if s is None:
            s, buf = socket.create_connection(address, timeout=HANG_S), b""
            with lock:
                t.connections += 1
        try:
            s.sendall(data)
            status, headers, body, buf = _read_http(s, method, buf)
        except TimeoutError:
            with lock:
                t.hangs.append(f"no answer in {HANG_S} s to {data[:160]!r}")
            status, headers, body = -1, {}, b""
        except OSError:  # reset: the gateway closed after its answer to a bad request
            status, headers, body = 0, {}, b""
        with lock:
            t.requests += 1
            if status == 0:
                t.unanswered.append(f"closed without an answer: {data[:160]!r}")
            if status > 0:
                _judge(t, data, status, headers, body)
        if status <= 0 or headers.get("connection") == "close":
            s.close()
            s = None
    if s is not None:
        s.close()


# Slow and abandoned connections: what each does, and whether the gateway must end it (within
# its timeout) or the client leaves. "stream" requests generate a few tokens.
_STREAM = (b"POST /v1/completions HTTP/1.1\r\nHost: ktd\r\nContent-Type: application/json\r\nContent-Length: %d"
           b"\r\n\r\n%s")
SLOW_KINDS = ("silent", "trickle_headers", "trickle_body", "leave_at_connect", "leave_in_line",
              "leave_after_headers", "leave_in_body", "leave_before_answer", "leave_in_stream", "slow_reader")


def _stream_request(max_tokens: int) -> bytes:
    body = b'{"model": "fake", "prompt": "slow", "max_tokens": %d, "stream": true}' % max_tokens
    return _STREAM % (len(body), body)


class _Slow:
    """One slow or abandoned connection, driven by ``step`` every tick."""

    def __init__(self, kind: str, address: tuple[str, int]):
        self.kind, self.sock, self.sent, self.got = kind, socket.create_connection(address, timeout=HANG_S), 0, b""
        self.sock.setblocking(False)
        self.done = False          # the client is finished with it (left, or saw the end)
        self.closed_by_gateway = False
        self.t0 = time.monotonic()
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: ktd\r\nContent-Length: 500\r\n\r\n"
        self.script = {"trickle_headers": head, "trickle_body": head + b" " * 400}[kind] \
            if kind.startswith("trickle") else b""

    def step(self) -> None:
        if self.done:
            return
        k = self.kind
        if k in ("leave_at_connect", "leave_in_line", "leave_after_headers", "leave_in_body",
                 "leave_before_answer"):
            data = {"leave_at_connect": b"", "leave_in_line": b"POST /v1/chat/comp",
                    "leave_after_headers": b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: 90\r\n\r\n",
                    "leave_in_body": b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: 90\r\n\r\n{\"mod",
                    "leave_before_answer": _stream_request(12)}[k]
            self._send(data)
            self._leave()
            return
        if k in ("leave_in_stream", "slow_reader") and self.sent == 0:
            self._send(_stream_request(12))
            self.sent = 1
            return
        if k == "leave_in_stream":
            if self._recv() and b"data:" in self.got:
                self._leave()
            return
        if k == "slow_reader":
            if time.monotonic() - self.t0 > 1.5:  # read nothing for 1.5 s, then everything
                self._recv()
                if b"[DONE]" in self.got:
                    self._leave()
            return
        if k.startswith("trickle") and self.sent < len(self.script) and not self.closed_by_gateway:
            n = 1 if k == "trickle_headers" or self.sent >= len(self.script) - 400 else len(self.script)
            self._send(self.script[self.sent:self.sent + n])
            self.sent += n
        self._recv()

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BlockingIOError, OSError):
            pass

    def _recv(self) -> bool:
        try:
            chunk = self.sock.recv(1 << 16)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self.closed_by_gateway = self.done = True
            self.sock.close()
            return False
        self.got += chunk
        return True

    def _leave(self) -> None:
        self.done = True
        self.sock.close()


def _slow_round(address: tuple[str, int], rng: random.Random, t: _Tally, check) -> None:
    """SLOW_ROUND slow or abandoned connections at once; meanwhile ``check()`` (a normal request
    on a fresh connection) must be answered. Those the gateway must end are ended in time."""
    conns = [_Slow(rng.choice(SLOW_KINDS), address) for _ in range(SLOW_ROUND)]
    t.connections += len(conns)
    t.slow += len(conns)
    checked = False
    limit = time.monotonic() + GW_TIMEOUT_S + HANG_S
    while not all(c.done for c in conns) and time.monotonic() < limit:
        for c in conns:
            c.step()
        if not checked and time.monotonic() - conns[0].t0 > 0.5:
            check()
            checked = True
        time.sleep(0.05)
    for c in conns:
        if not c.done:
            t.hangs.append(f"{c.kind}: not ended by the gateway in {HANG_S} s")
            c.sock.close()
        elif c.kind == "trickle_body" and not c.got.startswith(b"HTTP/1.1 408"):
            t.untyped.append(f"trickle_body ended without a 408: {c.got[:100]!r}")
        elif c.kind == "slow_reader" and b"[DONE]" not in c.got:
            t.unanswered.append(f"slow reader got an incomplete stream: {c.got[-100:]!r}")


def _over_cap_round(address: tuple[str, int], t: _Tally) -> int:
    """Opens GW_MAX_CONNECTIONS silent connections and 20 more: those 20 get 503 at once. The silent
    ones are then ended by the header timeout. Returns the 503s seen."""
    held = [socket.create_connection(address, timeout=HANG_S) for _ in range(GW_MAX_CONNECTIONS)]
    refused = 0
    for _ in range(20):
        s = socket.create_connection(address, timeout=HANG_S)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: ktd\r\n\r\n")
        status, headers, body, _ = _read_http(s, "GET", b"")
        s.close()
        refused += status == 503 and b"too_many_connections" in body
    t.connections += len(held) + 20
    t.slow += len(held) + 20
    for s in held:
        s.settimeout(GW_TIMEOUT_S + HANG_S)
        try:
            if s.recv(1):
                t.untyped.append("a silent connection got bytes")
        except TimeoutError:
            t.hangs.append("a silent connection was not closed by the header timeout")
        except OSError:
            pass
        s.close()
    return refused


def _gateway_metrics(address: tuple[str, int]) -> dict[str, float]:
    with socket.create_connection(address, timeout=HANG_S) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: ktd\r\n\r\n")
        status, _, body, _ = _read_http(s, "GET", b"")
    out = {}
    for line in body.decode().splitlines():
        if line.startswith("ktd_http_") and " " in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _at_rest(d, address: tuple[str, int]) -> str:
    """"" once the gateway has no request in flight but the metrics one and no connection but that
    one, and the daemon no slot or queue entry in use; else what is still busy."""
    from ktd.client import Client

    deadline = time.monotonic() + HANG_S
    while True:
        m = _gateway_metrics(address)
        with Client(d.socket, timeout=10) as c:
            st = c.status()["scheduler"]
        busy = {k: v for k, v in (("in_flight", m["ktd_http_in_flight"] - 1), ("connections", m["ktd_http_connections"] - 1),
                                  ("slots", st["slots_in_use"]), ("queued", st["queued"])) if v}
        if not busy or time.monotonic() > deadline:
            return ", ".join(f"{k} {v:g}" for k, v in busy.items())
        time.sleep(0.2)


def gateway_campaign(n_requests: int, n_slow: int, seed: int = 0) -> Report:
    """The gateway (python -m ktd.http) in front of the daemon (fake engine): ``n_requests``
    hostile requests from GW_WORKERS keep-alive clients, then ``n_slow`` slow or abandoned
    connections in rounds (each with a normal request answered meanwhile) and a round over the
    connection cap. Counted: crash (either process exited), hang, unanswered, 5xx (every request
    is a client mistake or valid), untyped (an error answer not in JSON), RSS of both processes,
    and whether gateway and daemon are back at rest."""
    from http_helpers import start_gateway

    rep = Report("gateway", rss_budget=GW_RSS_BUDGET)
    t, lock = _Tally(), threading.Lock()
    with DaemonProcess(limits={"max_tokens": 16}, model={"n_ctx": 128, "n_seq_max": 4},
                       server={"max_queue": 64}) as d:
        g = start_gateway(d.socket, d.dir, unix=False, args=[
            "--header-timeout-s", str(GW_TIMEOUT_S), "--body-timeout-s", str(GW_TIMEOUT_S),
            "--max-connections", str(GW_MAX_CONNECTIONS), "--max-body-bytes", str(1 << 20), "--log-level", "warning"])
        address = (g.url.split("//")[1].split(":")[0], int(g.url.rsplit(":", 1)[1].split("/")[0]))
        try:
            _gateway_metrics(address)  # warm
            rss0 = (_rss(g.proc.pid), _rss(d.proc.pid))
            per = -(-n_requests // GW_WORKERS)
            workers = [threading.Thread(target=_http_worker, args=(address, seed * 1000 + i, per, t, lock))
                       for i in range(GW_WORKERS)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            rng = random.Random(seed)

            def check() -> None:
                with socket.create_connection(address, timeout=HANG_S) as s:
                    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: ktd\r\n\r\n")
                    if _read_http(s, "GET", b"")[0] != 200:
                        t.server_errors.append("a normal request was not answered during a slow round")

            for _ in range(-(-n_slow // SLOW_ROUND)):
                _slow_round(address, rng, t, check)
            refused = _over_cap_round(address, t)
            if refused != 20:
                rep.notes.append(f"over the cap: {refused} of 20 connections answered 503")
                t.untyped.append("the connection cap did not answer 503")
            busy = _at_rest(d, address)
            if busy:
                t.hangs.append(f"not back at rest: {busy}")
            rep.rss_before, rep.rss_after = rss0[0], _rss(g.proc.pid)
            rep.other_rss = {"daemon": (rss0[1], _rss(d.proc.pid))}
            for proc, name in ((g.proc, "gateway"), (d.proc, "daemon")):
                if proc.poll() is not None:
                    rep.crashes += 1
                    rep.notes.append(f"the {name} exited with {proc.returncode}")
        finally:
            g.stop()
        for name, log in (("gateway", g.log()), ("daemon", d.log())):
            for bad in ("Traceback", "Future exception was never retrieved", "Exception in ASGI application"):
                n = log.count(bad)
                if n:
                    t.untyped.append(f"{n} × {bad!r} in the {name} log")
    rep.inputs, rep.connections, rep.slow = t.requests, t.connections, t.slow
    rep.hangs, rep.unanswered = len(t.hangs), len(t.unanswered)
    rep.untyped, rep.server_errors = len(t.untyped), len(t.server_errors)
    rep.notes += [f"statuses: {dict(sorted(t.statuses.items()))}"] + t.server_errors[:8] + t.hangs[:8] \
        + t.unanswered[:8] + t.untyped[:8]
    return rep


def table(reports: list[Report]) -> str:
    rows = [("campaign", "inputs", "conns", "slow", "crashes", "hangs", "unanswered", "untyped", "5xx",
             "loaded", "RSS before", "RSS after")]
    for r in reports:
        rows.append((r.name, str(r.inputs), str(r.connections), str(r.slow), str(r.crashes), str(r.hangs),
                     str(r.unanswered), str(r.untyped), str(r.server_errors), str(r.accepted),
                     "-" if r.rss_before is None else f"{r.rss_before / 2**20:.0f} MiB",
                     f"{r.rss_after / 2**20:.0f} MiB" + ("" if r.rss_before is not None else " (peak)")))
        for name, (before, after) in r.other_rss.items():
            rows.append((f"  {name}", *[""] * 9, f"{before / 2**20:.0f} MiB", f"{after / 2**20:.0f} MiB"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    for r in reports:
        lines += [f"  {r.name}: {n}" for n in r.notes[:20]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--http-requests", type=int, default=50_000)
    ap.add_argument("--http-slow", type=int, default=1_000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    reports = []
    if a.frames:
        reports.append(protocol_campaign(a.frames, a.seed))
    if a.files:
        reports.append(gguf_campaign(a.files, a.seed))
    if a.http_requests or a.http_slow:
        reports.append(gateway_campaign(a.http_requests, a.http_slow, a.seed))
    print(table(reports))
    print(f"RSS budgets: the daemon +{RSS_BUDGET >> 20} MiB over each campaign, the gateway "
          f"+{GW_RSS_BUDGET >> 20} MiB")
    within = all(rss_ok(r) for r in reports)
    return 0 if all(r.ok for r in reports) and within else 1


if __name__ == "__main__":
    sys.exit(main())
