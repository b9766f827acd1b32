"""``ktd http`` / ``ktd-http`` / ``python -m ktd.http``: run the gateway in the foreground.

Listeners: the sockets systemd passes (``ktd-http.socket``, LISTEN_FDS) when socket-activated,
else every ``--listen`` (``HOST:PORT``, ``[IPv6]:PORT``, or ``unix:PATH`` / a path ending in
``.sock``), default ``127.0.0.1:11435``. A TCP listener on anything but loopback needs
``--api-keys``: the gateway refuses to start without it. Type=notify: READY=1 once uvicorn
accepts; SIGTERM/SIGINT stop it (running answers get ``--graceful-s`` to finish).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import stat
import sys

from ktd import __version__

from ktd.ops import systemd
from ktd.client import default_socket
from ktd.http import DEFAULT_PORT, limits

log = logging.getLogger("ktd.http")


class StartupError(Exception):
    """A configuration the gateway refuses (printed as one line, exit status 1)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", "-s", default=None, metavar="PATH",
                   help="the daemon's socket (default $KTD_SOCKET, else /run/ktd/ktd.sock)")
    p.add_argument("--listen", "-l", action="append", default=None, metavar="ADDR",
                   help=f"HOST:PORT, [IPv6]:PORT or unix:PATH; repeatable (default 127.0.0.1:{DEFAULT_PORT}; "
                        "ignored when systemd passes sockets)")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="API keys, one ID:SECRET per line (mode 0640 or stricter); required to "
                        "listen on anything but loopback")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients see and send (default: the GGUF file name without .gguf)")
    p.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                   help="largest request body (default 4 MiB; above it: 413)")
    p.add_argument("--unix-mode", default="0660", metavar="MODE",
                   help="permissions of a Unix listening socket the gateway creates (default 0660)")
    p.add_argument("--graceful-s", type=float, default=10.0, metavar="S",
                   help="on SIGTERM, how long running answers may take to finish (default 10)")
    p.add_argument("--keep-alive-s", type=float, default=30.0, metavar="S",
                   help="idle keep-alive HTTP connections are closed after this long (default 30)")
    p.add_argument("--header-timeout-s", type=float, default=limits.HEADER_TIMEOUT_S, metavar="S",
                   help="a request's line and headers must arrive within this long of the connection (or of "
                        f"its first byte after a keep-alive wait); else closed (default {limits.HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout-s", type=float, default=limits.BODY_TIMEOUT_S, metavar="S",
                   help="a request's body must arrive within this long of its headers; else 408 "
                        f"(default {limits.BODY_TIMEOUT_S:g})")
    p.add_argument("--max-connections", type=int, default=limits.MAX_CONNECTIONS, metavar="N",
                   help="open HTTP connections; one more is answered 503 and closed (default "
                        f"{limits.MAX_CONNECTIONS}; bounded by RLIMIT_NOFILE)")
    p.add_argument("--max-in-flight", type=int, default=limits.MAX_IN_FLIGHT, metavar="N",
                   help=f"requests answered at once; beyond: 429 with Retry-After (default {limits.MAX_IN_FLIGHT})")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def parse_listen(spec: str) -> tuple[str, str | tuple[str, int]]:
    """('unix', path) or ('tcp', (host, port))."""
    if spec.startswith("unix:"):
        return "unix", spec[5:]
    if spec.startswith("/") or spec.endswith(".sock"):
        return "unix", spec
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise StartupError(f"--listen {spec!r}: expected HOST:PORT, [IPv6]:PORT or unix:PATH")
    host = host.strip("[]") or "127.0.0.1"
    return "tcp", (host, int(port))


def open_listener(spec: str, unix_mode: int) -> socket.socket:
    kind, where = parse_listen(spec)
    try:
        if kind == "tcp":
            host, port = where
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            return socket.create_server((host, port), family=family, backlog=2048)
        path = where
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(path)
                    raise StartupError(f"{path}: another process is listening on this socket")
                except ConnectionRefusedError:
                    os.unlink(path)  # stale socket of a previous run
                finally:
                    probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, unix_mode)
        sock.listen(2048)
        return sock
    except OSError as e:
        raise StartupError(f"--listen {spec}: {e.strerror or e}") from None


