"""The daemon's lifecycle: load, serve, reload, drain, stop.

The parts it composes: ``sockets`` (the listening socket), ``connections`` (clients, requests,
generate streams), ``scheduler`` (the engine thread), ``weights`` (the switch to prepared weights
after a weights_map: auto miss), ``instrument`` (status, metrics, STATUS=).
One process serves one model. The event loop owns the sockets and never blocks: the model runs
on the scheduler's engine thread, tokenization in the default executor. Lifecycle (docs/OPERATIONS.md):
bind or inherit the socket and accept → load the model (STATUS=/EXTEND_TIMEOUT_USEC= progress;
meanwhile ``health``/``status``/``metrics`` report the load's progress and every other method gets
the typed ``loading`` error) → start the engine thread → serve every method → READY=1; SIGHUP reloads the live keys (RELOADING=1 … READY=1); SIGTERM
sends STOPPING=1, stops accepting, lets running requests finish for ``drain_timeout_s``, cancels
the rest, answers them, and exits 0. SIGTERM during the load sends STOPPING=1 and exits 0 at
once, without waiting for the load; SIGHUP during the load is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ktd.ops import config as config_mod, routing_profile, systemd
from ktd.server.connections import READ_CHUNK, Connections, Policy, loop_delivery
from ktd.server.engine_api import Engine, EngineFactory, WeightsFactory, WeightsSwitch, model_info
from ktd.server.instrument import Instrument, ServerFacts, loading_metrics_text, loading_status_document
from ktd.ops.routing_profile import RoutingProfile
from ktd.server.scheduler import Scheduler
from ktd.server.sockets import StartupError, listening_socket

__all__ = ["Daemon", "StartupError", "StoppedDuringLoad", "serve", "setup_logging"]

log = logging.getLogger("ktd.server.daemon")

_LOAD_EXTEND_S = 120.0      # EXTEND_TIMEOUT_USEC sent with each loading progress report
_STATUS_EVERY_S = 5.0       # STATUS= serving summary refresh


class StoppedDuringLoad(Exception):
    """SIGTERM/SIGINT arrived while the model was loading: the daemon stops (exit 0) without
    waiting for the load, which runs in native code that cannot be interrupted."""


class Daemon:
    """The lifecycle: start (socket, load, engine thread, accept), reload, drain, stop. Requests
    are the ``Connections``'; what the daemon reports, the ``Instrument``'s."""

    def __init__(self, config: config_mod.Config, engine_factory: EngineFactory, *,
                 weights_factory: WeightsFactory | None = None, config_path: str | None = None,
                 socket_path: str | None = None):
        self.config = config
        self.config_path = config_path
        self.socket_path = socket_path or config.server.socket
        self.engine_factory = engine_factory
        self.weights_factory = weights_factory
        self.engine: Engine | None = None
        self.weights: WeightsSwitch | None = None
        self.scheduler: Scheduler | None = None
        self.connections: Connections | None = None
        self.instrument: Instrument | None = None
        self.counters: Counter[str] = Counter()   # requests_, errors_, rejected_ (the connections')
        self.reloads = 0
        self.activated = False
        self.state = "starting"
        self.started = time.monotonic()
        self._stop = asyncio.Event()
        self._policy = Policy.from_config(config)
        self._last_status = ""
        self.profile: RoutingProfile | None = None
        # The load's progress while state is "loading" (health, status, the loading error's data).
        self._loading: dict[str, Any] = {"phase": "starting", "text": "", "fraction": None}
        self._load_started = time.monotonic()

    # --- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        sc = self.config.server
        sock, self.socket_path, self.activated = listening_socket(self.socket_path, sc.socket_mode,
                                                                  sc.socket_group)
        # A stop request during the load (systemctl stop while starting) ends the daemon at once;
        # a reload request then has nothing to reload yet (SIGHUP must not kill the process).
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: log.info("reload ignored: the model is loading"))
        # Accepting from the start: health/status/metrics answer with the load's progress, the
        # other methods get ``loading`` until the engine is attached below.
        self.state = "loading"
        self.connections = Connections(None, None, self._policy, self.counters,
                                       {"health": self.health, "status": self.status, "metrics": self.metrics},
                                       loading=self.loading_progress)
        server = await asyncio.start_unix_server(self.connections.accept, sock=sock, limit=READ_CHUNK)
        try:
            self.engine, self.weights = await self._load(loop)
        except BaseException:
            server.close()
            sock.close()
            self._unlink_own_socket()
            raise
        self.scheduler = Scheduler(self.engine,
                                   prefill_tokens_per_step=self.config.scheduler.prefill_tokens_per_step,
                                   max_queue=sc.max_queue, deliver=loop_delivery(loop),
                                   prefix_cache_bytes=self.config.prefix_cache.max_bytes, weights=self.weights)
        self.instrument = Instrument(self.engine, self.scheduler, self.counters, model_info=self.model_info)
        self.profile = self._open_profile()
        introspect = {"health": self.health, "status": self.status, "metrics": self.metrics}
        if self.profile is not None:
            introspect["profile"] = self._profile_answer
        self.scheduler.start()
        self.connections.attach(self.engine, self.scheduler, introspect, model_info=self.model_info)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self._reload()))
        self.state = "serving"
        systemd.ready(self._status_text())
        log.info("serving on %s%s", self.socket_path, " (socket-activated)" if self.activated else "")
        background = [loop.create_task(self._status_loop())]
        if self.profile is not None:
            background.append(loop.create_task(self._profile_loop()))
        interval = systemd.watchdog_interval()
        if interval:
            background.append(loop.create_task(self._watchdog_loop(interval)))
        await self._stop.wait()
        await self._shutdown(server)
        for t in background:
            t.cancel()
        return 0

    def _unlink_own_socket(self) -> None:
        if not self.activated:
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)

    async def _load(self, loop: asyncio.AbstractEventLoop) -> tuple[Engine, WeightsSwitch | None]:
        def progress(what: str, fraction: float | None, **detail: Any) -> None:
            # detail (the real engine's): phase, done_bytes, total_bytes
            text = f"loading: {what}" + (f" ({fraction:.0%})" if fraction is not None else "")
            with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is stopping
                loop.call_soon_threadsafe(self._report_progress, text, what, fraction, detail)

        def settle(result: Any, error: BaseException | None) -> None:
            if not loaded.done():
                if error is None:
                    loaded.set_result(result)
                else:
                    loaded.set_exception(error)

        def load() -> None:
            try:
                engine = self.engine_factory(self.config, progress)
                weights = self.weights_factory(engine) if self.weights_factory else None
            except BaseException as e:  # handed to the event loop
                result, error = None, e
            else:
                result, error = (engine, weights), None
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, error)

        systemd.notify("STATUS=loading model", f"EXTEND_TIMEOUT_USEC={int(_LOAD_EXTEND_S * 1e6)}")
        log.info("loading model %s", self.config.model.path)
        # A daemon thread, not the executor: a stop during the load must not wait for it.
        loaded: asyncio.Future[tuple[Engine, WeightsSwitch | None]] = loop.create_future()
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
            engine, weights = loaded.result()
        except StartupError:
            raise
        except Exception as e:  # GGUFError, ResourceError, OSError ...: one line for the operator
            log.debug("model load failed", exc_info=True)
            raise StartupError(f"cannot load the model: {e}") from None
        log.info("model loaded: %s", engine.info().get("name", "?"))
        return engine, weights

    def _open_profile(self) -> RoutingProfile | None:
        """The routing profile of a MoE model (model.routing_profile), before serving starts (the
        engine is idle: its counts can be read here)."""
        where = self.config.model.routing_profile
        counts = getattr(self.engine, "expert_counts", None)
        if where == "off" or counts is None or not self.config.model.path:
            return None
        shape = tuple(int(x) for x in np.shape(counts()))
        if len(shape) != 2 or shape[1] == 0:
            return None  # a dense model
        directory = routing_profile.default_dir() if where == "auto" else Path(where)
        try:
            key = routing_profile.model_key(self.config.model.path)
        except (OSError, ValueError) as e:
            log.warning("routing profile disabled: %s", e)
            return None
        return RoutingProfile(directory, key, shape)  # type: ignore[arg-type]

    async def _profile_loop(self) -> None:
        assert self.profile is not None
        while True:
            await asyncio.sleep(routing_profile.SAVE_EVERY_S)
            self.profile.update(self.engine.expert_snapshot())
            await asyncio.to_thread(self.profile.save)

    def _profile_answer(self, reset: bool) -> dict[str, Any]:
        assert self.profile is not None
        self.profile.update(self.engine.expert_snapshot())
        if reset:
            self.profile.reset()
            self.profile.save()
            log.info("routing profile reset by a client")
        return {"enabled": True, **self.profile.summary()}

    def _report_progress(self, text: str, what: str = "", fraction: float | None = None,
                         detail: dict[str, Any] | None = None) -> None:
        self._loading = {"phase": (detail or {}).get("phase", "loading"), "text": what,
                         "fraction": None if fraction is None else round(float(fraction), 4),
                         **{k: int(v) for k, v in (detail or {}).items() if k in ("done_bytes", "total_bytes")}}
        log.info("%s", text)
        systemd.notify(f"STATUS={text}", f"EXTEND_TIMEOUT_USEC={int(_LOAD_EXTEND_S * 1e6)}")

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
            elif not self.scheduler.alive:
                log.error("the engine thread has ended: watchdog not fed")
            else:
                log.error("engine made no progress for %.1f s with work pending: watchdog not fed",
                          interval)
            await asyncio.sleep(interval)

    async def _reload(self) -> None:
        systemd.reloading()
        self.state = "reloading"
        try:
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
        self._policy = Policy.from_config(self.config)
        logging.getLogger("ktd").setLevel(self.config.logging.level.upper())
        assert self.scheduler is not None and self.connections is not None
        self.connections.policy = self._policy
        self.scheduler.reconfigure(prefill_tokens_per_step=self.config.scheduler.prefill_tokens_per_step,
                                   max_queue=self.config.server.max_queue)
        self.reloads += 1
        self.state = "serving"
        log.info("reloaded configuration (%s)", ", ".join(live) or "no live key changed")
        systemd.ready(self._status_text())

    async def _shutdown(self, server: asyncio.AbstractServer) -> None:
        assert self.scheduler is not None and self.connections is not None
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
        await self.connections.close(timeout=5.0)  # the cancelled requests' answers go out first
        self.scheduler.stop(timeout=10.0)
        if self.weights is not None:
            self.weights.close()  # the background weights build, if one still runs
        if self.profile is not None:
            # The engine thread has ended: the counts are read directly, and written once more.
            self.profile.update(self.engine.expert_counts())
            self.profile.save()
        self._unlink_own_socket()
        log.info("stopped")

    # --- introspection (the instrument's reports, with what only the lifecycle knows) ---------

    def _facts(self) -> ServerFacts:
        return ServerFacts(state=self.state, socket=self.socket_path, activated=self.activated,
                           connections=self.connections.count if self.connections else 0,
                           reloads=self.reloads, uptime_s=time.monotonic() - self.started)

    def _status_text(self) -> str:
        if self.instrument is None:
            return self.state
        return self.instrument.status_line(self._facts())

    def model_info(self) -> dict[str, Any]:
        """``model`` in hello and status."""
        assert self.engine is not None
        return model_info(self.engine, self.weights)

    def loading_progress(self) -> dict[str, Any]:
        """The load's progress (``loading`` in health and status, the ``loading`` error's data)."""
        return {**self._loading, "elapsed_s": round(time.monotonic() - self._load_started, 3)}

    def health(self) -> dict[str, Any]:
        if self.scheduler is None:
            return {"status": self.state, "loading": self.loading_progress()}
        if not self.scheduler.alive and self.state == "serving":
            # the engine thread ended (it raised): nothing will run again; the watchdog is not
            # fed, and systemd restarts the daemon
            return {"status": "unhealthy"}
        return {"status": "ok" if self.state == "serving" else self.state}

    def status(self) -> dict[str, Any]:
        if self.instrument is None:  # loading
            return loading_status_document(self._facts(), pid=os.getpid(), path=self.config.model.path,
                                           loading=self.loading_progress())
        return self.instrument.status(self._facts(), self._policy.limits)

    def metrics(self) -> dict[str, Any]:
        assert self.connections is not None
        if self.instrument is None:  # loading
            return {"text": loading_metrics_text(requests=self.counters, connections=self.connections.count,
                                                 fraction=self._loading.get("fraction"))}
        return {"text": self.instrument.metrics(up=self.state == "serving",
                                                connections=self.connections.count)}


def setup_logging(level: str) -> None:
    root = logging.getLogger("ktd")
    root.handlers[:] = [systemd.log_handler()]
    root.setLevel(level.upper())
    root.propagate = False


def serve(config: config_mod.Config, engine_factory: EngineFactory, *, config_path: str | None,
          socket_path: str | None = None, weights_factory: WeightsFactory | None = None) -> int:
    """Run the daemon until SIGTERM; returns the exit status. Raises StartupError."""
    setup_logging(config.logging.level)
    daemon = Daemon(config, engine_factory, weights_factory=weights_factory, config_path=config_path,
                    socket_path=socket_path)
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
