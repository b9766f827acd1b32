"""The daemon: asyncio Unix-socket server, request handling, lifecycle (load, serve, reload, drain).

One process serves one model. The event loop owns the sockets and never blocks: the model runs
on the scheduler's engine thread, tokenization in the default executor. Lifecycle (docs/OPS.md):
bind or inherit the socket → load the model (STATUS=/EXTEND_TIMEOUT_USEC= progress) → start the
engine thread → accept → READY=1; SIGHUP reloads the live keys (RELOADING=1 … READY=1); SIGTERM
sends STOPPING=1, stops accepting, lets running requests finish for ``drain_timeout_s``, cancels
the rest, answers them, and exits 0. SIGTERM during the load sends STOPPING=1 and exits 0 at
once, without waiting for the load; SIGHUP during the load is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import itertools
import logging
import os
import pwd
import signal
import socket
import stat
import struct
import sys
import threading
import time
from collections import Counter
from typing import Any

from ktd import __version__, admission, config as config_mod, protocol, systemd
from ktd.engine_api import Engine, EngineFactory
from ktd.instrument import Instrument, ServerFacts
from ktd.errors import BadRequest, Busy, Internal, KtdError, NotFound, Unauthorized
from ktd.scheduler import Job, Scheduler, deliver_here

log = logging.getLogger("ktd.server")

_READ_CHUNK = 64 * 1024
_REFUSE_WAIT_S = 2.0        # a refused peer gets this long to send the request we answer
_LINGER_S = 1.0             # lingering close: drain input this long after shutdown(SHUT_WR)
_LOAD_EXTEND_S = 120.0      # EXTEND_TIMEOUT_USEC sent with each loading progress report
_STATUS_EVERY_S = 5.0       # STATUS= serving summary refresh
_INFLIGHT_SPARE = 64        # unanswered requests per connection beyond running + queued generates
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


class StartupError(Exception):
    """The daemon cannot start (socket, model): one line for the operator, exit 1."""


class StoppedDuringLoad(Exception):
    """SIGTERM/SIGINT arrived while the model was loading: the daemon stops (exit 0) without
    waiting for the load, which runs in native code that cannot be interrupted."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int, frozenset[int]]:
    """(pid, uid, gid, supplementary gids) of a Unix-socket peer, from the kernel."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    groups: frozenset[int] = frozenset()
    with contextlib.suppress(OSError):
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
        groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    return pid, uid, gid, groups


def resolve_ids(names: tuple[int | str, ...], kind: str) -> frozenset[int]:
    """Numeric ids for configured uids/user names or gids/group names; unknown names are skipped."""
    out = set()
    for n in names:
        if isinstance(n, int):
            out.add(n)
            continue
        try:
            out.add(pwd.getpwnam(n).pw_uid if kind == "user" else grp.getgrnam(n).gr_gid)
        except KeyError:
            log.warning("allow-list: unknown %s %r skipped", kind, n)
    return frozenset(out)


def bind_socket(path: str, mode: int, group: str | None) -> socket.socket:
    """Bind and listen on ``path`` with ``mode`` set by umask at bind time (no chmod window)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o755, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise StartupError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # stale socket of a dead daemon
        else:
            raise StartupError(f"another daemon is listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot bind {path}: {e.strerror}") from None
    finally:
        os.umask(old)
    if group is not None:
        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
            os.chown(path, -1, gid)
        except KeyError:
            log.warning("socket group %r does not exist; %s keeps the daemon's group", group, path)
        except PermissionError:
            log.warning("cannot give %s to group %r (not permitted); it keeps the daemon's group",
                        path, group)
    sock.listen(128)
    return sock


