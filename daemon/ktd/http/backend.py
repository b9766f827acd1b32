"""The gateway's side of the daemon socket: one shared ``AsyncClient`` connection, the served
model's identity, and the translation of the daemon's typed errors into HTTP answers.

One connection carries every HTTP request (the protocol runs requests concurrently on a
connection; a disconnected HTTP client's generation is ended with ``cancel``). When the daemon
restarts, the next request reconnects and reads ``hello`` again (the model may have changed).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from ktd.client import AsyncClient, AsyncStream, ConnectionLost
from ktd.errors import Loading
from ktd.errors import (BadRequest, Busy, Cancelled, ContextOverflow, KtdError, NotFound, TooLarge,
                        Unauthorized)

log = logging.getLogger("ktd.http")

CALL_TIMEOUT_S = 30.0      # hello/status/metrics/tokenize; generate relies on the daemon's deadline
BUSY_RETRY_AFTER_S = 1     # Retry-After of a 429 (the daemon's slots and queue are full)
DOWN_RETRY_AFTER_S = 5     # Retry-After of a 503 (daemon unreachable, loading or stopping)


@dataclass
class HTTPFailure(Exception):
    """An error answer, in neutral form; each API dialect renders it in its own body shape."""

    status: int
    message: str
    type: str = "invalid_request_error"   # OpenAI's error.type
    code: str | None = None               # OpenAI's error.code
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.code or self.type}: {self.message}"


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> HTTPFailure:
    return HTTPFailure(400, message, code=code, param=param)


def from_daemon(exc: BaseException) -> HTTPFailure:
    """The HTTP answer for an error of the daemon (typed) or of the connection to it."""
    if isinstance(exc, HTTPFailure):
        return exc
    if isinstance(exc, ContextOverflow):  # data: prompt_tokens, n_ctx (in the message too)
        return HTTPFailure(400, exc.message, code="context_length_exceeded")
    if isinstance(exc, TooLarge):
        return HTTPFailure(400, exc.message, code="too_large")
    if isinstance(exc, BadRequest):
        return HTTPFailure(400, exc.message, code="bad_request")
    if isinstance(exc, Busy):
        return HTTPFailure(429, exc.message, type="rate_limit_error", code="busy",
                           headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})
    if isinstance(exc, Loading):  # llama-server: 503 "Loading model"
        return HTTPFailure(503, exc.message, type="server_error", code="loading",
                           headers={"Retry-After": str(DOWN_RETRY_AFTER_S)})
    if isinstance(exc, Cancelled):  # the request's deadline (server.request_deadline_s) or shutdown
        return HTTPFailure(504, exc.message, type="server_error", code="cancelled")
    if isinstance(exc, Unauthorized):
        return HTTPFailure(503, "the daemon refuses the gateway's uid (add it to server.allowed_uids "
                           f"or its group to server.allowed_gids): {exc.message}", type="server_error",
                           code="daemon_unauthorized", headers={"Retry-After": str(DOWN_RETRY_AFTER_S)})
    if isinstance(exc, (ConnectionLost, ConnectionError, OSError, TimeoutError)):
        return HTTPFailure(503, f"the daemon is not available: {exc}", type="server_error",
                           code="daemon_unavailable", headers={"Retry-After": str(DOWN_RETRY_AFTER_S)})
    if isinstance(exc, (KtdError, NotFound)):
        return HTTPFailure(500, exc.message, type="server_error", code=exc.code)
    return HTTPFailure(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal")


@dataclass(frozen=True)
class ModelInfo:
    """The served model as the HTTP APIs name and describe it (from the daemon's ``hello``)."""

    id: str                      # the name clients send: the GGUF file name without .gguf
    architecture: str
    n_params: int
    n_ctx: int
    n_seq_max: int
    fim: dict[str, int] | None   # prefix/suffix/middle token ids, None: no fill-in-the-middle
    info: dict[str, Any]

    @classmethod
    def from_hello(cls, hello: dict, name_override: str | None = None) -> ModelInfo:
        info = hello.get("model") or {}
        name = str(info.get("name") or "model")
        stem = name[:-5] if name.lower().endswith(".gguf") else name
        return cls(id=name_override or stem, architecture=str(info.get("architecture", "")),
                   n_params=int(info.get("n_params") or 0), n_ctx=int(hello.get("n_ctx") or 0),
                   n_seq_max=int(hello.get("n_seq_max") or 0), fim=hello.get("fim"), info=info)

    def matches(self, requested: str) -> bool:
        """Accepts the id, the file name (id.gguf) and Ollama's tagged form (id:latest)."""
        r = requested.strip()
        return r in (self.id, f"{self.id}.gguf", f"{self.id}:latest", str(self.info.get("name")))


class Backend:
    """The daemon at ``socket_path``, as the HTTP handlers use it."""

    def __init__(self, socket_path: str, *, model_name: str | None = None,
                 connect_timeout: float = 5.0, call_timeout: float = CALL_TIMEOUT_S):
        self.socket_path = socket_path
        self.model_name = model_name
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self._client: AsyncClient | None = None
        self._model: ModelInfo | None = None
        self._lock = asyncio.Lock()

    async def client(self) -> AsyncClient:
        c = self._client
        if c is not None and not c.closed:
            return c
        async with self._lock:
            c = self._client
            if c is not None and not c.closed:
                return c
            if c is not None:
                await c.close()
                self._client = None
            c = await AsyncClient.connect(self.socket_path, timeout=None,
                                          connect_timeout=self.connect_timeout)
            try:
                hello = await asyncio.wait_for(c.hello(), self.call_timeout)
            except BaseException:
                await c.close()
                raise
            self._model = ModelInfo.from_hello(hello, self.model_name)
            self._client = c
            log.info("connected to the daemon at %s: model %s", self.socket_path, self._model.id)
            return c

    async def model(self) -> ModelInfo:
        await self.client()
        assert self._model is not None
        return self._model

    async def call(self, method: str, **params: Any) -> Any:
        c = await self.client()
        return await asyncio.wait_for(c.call(method, **params), self.call_timeout)

    async def stream(self, params: dict[str, Any]) -> AsyncStream:
        c = await self.client()
        prompt = params.pop("prompt", None)
        return await c.stream(prompt, **params)

    async def cancel(self, stream: AsyncStream) -> None:
        """End a generation whose HTTP client left (the daemon answers it ``cancelled``)."""
        try:
            await asyncio.wait_for(stream.cancel(), self.call_timeout)
        except (KtdError, ConnectionError, OSError, TimeoutError) as e:
            log.warning("cancel of generate %d failed: %s", stream.msgid, e)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


def fim_params(model: ModelInfo, prefix: str, suffix: str) -> dict[str, Any]:
    """A fill-in-the-middle request's generate params: the text before the gap as ``prompt`` and
    the text after it as ``suffix`` (the daemon builds the prompt from the model's FIM tokens).
    The model's FIM tokens are known from ``hello``: a model without them is answered here."""
    if not model.fim:
        raise bad_request(f"model {model.id} has no fill-in-the-middle tokens (its GGUF metadata names "
                          "no tokenizer.ggml.fim_pre/suf/mid_token_id and its vocabulary has no "
                          "<|fim_prefix|>-style tokens): `suffix` cannot be used with it", param="suffix",
                          code="fim_unsupported")
    return {"prompt": prefix, "suffix": suffix}
