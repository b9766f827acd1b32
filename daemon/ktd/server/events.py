"""What the scheduler hands out: events addressed to the request they belong to.

A job's ``sink`` is its request's stream: ``sink(kind, payload)`` takes ("chunk", text) pieces in
order, then exactly one terminal ("done", result dict) or ("error", KtdError). The scheduler
collects each step's events and passes the list, once per step on the engine thread, to the one
``Deliver`` it was given; the server's posts the list to its event loop, which runs ``call_sinks``
there. Events flow one way: engine thread → deliver → each request's sink.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ktd.server.scheduler")

Sink = Callable[[str, Any], None]   # sink(kind, payload): "chunk" str | "done" dict | "error" KtdError
Event = tuple[Sink, str, Any]
Deliver = Callable[[list[Event]], None]


def call_sinks(events: list[Event]) -> None:
    """Hand every event to its sink, here. A failing sink is logged and does not keep the other
    requests' events from being delivered."""
    for sink, kind, payload in events:
        try:
            sink(kind, payload)
        except Exception:
            log.exception("delivering a %r event failed", kind)
