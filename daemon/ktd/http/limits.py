"""The gateway's connection limits, below the application: uvicorn's h11 protocol with

- a cap on open connections: one over it is answered 503 (JSON, ``Retry-After``) at once, its
  input discarded, and closed once the client has read the answer (a lingering close, at most
  ``LINGER_S``; at most ``MAX_LINGERING`` such connections at a time, beyond them the close is at
  once), so that silent clients cannot take every file descriptor and starve ``accept()``;
- a header timeout: a request's line and headers must arrive within ``header_timeout_s`` of the
  connection, or of the first byte after a keep-alive wait (uvicorn's ``timeout_keep_alive``
  bounds that wait); else the connection is closed, with a 408 when part of a request came;
- a body timeout: the whole body within ``body_timeout_s`` of the headers; else 408 and the
  connection closed (the handler sees the client gone and logs 408);
- malformed HTTP answered 400 in JSON (OpenAI's error shape: no dialect is known yet);
- the peer's uid on a Unix listener (SO_PEERCRED), as ``request.state.peer_uid``: the caller's
  identity for the prefix cache when the gateway has no API keys (ktd.http.app).

Counts (open, refused, timed out) go to the gateway's metrics (``ktd_http_connections`` ...).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ktd.http")

MAX_CONNECTIONS = 2000     # open HTTP connections (LimitNOFILE of ktd-http.service is sized for it)
MAX_IN_FLIGHT = 1024       # requests being answered at once; beyond: 429 (ktd.http.app)
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0      # a 4 MiB body at 1 Mbit/s takes 34 s
LINGER_S = 2.0             # a refused connection's answer gets this long to be read
MAX_LINGERING = 256        # refused connections lingering at once; beyond, closed at once
FD_RESERVE = 64            # descriptors the gateway needs besides its connections (listeners,
                           # the daemon's socket, logs, Python's own) plus MAX_LINGERING


@dataclass
class ConnectionLimits:
    max_connections: int = MAX_CONNECTIONS
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S


@dataclass
class ConnectionStats:
    """Read by /metrics (ktd.http.app.HTTPMetrics)."""

    open: int = 0          # connections being served
    lingering: int = 0     # refused connections still held for their answer
    refused: int = 0       # connections refused over the cap, in all
    header_timeouts: int = 0
    body_timeouts: int = 0


def _canned(status: int, reason: str, code: str, message: str, extra: dict[str, str] | None = None) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "server_error", "param": None, "code": code}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *(f"{k}: {v}" for k, v in (extra or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def fd_budget(max_connections: int) -> int:
    """The connection cap the process's descriptor limit allows: RLIMIT_NOFILE's soft limit is
    raised towards the hard one when it is short (systemd's LimitNOFILE sets both); a cap that
    still does not fit is lowered, with a warning."""
    import resource

    need = max_connections + FD_RESERVE + MAX_LINGERING
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        fitted = max(1, soft - FD_RESERVE - MAX_LINGERING)
        log.warning("--max-connections %d needs %d file descriptors, RLIMIT_NOFILE allows %d: serving at "
                    "most %d connections (raise LimitNOFILE)", max_connections, need, soft, fitted)
        return fitted
    return max_connections


def _unix_peer_uid(transport: Any) -> int | None:
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    from ktd.server.sockets import peer_credentials
    try:
        return peer_credentials(sock)[1]
    except OSError:
        return None


class _GatewayLimits:
    """The limits, mixed into uvicorn's H11Protocol by ``protocol_class`` (which sets ``limits``
    and ``stats``): overrides call the protocol's own methods through ``super()``."""

    limits: ConnectionLimits
    stats: ConnectionStats
    _timer: asyncio.TimerHandle | None = None
    _timed: Any = None            # the request cycle whose headers arrived (its body timed)
    _refused = False
    _counted = False
    _partial = False              # bytes of a request not yet whole arrived

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer_uid = _unix_peer_uid(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse()
            return
        self._counted = True
        self.stats.open += 1
        self._arm(self.limits.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc) -> None:
        self._cancel()
        if self._counted:
            self.stats.open -= 1
            self._counted = False
        if self._refused:
            self.stats.lingering -= 1
            self._refused = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped: the client gets the 503 before the close
        if self._timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm(self.limits.header_timeout_s, self._header_timeout)  # the first byte after keep-alive
        self._partial = True
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        c = self.cycle
        if c is None or c is self._timed or c.response_complete:
            return
        # A request's headers arrived: its state gets the peer, its body the body timeout.
        self._timed = c
        self._partial = False
        c.scope.setdefault("state", {})["peer_uid"] = self._peer_uid
        self._cancel()
        if c.more_body:
            self._arm(self.limits.body_timeout_s, self._body_timeout)

    def on_response_complete(self) -> None:
        self._cancel()
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        self._cancel()
        self.transport.write(_canned(400, "Bad Request", "invalid_http", msg))
        self.transport.close()

    # --- timers and refusal ---

    def _arm(self, seconds: float, callback) -> None:
        self._cancel()
        if seconds > 0:
            self._timer = self.loop.call_later(seconds, callback)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        self.stats.header_timeouts += 1
        if self._partial:
            self.transport.write(_canned(408, "Request Timeout", "request_timeout", "the request's headers did "
                                         f"not arrive within {self.limits.header_timeout_s:g} s"))
        self.transport.close()

    def _body_timeout(self) -> None:
        self._timer = None
        c = self.cycle
        if self.transport.is_closing() or c is None or not c.more_body:
            return
        self.stats.body_timeouts += 1
        c.scope.setdefault("state", {})["timed_out"] = True
        if not c.response_started:
            self.transport.write(_canned(408, "Request Timeout", "request_timeout", "the request's body did "
                                         f"not arrive within {self.limits.body_timeout_s:g} s"))
        # the close reaches the handler as a disconnect (its own answer is dropped): it logs 408
        self.transport.close()

    def _refuse(self) -> None:
        self.connections.discard(self)
        self.stats.refused += 1
        if self.stats.refused == 1 or self.stats.refused % 1000 == 0:
            log.warning("connection limit (%d open, --max-connections): refusing new connections with 503 "
                        "(%d refused so far)", self.limits.max_connections, self.stats.refused)
        self.transport.write(_canned(503, "Service Unavailable", "too_many_connections",
                                     f"the gateway serves at most {self.limits.max_connections} connections; "
                                     "retry shortly", {"retry-after": "1"}))
        if self.stats.lingering >= MAX_LINGERING or not self.transport.can_write_eof():
            self.transport.close()
            return
        self._refused = True
        self.stats.lingering += 1
        self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)

    def eof_received(self) -> bool | None:
        if self._refused:
            self.transport.close()
        return None


def protocol_class(limits: ConnectionLimits, stats: ConnectionStats) -> type:
    """uvicorn's ``http=`` protocol class with ``limits``, counting into ``stats`` (uvicorn is
    imported here, not with this module: ``ktd --help`` reads the defaults above)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return type("GatewayH11Protocol", (_GatewayLimits, H11Protocol), {"limits": limits, "stats": stats})
