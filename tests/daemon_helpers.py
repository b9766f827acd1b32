"""Start the real daemon (tests/daemon_launcher.py: `ktd serve` + fake engine) as a process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import msgpack

from ktd.client import Client

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHER = os.path.join(HERE, "daemon_launcher.py")


def short_tmpdir() -> str:
    """Unix socket paths are limited to 107 bytes: keep them short."""
    d = tempfile.mkdtemp(prefix="ktd-", dir="/tmp")
    os.chmod(d, 0o755)
    return d


class DaemonProcess:
    def __init__(self, *, fake: dict | None = None, model: dict | None = None,
                 server: dict | None = None, limits: dict | None = None, scheduler: dict | None = None,
                 env: dict | None = None):
        self.dir = short_tmpdir()
        self.socket = os.path.join(self.dir, "ktd.sock")
        self.config_path = os.path.join(self.dir, "ktd.yaml")
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.fake = fake or {}
        self.env = env or {}
        self.sections = {
            "model": {"n_ctx": 256, "n_seq_max": 4, **(model or {})},
            "server": {"socket": self.socket, "socket_group": None, **(server or {})},
            "limits": limits or {},
            "scheduler": scheduler or {},
            "logging": {"level": "debug"},
        }
        self.proc: subprocess.Popen | None = None
        self.write_config()

    def write_config(self, **sections) -> None:
        for name, values in sections.items():
            self.sections[name] = {**self.sections.get(name, {}), **values}
        with open(self.config_path, "w") as f:
            json.dump({k: v for k, v in self.sections.items() if v}, f)  # JSON is YAML

    def command(self) -> list[str]:
        return [sys.executable, LAUNCHER, json.dumps(self.fake), "--", "serve", "--config", self.config_path]

    def spawn(self, command=None, **popen) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KTD_", "NOTIFY_SOCKET", "LISTEN_", "WATCHDOG_", "JOURNAL_STREAM"))}
        env.update(self.env)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(command or self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, **popen)
        return self.proc

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        self.spawn()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with Client(self.socket, timeout=5) as c:
                    if c.health()["status"] == "ok":
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"daemon not ready after {timeout} s:\n{self.log()}")

    def client(self, **kw) -> Client:
        return Client(self.socket, **kw)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def close(self) -> None:
        try:
            self.stop()
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


class NotifySocket:
    """A fake systemd notify socket (NOTIFY_SOCKET) bound at path: collects the daemon's sd_notify
    datagrams, a list of (time.monotonic(), {KEY: VALUE})."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def keys(self) -> list[str]:
        return [k for _, m in self.messages for k in m]

    def index(self, key: str, value: str | None = None, start: int = 0) -> int:
        for i, (_, m) in enumerate(self.messages[start:], start):
            if key in m and (value is None or m[key] == value):
                return i
        return -1

    def wait(self, key: str, value: str | None = None, start: int = 0, timeout: float = 20.0) -> int:
        assert wait_for(lambda: self.index(key, value, start) >= 0, timeout), \
            f"no {key}={value} after message {start}: {self.messages}"
        return self.index(key, value, start)

    def close(self):
        self._stop = True
        self.sock.close()


def run_as_uid(uid: int, fn) -> bytes:
    """``fn()`` (bytes) in a forked child that first drops to ``uid`` (setgroups/setgid/setuid;
    needs root); its bytes, or b"" when it failed. The child makes only os/socket calls."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, fn())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return data


def reply_as_uid(uid: int, sock_path: str, request: bytes, *, until_close: bool = False) -> bytes:
    """Send `request` on the daemon's socket as another uid (``run_as_uid``) and return the raw
    reply bytes: the first whole message, or with until_close everything until the daemon closes
    (the child shuts down its writing side first)."""
    def exchange() -> bytes:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(sock_path)
        s.sendall(request)
        if until_close:
            s.shutdown(socket.SHUT_WR)
        unpacker = msgpack.Unpacker(raw=False)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            unpacker.feed(chunk)
            if not until_close and list(unpacker):
                break
        return data

    return run_as_uid(uid, exchange)


def spawn_real_serve(model, sock, env: dict[str, str] | None = None, *, preexec=None,
                     timeout: float = 60.0) -> subprocess.Popen:
    """``python -m ktd serve`` with the real engine on ``model`` (config from KTD_* variables:
    the model path, no socket group, and ``env``), its output piped; returns once it serves. A daemon that exits or takes longer than ``timeout`` fails the test with its output."""
    full_env = dict(os.environ, KTD_MODEL__PATH=str(model), KTD_SERVER__SOCKET_GROUP="null", **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "ktd", "serve", "--socket", str(sock)], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec)
    wait_serving(proc, sock, timeout)
    return proc


class RealServe:
    """spawn_real_serve as a context: the daemon serves inside the with block (``.proc``); leaving
    it sends SIGTERM, and the daemon must then exit 0 (its output in the failure). Its output is
    ``.output`` afterwards."""

    def __init__(self, model, sock, env: dict[str, str] | None = None, *, preexec=None, timeout: float = 60.0):
        self.args = (model, sock, env)
        self.preexec, self.timeout = preexec, timeout
        self.proc: subprocess.Popen | None = None
        self.output = ""

    def __enter__(self) -> RealServe:
        self.proc = spawn_real_serve(*self.args, preexec=self.preexec, timeout=self.timeout)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.proc.terminate()
        self.output = self.proc.communicate(timeout=60)[0]
        if exc_type is None:
            assert self.proc.returncode == 0, self.output


def wait_serving(proc: subprocess.Popen, sock, timeout: float = 60.0) -> None:
    """Until the daemon ``proc`` at ``sock`` serves (health ok: it accepts while it loads, and
    answers other methods ``loading`` meanwhile). A daemon that exits or takes longer than
    ``timeout`` fails the test with its output."""
    import pytest

    deadline = time.monotonic() + timeout
    while True:
        if os.path.exists(sock):
            try:
                with Client(str(sock), timeout=30) as c:
                    if c.health()["status"] == "ok":
                        return
            except OSError:
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"daemon did not start:\n{proc.communicate()[0]}")
        time.sleep(0.05)
