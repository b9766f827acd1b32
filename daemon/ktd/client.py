"""Client library for the ktd socket protocol (docs/PROTOCOL.md): sync ``Client``, async
``AsyncClient``, streaming iterators, timeouts, and the typed exceptions of ``ktd.errors``
(``BadRequest``, ``TooLarge``, ``Busy``, ``Unauthorized``, ``NotFound``, ``Cancelled``,
``ContextOverflow``, ``Loading``, ``Internal``) raised from the server's error codes.

    with Client("/run/ktd/ktd.sock") as c:
        for text in (s := c.stream("Once upon a time", max_tokens=64)):
            print(text, end="")
        print(s.result["usage"])
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgpack

from ktd.server import protocol
from ktd.errors import (BadRequest, Busy, Cancelled, ContextOverflow, Internal, KtdError, NotFound,
                        TooLarge, Unauthorized, from_wire)
from ktd.errors import Loading

__all__ = ["Client", "AsyncClient", "Stream", "AsyncStream", "default_socket", "ConnectionLost",
           "KtdError", "BadRequest", "TooLarge", "Busy", "Unauthorized", "NotFound", "Cancelled",
           "ContextOverflow", "Internal", "Loading"]

DEFAULT_SOCKET = "/run/ktd/ktd.sock"
_END = object()  # on a stream's queue: its response (or a connection error) has arrived


class ConnectionLost(ConnectionError):
    """The daemon closed the connection or did not answer in time."""


def default_socket() -> str:
    """$KTD_SOCKET, else /run/ktd/ktd.sock."""
    return os.environ.get("KTD_SOCKET") or DEFAULT_SOCKET


def _params(kwargs: dict[str, Any]) -> list[Any]:
    p = {k: v for k, v in kwargs.items() if v is not None}
    return [p] if p else []


def _piece(params: list[Any]) -> Any:
    """A chunk's text, or (text, extra) when it carries an extra map (logprobs)."""
    return params[2] if len(params) < 4 else (params[2], params[3])


def _take(piece: Any, logprobs: list[dict]) -> str:
    """The text of a piece; its logprobs entries appended to ``logprobs``."""
    if isinstance(piece, tuple):
        text, extra = piece
        logprobs.extend(extra.get("logprobs", ()))
        return text
    return piece


def _unpacker() -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, max_buffer_size=64 << 20)


def _encode(msgid: int, method: str, params: list[Any]) -> bytes:
    """A request on the wire, or BadRequest for a value msgpack cannot carry (an integer past
    64 bits, a string with a lone UTF-16 surrogate, an object of another type): raised before
    anything is registered or sent, so a refused request leaves nothing behind."""
    try:
        return protocol.pack([protocol.REQUEST, msgid, method, params])
    except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as e:
        raise BadRequest(f"{method}: the request cannot be encoded for the daemon: "
                         f"{str(e).encode('ascii', 'backslashreplace').decode()[:300]}") from None


class Client:
    """Blocking client; one connection. Not thread-safe; concurrent streams on one client work
    (messages for other requests are buffered), but use one client per thread."""

    def __init__(self, path: str | None = None, *, timeout: float | None = 60.0,
                 connect_timeout: float = 5.0):
        self.path = path or default_socket()
        self.timeout = timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout)
        try:
            self._sock.connect(self.path)
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(timeout)
        self._unpacker = _unpacker()
        self._ids = itertools.count(1)
        self._responses: dict[int, tuple[Any, Any]] = {}
        self._chunks: dict[int, collections.deque[str]] = collections.defaultdict(collections.deque)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_request(self, method: str, params: list[Any]) -> int:
        msgid = next(self._ids)
        data = _encode(msgid, method, params)
        try:
            self._sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            # The daemon closed first: a refused connection (too many, not allowed) gets its error
            # notification and is closed without waiting for a request. Raise what it said.
            while True:
                self._pump()  # the notification raises its error; the end raises ConnectionLost
        return msgid

    def _pump(self) -> None:
        """Read one message and file it."""
        while True:
            for msg in self._unpacker:
                self._file(msg)
                return
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                raise ConnectionLost(f"no answer from {self.path} within {self.timeout} s") from None
            if not data:
                raise ConnectionLost(f"{self.path} closed the connection")
            self._unpacker.feed(data)

    def _file(self, msg: Any) -> None:
        if msg[0] == protocol.RESPONSE:
            self._responses[msg[1]] = (msg[2], msg[3])
        elif msg[0] == protocol.NOTIFICATION and msg[1] == protocol.CHUNK:
            self._chunks[msg[2][0]].append(_piece(msg[2]))
        elif msg[0] == protocol.NOTIFICATION and msg[1] == protocol.ERROR_NOTIFICATION:
            raise from_wire(msg[2][0])

    def wait(self, msgid: int) -> Any:
        while msgid not in self._responses:
            self._pump()
        error, result = self._responses.pop(msgid)
        self._chunks.pop(msgid, None)
        if error is not None:
            raise from_wire(error)
        return result

    def call(self, method: str, **params: Any) -> Any:
        return self.wait(self.send_request(method, _params(params)))

    def hello(self) -> dict:
        return self.call("hello")

    def health(self) -> dict:
        return self.call("health")

    def status(self) -> dict:
        return self.call("status")

    def metrics(self) -> str:
        return self.call("metrics")["text"]

    def tokenize(self, text: str, **params: Any) -> list[int]:
        return self.call("tokenize", text=text, **params)["tokens"]

    def detokenize(self, tokens: list[int]) -> str:
        return self.call("detokenize", tokens=tokens)["text"]

    def cancel(self, msgid: int) -> dict:
        return self.call("cancel", id=msgid)

    def generate(self, prompt: str | None = None, **params: Any) -> dict:
        """Whole result (``text``, ``finish_reason``, ``usage``, ``timings``)."""
        return self.call("generate", prompt=prompt, stream=False, **params)

    def stream(self, prompt: str | None = None, **params: Any) -> Stream:
        """Iterator over text pieces; ``.result`` holds usage/timings after the last piece."""
        msgid = self.send_request("generate", _params({"prompt": prompt, "stream": True, **params}))
        return Stream(self, msgid)


