"""Client connections: authorization, framing, request dispatch, and generate streams.

``Connections`` accepts a peer (SO_PEERCRED against the allow-list, the connection limit), reads
its messages, answers each request in a task of its own, and streams a generate request's output
as the scheduler's events arrive. One generate request, socket to streamed chunk:

    read → FrameDecoder → parse_request → _generate: parse_generate, tokenize (worker thread),
    admission.admit → scheduler.submit(Job(sink=stream))
    engine thread: step → deliver(events) → loop.call_soon_threadsafe(call_sinks, events)
    event loop: stream("chunk", text) writes the chunk; stream("done" | "error", ...) writes the
    response and ends the request's task.

Nothing on the way back calls into the scheduler. What the connections may do (limits, the
allow-list) is a ``Policy`` the daemon replaces on reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import itertools
import logging
import os
import pwd
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ktd import __version__

from ktd.server import admission, protocol

from ktd.ops import config as config_mod

from ktd.text import grammar, tools
from ktd.server.engine_api import Engine
from ktd.errors import BadRequest, Busy, Cancelled, Internal, KtdError, Loading, NotFound, TooLarge, Unauthorized
from ktd.server.events import Deliver, Event, call_sinks
from ktd.server.scheduler import Job, Scheduler
from ktd.text.tools import ToolCallParser
from ktd.server.sockets import peer_credentials

# The request log keeps the daemon's logger name: journal queries (LOGGER=ktd.server.daemon) rely on it.
log = logging.getLogger("ktd.server.daemon")

READ_CHUNK = 64 * 1024
_REFUSE_WAIT_S = 2.0        # a refused peer gets this long to send the request we answer
_LINGER_S = 1.0             # lingering close: drain input this long after shutdown(SHUT_WR)
_INFLIGHT_SPARE = 64        # unanswered requests per connection beyond running + queued generates
# Methods whose request and answer can each be as large as a frame (or larger: one token id can
# detokenize to a long piece): a connection has one of them in progress at a time.
_HEAVY = frozenset({"tokenize", "detokenize"})
# While the model loads (Connections.engine is None) only these are answered; the rest get
# ``loading`` (docs/PROTOCOL.md).
_WHILE_LOADING = frozenset({"health", "status", "metrics"})
_INFLIGHT_WHILE_LOADING = 8


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


@dataclass(frozen=True)
class Policy:
    """What clients may do: the live-reloadable keys of the server and limits sections."""

    limits: protocol.Limits
    max_connections: int
    max_queue: int
    max_unsent_bytes: int
    idle_timeout_s: float | None
    request_deadline_s: float | None
    allowed_uids: frozenset[int]     # the daemon's own uid included
    allowed_gids: frozenset[int]
    prefix_cache_share: bool = False  # prefix_cache.share: cached prompts reused across owners

    @classmethod
    def from_config(cls, c: config_mod.Config) -> Policy:
        limits = protocol.Limits(max_frame_bytes=c.server.max_frame_bytes,
                                 max_prompt_tokens=c.limits.max_prompt_tokens,
                                 max_tokens=c.limits.max_tokens, max_messages=c.limits.max_messages,
                                 max_nesting=c.limits.max_nesting, max_stop=c.limits.max_stop,
                                 chat_template_max_chars=c.limits.chat_template_max_chars,
                                 chat_template_timeout_s=c.limits.chat_template_timeout_s)
        return cls(limits=limits, max_connections=c.server.max_connections, max_queue=c.server.max_queue,
                   max_unsent_bytes=c.server.max_unsent_bytes, idle_timeout_s=c.server.idle_timeout_s or None,
                   request_deadline_s=c.server.request_deadline_s or None,
                   allowed_uids=resolve_ids(c.server.allowed_uids, "user") | {os.getuid()},
                   allowed_gids=resolve_ids(c.server.allowed_gids, "group"),
                   prefix_cache_share=c.prefix_cache.share)

    def cache_owner(self, uid: int, caller: str | None) -> str | None:
        """Whose cached prompt prefixes a request may reuse: its peer's uid, narrowed by the caller
        the peer names (the gateway: its API key id), so that no peer reaches another uid's
        entries; None (everyone's) when the cache is shared."""
        if self.prefix_cache_share:
            return None
        return f"uid:{uid}" if caller is None else f"uid:{uid}/{caller}"

    def authorized(self, uid: int, gid: int, groups: frozenset[int]) -> bool:
        return uid in self.allowed_uids or bool(({gid} | groups) & self.allowed_gids)


def loop_delivery(loop: asyncio.AbstractEventLoop) -> Deliver:
    """The scheduler's hand-off (called on the engine thread): each step's events go to ``loop``
    in one callback, one wakeup per step, where every request's stream takes its own."""
    def deliver(events: list[Event]) -> None:
        try:
            loop.call_soon_threadsafe(call_sinks, events)
        except RuntimeError:  # the loop has closed: the daemon is exiting, nobody is waiting
            pass
    return deliver


def _fim_tokens(fim_ids: Mapping[str, int]) -> dict[str, int] | None:
    """hello's ``fim``: the prefix/suffix/middle token ids when the model has all three."""
    if all(k in fim_ids for k in admission.FIM_ROLES):
        return {"prefix": fim_ids["pre"], "suffix": fim_ids["suf"], "middle": fim_ids["mid"]}
    return None


def _unprivileged_model(info: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in info.items() if k != "path"}
    if isinstance(info.get("weights_cache"), Mapping):  # its entry's path and reason name the model's path
        out["weights_cache"] = {k: v for k, v in info["weights_cache"].items() if k in ("state", "bytes")}
    memory = info.get("memory")
    if isinstance(memory, Mapping) and isinstance(memory.get("weights_map_switch"), Mapping):  # entry, reason: likewise
        out["memory"] = {**memory, "weights_map_switch": {k: v for k, v in memory["weights_map_switch"].items()
                                                          if k in ("state", "from", "to", "at")}}
    return out


def _unprivileged_status(doc: Mapping[str, Any]) -> dict[str, Any]:
    server = {k: v for k, v in doc["server"].items() if k not in ("pid", "socket")}
    return {**doc, "server": server, "model": _unprivileged_model(doc["model"])}


class Connection:
    def __init__(self, cid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 creds: tuple[int, int, int, frozenset[int]], max_unsent: int = 0):
        self.cid = cid
        self.reader, self.writer = reader, writer
        self.max_unsent = max_unsent               # 0: unbounded (tests without a transport)
        if max_unsent:
            # drain() waits while more than this is unsent
            writer.transport.set_write_buffer_limits(high=max_unsent)
        self.heavy: asyncio.Task | None = None     # the tokenize/detokenize in progress
        self.pid, self.uid, self.gid, self.groups = creds
        # Where the model file and the daemon's process are is for its operators (root, the
        # daemon's own user); other allowed clients see the model's name.
        self.privileged = self.uid in (0, os.getuid())
        # msgid -> scheduler job id of a generate request; None while it is parsed and tokenized
        # (it can be cancelled then too: its msgid goes to ``cancel_early``)
        self.active: dict[int, int | None] = {}
        self.cancel_early: set[int] = set()
        self.closed = False                        # the peer has gone: submit nothing more
        self.write_shut = False                    # shutdown(SHUT_WR) sent: nothing more to write
        self.tasks: set[asyncio.Task] = set()
        self.n_requests = 0

    def send(self, data: bytes) -> None:
        # After a lingering close has shut down writing, a request's task may still finish.
        if not self.writer.is_closing() and not self.write_shut:
            self.writer.write(data)
            # Reading stops at max_unsent, but streamed generate output keeps coming: a peer that
            # lets it pile up to twice the budget is cut off (its requests are then cancelled).
            if self.max_unsent and self.writer.transport.get_write_buffer_size() > 2 * self.max_unsent:
                log.warning("connection %d: %d bytes unread by the peer; disconnecting", self.cid,
                            self.writer.transport.get_write_buffer_size(), extra={"KTD_PEER_UID": self.uid})
                self.writer.transport.abort()

    async def drain(self) -> None:
        if not self.writer.is_closing():
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()


class _Stream:
    """One generate request's sink, on the event loop: a streamed piece is written at once,
    without waking the request's task; the terminal event writes the response and resolves
    ``ended``. Unread output is bounded by max_tokens. With tools, ``parser``
    (ktd.text.tools.ToolCallParser) takes the calls out of the text before it is sent."""

    __slots__ = ("conn", "msgid", "stream", "parts", "index", "ended", "counters", "label", "extra",
                 "logprobs", "parser", "pending")

    def __init__(self, conn: Connection, msgid: int, stream: bool, ended: asyncio.Future[None],
                 counters: Counter[str], label: str, parser: ToolCallParser | None = None):
        self.conn, self.msgid, self.stream, self.ended = conn, msgid, stream, ended
        self.parts: list[str] = []
        self.logprobs: list[dict[str, Any]] | None = None  # unstreamed: those of the chunks
        self.index = 0
        self.counters, self.label = counters, label
        self.extra = {"KTD_REQUEST_ID": label, "KTD_PEER_UID": conn.uid}
        self.parser = parser
        self.pending: list[dict[str, Any]] = []  # logprobs of text the parser holds back

    def _piece(self, text: str, extra: dict[str, Any] | None) -> None:
        if self.parser is not None:
            text = self.parser.feed(text)
            if extra is not None:
                self.pending.extend(extra["logprobs"])
            if not text:
                return
            extra, self.pending = ({"logprobs": self.pending}, []) if self.pending else (None, [])
        self._emit(text, extra)

    def _emit(self, text: str, extra: dict[str, Any] | None) -> None:
        if self.stream:
            self.conn.send(protocol.chunk(self.msgid, self.index, text, extra))
            self.index += 1
        else:
            self.parts.append(text)
            if extra is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(extra["logprobs"])

    def __call__(self, kind: str, payload: Any) -> None:
        if kind == "chunk":
            text, extra = payload if isinstance(payload, tuple) else (payload, None)
            self._piece(text, extra)
            return
        if self.ended.done():
            return
        self.conn.active.pop(self.msgid, None)
        if kind == "done":
            if self.parser is not None:
                rest, calls = self.parser.finish()
                if rest:
                    extra, self.pending = ({"logprobs": self.pending}, []) if self.pending else (None, [])
                    self._emit(rest, extra)
                if self.pending:  # logprobs of the calls' tokens
                    payload["logprobs"] = self.pending + payload.get("logprobs", [])
                    self.pending = []
                if calls:
                    payload["tool_calls"] = calls
                    payload["finish_reason"] = "tool_calls"
            if not self.stream:
                payload["text"] = "".join(self.parts)
                if self.logprobs is not None:  # every token's, in order
                    payload["logprobs"] = self.logprobs + payload.get("logprobs", [])
            self.conn.send(protocol.response(self.msgid, payload))
            log.info("%s: %s, %d tokens", self.label, payload["finish_reason"],
                     payload["usage"]["completion_tokens"], extra=self.extra)
        else:
            self.counters["errors_" + payload.code] += 1
            self.conn.send(protocol.response(self.msgid, error=payload))
            log.info("%s: %s: %s", self.label, payload.code, payload.message, extra=self.extra)
        self.ended.set_result(None)


class Connections:
    """The open client connections and their requests. ``introspect`` answers the methods
    without parameters that describe the daemon (health, status, metrics) with their results."""

    def __init__(self, engine: Engine | None, scheduler: Scheduler | None, policy: Policy, counters: Counter[str],
                 introspect: Mapping[str, Callable[[], Any]], loading: Callable[[], dict[str, Any]] | None = None):
        """engine and scheduler None: the model is loading (``attach`` them when it is loaded);
        ``loading`` gives the load's progress for the ``loading`` error's data."""
        self.engine, self.scheduler, self.policy = engine, scheduler, policy
        self._model_info = engine.info if engine is not None else None
        self.loading = loading
        self.counters = counters
        self.introspect = introspect
        self.open: dict[int, Connection] = {}
        self.refusing = 0     # refused peers still held (waiting for the request we answer)
        self._conn_ids = itertools.count(1)
        self._req_ids = itertools.count(1)

    def attach(self, engine: Engine, scheduler: Scheduler, introspect: Mapping[str, Callable[[], Any]], *,
               model_info: Callable[[], dict[str, Any]] | None = None) -> None:
        """The model is loaded: every method is served from now on (connections opened during
        the load stay open). ``model_info``: hello's ``model`` (default: the engine's info)."""
        self.engine, self.scheduler, self.introspect = engine, scheduler, introspect
        self._model_info = model_info or engine.info

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The ``asyncio.start_unix_server`` callback: serve one peer until it leaves."""
        try:
            creds = peer_credentials(writer.get_extra_info("socket"))
        except OSError as e:
            log.warning("cannot read peer credentials: %s", e)
            writer.close()
            return
        conn = Connection(next(self._conn_ids), reader, writer, creds, self.policy.max_unsent_bytes)
        extra = {"KTD_PEER_UID": conn.uid, "KTD_PEER_PID": conn.pid}
        policy = self.policy
        if not policy.authorized(conn.uid, conn.gid, conn.groups):
            self.counters["rejected_unauthorized"] += 1
            log.warning("refused peer pid=%d uid=%d gid=%d: not in the allow-list", conn.pid, conn.uid,
                        conn.gid, extra=extra)
            await self._refuse(conn, Unauthorized(f"uid {conn.uid} is not allowed to use this daemon"))
            return
        if self.count >= policy.max_connections:
            self.counters["rejected_busy"] += 1
            log.warning("refused peer pid=%d uid=%d: %d connections open", conn.pid, conn.uid,
                        self.count, extra=extra)
            await self._refuse(conn, Busy(f"too many connections ({policy.max_connections})"))
            return
        self.open[conn.cid] = conn
        log.debug("connection %d from pid=%d uid=%d", conn.cid, conn.pid, conn.uid, extra=extra)
        try:
            await self._serve(conn)
        except asyncio.CancelledError:
            # The daemon is stopping and asyncio.run cancels the tasks of connections still open
            # (an idle ktd-http, a ktctl): end quietly (Python 3.11's start_unix_server callback
            # logs a cancelled connection task as an error with a traceback).
            pass
        finally:
            del self.open[conn.cid]
            conn.closed = True
            for rid in conn.active.values():
                if rid is not None and self.scheduler is not None:
                    self.scheduler.cancel(rid, "client disconnected")
            if conn.active:
                log.info("connection %d closed: cancelled %d requests", conn.cid, len(conn.active), extra=extra)
            if conn.tasks:  # answers to a peer that only shut down its writing side still go out
                await asyncio.wait(list(conn.tasks), timeout=5.0)
            conn.writer.close()
            log.debug("connection %d closed after %d requests", conn.cid, conn.n_requests, extra=extra)

    @property
    def count(self) -> int:
        """Connections held: served ones and refused ones still waiting for their answer."""
        return len(self.open) + self.refusing

    async def close(self, timeout: float) -> None:
        """Let the requests' tasks send their answers (up to ``timeout``), then close every
        connection."""
        tasks = [t for c in self.open.values() for t in c.tasks]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        for conn in list(self.open.values()):
            # a peer that does not read would hold the shutdown here for ever
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_LINGER_S):
                    await conn.drain()
            conn.writer.close()

    async def _refuse(self, conn: Connection, error: KtdError) -> None:
        """Answer the peer's first request (or send an error notification), then close. A refused
        peer counts against max_connections while it is held; at the limit it gets the error
        notification at once and is closed without waiting."""
        reply = protocol.error_notification(error)
        if self.count >= self.policy.max_connections:
            conn.send(reply)
            conn.writer.close()
            return
        self.refusing += 1
        try:
            await self._answer_refused(conn, reply, error)
        finally:
            self.refusing -= 1

    async def _answer_refused(self, conn: Connection, reply: bytes, error: KtdError) -> None:
        decoder = protocol.FrameDecoder(self.policy.limits.max_frame_bytes)
        try:
            async with asyncio.timeout(_REFUSE_WAIT_S):
                while True:
                    data = await conn.reader.read(READ_CHUNK)
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
                conn.write_shut = True
            async with asyncio.timeout(_LINGER_S):
                while await conn.reader.read(READ_CHUNK):
                    pass
        except (TimeoutError, ConnectionError, OSError):
            pass
        conn.writer.close()

    async def _serve(self, conn: Connection) -> None:
        decoder = protocol.FrameDecoder(self.policy.limits.max_frame_bytes)
        while True:
            # A peer with nothing in progress may not hold its connection (and a partial
            # message) for ever: it waits for its bytes at most idle_timeout_s.
            idle = self.policy.idle_timeout_s if not conn.tasks else None
            try:
                async with asyncio.timeout(idle):
                    data = await conn.reader.read(READ_CHUNK)
            except ConnectionError:
                return
            except TimeoutError:
                log.info("connection %d: idle for %.0f s; closing", conn.cid, idle,
                         extra={"KTD_PEER_UID": conn.uid})
                await self._lingering_close(conn, protocol.error_notification(
                    BadRequest(f"no request for {idle:g} s (server.idle_timeout_s); closing")))
                return
            if not data:
                truncated = decoder.partial
                # The partial message's bytes go now: writing to a peer that has gone raises, and
                # the exception's traceback would keep this frame (and them) until the cyclic GC.
                del decoder
                if truncated:  # the peer may only have shut down its writing side
                    conn.send(protocol.error_notification(BadRequest("connection closed inside a message")))
                    await conn.drain()
                return
            try:
                for value in decoder.feed(data):
                    # Backpressure against pipelining floods: stop reading while too many requests
                    # of this connection are unanswered. Room is left above the generate
                    # requests that can be running or queued, so a cancel always gets through.
                    limit = (self.engine.n_seq_max + self.policy.max_queue + _INFLIGHT_SPARE
                             if self.engine is not None else _INFLIGHT_WHILE_LOADING)
                    while len(conn.tasks) >= limit:
                        await asyncio.wait(list(conn.tasks), return_when=asyncio.FIRST_COMPLETED)
                    # Output backpressure: no more requests while the peer leaves answers unread.
                    await conn.drain()
                    await self._dispatch(conn, value)
            except protocol.FramingError as e:
                self.counters["errors_" + e.error.code] += 1
                log.warning("connection %d: %s; closing", conn.cid, e.error.message,
                            extra={"KTD_PEER_UID": conn.uid})
                if conn.tasks:  # the requests before the bad bytes are answered first
                    await asyncio.wait(list(conn.tasks), timeout=5.0)
                await self._lingering_close(conn, protocol.error_notification(e.error))
                return

    async def _dispatch(self, conn: Connection, value: Any) -> None:
        try:
            req = protocol.parse_request(value, self.policy.limits)
        except Exception as e:  # a KtdError, or a bug in validation: the peer still gets an answer
            if not isinstance(e, KtdError):
                log.exception("internal error validating a message")
                e = Internal("internal error validating the message")
            self.counters["errors_" + e.code] += 1
            msgid = protocol.request_id(value)
            conn.send(protocol.response(msgid, error=e) if msgid is not None
                      else protocol.error_notification(e))
            return
        self.counters["requests_" + req.method] += 1
        conn.n_requests += 1
        if self.engine is None and req.method not in _WHILE_LOADING:
            progress = self.loading() if self.loading else {}
            pct = f" ({progress['fraction']:.0%})" if progress.get("fraction") is not None else ""
            e = Loading(f"{req.method}: the model is loading{pct}; retry when health says ok", data=progress)
            self.counters["errors_" + e.code] += 1
            conn.send(protocol.response(req.msgid, error=e))
            return
        if req.method == "generate":
            # Claimed here, in arrival order, not in the request's task: two pipelined requests
            # with one msgid would both pass a check made after the first await.
            if req.msgid in conn.active:
                self.counters["errors_bad_request"] += 1
                conn.send(protocol.response(req.msgid, error=BadRequest(
                    f"generate: msgid {req.msgid} is already in use on this connection")))
                return
            conn.active[req.msgid] = None
        if req.method in _HEAVY:
            if conn.heavy is not None and not conn.heavy.done():
                await asyncio.wait([conn.heavy])
        task = asyncio.get_running_loop().create_task(self._handle(conn, req))
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)
        if req.method in _HEAVY:
            conn.heavy = task

    async def _handle(self, conn: Connection, req: protocol.Request) -> None:
        try:
            if req.method == "generate":
                await self._generate(conn, req)
            else:
                answer = protocol.response(req.msgid, await self._call(conn, req))
                budget = self.policy.max_unsent_bytes
                if len(answer) > budget:
                    raise TooLarge(f"{req.method}: the answer is {len(answer)} bytes, more than "
                                   f"server.max_unsent_bytes ({budget})")
                conn.send(answer)
        except KtdError as e:
            self.counters["errors_" + e.code] += 1
            conn.send(protocol.response(req.msgid, error=e))
        except Exception:
            log.exception("internal error in %s", req.method)
            self.counters["errors_internal"] += 1
            conn.send(protocol.response(req.msgid, error=Internal(f"internal error in {req.method}")))
        await conn.drain()

    async def _call(self, conn: Connection, req: protocol.Request) -> Any:
        m, p = req.method, req.params
        if m == "profile":
            reset = protocol.parse_profile(p)
            if reset and not conn.privileged:
                raise Unauthorized("profile: only root or the daemon's own user may reset the routing profile")
            profile = self.introspect.get("profile")
            return profile(reset) if profile else {"enabled": False, "reason": "not a MoE model"}
        if m in self.introspect:
            protocol.parse_empty(m, p)
            result = self.introspect[m]()
            return result if conn.privileged or m != "status" else _unprivileged_status(result)
        assert self.engine is not None  # while loading, _dispatch answers the other methods
        tok = self.engine.tokenizer
        if m == "hello":
            protocol.parse_empty(m, p)
            assert self._model_info is not None
            info = self._model_info()
            return {"protocol": protocol.PROTOCOL_VERSION, "server": f"ktd {__version__}",
                    "model": info if conn.privileged else _unprivileged_model(info),
                    "n_ctx": self.engine.n_ctx,
                    "n_seq_max": self.engine.n_seq_max, "n_vocab": tok.n_vocab,
                    "fim": _fim_tokens(tok.fim_ids)}
        if m == "cancel":
            msgid = protocol.parse_cancel(p)
            if msgid not in conn.active:
                raise NotFound(f"no running generate request with id {msgid} on this connection")
            rid = conn.active[msgid]
            if rid is None:  # not submitted yet: _generate answers it cancelled instead
                conn.cancel_early.add(msgid)
            else:
                self.scheduler.cancel(rid, "cancelled by the client")
            return {"cancelled": True}
        loop = asyncio.get_running_loop()
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
        loop = asyncio.get_running_loop()
        label = f"r{next(self._req_ids)}"
        try:
            policy = self.policy
            g = protocol.parse_generate(req.params, policy.limits)
            prompt = await loop.run_in_executor(None, admission.prompt_tokens, g, self.engine.tokenizer,
                                                policy.limits)
            max_tokens = admission.admit(prompt, g.max_tokens, n_vocab=self.engine.tokenizer.n_vocab,
                                         n_ctx=self.engine.n_ctx, limits=policy.limits)
            spec, parser = g.grammar, None
            if g.tools is not None and g.tools.choice != "none":
                fam = tools.family(self.engine.tokenizer.chat_template)
                if fam is None:
                    raise BadRequest("generate: tools: the model's chat template has no tool-call support "
                                     "(no tools section in a known format: <tool_call>, [TOOL_CALLS], Llama 3)")
                parser = tools.ToolCallParser(fam)
                if g.tools.choice in ("required", "function"):
                    spec = tools.forced_grammar(g.tools, fam)
            constraint = None
            if spec is not None:  # a bad grammar is answered here, before a slot is taken
                constraint = await loop.run_in_executor(None, grammar.compile_grammar, spec, self.engine.tokenizer)
            if conn.closed:
                raise Cancelled("client disconnected")
            if req.msgid in conn.cancel_early:
                raise Cancelled("cancelled by the client")
            deadlines = [d for d in (policy.request_deadline_s, g.deadline_s) if d]
            deadline = time.monotonic() + min(deadlines) if deadlines else None
            ended: asyncio.Future[None] = loop.create_future()
            stream = _Stream(conn, req.msgid, g.stream, ended, self.counters, label, parser)
            job = Job(client=conn.cid, prompt=prompt, sampling=g.sampling, max_tokens=max_tokens,
                      stop=g.stop, ignore_eos=g.ignore_eos, sink=stream, deadline=deadline, label=label,
                      constraint=constraint, top_logprobs=g.top_logprobs,
                      cache_prompt=g.cache_prompt, cache_owner=policy.cache_owner(conn.uid, g.cache_owner))
            rid = conn.active[req.msgid] = self.scheduler.submit(job)
        except BaseException:
            conn.active.pop(req.msgid, None)
            raise
        finally:
            conn.cancel_early.discard(req.msgid)
        log.info("%s: generate, %d prompt tokens, max_tokens %d", label, len(prompt), max_tokens,
                 extra=stream.extra)
        try:
            await ended  # the stream has answered; this task only drains the writer
        finally:
            if conn.active.get(req.msgid) == rid:
                del conn.active[req.msgid]
