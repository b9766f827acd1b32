"""The weights switch of model.weights_map: auto after a cache miss: the server's ``WeightsManager``.

The load missed the prepared-weights cache (the native loader's cache state ``absent``): the
engine serves from the model file at once, and the manager

1. starts the builder process (``ktd.ops.cache_builder``) that writes the entry, and watches it;
2. when it has written the entry, opens it (mapped, every checksum verified) with a KV cache of its
   own, on the watch thread, while the engine serves: state ``opening`` → ``ready``;
3. tells the scheduler (``on_ready``'s ``wake``), whose engine thread calls ``switch`` at a step
   with no sequence in flight: the engine adopts the new model and context (state ``done``).

Any failure is logged and recorded (state ``failed``), and the engine keeps serving from the
file. ``status`` is what the daemon shows as ``model.memory.weights_map_switch``: ``{state: none}``
without a switch, else ``state``, ``from``, ``to``, the ``entry`` path and ``reason``/``at``.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from ktd.ops import cache_builder, weights_cache
from ktd.server.engine import BackendNotMoved, Engine

# The engine's logger: the load's cache line, the builder's end and the switch read as one story
# in the journal (the name is part of each line).
log = logging.getLogger("ktd.server.engine")


class WeightsManager:
    """Spawns and watches the builder of the engine's missing cache entry and switches the engine
    to it. Thread use: the builder's watch thread opens the entry; ``switch`` runs on the engine
    thread; ``status``, ``wait`` and ``on_ready`` on any thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.builder: subprocess.Popen | None = None
        self._state: dict[str, Any] = {"state": "none"}
        self._lock = threading.Condition()
        # The (model, context) opened from the entry, waiting for the engine thread.
        self._prepared: tuple[Any, Any] | None = None
        self._wake: Callable[[], None] | None = None
        self._closed = False

    @classmethod
    def start(cls, engine: Engine) -> "WeightsManager":
        """The daemon's: a manager for ``engine``; after a miss under weights_map: auto it starts
        the builder (state ``building``), otherwise it has nothing to do (state ``none``)."""
        manager = cls(engine)
        cache = engine.model.cache
        if cache["state"] == "absent":
            weights_cache.log_load(cache, building=True)
            manager._build(cache["path"])
        return manager

    def _build(self, entry: str) -> None:
        opts = self.engine.model_options
        self._state = {"state": "building", "from": "gguf", "to": "arena", "entry": entry}
        self.builder = cache_builder.spawn(self.engine.path, opts["cache_dir"], opts["n_threads"], opts)
        cache_builder.watch(self.builder, entry, on_end=self._builder_ended)

    # --- the builder's watch thread ---------------------------------------------------------

    def _builder_ended(self, ok: bool, why: str) -> None:
        """The entry is written (ok) or not: opens it as a warm start does, here, while the
        engine serves."""
        if not ok:
            self._failed(f"the background build failed: {why}")
            return
        with self._lock:
            if self._closed:
                return
            self._set(state="opening")
        t0 = time.monotonic()
        try:
            # auto: the entry mapped (a hit) or, whatever is wrong with it, the file (a miss).
            model = self.engine.open_model()
            c = model.cache
            if c["state"] != "hit":
                del model
                self._failed(f"the entry cannot be used: {c['reason'] or c['state']}")
                return
            context = self.engine.new_context(model)
        except Exception as e:  # GGUFError, OSError, MemoryError: the file or the entry changed under us
            self._failed(f"opening the entry failed: {type(e).__name__}: {e}")
            return
        with self._lock:
            if self._closed:
                return
            self._prepared = (model, context)
            log.info("weights map: the prepared entry %s is open (%.2f s, checksums verified); switching to it when "
                     "no request is in flight", c["path"], time.monotonic() - t0)
            self._set(state="ready", open_s=round(time.monotonic() - t0, 3))
            wake = self._wake
        if wake is not None:
            wake()

    def _failed(self, reason: str) -> None:
        with self._lock:
            if self._closed:
                return
            # Logged before the lock is released: whoever waits for "failed" finds the line written.
            log.warning("weights map: not switching to the prepared entry, serving from the model file until the "
                        "next start: %s", reason)
            self._set(state="failed", reason=reason)

    def _set(self, **fields: Any) -> None:
        # under _lock
        self._state = {**self._state, **fields}
        self._lock.notify_all()

    # --- the scheduler's side ---------------------------------------------------------------

    def on_ready(self, wake: Callable[[], None]) -> None:
        """Registers ``wake`` (the scheduler's; thread-safe and quick), called once the entry is
        open and waits for ``switch``, at once if it already does."""
        with self._lock:
            self._wake = wake
            ready = self._prepared is not None
        if ready:
            wake()

    def switch(self) -> bool:
        """Engine thread, no sequence in flight: the engine adopts the model and context opened
        from the entry (if any). Returns whether every KV slot is empty afterwards (the caller
        drops its prefix cache): the new context's KV cache starts empty. The file's model is
        released (its mapping unmapped once nothing refers to it). A backend that cannot be set
        on the new context leaves the old model serving (a device backend's KV cache is gone
        then too)."""
        with self._lock:
            prepared, self._prepared = self._prepared, None
        if prepared is None:
            return False
        model, context = prepared
        before = self.engine.model.memory["weights_map"]
        try:
            self.engine.adopt(model, context)
        except BackendNotMoved as e:
            self._failed(str(e))
            return e.kv_emptied
        after = self.engine.model.memory["weights_map"]
        with self._lock:
            log.info("weights map: switched from %s to %s (the prepared entry %s, %s); the model file's pages are "
                     "released; KV and prefix caches start empty", before, after, self._state.get("entry"),
                     "mapped" if model.cache.get("mapped") else "read")
            self._set(state="done", **{"from": before, "to": after,
                                       "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        return True

    # --- any thread -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``model.memory.weights_map_switch`` (a copy)."""
        with self._lock:
            return dict(self._state)

    def wait(self, states: tuple[str, ...] = ("ready", "done", "failed"),
             timeout: float | None = None) -> dict[str, Any]:
        """Until the state is one of ``states`` (tests; ``timeout`` s at most): the status."""
        with self._lock:
            self._lock.wait_for(lambda: self._state["state"] in states, timeout)
            return dict(self._state)

    def close(self) -> None:
        """Stops the builder (if it still runs) and drops a switch not yet made."""
        with self._lock:
            self._closed = True
            self._prepared = None
        b = self.builder
        if b is not None and b.poll() is None:
            b.terminate()
            try:
                b.wait(timeout=10)
            except subprocess.TimeoutExpired:
                b.kill()
                b.wait()

