"""Start the HTTP gateway (``python -m ktd.http``) as a process in front of a test daemon."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import httpx


class GatewayProcess:
    """``ktd http`` on 127.0.0.1 (a free port chosen by the kernel) and optionally a Unix socket.
    ``url`` is the base URL it prints on its own line (``http://127.0.0.1:PORT/v1``)."""

    def __init__(self, daemon_socket: str, workdir: str, *, args: list[str] | None = None,
                 unix: bool = True, listen: list[str] | None = None, env: dict | None = None,
                 command: list[str] | None = None, pass_fds: tuple[int, ...] = ()):
        self.unix_path = os.path.join(workdir, "http.sock") if unix else None
        self.log_path = os.path.join(workdir, "gateway.log")
        listen = listen if listen is not None else ["127.0.0.1:0"]
        if self.unix_path:
            listen = [*listen, f"unix:{self.unix_path}"]
        self.tcp = bool(command) or any(not spec.startswith("unix:") for spec in listen)
        argv = command or [sys.executable, "-m", "ktd.http", "--socket", daemon_socket,
                           *sum((["--listen", spec] for spec in listen), []), *(args or [])]
        child_env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_SOCKET"))}
        child_env.update(env or {})
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, env=child_env,
                                     pass_fds=pass_fds)
        self.lines: list[str] = []
        self._got_url = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.url: str | None = None

    def _read_stdout(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if re.fullmatch(r"http://[^ ]+/v1", line):
                self.url = line
                self._got_url.set()
        self._got_url.set()

    def wait_ready(self, timeout: float = 30.0) -> GatewayProcess:
        """Waits for the URL line (a TCP listener), else for the Unix socket to answer."""
        deadline = time.monotonic() + timeout
        if self.tcp:
            self._got_url.wait(timeout)
        else:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with httpx.Client(transport=httpx.HTTPTransport(uds=self.unix_path), timeout=5) as c:
                        c.get("http://gw/api/version")
                    return self
                except httpx.TransportError:
                    time.sleep(0.05)
        if self.proc.poll() is not None or (self.tcp and not self.url):
            raise RuntimeError(f"gateway did not start (rc {self.proc.poll()}):\n{self.log()}")
        return self

    @property
    def root(self) -> str:
        return self.url[: -len("/v1")]

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        self._log.close()
        return self.proc.returncode


def start_gateway(daemon_socket: str, workdir: str, **kw) -> GatewayProcess:
    return GatewayProcess(daemon_socket, workdir, **kw).wait_ready()


# Two tools in the OpenAI format, shared by the tool-call tests of the daemon and the gateway.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}},
                                       "required": ["tz"], "additionalProperties": False}}}


def daemon_status(sock: str) -> dict:
    from ktd.client import Client

    with Client(sock, timeout=10) as c:
        return c.status()["scheduler"]


def finished_cancelled(sock: str) -> int:
    from ktd.client import Client

    with Client(sock, timeout=10) as c:
        text = c.metrics()
    m = re.search(r'^ktd_generate_finished_total\{reason="cancelled"\} (\d+)', text, re.M)
    return int(m.group(1)) if m else 0