class Stream:
    """Text pieces of one streamed generate; ``result`` once iteration ends; ``logprobs``: with
    ``logprobs=True``, every generated token's entry in order (those of the chunks, then those
    of the response)."""

    def __init__(self, client: Client, msgid: int):
        self.client, self.msgid = client, msgid
        self.result: dict | None = None
        self.logprobs: list[dict] = []

    def __iter__(self) -> Iterator[str]:
        c = self.client
        while True:
            chunks = c._chunks.get(self.msgid)
            if chunks:
                yield _take(chunks.popleft(), self.logprobs)
                continue
            if self.msgid in c._responses:
                self.result = c.wait(self.msgid)  # raises the typed error, if any
                self.logprobs.extend(self.result.get("logprobs", ()))
                return
            c._pump()

    def text(self) -> str:
        return "".join(self)

    def cancel(self) -> None:
        """Ask the daemon to stop; iteration then ends with ``Cancelled``."""
        c = self.client
        try:
            c.wait(c.send_request("cancel", [{"id": self.msgid}]))
        except NotFound:
            pass  # it had already finished


class AsyncClient:
    """asyncio client; many requests may run concurrently on one connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str,
                 timeout: float | None):
        self._reader, self._writer, self.path, self.timeout = reader, writer, path, timeout
        self._ids = itertools.count(1)
        self._waiters: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
        self._closed_error: BaseException | None = None

    @classmethod
    async def connect(cls, path: str | None = None, *, timeout: float | None = 60.0,
                      connect_timeout: float = 5.0) -> AsyncClient:
        path = path or default_socket()
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path, limit=1 << 20),
                                                connect_timeout)
        return cls(reader, writer, path, timeout)

    async def close(self) -> None:
        self._task.cancel()
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass

    @property
    def closed(self) -> bool:
        """The connection is gone (closed by the daemon, or an error notification arrived)."""
        return self._closed_error is not None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _read_loop(self) -> None:
        unpacker = _unpacker()
        try:
            while True:
                data = await self._reader.read(65536)
                if not data:
                    raise ConnectionLost(f"{self.path} closed the connection")
                unpacker.feed(data)
                for msg in unpacker:
                    if msg[0] == protocol.RESPONSE:
                        fut = self._waiters.pop(msg[1], None)
                        if fut is not None and not fut.done():
                            fut.set_result((msg[2], msg[3]))
                        q = self._streams.get(msg[1])
                        if q is not None:
                            q.put_nowait(_END)
                    elif msg[0] == protocol.NOTIFICATION and msg[1] == protocol.CHUNK:
                        q = self._streams.get(msg[2][0])
                        if q is not None:
                            q.put_nowait(_piece(msg[2]))
                    elif msg[0] == protocol.NOTIFICATION and msg[1] == protocol.ERROR_NOTIFICATION:
                        raise from_wire(msg[2][0])
        except (ConnectionError, KtdError) as e:
            self._closed_error = e
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(e)
            self._waiters.clear()
            for q in self._streams.values():
                q.put_nowait(_END)

    async def _send(self, method: str, params: list[Any]) -> tuple[int, asyncio.Future]:
        if self._closed_error is not None:
            raise self._closed_error
        msgid = next(self._ids)
        data = _encode(msgid, method, params)
        fut = asyncio.get_running_loop().create_future()
        self._waiters[msgid] = fut
        await self._write(msgid, data)
        return msgid, fut

    async def _write(self, msgid: int, data: bytes) -> None:
        self._writer.write(data)
        # A send that failed at once (EPIPE) closes the transport: the daemon closed first, as it
        # does a refused connection (too many, not allowed) right after its error notification,
        # without waiting for a request. The transport has stopped reading and closes the socket
        # at the loop's next turn, so a notification still in the socket is read now; one the
        # transport had already read reaches the read loop before that close.
        refusal = self._unread_error() if self._writer.transport.is_closing() else None
        try:
            await self._writer.drain()
        except ConnectionError:
            self._waiters.pop(msgid, None)
            self._streams.pop(msgid, None)
            await asyncio.wait({self._task}, timeout=self.timeout)
            if refusal is None and isinstance(self._closed_error, KtdError):
                refusal = self._closed_error
            if refusal is None:
                raise
            self._closed_error = refusal  # what later calls raise too, as Client does
            raise refusal from None

    def _unread_error(self) -> KtdError | None:
        """The daemon's error notification among the bytes left unread in the socket, if any."""
        sock = self._writer.get_extra_info("socket")
        data = b""
        try:
            while sock is not None and (chunk := os.read(sock.fileno(), 65536)):  # non-blocking
                data += chunk
        except OSError:  # nothing more (EAGAIN), or the socket is gone
            pass
        unpacker = _unpacker()
        unpacker.feed(data)
        for msg in unpacker:
            if msg[0] == protocol.NOTIFICATION and msg[1] == protocol.ERROR_NOTIFICATION:
                return from_wire(msg[2][0])
        return None

    async def _result(self, fut: asyncio.Future) -> Any:
        try:
            error, result = await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except TimeoutError:
            raise ConnectionLost(f"no answer from {self.path} within {self.timeout} s") from None
        if error is not None:
            raise from_wire(error)
        return result

    async def call(self, method: str, **params: Any) -> Any:
        _, fut = await self._send(method, _params(params))
        return await self._result(fut)

    async def hello(self) -> dict:
        return await self.call("hello")

    async def health(self) -> dict:
        return await self.call("health")

    async def status(self) -> dict:
        return await self.call("status")

    async def metrics(self) -> str:
        return (await self.call("metrics"))["text"]

    async def tokenize(self, text: str, **params: Any) -> list[int]:
        return (await self.call("tokenize", text=text, **params))["tokens"]

    async def detokenize(self, tokens: list[int]) -> str:
        return (await self.call("detokenize", tokens=tokens))["text"]

    async def generate(self, prompt: str | None = None, **params: Any) -> dict:
        return await self.call("generate", prompt=prompt, stream=False, **params)

    async def stream(self, prompt: str | None = None, **params: Any) -> AsyncStream:
        if self._closed_error is not None:
            raise self._closed_error
        msgid = next(self._ids)
        data = _encode(msgid, "generate", _params({"prompt": prompt, "stream": True, **params}))
        q: asyncio.Queue = asyncio.Queue()
        self._streams[msgid] = q
        fut = asyncio.get_running_loop().create_future()
        self._waiters[msgid] = fut
        await self._write(msgid, data)
        return AsyncStream(self, msgid, q, fut)