def describe(sock: socket.socket) -> str:
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(sock: socket.socket) -> bool:
    if sock.family == socket.AF_UNIX:
        return True
    host = sock.getsockname()[0]
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def base_urls(socks: list[socket.socket]) -> list[str]:
    out = []
    for s in socks:
        if s.family == socket.AF_UNIX:
            continue
        host, port = s.getsockname()[:2]
        out.append(f"http://{f'[{host}]' if ':' in host else host}:{port}/v1")
    return out


class _Server:
    """uvicorn's server with the gateway's signal handling: SIGTERM/SIGINT end the main loop
    (no re-raise of the signal after the shutdown: exit status 0), READY=1 once it accepts."""

    def __init__(self, config) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, self._stop)
                try:
                    yield
                finally:
                    for sig in (signal.SIGTERM, signal.SIGINT):
                        loop.remove_signal_handler(sig)

            def _stop(self) -> None:
                if self.should_exit:
                    self.force_exit = True
                self.should_exit = True
                systemd.stopping()

        self.server = Server(config)

    async def run(self, socks: list[socket.socket], on_ready) -> None:
        task = asyncio.get_running_loop().create_task(self.server.serve(sockets=socks))
        while not self.server.started and not task.done():
            await asyncio.sleep(0.02)
        if self.server.started:
            on_ready()
        await task


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ktd.http.app import ApiKeys, Gateway, KeyFileError, build_app
    from ktd.http.backend import Backend

    logging.getLogger("ktd").handlers[:] = [systemd.log_handler("ktd-http")]
    logging.getLogger("ktd").setLevel(args.log_level.upper())
    logging.getLogger("ktd").propagate = False
    try:
        keys = ApiKeys.load(args.api_keys) if args.api_keys else None
    except KeyFileError as e:
        raise StartupError(str(e)) from None
    for name in ("max_connections", "max_in_flight"):
        if getattr(args, name) < 1:
            raise StartupError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("header_timeout_s", "body_timeout_s"):
        if not getattr(args, name) > 0:
            raise StartupError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    try:
        unix_mode = int(args.unix_mode, 8)
    except ValueError:
        raise StartupError(f"--unix-mode {args.unix_mode!r}: expected an octal mode such as 0660") from None
    activated = systemd.listen_sockets()
    socks = [s for s, _ in activated]
    if not socks:
        socks = [open_listener(spec, unix_mode) for spec in (args.listen or [f"127.0.0.1:{DEFAULT_PORT}"])]
    exposed = [describe(s) for s in socks if not is_loopback(s)]
    if exposed and keys is None:
        for s in socks:
            s.close()
        raise StartupError(f"refusing to listen on {', '.join(exposed)} (not loopback) without "
                           "--api-keys: anyone on the network could use the model")
    backend = Backend(args.socket or default_socket(), model_name=args.model_name)
    gw = Gateway(backend, keys, max_in_flight=args.max_in_flight)
    if args.max_body_bytes:
        gw.max_body_bytes = args.max_body_bytes
    conn_limits = limits.ConnectionLimits(max_connections=limits.fd_budget(args.max_connections),
                                          header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s)
    http = limits.protocol_class(conn_limits, gw.metrics.connections)
    config = uvicorn.Config(build_app(gw), http=http, loop="asyncio", lifespan="off", access_log=False,
                            log_config=None, log_level=args.log_level, server_header=False,
                            timeout_graceful_shutdown=args.graceful_s, backlog=2048,
                            timeout_keep_alive=args.keep_alive_s)
    where = ", ".join(describe(s) for s in socks)

    def ready() -> None:
        log.info("ktd-http %s: listening on %s%s, daemon %s%s", __version__, where,
                 " (socket-activated)" if activated else "", backend.socket_path,
                 ", API keys required" if keys else "")
        for url in base_urls(socks):
            print(url, flush=True)  # on a line of its own: `make run` and scripts read it
        systemd.ready(f"listening on {where}")

    try:
        asyncio.run(_Server(config).run(socks, ready))
    finally:
        for s in socks:
            if s.family == socket.AF_UNIX and not activated:
                with contextlib.suppress(OSError):
                    os.unlink(s.getsockname())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ktd-http", description="OpenAI- and Ollama-compatible HTTP gateway to ktd")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except StartupError as e:
        print(f"ktd-http: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
