"""ktd-http against the real daemon process (fake engine) with the real client libraries: the
``openai`` SDK (sync and async, streamed and not), the ``ollama`` package and langchain-openai's
``ChatOpenAI``, over 127.0.0.1 and over a Unix socket (httpx transport). The reference for every
text is ``ktd.client`` sending the same request to the same daemon at temperature 0.

No test here touches the internet: the clients are pointed at the gateway, langchain's token
counting (tiktoken, which downloads its encodings) is never called, and LangSmith tracing is off.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys

import httpx
import pytest

from daemon_helpers import DaemonProcess, wait_for
from http_helpers import daemon_status, finished_cancelled, start_gateway
from ktd.client import Client

openai = pytest.importorskip("openai", reason="the openai package (requirements-dev.txt) is not installed")
ollama = pytest.importorskip("ollama", reason="the ollama package (requirements-dev.txt) is not installed")

os.environ.setdefault("LANGSMITH_TRACING", "false")
os.environ.setdefault("LANGCHAIN_TRACING_V2", "false")

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
N = 24


# the module's daemon (conftest)
DAEMON = dict(model={"n_ctx": 256, "n_seq_max": 4}, server={"max_queue": 8}, fake={"eos_bias": -8.0})


def reference(daemon, **params) -> dict:
    with Client(daemon.socket, timeout=30) as c:
        return c.generate(**params)


def usage_of(r: dict) -> tuple[int, int]:
    return r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]


# --- OpenAI SDK ------------------------------------------------------------------------------------

def test_openai_sync_chat_matches_ktd_client(daemon, gateway):
    want = reference(daemon, messages=MESSAGES, temperature=0, max_tokens=N)
    assert want["text"]  # the fake model really generates
    client = openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake"]
    r = client.chat.completions.create(model="fake", messages=MESSAGES, temperature=0, max_tokens=N)
    assert r.choices[0].message.content == want["text"]
    assert r.choices[0].finish_reason == want["finish_reason"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == usage_of(want)
    assert r.usage.total_tokens == sum(usage_of(want))

    pieces, usage, finish = [], None, None
    for chunk in client.chat.completions.create(model="fake", messages=MESSAGES, temperature=0,
                                                max_tokens=N, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert len([p for p in pieces if p]) > 1  # really streamed, piece by piece
    assert "".join(pieces) == want["text"]
    assert finish == want["finish_reason"]
    assert (usage.prompt_tokens, usage.completion_tokens) == usage_of(want)


def test_openai_stop_seed_and_sampling_parameters(daemon, gateway):
    client = openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
    free = reference(daemon, messages=MESSAGES, temperature=0, max_tokens=N)["text"]
    stop = free[3:5]
    want = reference(daemon, messages=MESSAGES, temperature=0, max_tokens=N, stop=[stop])
    r = client.chat.completions.create(model="fake", messages=MESSAGES, temperature=0, max_tokens=N,
                                       stop=stop)
    assert r.choices[0].message.content == want["text"] and stop not in want["text"]
    assert r.choices[0].finish_reason == "stop"
    # a seeded sample at temperature 1.3 with penalties and top_p: the daemon's own answer
    kw = dict(temperature=1.3, top_p=0.9, seed=1234, presence_penalty=0.5, frequency_penalty=0.25)
    want = reference(daemon, messages=MESSAGES, max_tokens=N, **kw)
    r = client.chat.completions.create(model="fake", messages=MESSAGES, max_completion_tokens=N, **kw)
    assert r.choices[0].message.content == want["text"]


def test_openai_async_completions_stream_and_whole(daemon, gateway):
    prompt = "Once upon a time"
    want = reference(daemon, prompt=prompt, parse_special=True, temperature=0, max_tokens=N)

    async def go():
        client = openai.AsyncOpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
        whole = await client.completions.create(model="fake", prompt=prompt, temperature=0, max_tokens=N)
        pieces = []
        async for chunk in await client.completions.create(model="fake", prompt=prompt, temperature=0,
                                                           max_tokens=N, stream=True):
            pieces.extend(c.text for c in chunk.choices)
        chat = await client.chat.completions.create(model="fake", messages=MESSAGES, temperature=0,
                                                    max_tokens=N)
        await client.close()
        return whole, "".join(pieces), chat

    whole, streamed, chat = asyncio.run(go())
    assert whole.choices[0].text == want["text"] == streamed
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == usage_of(want)
    assert chat.choices[0].message.content == reference(daemon, messages=MESSAGES, temperature=0,
                                                        max_tokens=N)["text"]


def test_openai_over_unix_socket(daemon, gateway):
    want = reference(daemon, messages=MESSAGES, temperature=0, max_tokens=N)
    http = httpx.Client(transport=httpx.HTTPTransport(uds=gateway.unix_path))
    client = openai.OpenAI(base_url="http://ktd/v1", api_key="unused", http_client=http, max_retries=0)
    r = client.chat.completions.create(model="fake", messages=MESSAGES, temperature=0, max_tokens=N)
    assert r.choices[0].message.content == want["text"]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="fake", messages=MESSAGES, temperature=0, max_tokens=N, stream=True) if c.choices)
    assert streamed == want["text"]
    http.close()


def test_langchain_chat_openai(daemon, gateway):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai (requirements-dev.txt) is not installed")
    want = reference(daemon, messages=[{"role": "user", "content": "Say something."}], temperature=0,
                     max_tokens=N)
    llm = lc.ChatOpenAI(model="fake", base_url=gateway.url, api_key="unused", temperature=0,
                        max_tokens=N, max_retries=0)
    msg = llm.invoke("Say something.")
    assert msg.content == want["text"]
    assert msg.usage_metadata["input_tokens"] == want["usage"]["prompt_tokens"]
    assert msg.usage_metadata["output_tokens"] == want["usage"]["completion_tokens"]
    assert "".join(c.content for c in llm.stream("Say something.")) == want["text"]


# --- Ollama client ---------------------------------------------------------------------------------

def test_ollama_client_chat_generate_and_listing(daemon, gateway):
    client = ollama.Client(host=gateway.root)
    opts = {"temperature": 0, "num_predict": N}
    want = reference(daemon, messages=MESSAGES, temperature=0, max_tokens=N)
    r = client.chat(model="fake", messages=MESSAGES, options=opts, keep_alive="5m")
    assert r.message.content == want["text"] and r.done and r.done_reason == want["finish_reason"]
    assert (r.prompt_eval_count, r.eval_count) == usage_of(want)
    parts = list(client.chat(model="fake", messages=MESSAGES, options=opts, stream=True))
    assert "".join(p.message.content for p in parts) == want["text"]
    assert parts[-1].done and parts[-1].eval_count == want["usage"]["completion_tokens"]

    # /api/generate without raw: the prompt is the user turn of the chat template (as Ollama)
    want = reference(daemon, messages=[{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi"}], temperature=0, max_tokens=N)
    r = client.generate(model="fake", prompt="Hi", system="Be brief.", options=opts)
    assert r.response == want["text"]
    want = reference(daemon, prompt="Hi", parse_special=True, temperature=0, max_tokens=N)
    streamed = "".join(p.response for p in client.generate(model="fake:latest", prompt="Hi", raw=True,
                                                            options=opts, stream=True))
    assert streamed == want["text"]
    assert client.generate(model="fake", prompt="").done_reason == "load"  # Ollama's load request

    tags = client.list()
    assert [(m.model) for m in tags.models] == ["fake"]
    raw = httpx.get(f"{gateway.root}/api/tags").json()["models"][0]
    assert raw["name"] == raw["model"] == "fake"  # both fields (open-webui#12463)
    assert client.show("fake").details.format == "gguf"
    assert [m.model for m in client.ps().models] == ["fake"]
    assert httpx.get(f"{gateway.root}/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError, match="offline"):
        client.pull("llama3")
    with pytest.raises(ollama.ResponseError, match="not found") as e:
        client.chat(model="llama3", messages=MESSAGES)
    assert e.value.status_code == 404


def test_fim_refused_without_fim_tokens(gateway):
    r = httpx.post(f"{gateway.url}/completions", json={"model": "fake", "prompt": "def f(", "suffix": ")"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "fim_unsupported" and "fill-in-the-middle" in r.json()["error"]["message"]
    r = httpx.post(f"{gateway.root}/api/generate", json={"model": "fake", "prompt": "a", "suffix": "b"})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]


# --- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (b'{"model": "fake", "messages": "hi"}', 400, "invalid_type"),
    (b'{"model": "fake", "messages": [{"role": "user", "content": 5}]}', 400, "invalid_type"),
    (b'{"model": "fake", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400, "invalid_type"),
    (b'{"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', 400, "invalid_type"),
    (b'{"model": "fake", "messages": [{"role": "user", "content": "x"}], "n": 2}', 400, "unsupported_value"),
    (b'{"model": "fake", "messages": [{"role": "user", "content": "x"}], "temperature": 1000}', 400, "bad_request"),
    (b'{"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}', 400, "too_large"),
    (b'{"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "invalid_type"),
    (b'{"model": "fake", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
     "unsupported_content"),
])
def test_bad_requests_get_openai_shaped_errors(gateway, body, status, code):
    r = httpx.post(f"{gateway.url}/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and "type" in err


def test_context_overflow_is_context_length_exceeded(gateway):
    client = openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x" * 400}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # also when streaming: the error comes first
        client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=250, stream=True)
    assert e.value.code == "context_length_exceeded"


def test_huge_body_is_refused_bounded(gateway):
    big = b'{"model": "fake", "prompt": "' + b"a" * (5 << 20) + b'"}'
    r = httpx.post(f"{gateway.url}/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: the limit is counted while reading
        for _ in range(80):
            yield b"a" * (64 << 10)

    r = httpx.post(f"{gateway.url}/completions", content=chunks())
    assert r.status_code == 413
    assert httpx.get(f"{gateway.url}/models").status_code == 200  # still serving


@pytest.fixture(scope="module")
def slow_pair():
    """A daemon whose engine steps take 20 ms (a 200-token answer lasts >= 4 s) and its gateway."""
    d = DaemonProcess(fake={"step_delay_s": 0.02, "eos_bias": -50.0})
    d.start()
    g = start_gateway(d.socket, d.dir, unix=False)
    yield d, g
    assert g.stop() == 0
    d.close()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_generation(slow_pair, stream):
    daemon, gateway = slow_pair
    before = finished_cancelled(daemon.socket)
    body = {"model": "fake", "prompt": "x", "max_tokens": 200, "stream": stream}
    with httpx.Client(timeout=30) as http:
        if stream:  # leave after the first event
            with http.stream("POST", f"{gateway.url}/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())
        else:  # give up waiting for the whole answer
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{gateway.url}/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    assert wait_for(lambda: finished_cancelled(daemon.socket) == before + 1, 10), gateway.log()[-2000:]
    assert wait_for(lambda: daemon_status(daemon.socket)["slots_in_use"] == 0, 10)
    assert "499" in gateway.log()  # logged as "client closed request"


def test_many_keep_alive_connections_leak_no_slots(daemon, gateway):
    """1,000 keep-alive HTTP connections open at once (each client opens its one connection, then
    all wait until every connection is open), each then sends a streamed generate (the daemon's 4
    slots + 8 queue places answer some with 200, the rest with 429 + Retry-After) and a third
    request on the same connection; afterwards the daemon holds no slot and no queue entry."""
    n_conn = 1000

    async def go():
        opened = asyncio.Event()
        n_open = 0

        async def one(client: httpx.AsyncClient) -> tuple[int, int]:
            nonlocal n_open
            assert (await client.get(f"{gateway.url}/models")).status_code == 200
            n_open += 1
            if n_open == n_conn:
                opened.set()
            await opened.wait()
            r = await client.post(f"{gateway.url}/completions",
                                  json={"model": "fake", "prompt": "abc", "max_tokens": 4, "stream": True})
            if r.status_code == 429:
                assert r.headers["retry-after"]
                assert r.json()["error"]["code"] == "busy"
            r2 = await client.get(f"{gateway.url}/models")
            return r.status_code, r2.status_code

        # one connection per client; verify=False: plain HTTP, and no CA bundle loaded 1,000 times
        clients = [httpx.AsyncClient(timeout=120, verify=False, limits=httpx.Limits(max_connections=1))
                   for _ in range(n_conn)]
        try:
            results = await asyncio.gather(*(one(c) for c in clients))
            held = sum(len(c._transport._pool.connections) for c in clients)
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        return results, held

    results, held = asyncio.run(go())
    assert held == n_conn  # every connection was kept alive through its three requests
    codes = [a for a, _ in results]
    assert set(codes) <= {200, 429} and codes.count(200) >= 12, sorted(set(codes))
    assert all(b == 200 for _, b in results)
    st = daemon_status(daemon.socket)
    assert st["slots_in_use"] == 0 and st["queued"] == 0


# --- operations, authentication, listeners -----------------------------------------------------------

def test_health_and_metrics(daemon, gateway):
    assert httpx.get(f"{gateway.root}/health").json() == {"status": "ok"}
    httpx.get(f"{gateway.url}/models")
    text = httpx.get(f"{gateway.root}/metrics").text
    assert re.search(r"^ktd_slots_total 4", text, re.M)  # the daemon's
    assert re.search(r'^ktd_http_requests_total\{route="/v1/models",status="200"\} [1-9]', text, re.M)
    assert re.search(r'^ktd_http_request_duration_seconds_count\{route="/v1/models"\} [1-9]', text, re.M)


def test_health_is_503_while_the_daemon_is_away(tmp_path):
    g = start_gateway(str(tmp_path / "absent.sock"), str(tmp_path), unix=False)
    try:
        r = httpx.get(f"{g.root}/health")
        assert r.status_code == 503 and r.headers["retry-after"]
        r = httpx.post(f"{g.url}/chat/completions", json={"model": "x", "messages": MESSAGES})
        assert r.status_code == 503 and r.json()["error"]["code"] == "daemon_unavailable"
    finally:
        assert g.stop() == 0


def test_health_is_503_while_the_daemon_loads(tmp_path):
    d = DaemonProcess(fake={"load_steps": 4, "load_delay_s": 6.0})
    d.spawn()
    try:
        assert wait_for(lambda: os.path.exists(d.socket), 10)  # bound before the load, as under systemd
        g = start_gateway(d.socket, d.dir, unix=False)
        try:
            r = httpx.get(f"{g.root}/health", timeout=30)
            assert r.status_code == 503 and r.json()["status"] == "loading" and r.headers["retry-after"]
            # a request meanwhile: 503 "loading" with Retry-After (llama-server: 503 Loading model)
            r = httpx.post(f"{g.url}/chat/completions", json={"model": "x", "messages": MESSAGES}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and r.headers["retry-after"]
            d.wait_ready(60)
            assert wait_for(lambda: httpx.get(f"{g.root}/health", timeout=30).status_code == 200, 30)
        finally:
            assert g.stop() == 0
    finally:
        d.close()


def test_api_keys(daemon, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# id:secret\nalice:0123456789abcdef-alice\nbob:0123456789abcdef-bob\n")
    keys.chmod(0o640)
    g = start_gateway(daemon.socket, str(tmp_path), unix=False, args=["--api-keys", str(keys)])
    try:
        assert httpx.get(f"{g.url}/models").status_code == 401
        r = httpx.get(f"{g.url}/models", headers={"Authorization": "Bearer wrong-key-0123456789"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{g.root}/health").status_code == 200  # probes need no key
        bad = openai.OpenAI(base_url=g.url, api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=g.url, api_key="0123456789abcdef-bob", max_retries=0)
        r = good.chat.completions.create(model="fake", messages=MESSAGES, temperature=0, max_tokens=4)
        assert r.choices[0].message.content
        c = ollama.Client(host=g.root, headers={"Authorization": "Bearer 0123456789abcdef-alice"})
        assert c.list().models
    finally:
        assert g.stop() == 0
    log = g.log()
    assert "key=bob" in log and "key=alice" in log and "0123456789abcdef" not in log


def _run_gateway(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ktd.http", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_refuses_network_listener_without_keys_and_open_key_files(tmp_path):
    r = _run_gateway("--socket", str(tmp_path / "d.sock"), "--listen", "0.0.0.0:0")
    assert r.returncode == 1 and "not loopback" in r.stderr and "--api-keys" in r.stderr
    keys = tmp_path / "keys"
    keys.write_text("a:0123456789abcdefXYZ\n")
    keys.chmod(0o644)
    r = _run_gateway("--socket", str(tmp_path / "d.sock"), "--api-keys", str(keys))
    assert r.returncode == 1 and "readable or writable by others" in r.stderr
    keys.chmod(0o600)
    keys.write_text("a:short\n")
    r = _run_gateway("--socket", str(tmp_path / "d.sock"), "--api-keys", str(keys))
    assert r.returncode == 1 and "at least 16" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ktd", "http", "--listen", "nonsense"], capture_output=True,
                       text=True, timeout=20)
    assert r.returncode == 1 and "HOST:PORT" in r.stderr


def test_socket_activation_and_notify(daemon, tmp_path):
    """systemd's protocol, set up by the test: a listening TCP socket on fd 3 (LISTEN_FDS=1,
    LISTEN_PID = the gateway's pid) and a NOTIFY_SOCKET that must receive READY=1."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    notify_path = str(tmp_path / "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(20)
    fd = os.dup(listener.fileno())
    script = (f'exec 3<&{fd} {fd}<&-; LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=ktd-http.socket '
              f'exec "$0" -m ktd.http --socket {daemon.socket}')
    g = start_gateway(daemon.socket, str(tmp_path), unix=False, command=["bash", "-c", script, sys.executable],
                      pass_fds=(fd,), env={"NOTIFY_SOCKET": notify_path})
    os.close(fd)
    listener.close()  # the gateway holds its own copy
    try:
        assert g.url == f"http://127.0.0.1:{port}/v1"
        assert b"READY=1" in notify.recv(4096)
        assert httpx.get(f"{g.url}/models").json()["data"][0]["id"] == "fake"
        assert "socket-activated" in g.log()
    finally:
        assert g.stop() == 0
        notify.close()


def test_gateway_reconnects_after_daemon_restart(tmp_path):
    d = DaemonProcess()
    d.start()
    try:
        g = start_gateway(d.socket, d.dir, unix=False)
        try:
            assert httpx.get(f"{g.url}/models").status_code == 200
            assert d.stop() == 0
            assert "Traceback" not in d.log()  # the gateway's idle connection ended quietly
            assert httpx.get(f"{g.url}/models").status_code == 503
            d.start()
            r = httpx.post(f"{g.url}/chat/completions",
                           json={"model": "fake", "messages": MESSAGES, "max_tokens": 3})
            assert r.status_code == 200, r.text
        finally:
            assert g.stop() == 0
    finally:
        d.close()


def test_ktctl_http_prints_client_settings(gateway):
    r = subprocess.run([sys.executable, "-m", "ktd.ctl", "http", "--url", gateway.url], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert f"OPENAI_BASE_URL={gateway.url} " in r.stdout and f"OLLAMA_HOST={gateway.root}\n" in r.stdout
    assert "model 'fake'" in r.stdout or "model fake" in r.stdout
    r = subprocess.run([sys.executable, "-m", "ktd.ctl", "http", "--url", "http://127.0.0.1:9"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "ktd-http" in r.stderr