class AsyncStream:
    """Text pieces of one streamed generate; ``result`` (usage, timings) once iteration ends.

    The client's read loop puts the pieces, then ``_END`` when the response (or a connection
    error) arrives, on this stream's queue: one queue operation per piece, no task per piece.
    """

    def __init__(self, client: AsyncClient, msgid: int, queue: asyncio.Queue, fut: asyncio.Future):
        self.client, self.msgid, self._queue, self._fut = client, msgid, queue, fut
        self.result: dict | None = None
        self.logprobs: list[dict] = []     # as Stream.logprobs
        self.t_first: float | None = None  # time.monotonic() of the first text piece
        self.t_last: float | None = None   # ... and of the last one

    async def _next(self) -> Any:
        if not self._queue.empty():
            return self._queue.get_nowait()
        if self.client.timeout is None:
            return await self._queue.get()
        try:
            async with asyncio.timeout(self.client.timeout):
                return await self._queue.get()
        except TimeoutError:
            raise ConnectionLost(f"no answer from {self.client.path} within {self.client.timeout} s") from None

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            while True:
                piece = await self._next()
                if piece is _END:
                    self.result = await self.client._result(self._fut)
                    self.logprobs.extend(self.result.get("logprobs", ()))
                    return
                self.t_last = time.monotonic()
                if self.t_first is None:
                    self.t_first = self.t_last
                yield _take(piece, self.logprobs)
        finally:
            self.client._streams.pop(self.msgid, None)

    async def cancel(self) -> None:
        try:
            await self.client.call("cancel", id=self.msgid)
        except NotFound:
            pass
