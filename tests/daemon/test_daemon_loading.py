"""The daemon while its model loads: the socket accepts from the start, ``health``/``status``/
``metrics`` report the load's progress, every other method gets the typed ``loading`` error, and
READY=1 comes only when everything is served (docs/PROTOCOL.md, "While the model loads").

The fake engine's load is stepped by the test (``load_gate``: step i waits for a file), so the
progress seen at each poll is known without any timing assumption."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import msgpack
import pytest

from daemon_helpers import DaemonProcess, NotifySocket, wait_for
from ktd.client import Client, Loading


def _open_gate(gate: str, i: int) -> None:
    with open(f"{gate}.{i}", "w"):
        pass


def test_status_reports_progress_while_loading_and_only_then_ready():
    steps = 4
    d = DaemonProcess(fake={"load_steps": steps, "load_gate": "GATE"})
    gate = os.path.join(d.dir, "gate")
    d.fake["load_gate"] = gate
    notify = NotifySocket(os.path.join(d.dir, "notify"))
    d.env["NOTIFY_SOCKET"] = notify.path
    try:
        d.spawn()
        assert wait_for(lambda: os.path.exists(d.socket), 20), d.log()
        with Client(d.socket, timeout=10) as c:
            seen = []
            for i in range(steps):
                # step i has been reported and the load waits for its gate: status says so
                assert wait_for(lambda: (c.status().get("loading") or {}).get("fraction") == (i + 1) / steps, 20), \
                    c.status()
                st = c.status()
                assert st["server"]["state"] == "loading"
                assert st["model"]["path"] == d.sections["model"].get("path", "")
                ld = st["loading"]
                assert ld["done_bytes"] == (i + 1) * 1000 and ld["total_bytes"] == steps * 1000
                assert ld["phase"] == "preparing" and ld["elapsed_s"] >= 0
                seen.append(ld["fraction"])
                h = c.health()
                assert h["status"] == "loading" and h["loading"]["fraction"] == ld["fraction"]
                # generation and the model's facts are refused with the typed error, its data the progress
                with pytest.raises(Loading, match="the model is loading") as e:
                    c.generate("hi", max_tokens=2)
                assert e.value.data["fraction"] == ld["fraction"]
                with pytest.raises(Loading):
                    c.hello()
                with pytest.raises(Loading):
                    c.tokenize("hi")
                metrics = c.metrics()
                samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
                assert float(samples["ktd_up"]) == 0 and float(samples["ktd_loading_progress"]) == ld["fraction"]
                assert notify.index("READY", "1") < 0
                _open_gate(gate, i)
            assert seen == sorted(seen) and seen[-1] == 1.0
            # the same connection is served once the model is loaded
            assert wait_for(lambda: c.health()["status"] == "ok", 20)
            assert c.hello()["n_ctx"] == 256
            assert c.generate("hi", max_tokens=2)["usage"]["completion_tokens"] == 2
            st = c.status()
            assert st["server"]["state"] == "serving" and "loading" not in st and "scheduler" in st
        notify.wait("READY", "1")
        assert d.stop() == 0
    finally:
        notify.close()
        d.close()


def _gated_daemon() -> tuple[DaemonProcess, str]:
    """A fake daemon whose two-step load advances only when the test opens the gate file."""
    d = DaemonProcess(fake={"load_steps": 2})
    gate = os.path.join(d.dir, "gate")
    d.fake["load_gate"] = gate
    return d, gate


def _spawn_to_half(d: DaemonProcess) -> None:
    """Start it and wait until its status reports the load half done (held at the gate)."""
    d.spawn()
    assert wait_for(lambda: os.path.exists(d.socket), 20), d.log()
    with Client(d.socket, timeout=10) as c:
        assert wait_for(lambda: (c.status().get("loading") or {}).get("fraction") == 0.5, 20)


def test_a_raw_msgpack_client_gets_the_loading_error_code():
    """The wire form: [1, msgid, {"code": "loading", "message", "data"}, nil]."""
    d, gate = _gated_daemon()
    try:
        _spawn_to_half(d)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(d.socket)
        s.sendall(msgpack.packb([0, 7, "generate", [{"prompt": "x", "max_tokens": 1}]]))
        unpacker = msgpack.Unpacker()
        while True:
            unpacker.feed(s.recv(65536))
            msgs = list(unpacker)
            if msgs:
                break
        s.close()
        kind, msgid, error, result = msgs[0]
        assert (kind, msgid, result) == (1, 7, None)
        assert error["code"] == "loading" and error["data"]["fraction"] == 0.5
        _open_gate(gate, 0)
        _open_gate(gate, 1)
        d.wait_ready()
    finally:
        d.close()


def _ktctl(sock: str, *args: str, background: bool = False):
    cmd = [sys.executable, "-c", "import sys; from ktd.ctl import main; sys.exit(main())", "--socket", sock,
           "--timeout", "60", *args]
    if background:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_ktctl_reports_loading_and_its_commands_wait_for_the_model():
    """`ktctl health` says loading (exit 1); `ktctl status` shows the progress; `ktctl generate`
    sent during the load waits for the model (as it did when the daemon accepted only after it);
    `ktctl health --wait` returns ok once loaded."""
    d, gate = _gated_daemon()
    try:
        _spawn_to_half(d)
        r = _ktctl(d.socket, "health")
        assert r.returncode == 1 and r.stdout.strip() == "loading", r
        r = _ktctl(d.socket, "status")
        assert r.returncode == 0 and json.loads(r.stdout)["loading"]["fraction"] == 0.5, r
        def health_requests() -> float:
            with Client(d.socket, timeout=10) as c:
                samples = dict(line.rsplit(" ", 1) for line in c.metrics().splitlines() if not line.startswith("#"))
            return float(samples.get('ktd_requests_total{method="health"}', 0))

        before = health_requests()
        gen = _ktctl(d.socket, "generate", "hi", "-n", "3", "-t", "0", "--no-stream", background=True)
        waiter = _ktctl(d.socket, "health", "--wait", background=True)
        # both poll health while the model loads (twice a second each), neither has ended
        assert wait_for(lambda: health_requests() >= before + 6, 30)
        assert gen.poll() is None and waiter.poll() is None
        _open_gate(gate, 0)
        _open_gate(gate, 1)
        out, err = gen.communicate(timeout=60)
        assert gen.returncode == 0 and out.strip(), err
        out, err = waiter.communicate(timeout=60)
        assert waiter.returncode == 0 and out.strip() == "ok", err
    finally:
        d.close()


def test_the_real_engine_reports_its_load_in_bytes_then_serves(tmp_path):
    """`ktd serve` with the real engine, its load slowed by the native loader's test hook (a sleep
    after each tensor): status shows the phase and bytes rising, the total being the file's tensor
    bytes (gguf-py's count), then the daemon serves."""
    from gguf import GGUFReader

    from models.tiny_dense import make_model
    model = make_model("llama", tmp_path / "m.gguf", wtype="Q8_0")
    n_tensors = len(GGUFReader(str(model)).tensors)
    total = sum(int(t.n_bytes) for t in GGUFReader(str(model)).tensors)
    sock = str(tmp_path / "k.sock")
    env = dict(os.environ, KTD_MODEL__PATH=str(model), KTD_MODEL__N_CTX="64", KTD_MODEL__THREADS="1",
               KTD_MODEL__WEIGHTS_CACHE="off", KTD_SERVER__SOCKET_GROUP="null",
               KTD_TEST_LOAD_TENSOR_DELAY_MS=str(max(50, 4000 // n_tensors)))  # about 4 s of load
    proc = subprocess.Popen([sys.executable, "-m", "ktd", "serve", "--socket", sock], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, 60) and proc.poll() is None
        seen = []
        with Client(sock, timeout=30) as c:
            while (h := c.health())["status"] == "loading":
                ld = c.status().get("loading") or {}
                if ld.get("phase") == "preparing weights":
                    seen.append((ld["done_bytes"], ld["total_bytes"], ld["fraction"]))
                time.sleep(0.05)
            assert h["status"] == "ok"
            assert c.generate("hi", max_tokens=2)["usage"]["completion_tokens"] >= 1
        done = sorted({d for d, _, _ in seen})
        assert len(done) >= 2 and [d for d, _, _ in seen] == sorted(d for d, _, _ in seen), seen
        assert all(t == total and 0 < d <= t and abs(f - d / t) < 1e-3 for d, t, f in seen), (seen, total)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
