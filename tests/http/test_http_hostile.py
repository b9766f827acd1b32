"""The gateway under hostile clients, one regression test per finding: connections that send
nothing or trickle, requests the gateway cannot pass on to the daemon (numbers msgpack cannot
carry, lone UTF-16 surrogates), error answers that echo such text, malformed bodies, users who
must not see each other's prompts through the prefix cache, and API-key files others control.
The daemon is the real process with the fake engine; the gateway is ``python -m ktd.http``."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import httpx
import pytest

from daemon_helpers import run_as_uid, wait_for
from http_helpers import daemon_status, start_gateway

DAEMON = dict(model={"n_ctx": 256, "n_seq_max": 4}, server={"max_queue": 8}, fake={"eos_bias": -8.0})  # the module's daemon (conftest)

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
# Short limits, so that the tests wait seconds, not the defaults' tens of seconds.
TIMEOUTS = ["--header-timeout-s", "1", "--body-timeout-s", "2"]


@pytest.fixture(scope="module")
def gateway(daemon):
    g = start_gateway(daemon.socket, daemon.dir, unix=False, args=TIMEOUTS)
    yield g
    assert g.stop() == 0, g.log()


def _address(g) -> tuple[str, int]:
    host, port = re.match(r"http://([^:/]+):(\d+)/", g.url).groups()
    return host, int(port)


def _connect(g) -> socket.socket:
    s = socket.create_connection(_address(g), timeout=15)
    return s


def _read_until_closed(s: socket.socket, limit_s: float = 15.0) -> tuple[bytes, float]:
    """Everything the gateway sends until it closes, and how long that took (``limit_s``: the
    gateway did not close; the test fails on the bytes' absence of a close)."""
    t0 = time.monotonic()
    s.settimeout(limit_s)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        return data, float("inf")
    except ConnectionResetError:
        pass
    return data, time.monotonic() - t0


def _request(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: ktd", f"Content-Length: {len(body)}",
            "Content-Type: application/json", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _response(s: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length, read from ``s`` (which stays open)."""
    s.settimeout(15)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    n = int(headers["content-length"])
    while len(rest) < n:
        chunk = s.recv(65536)
        assert chunk, "closed in the middle of a response body"
        rest += chunk
    return status, headers, rest[:n]


def _gauge(g, name: str) -> int:
    text = httpx.get(f"{g.root}/metrics", timeout=10).text
    m = re.search(rf"^{name} (\d+)", text, re.M)
    assert m, text[-2000:]
    return int(m.group(1))


# --- finding 1: connections that send nothing, trickle, or are too many ----------------------------

def test_silent_and_trickling_connections_are_closed(gateway):
    """A connection that sends nothing, one that trickles its request line, and one that sends
    its headers then trickles its body are each closed within the header or body timeout (the
    body one with a 408 in JSON); a request on a fresh connection is answered meanwhile."""
    silent = _connect(gateway)
    headers_trickle = _connect(gateway)
    body_trickle = _connect(gateway)
    body_trickle.sendall(_request("POST", "/v1/chat/completions", headers={"Content-Length": "1000"})
                         .replace(b"Content-Length: 0\r\n", b""))
    t0 = time.monotonic()
    for i in range(12):  # 3.6 s: past both timeouts
        for s, piece in ((headers_trickle, b"POST /v1/chat/completions HTTP/1.1\r\n"[i:i + 1]), (body_trickle, b" ")):
            try:
                s.sendall(piece)
            except OSError:
                pass  # closed already: what the test wants
        time.sleep(0.3)
    assert httpx.get(f"{gateway.url}/models", timeout=10).status_code == 200
    for name, s in (("silent", silent), ("headers", headers_trickle), ("body", body_trickle)):
        data, took = _read_until_closed(s, limit_s=15.0)
        s.close()
        assert took != float("inf"), f"the {name} connection was not closed"
        if name == "body":
            assert data.startswith(b"HTTP/1.1 408"), data[:200]
            assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert time.monotonic() - t0 < 60
    assert wait_for(lambda: _gauge(gateway, "ktd_http_in_flight") == 1, 10)  # the /metrics request itself


def test_connections_over_the_cap_get_503_and_the_cap_frees(daemon, tmp_path):
    g = start_gateway(daemon.socket, str(tmp_path), unix=False,
                      args=["--max-connections", "16", "--header-timeout-s", "30"])
    try:
        held = [_connect(g) for _ in range(16)]  # accepted in order: the next one is the 17th
        try:
            over = _connect(g)
            data, took = _read_until_closed(over, limit_s=10.0)
            over.close()
            assert took != float("inf") and data.startswith(b"HTTP/1.1 503"), data[:200]
            body = json.loads(data.partition(b"\r\n\r\n")[2])
            assert body["error"]["code"] == "too_many_connections" and b"retry-after: 1" in data.lower()
        finally:
            for s in held:
                s.close()
        # the held connections are gone: the gateway answers again (its count is back down)
        assert wait_for(lambda: _status_or_none(g) == 200, 10)
        assert wait_for(lambda: _gauge(g, "ktd_http_connections") <= 1, 10)
    finally:
        assert g.stop() == 0, g.log()
    assert "connection limit" in g.log()


def _status_or_none(g) -> int | None:
    try:
        return httpx.get(f"{g.url}/models", timeout=5).status_code
    except httpx.TransportError:
        return None


def test_requests_over_the_in_flight_cap_get_429(tmp_path):
    from daemon_helpers import DaemonProcess

    with DaemonProcess(fake={"step_delay_s": 0.05, "eos_bias": -50.0}) as d:
        g = start_gateway(d.socket, str(tmp_path), unix=False, args=["--max-in-flight", "2"])
        try:
            with httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b, httpx.Client(timeout=30) as c:
                body = {"model": "fake", "prompt": "x", "max_tokens": 60, "stream": True}
                with a.stream("POST", f"{g.url}/completions", json=body) as ra, \
                        b.stream("POST", f"{g.url}/completions", json=body) as rb:
                    assert ra.status_code == rb.status_code == 200
                    r = c.post(f"{g.url}/completions", json=body)
                    assert r.status_code == 429 and r.headers["retry-after"]
                    assert r.json()["error"]["code"] == "too_many_requests"
            assert wait_for(lambda: _gauge(g, "ktd_http_in_flight") == 1, 10)
        finally:
            assert g.stop() == 0, g.log()


# --- findings 2, 3, 4: bodies the gateway could not pack, render or parse ------------------------------

SURROGATE = "\\ud800"  # JSON text for a lone high surrogate: valid JSON, not encodable as UTF-8


def _chat_with(**fields) -> bytes:
    """A body every generate route reads: a prompt for the completion routes, messages for chat."""
    return json.dumps({**CHAT, "prompt": "x", **fields}).encode()


BAD_BODIES = [
    ("seed of 2**64", _chat_with(seed=2**64), "seed"),
    ("max_tokens of 2**70", _chat_with(max_tokens=2**70), "max_tokens"),
    ("negative 2**64", _chat_with(seed=-(2**64)), "seed"),
    ("5,000 digits", b'{"model": "fake", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),
    ("nested 100,000 deep", b'{"model": "fake", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("nested 200 deep", b'{"model": "fake", "x": ' + b"[" * 200 + b"]" * 200 + b"}", None),
    ("surrogate in content",
     b'{"model": "fake", "max_tokens": 2, "prompt": "x", "messages": [{"role": "user", "content": "a'
     + SURROGATE.encode() + b'"}]}', "messages[0].content"),
    ("surrogate in the prompt", b'{"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "a"}], '
     b'"prompt": "' + SURROGATE.encode() + b'"}', "prompt"),
    ("surrogate in a stop string",
     b'{"model": "fake", "max_tokens": 2, "prompt": "x", "messages": [{"role": "user", "content": "a"}], '
     b'"stop": ["' + SURROGATE.encode() + b'"]}', "stop[0]"),
    ("surrogate in a key", b'{"model": "fake", "prompt": "x", "' + SURROGATE.encode() + b'": 1}', None),
]


@pytest.mark.parametrize("name, body, param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"])
def test_malformed_bodies_are_400_in_json(gateway, name, body, param, route):
    r = httpx.post(f"{gateway.root}{route}", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    if route.startswith("/v1"):
        assert err["code"] == "invalid_json" and err["message"]
        if param:
            assert param in err["message"], err
    else:
        assert isinstance(err, str) and err


def test_an_unpackable_request_leaks_nothing(gateway):
    """Finding 2: each request the gateway could not pack for the daemon kept its future and
    logged "Future exception was never retrieved". A burst of them leaves the gateway's log clean,
    its in-flight gauge at rest, and the daemon idle."""
    with httpx.Client(timeout=30) as http:
        for i in range(200):
            body = _chat_with(seed=2**64 + i) if i % 2 else (
                b'{"model": "fake", "prompt": "' + SURROGATE.encode() + b'", "max_tokens": 2}')
            r = http.post(f"{gateway.url}/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400
        assert http.post(f"{gateway.url}/chat/completions", json=CHAT).status_code == 200
    log = gateway.log()
    assert "Future exception was never retrieved" not in log and "Traceback" not in log, log[-3000:]
    assert wait_for(lambda: _gauge(gateway, "ktd_http_in_flight") == 1, 10)


def test_an_echoed_surrogate_is_answered_in_json_on_the_same_connection(gateway):
    """Finding 3: a lone surrogate in a field the error message quotes (here the model name)
    escaped the handler: plain-text 500, the keep-alive connection dropped, the in-flight gauge
    never decremented, nothing logged. Now: a JSON 400, the connection serves the next request,
    the gauge is back, and the request is logged."""
    s = _connect(gateway)
    try:
        for body in (b'{"model": "' + SURROGATE.encode() + b'", "messages": [{"role": "user", "content": "x"}]}',
                     b'{"model": "' + SURROGATE.encode() + b'"}'):
            s.sendall(_request("POST", "/v1/chat/completions", body))
            status, headers, payload = _response(s)
            assert status == 400 and headers["content-type"].startswith("application/json"), payload
            payload.decode("ascii")  # ASCII-safe JSON
            assert json.loads(payload)["error"]["code"] == "invalid_json"
        s.sendall(_request("GET", "/v1/models"))
        status, _, payload = _response(s)
        assert status == 200 and json.loads(payload)["data"][0]["id"] == "fake"
    finally:
        s.close()
    assert wait_for(lambda: _gauge(gateway, "ktd_http_in_flight") == 1, 10)
    assert re.search(r"POST /v1/chat/completions 400 ", gateway.log())


def test_an_error_message_with_a_surrogate_still_renders(tmp_path):
    """The handler's rendering itself (whatever an error message holds, the answer is ASCII JSON
    and the gauge is decremented): an action raising an HTTPFailure whose message quotes a lone
    surrogate, and one raising a non-HTTP exception whose text holds one."""
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from ktd.http import openai as oa
    from ktd.http.app import Gateway, handler
    from ktd.http.backend import Backend, HTTPFailure

    gw = Gateway(Backend(str(tmp_path / "none.sock")))

    async def echo(gw, request, done):
        raise HTTPFailure(404, "the model '\ud800' does not exist", code="model_not_found")

    async def broken(gw, request, done):
        raise RuntimeError("\udcff")

    app = Starlette(routes=[Route("/echo", handler(gw, "/echo", echo, oa.error_body)),
                            Route("/broken", handler(gw, "/broken", broken, oa.error_body))])
    with TestClient(app, raise_server_exceptions=True) as client:
        r = client.get("/echo")
        assert r.status_code == 404 and r.content.decode("ascii")
        assert r.json()["error"]["message"] == "the model '\ud800' does not exist"
        r = client.get("/broken")
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal"
    assert gw.metrics.in_flight == 0
    assert gw.metrics.requests[("/echo", 404)] == 1 and gw.metrics.requests[("/broken", 500)] == 1


# --- finding 6: the prefix cache between API keys -------------------------------------------------------

@pytest.fixture
def keyed(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("alice:0123456789abcdef-alice\nbob:0123456789abcdef-bob\n")
    keys.chmod(0o640)
    return keys


def _prefix_stats(sock: str) -> dict:
    return daemon_status(sock)["prefix_cache"]


@pytest.mark.parametrize("share", [False, True])
def test_the_prefix_cache_is_not_shared_between_api_keys(tmp_path, keyed, share):
    """Alice's prompt is in the prefix cache; Bob sending the same prompt must not reuse it (its
    cached_tokens and its latency would tell him Alice sent it) unless prefix_cache.share is on.
    Alice re-sending it does reuse it."""
    from daemon_helpers import DaemonProcess

    prompt = "The confidential quarterly report of the company says: " + "x" * 60
    body = {"model": "fake", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    d = DaemonProcess(model={"n_ctx": 256, "n_seq_max": 2})
    if share:
        d.write_config(prefix_cache={"share": True})
    with d:
        g = start_gateway(d.socket, str(tmp_path), unix=False, args=["--api-keys", str(keyed)])
        try:
            alice = {"Authorization": "Bearer 0123456789abcdef-alice"}
            bob = {"Authorization": "Bearer 0123456789abcdef-bob"}
            assert httpx.post(f"{g.url}/completions", json=body, headers=alice, timeout=30).status_code == 200
            before = _prefix_stats(d.socket)
            assert httpx.post(f"{g.url}/completions", json=body, headers=bob, timeout=30).status_code == 200
            after_bob = _prefix_stats(d.socket)
            if share:
                assert after_bob["cached_tokens"] > before["cached_tokens"] + 50
            else:
                assert after_bob["cached_tokens"] == before["cached_tokens"], (before, after_bob)
            assert httpx.post(f"{g.url}/completions", json=body, headers=alice, timeout=30).status_code == 200
            assert _prefix_stats(d.socket)["cached_tokens"] > after_bob["cached_tokens"] + 50
        finally:
            assert g.stop() == 0, g.log()


def _post_as(uid: int, unix_path: str, body: bytes) -> int:
    """POST /v1/completions over the gateway's Unix socket as ``uid`` (needs root); the status."""
    def post() -> bytes:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(unix_path)
        s.sendall(_request("POST", "/v1/completions", body))
        return str(_response(s)[0]).encode()

    return int(run_as_uid(uid, post) or b"0")


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another uid needs root")
def test_unix_peers_of_the_gateway_do_not_share_cached_prompts(tmp_path):
    """Without API keys, the gateway names a Unix-socket caller by its uid (SO_PEERCRED): one
    local user's cached prompt is not reused for another's request."""
    from daemon_helpers import DaemonProcess

    body = json.dumps({"model": "fake", "prompt": "Quarterly figures, confidential: " + "y" * 80,
                       "max_tokens": 2}).encode()
    with DaemonProcess(model={"n_ctx": 256, "n_seq_max": 2}) as d:
        g = start_gateway(d.socket, d.dir, unix=True, args=["--unix-mode", "0666"])
        try:
            assert _post_as(0, g.unix_path, body) == 200
            before = _prefix_stats(d.socket)["cached_tokens"]
            assert _post_as(65534, g.unix_path, body) == 200
            assert _prefix_stats(d.socket)["cached_tokens"] == before
            assert _post_as(0, g.unix_path, body) == 200
            assert _prefix_stats(d.socket)["cached_tokens"] > before + 50
        finally:
            assert g.stop() == 0, g.log()


def test_unknown_routes_and_methods_answer_json(gateway):
    for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/chat/completions", 405),
                                 ("PUT", "/api/chat", 405), ("GET", "/api/nope", 404)):
        r = httpx.request(method, f"{gateway.root}{path}", timeout=10)
        assert r.status_code == status and r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert (err if path.startswith("/api/") else err["message"]).startswith(f"{method} {path}")


