"""One ``generate`` run as an HTTP response, streamed (SSE or NDJSON) or whole (JSON).

The daemon is always asked for a stream: a non-streamed HTTP answer is the concatenation of the
same pieces, so streamed and whole answers have the same text by construction. The status line
is sent when the first piece (or the end) arrives, so an error the daemon reports before any
text (busy, context overflow, bad parameter) is a proper HTTP error, not a 200 with an error
inside. While the response runs, a watcher reads the ASGI ``receive`` channel; when the client
disconnects it interrupts the response and the generation is cancelled in the daemon (its KV
slot is freed at the next engine step; ``ktd_generate_finished_total{reason="cancelled"}``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ktd.http.backend import Backend, HTTPFailure, from_daemon

log = logging.getLogger("ktd.http")


@dataclass
class Outcome:
    """What a finished generation produced (for the dialect's final chunk / whole body)."""

    text: str
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float]
    tool_calls: list[dict] | None = None   # the daemon's (OpenAI's shape), when the reply holds calls
    logprobs: list[dict] | None = None     # every token's entry, when the request asked for them
    logprobs_tail: list[dict] | None = None  # streamed: the entries no piece carried (held-back text)


class Dialect:
    """How one API renders a generation. ``media_type`` of the streamed body; ``piece`` → bytes of
    one text delta (with the daemon's logprobs entries of its tokens, when asked); ``first`` → bytes sent before the first delta (may be b""); ``end`` → the
    closing bytes of a stream; ``whole`` → the JSON body of a non-streamed answer;
    ``error_body`` → (status, headers, body bytes) of an error before the stream starts;
    ``stream_error`` → bytes that report an error after the stream started."""

    media_type = "text/event-stream"

    def first(self) -> bytes:
        return b""

    def piece(self, text: str, logprobs: list[dict] | None = None) -> bytes:
        raise NotImplementedError

    def end(self, outcome: Outcome) -> bytes:
        raise NotImplementedError

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        raise NotImplementedError

    def error_body(self, failure: HTTPFailure) -> dict[str, Any]:
        raise NotImplementedError

    def stream_error(self, failure: HTTPFailure) -> bytes:
        raise NotImplementedError


def json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class GenerationResponse:
    """ASGI response running ``params`` (daemon ``generate`` parameters) on ``backend``."""

    def __init__(self, backend: Backend, params: dict[str, Any], dialect: Dialect, *, stream: bool,
                 on_done: Callable[[int], None] | None = None):
        self.backend, self.params, self.dialect, self.stream = backend, params, dialect, stream
        self.status = 200
        self.on_done = on_done        # called with the status sent (request metrics)
        self._disconnected = False
        self._finished = False

    async def __call__(self, scope, receive, send) -> None:
        main = asyncio.current_task()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
            if not self._finished:
                self._disconnected = True
                main.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self._run(send)
        except asyncio.CancelledError:
            if not self._disconnected:
                raise
            main.uncancel()  # our own interruption: the client is gone, nothing to answer
            self.status = 499  # nginx's "client closed request", for the request log and metrics
        finally:
            self._finished = True
            watcher.cancel()
            if self.on_done:
                self.on_done(self.status)

    async def _send_error(self, send, failure: HTTPFailure) -> None:
        self.status = failure.status
        # ASCII: whatever the message quotes, the answer encodes
        body = json.dumps(self.dialect.error_body(failure), ensure_ascii=True, separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in failure.headers.items()]
        await send({"type": "http.response.start", "status": failure.status, "headers": headers})
        self._finished = True
        await send({"type": "http.response.body", "body": body})

    async def _run(self, send) -> None:
        try:
            gen = await self.backend.stream(dict(self.params))
        except Exception as e:  # noqa: BLE001 - every failure gets an HTTP answer
            await self._send_error(send, from_daemon(e))
            return
        pieces = gen.__aiter__()
        texts: list[str] = []
        n_lp = 0  # gen.logprobs entries already sent with a piece
        headers_sent = False
        try:
            try:
                async for piece in pieces:
                    lps = gen.logprobs[n_lp:]
                    if not piece and not lps:
                        continue
                    n_lp += len(lps)
                    texts.append(piece)
                    if self.stream:
                        if not headers_sent:
                            await self._start_stream(send)
                            headers_sent = True
                        await send({"type": "http.response.body", "body": self.dialect.piece(piece, lps or None),
                                    "more_body": True})
            except asyncio.CancelledError:
                if self._disconnected and gen.result is None:
                    log.info("client disconnected: cancelling generate %d", gen.msgid)
                    await asyncio.shield(self.backend.cancel(gen))
                raise
            finally:
                await pieces.aclose()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a typed daemon error or a lost connection
            failure = from_daemon(e)
            if not headers_sent:
                await self._send_error(send, failure)
            else:
                log.warning("generate %d failed after streaming began: %s", gen.msgid, failure)
                self._finished = True
                await send({"type": "http.response.body", "body": self.dialect.stream_error(failure)})
            return
        result = gen.result or {}
        outcome = Outcome(text="".join(texts), finish_reason=result.get("finish_reason", "stop"),
                          usage=result.get("usage", {}), timings=result.get("timings", {}),
                          tool_calls=result.get("tool_calls") or None,
                          logprobs=list(gen.logprobs) if self.params.get("logprobs") else None,
                          logprobs_tail=gen.logprobs[n_lp:] if self.params.get("logprobs") else None)
        if self.stream:
            if not headers_sent:
                await self._start_stream(send)
            self._finished = True
            await send({"type": "http.response.body", "body": self.dialect.end(outcome)})
        else:
            body = json_bytes(self.dialect.whole(outcome))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            self._finished = True
            await send({"type": "http.response.body", "body": body})

    async def _start_stream(self, send) -> None:
        headers = [(b"content-type", self.dialect.media_type.encode()), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]  # reverse proxies: do not buffer the stream
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        first = self.dialect.first()
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
