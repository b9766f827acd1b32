"""Typed errors of the daemon, each with the stable wire code clients see (docs/PROTOCOL.md).

A ``KtdError`` crossing the socket becomes the error map ``{"code": CODE, "message": TEXT}``
(plus ``"data"`` where a method documents it); the client library raises the class of the same
code again. Codes never change meaning; new codes may be added.
"""

from __future__ import annotations

from typing import Any


class KtdError(Exception):
    """Base class. ``code`` is the stable wire code; ``data`` optional structured detail."""

    code = "internal"

    def __init__(self, message: str, *, data: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.data = data

    def to_wire(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data:
            err["data"] = self.data
        return err


class BadRequest(KtdError):
    """Malformed frame or message, unknown method, wrong parameter type or value."""

    code = "bad_request"


class TooLarge(KtdError):
    """A size limit was exceeded (frame bytes, prompt tokens, max_tokens, messages, nesting)."""

    code = "too_large"


class Busy(KtdError):
    """The request queue or the connection limit is full, or the daemon is shutting down."""

    code = "busy"


class Unauthorized(KtdError):
    """The peer's uid/gid (SO_PEERCRED) is not in the configured allow-list."""

    code = "unauthorized"


class NotFound(KtdError):
    """The referenced request (cancel) or method does not exist."""

    code = "not_found"


class Cancelled(KtdError):
    """The request was cancelled (by the client, its deadline, or shutdown)."""

    code = "cancelled"


class ContextOverflow(KtdError):
    """Prompt plus requested tokens do not fit the per-sequence context (n_ctx).

    Also raised by an engine's ``forward`` when a position would exceed n_ctx; admission
    (``ktd.server.admission.admit``) checks n_ctx first so that this normally never happens there.
    """

    code = "context_overflow"


class Loading(KtdError):
    """The daemon is still loading its model: only ``health``, ``status`` and ``metrics`` are
    answered yet. ``data``: the load's progress (phase, fraction, done_bytes, total_bytes);
    retry later (llama-server answers 503 "Loading model" for the same state)."""

    code = "loading"


class Internal(KtdError):
    """A bug or an engine failure; the message is logged with the request id."""

    code = "internal"


ERRORS: dict[str, type[KtdError]] = {
    cls.code: cls
    for cls in (BadRequest, TooLarge, Busy, Unauthorized, NotFound, Cancelled, ContextOverflow, Loading,
                Internal)
}


def from_wire(err: Any) -> KtdError:
    """Rebuild the typed exception from a wire error map (unknown codes become ``Internal``)."""
    if isinstance(err, dict):
        cls = ERRORS.get(err.get("code"), Internal)  # type: ignore[arg-type]
        message = err.get("message")
        data = err.get("data")
        exc = cls(str(message) if message is not None else str(err.get("code")),
                  data=data if isinstance(data, dict) else None)
        return exc
    return Internal(f"malformed error from server: {err!r}")
