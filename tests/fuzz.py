"""The project's fuzz campaigns: the daemon's wire protocol and the model loader.

    python tests/fuzz.py [--frames N] [--files N] [--seed S]     (`make fuzz`: the full campaign)

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
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
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
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.crashes or self.hangs or self.unanswered or self.untyped)


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
    return rep.rss_before is None or rep.rss_after - rep.rss_before <= RSS_BUDGET


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


def table(reports: list[Report]) -> str:
    rows = [("campaign", "inputs", "conns", "crashes", "hangs", "unanswered", "untyped", "loaded",
             "RSS before", "RSS after")]
    for r in reports:
        rows.append((r.name, str(r.inputs), str(r.connections), str(r.crashes), str(r.hangs),
                     str(r.unanswered), str(r.untyped), str(r.accepted),
                     "-" if r.rss_before is None else f"{r.rss_before / 2**20:.0f} MiB",
                     f"{r.rss_after / 2**20:.0f} MiB" + ("" if r.rss_before is not None else " (peak)")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    for r in reports:
        lines += [f"  {r.name}: {n}" for n in r.notes[:20]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    reports = []
    if a.frames:
        reports.append(protocol_campaign(a.frames, a.seed))
    if a.files:
        reports.append(gguf_campaign(a.files, a.seed))
    print(table(reports))
    print(f"daemon RSS budget over the protocol campaign: +{RSS_BUDGET >> 20} MiB")
    within = all(rss_ok(r) for r in reports)
    return 0 if all(r.ok for r in reports) and within else 1


if __name__ == "__main__":
    sys.exit(main())