class Connection:
    def __init__(self, cid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 creds: tuple[int, int, int, frozenset[int]]):
        self.cid = cid
        self.reader, self.writer = reader, writer
        self.pid, self.uid, self.gid, self.groups = creds
        self.active: dict[int, int] = {}          # msgid -> scheduler job id (generate)
        self.tasks: set[asyncio.Task] = set()

    def send(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    async def drain(self) -> None:
        if not self.writer.is_closing():
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()


class Daemon:
    def __init__(self, config: config_mod.Config, engine_factory: EngineFactory, *,
                 config_path: str | None = None, socket_path: str | None = None):
        self.config = config
        self.config_path = config_path
        self.socket_path = socket_path or config.server.socket
        self.engine_factory = engine_factory
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.instrument: Instrument | None = None
        self.connections: dict[int, Connection] = {}
        self._conn_ids = itertools.count(1)
        self._req_ids = itertools.count(1)
        self.counters: Counter[str] = Counter()
        self.reloads = 0
        self.activated = False
        self.state = "starting"
        self.started = time.monotonic()
        self._stop = asyncio.Event()
        self._allowed_uids: frozenset[int] = frozenset()
        self._allowed_gids: frozenset[int] = frozenset()
        self._resolve_allow_list()
        self._limits = self._make_limits(config)
        self._last_status = ""

    # --- configuration -----------------------------------------------------------------------

    @staticmethod
    def _make_limits(c: config_mod.Config) -> protocol.Limits:
        return protocol.Limits(max_frame_bytes=c.server.max_frame_bytes,
                               max_prompt_tokens=c.limits.max_prompt_tokens,
                               max_tokens=c.limits.max_tokens, max_messages=c.limits.max_messages,
                               max_nesting=c.limits.max_nesting, max_stop=c.limits.max_stop)

    def _resolve_allow_list(self) -> None:
        self._allowed_uids = resolve_ids(self.config.server.allowed_uids, "user") | {os.getuid()}
        self._allowed_gids = resolve_ids(self.config.server.allowed_gids, "group")

    def authorized(self, uid: int, gid: int, groups: frozenset[int]) -> bool:
        return uid in self._allowed_uids or bool(({gid} | groups) & self._allowed_gids)

    # --- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        sock = self._listening_socket()
        # A stop request during the load (systemctl stop while starting) ends the daemon at once;
        # a reload request then has nothing to reload yet (SIGHUP must not kill the process).
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: log.info("reload ignored: the model is loading"))
        try:
            self.engine = await self._load(loop)
        except BaseException:
            sock.close()
            self._unlink_own_socket()
            raise
        self.scheduler = Scheduler(self.engine,
                                   prefill_tokens_per_step=self.config.scheduler.prefill_tokens_per_step,
                                   max_queue=self.config.server.max_queue,
                                   deliver=lambda events: self._deliver(loop, events))
        self.instrument = Instrument(self.engine, self.scheduler, self.counters)
        self.scheduler.start()
        server = await asyncio.start_unix_server(self._accept, sock=sock, limit=_READ_CHUNK)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self._reload()))
        self.state = "serving"
        systemd.ready(self._status_text())
        log.info("serving on %s%s", self.socket_path, " (socket-activated)" if self.activated else "")
        background = [loop.create_task(self._status_loop())]
        interval = systemd.watchdog_interval()
        if interval:
            background.append(loop.create_task(self._watchdog_loop(interval)))
        await self._stop.wait()
        await self._shutdown(server)
        for t in background:
            t.cancel()
        return 0

    def _listening_socket(self) -> socket.socket:
        inherited = systemd.listen_sockets()
        for sock, name in inherited:
            if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM:
                self.activated = True
                self.socket_path = sock.getsockname() or self.socket_path
                for other, _ in inherited:
                    if other is not sock:
                        other.close()
                log.info("using socket-activated fd %d (%s) %s", sock.fileno(), name, self.socket_path)
                return sock
        for sock, name in inherited:
            log.warning("ignoring inherited fd %d (%s): not a Unix stream socket", sock.fileno(), name)
            sock.close()
        return bind_socket(self.socket_path, self.config.server.socket_mode, self.config.server.socket_group)

    def _unlink_own_socket(self) -> None:
        if not self.activated:
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)

    async def _load(self, loop: asyncio.AbstractEventLoop) -> Engine:
        def progress(what: str, fraction: float | None) -> None:
            text = f"loading: {what}" + (f" ({fraction:.0%})" if fraction is not None else "")
            with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is stopping
                loop.call_soon_threadsafe(self._report_progress, text)

        def settle(result: Any, error: BaseException | None) -> None:
            if not loaded.done():
                if error is None:
                    loaded.set_result(result)
                else:
                    loaded.set_exception(error)

        def load() -> None:
            try:
                engine = self.engine_factory(self.config, progress)
            except BaseException as e:  # handed to the event loop
                result, error = None, e
            else:
                result, error = engine, None
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, error)

        systemd.notify("STATUS=loading model", f"EXTEND_TIMEOUT_USEC={int(_LOAD_EXTEND_S * 1e6)}")
        log.info("loading model %s", self.config.model.path)
        # A daemon thread, not the executor: a stop during the load must not wait for it.
        loaded: asyncio.Future[Engine] = loop.create_future()
        threading.Thread(target=load, name="ktd-load", daemon=True).start()
        stop = loop.create_task(self._stop.wait())
        await asyncio.wait({loaded, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not loaded.done():
            self.state = "stopping"
            systemd.stopping()
            log.info("stopping: a stop was requested while the model was loading")
            raise StoppedDuringLoad()
        try:
            engine = loaded.result()
        except StartupError:
            raise
        except Exception as e:  # GGUFError, ResourceError, OSError ...: one line for the operator
            log.debug("model load failed", exc_info=True)
            raise StartupError(f"cannot load the model: {e}") from None
        log.info("model loaded: %s", engine.info().get("name", "?"))
        return engine

    @staticmethod
    def _deliver(loop: asyncio.AbstractEventLoop, events: list) -> None:
        """The scheduler's hand-off (engine thread): one loop wakeup per step."""
        try:
            loop.call_soon_threadsafe(deliver_here, events)
        except RuntimeError:  # the loop has closed: the daemon is exiting, nobody is waiting
            pass

    def _report_progress(self, text: str) -> None:
        log.info("%s", text)
        systemd.notify(f"STATUS={text}", f"EXTEND_TIMEOUT_USEC={int(_LOAD_EXTEND_S * 1e6)}")

    def _facts(self) -> ServerFacts:
        return ServerFacts(state=self.state, socket=self.socket_path, activated=self.activated,
                           connections=len(self.connections), reloads=self.reloads,
                           uptime_s=time.monotonic() - self.started)

    def _status_text(self) -> str:
        if self.instrument is None:
            return self.state
        return self.instrument.status_line(self._facts())

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(_STATUS_EVERY_S)
            text = self._status_text()
            if text != self._last_status:
                self._last_status = text
                systemd.status(text)

    async def _watchdog_loop(self, interval: float) -> None:
        # Pinged from the event loop, and only while the engine thread makes progress or idles:
        # a wedged forward with work pending stops the pings and systemd restarts the daemon.
        assert self.scheduler is not None
        while True:
            if self.scheduler.healthy(max_stall_s=interval):
                systemd.watchdog_ping()
            else:
                log.error("engine made no progress for %.1f s with work pending: watchdog not fed",
                          interval)
            await asyncio.sleep(interval)

    async def _reload(self) -> None:
        systemd.reloading()
        self.state = "reloading"
        try:
            if self.config_path is None:
                new = config_mod.load(None)
            else:
                new = config_mod.load(self.config_path)
        except config_mod.ConfigError as e:
            log.error("reload failed, keeping the running configuration: %s", e)
            self.state = "serving"
            systemd.ready(self._status_text() + f" (reload failed: {e})")
            return
        live, restart = config_mod.live_changes(self.config, new)
        if restart:
            log.warning("reload: %s changed but needs a restart; keeping the running value",
                        ", ".join(restart))
        self.config = config_mod.apply_live(self.config, new)
        self._limits = self._make_limits(self.config)
        self._resolve_allow_list()
        logging.getLogger("ktd").setLevel(self.config.logging.level.upper())
        assert self.scheduler is not None
        self.scheduler.reconfigure(prefill_tokens_per_step=self.config.scheduler.prefill_tokens_per_step,
                                   max_queue=self.config.server.max_queue)
        self.reloads += 1
        self.state = "serving"
        log.info("reloaded configuration (%s)", ", ".join(live) or "no live key changed")
        systemd.ready(self._status_text())

    async def _shutdown(self, server: asyncio.AbstractServer) -> None:
        assert self.scheduler is not None
        self.state = "stopping"
        systemd.stopping()
        systemd.status("stopping: draining requests")
        log.info("stopping: draining for up to %.1f s", self.config.server.drain_timeout_s)
        server.close()
        self.scheduler.close()
        deadline = time.monotonic() + self.config.server.drain_timeout_s
        while self.scheduler.pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.scheduler.pending():
            log.warning("drain timeout: cancelling %d requests", self.scheduler.pending())
            self.scheduler.cancel_all("the daemon is shutting down")
        tasks = [t for c in self.connections.values() for t in c.tasks]
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)  # their cancel responses go out
        for conn in list(self.connections.values()):
            with contextlib.suppress(Exception):
                await conn.drain()
            conn.writer.close()
        self.scheduler.stop(timeout=10.0)
        self._unlink_own_socket()
        log.info("stopped")

    # --- connections -------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            creds = peer_credentials(sock)
        except OSError as e:
            log.warning("cannot read peer credentials: %s", e)
            writer.close()
            return
        conn = Connection(next(self._conn_ids), reader, writer, creds)
        extra = {"KTD_PEER_UID": conn.uid, "KTD_PEER_PID": conn.pid}
        if not self.authorized(conn.uid, conn.gid, conn.groups):
            self.counters["rejected_unauthorized"] += 1
            log.warning("refused peer pid=%d uid=%d gid=%d: not in the allow-list", conn.pid, conn.uid,
                        conn.gid, extra=extra)
            await self._refuse(conn, Unauthorized(f"uid {conn.uid} is not allowed to use this daemon"))
            return
        if len(self.connections) >= self.config.server.max_connections:
            self.counters["rejected_busy"] += 1
            log.warning("refused peer pid=%d uid=%d: %d connections open", conn.pid, conn.uid,
                        len(self.connections), extra=extra)
            await self._refuse(conn, Busy(f"too many connections ({self.config.server.max_connections})"))
            return
        self.connections[conn.cid] = conn
        log.debug("connection %d from pid=%d uid=%d", conn.cid, conn.pid, conn.uid, extra=extra)
        try:
            await self._serve(conn)
        finally:
            del self.connections[conn.cid]
            for rid in conn.active.values():
                self.scheduler.cancel(rid, "client disconnected")  # type: ignore[union-attr]
            if conn.active:
                log.info("connection %d closed: cancelled %d requests", conn.cid, len(conn.active), extra=extra)
            if conn.tasks:  # answers to a peer that only shut down its writing side still go out
                await asyncio.wait(list(conn.tasks), timeout=5.0)
            conn.writer.close()

    async def _refuse(self, conn: Connection, error: KtdError) -> None:
        """Answer the peer's first request (or send an error notification), then close."""
        decoder = protocol.FrameDecoder(self.config.server.max_frame_bytes)
        reply = protocol.error_notification(error)
        try:
            async with asyncio.timeout(_REFUSE_WAIT_S):
                while True:
                    data = await conn.reader.read(_READ_CHUNK)
                    if not data:
                        break
                    values = list(decoder.feed(data))
                    if values:
                        msgid = protocol.request_id(values[0])
                        if msgid is not None:
                            reply = protocol.response(msgid, error=error)
                        break
        except (TimeoutError, protocol.FramingError, ConnectionError):
            pass
        await self._lingering_close(conn, reply)

    async def _lingering_close(self, conn: Connection, last: bytes) -> None:
        """Send ``last``, shut down writing, drain input briefly, close (OPS.md section 7): the
        client reads the error instead of a connection reset."""
        try:
            conn.send(last)
            await conn.drain()
            if conn.writer.can_write_eof():
                conn.writer.write_eof()
            async with asyncio.timeout(_LINGER_S):
                while await conn.reader.read(_READ_CHUNK):
                    pass
        except (TimeoutError, ConnectionError, OSError):
            pass
        conn.writer.close()

    async def _serve(self, conn: Connection) -> None:
        decoder = protocol.FrameDecoder(self.config.server.max_frame_bytes)
        while True:
            try:
                data = await conn.reader.read(_READ_CHUNK)
            except ConnectionError:
                return
            if not data:
                if decoder.partial:  # the peer may only have shut down its writing side
                    conn.send(protocol.error_notification(BadRequest("connection closed inside a message")))
                    await conn.drain()
                return
            try:
                for value in decoder.feed(data):
                    # Backpressure against pipelining floods: stop reading while too many requests
                    # of this connection are unanswered. Room is left above the generate
                    # requests that can be running or queued, so a cancel always gets through.
                    limit = self.engine.n_seq_max + self.config.server.max_queue + _INFLIGHT_SPARE  # type: ignore[union-attr]
                    while len(conn.tasks) >= limit:
                        await asyncio.wait(list(conn.tasks), return_when=asyncio.FIRST_COMPLETED)
                    self._dispatch(conn, value)
            except protocol.FramingError as e:
                self.counters["errors_" + e.error.code] += 1
                log.warning("connection %d: %s; closing", conn.cid, e.error.message,
                            extra={"KTD_PEER_UID": conn.uid})
                await self._lingering_close(conn, protocol.error_notification(e.error))
                return

    def _dispatch(self, conn: Connection, value: Any) -> None:
        try:
            req = protocol.parse_request(value, self._limits)
        except KtdError as e:
            self.counters["errors_" + e.code] += 1
            msgid = protocol.request_id(value)
            conn.send(protocol.response(msgid, error=e) if msgid is not None
                      else protocol.error_notification(e))
            return
        self.counters["requests_" + req.method] += 1
        task = asyncio.get_running_loop().create_task(self._handle(conn, req))
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)

    async def _handle(self, conn: Connection, req: protocol.Request) -> None:
        try:
            if req.method == "generate":
                await self._generate(conn, req)
                return
            result = await self._call(conn, req)
            conn.send(protocol.response(req.msgid, result))
        except KtdError as e:
            self.counters["errors_" + e.code] += 1
            conn.send(protocol.response(req.msgid, error=e))
        except Exception:
            log.exception("internal error in %s", req.method)
            self.counters["errors_internal"] += 1
            conn.send(protocol.response(req.msgid, error=Internal(f"internal error in {req.method}")))
        await conn.drain()

    async def _call(self, conn: Connection, req: protocol.Request) -> Any:
        assert self.engine is not None and self.scheduler is not None
        loop = asyncio.get_running_loop()
        tok = self.engine.tokenizer
        m, p = req.method, req.params
        if m == "hello":
            protocol.parse_empty(m, p)
            return {"protocol": protocol.PROTOCOL_VERSION, "server": f"ktd {__version__}",
                    "model": self.engine.info(), "n_ctx": self.engine.n_ctx,
                    "n_seq_max": self.engine.n_seq_max, "n_vocab": tok.n_vocab}
        if m == "health":
            protocol.parse_empty(m, p)
            return {"status": "ok" if self.state == "serving" and self.scheduler.alive else self.state}
        if m == "status":
            protocol.parse_empty(m, p)
            return self.status()
        if m == "metrics":
            protocol.parse_empty(m, p)
            return {"text": self.metrics()}
        if m == "cancel":
            msgid = protocol.parse_cancel(p)
            rid = conn.active.get(msgid)
            if rid is None:
                raise NotFound(f"no running generate request with id {msgid} on this connection")
            self.scheduler.cancel(rid, "cancelled by the client")
            return {"cancelled": True}
        if m == "tokenize":
            text, add_special, parse_special = protocol.parse_tokenize(p)
            ids = await loop.run_in_executor(
                None, lambda: tok.encode(text, add_special=add_special, parse_special=parse_special))
            return {"tokens": ids}
        if m == "detokenize":
            ids = protocol.parse_detokenize(p, tok.n_vocab)
            return {"text": await loop.run_in_executor(None, tok.decode, ids)}
        raise BadRequest(f"unknown method {m!r}")  # parse_request already rejects these

    async def _generate(self, conn: Connection, req: protocol.Request) -> None:
        assert self.engine is not None and self.scheduler is not None
        loop = asyncio.get_running_loop()
        label = f"r{next(self._req_ids)}"
        extra = {"KTD_REQUEST_ID": label, "KTD_PEER_UID": conn.uid}
        if req.msgid in conn.active:
            raise BadRequest(f"generate: msgid {req.msgid} is already in use on this connection")
        g = protocol.parse_generate(req.params, self._limits)
        prompt = await loop.run_in_executor(None, admission.prompt_tokens, g, self.engine.tokenizer)
        max_tokens = admission.admit(prompt, g.max_tokens, n_vocab=self.engine.tokenizer.n_vocab,
                                     n_ctx=self.engine.n_ctx, limits=self._limits)
        deadlines = [d for d in (self.config.server.request_deadline_s or None, g.deadline_s) if d]
        deadline = time.monotonic() + min(deadlines) if deadlines else None
        # The sink runs on the event loop (the scheduler posts each step's events in one
        # callback): a streamed piece is written at once, without waking this task; the task
        # only waits for the terminal event. Unread output is bounded by max_tokens.
        end: asyncio.Future[tuple[str, Any]] = loop.create_future()
        parts: list[str] = []
        index = 0

        def sink(kind: str, payload: Any) -> None:
            nonlocal index
            if kind == "chunk":
                if g.stream:
                    conn.send(protocol.chunk(req.msgid, index, payload))
                    index += 1
                else:
                    parts.append(payload)
            elif not end.done():
                end.set_result((kind, payload))

        job = Job(client=conn.cid, prompt=prompt, sampling=g.sampling, max_tokens=max_tokens,
                  stop=g.stop, ignore_eos=g.ignore_eos, sink=sink, deadline=deadline, label=label)
        rid = self.scheduler.submit(job)
        conn.active[req.msgid] = rid
        log.info("%s: generate, %d prompt tokens, max_tokens %d", label, len(prompt), max_tokens, extra=extra)
        try:
            kind, payload = await end
            if kind == "done":
                if not g.stream:
                    payload["text"] = "".join(parts)
                conn.send(protocol.response(req.msgid, payload))
                log.info("%s: %s, %d tokens", label, payload["finish_reason"],
                         payload["usage"]["completion_tokens"], extra=extra)
            else:
                self.counters["errors_" + payload.code] += 1
                conn.send(protocol.response(req.msgid, error=payload))
                log.info("%s: %s: %s", label, payload.code, payload.message, extra=extra)
        finally:
            conn.active.pop(req.msgid, None)

    # --- introspection -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        assert self.instrument is not None
        return self.instrument.status(self._facts(), self._limits)

    def metrics(self) -> str:
        """Prometheus text exposition (version 0.0.4)."""
        assert self.instrument is not None
        return self.instrument.metrics(up=self.state == "serving", connections=len(self.connections))


def setup_logging(level: str) -> None:
    root = logging.getLogger("ktd")
    root.handlers[:] = [systemd.log_handler()]
    root.setLevel(level.upper())
    root.propagate = False


def serve(config: config_mod.Config, engine_factory: EngineFactory, *, config_path: str | None,
          socket_path: str | None = None) -> int:
    """Run the daemon until SIGTERM; returns the exit status. Raises StartupError."""
    setup_logging(config.logging.level)
    daemon = Daemon(config, engine_factory, config_path=config_path, socket_path=socket_path)
    try:
        return asyncio.run(daemon.run())
    except StoppedDuringLoad:
        # The loader thread is still inside the (uninterruptible) native load: leave without
        # interpreter finalization, which could tear down state that thread is using.
        # Exit 0: a requested stop is a clean stop for systemd.
        for handler in logging.getLogger("ktd").handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES, errno.EPERM):
            raise StartupError(f"{daemon.socket_path}: {e.strerror}") from None
        raise