# --- finding 8: the API-key file ---------------------------------------------------------------------

def _start_with_keys(daemon_sock: str, keys) -> tuple[int, str]:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "ktd.http", "--socket", daemon_sock, "--listen", "127.0.0.1:0",
                        "--api-keys", str(keys)], capture_output=True, text=True, timeout=20)
    return p.returncode, p.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("case, why", [
    ("group-writable", "writable by its group or others"),
    ("owned by another user", "owned by uid 65534"),
    ("world-writable directory", "writable by its group or others"),
    ("group-writable directory", "writable by its group or others"),
    ("directory of another user", "owned by uid 65534"),
    ("symbolic link", "symbolic link"),
])
def test_an_api_key_file_others_control_is_refused(tmp_path, case, why):
    d = tmp_path / "etc"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    keys = d / "keys"
    keys.write_text("alice:0123456789abcdef-alice\n")
    keys.chmod(0o640)
    if case == "group-writable":
        keys.chmod(0o660)
    elif case == "owned by another user":
        os.chown(keys, 65534, 65534)
    elif case == "world-writable directory":
        os.chmod(d, 0o1777)
    elif case == "group-writable directory":
        os.chmod(d, 0o775)
    elif case == "directory of another user":
        os.chown(d, 65534, 65534)
    elif case == "symbolic link":
        os.symlink(keys, d / "link")
        keys = d / "link"
    rc, err = _start_with_keys(str(tmp_path / "d.sock"), keys)
    assert rc == 1 and why in err, err


def test_a_root_owned_key_file_in_a_closed_directory_is_accepted(daemon, tmp_path):
    d = tmp_path / "etc"
    d.mkdir()
    os.chmod(d, 0o755)
    keys = d / "keys"
    keys.write_text("alice:0123456789abcdef-alice\n")
    keys.chmod(0o640)
    g = start_gateway(daemon.socket, str(tmp_path), unix=False, args=["--api-keys", str(keys)])
    try:
        r = httpx.get(f"{g.url}/models", headers={"Authorization": "Bearer 0123456789abcdef-alice"})
        assert r.status_code == 200
    finally:
        assert g.stop() == 0, g.log()
