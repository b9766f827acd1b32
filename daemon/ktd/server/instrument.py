"""What the daemon reports about itself: the ``status`` document, the ``metrics`` text
(Prometheus exposition 0.0.4), the systemd STATUS= line, and the /proc readers behind them.

The builders are pure (they take the numbers, not the daemon); ``Instrument`` gathers the numbers
from the engine, the scheduler and the request counters, with the /proc readers as constructor
parameters so that tests can give it their own.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ktd import __version__

from ktd.server import protocol
from ktd.server.engine_api import Engine
from ktd.server.scheduler import Scheduler

# /proc/meminfo lines status shows (prefixes), /proc/self/smaps_rollup lines (exact keys)
_MEMINFO_KEYS = ("HugePages_", "Hugepagesize", "AnonHugePages", "MemTotal", "MemAvailable")
_SMAPS_KEYS = frozenset({"Rss", "Private_Hugetlb", "Shared_Hugetlb", "AnonHugePages", "FilePmdMapped"})


def _kib_fields(lines: Iterable[str], wanted: Callable[[str], bool]) -> dict[str, int]:
    """``Key:  <n> kB`` lines as {key: bytes}; a value without a unit (HugePages_Total) is a count."""
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and wanted(key):
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def parse_meminfo(lines: Iterable[str]) -> dict[str, int]:
    """The system memory fields status shows, from /proc/meminfo lines (bytes; page counts)."""
    return _kib_fields(lines, lambda key: key.startswith(_MEMINFO_KEYS))


def parse_smaps_rollup(lines: Iterable[str]) -> dict[str, int]:
    """This process's resident and huge-page memory, bytes, from /proc/self/smaps_rollup lines."""
    return _kib_fields(lines, _SMAPS_KEYS.__contains__)


def _read_lines(path: str, parse: Callable[[Iterable[str]], dict[str, int]]) -> dict[str, int]:
    with contextlib.suppress(OSError), open(path) as f:
        return parse(f)
    return {}  # not Linux, or /proc not mounted: status shows nothing rather than failing


def read_meminfo() -> dict[str, int]:
    return _read_lines("/proc/meminfo", parse_meminfo)


def read_smaps_rollup() -> dict[str, int]:
    return _read_lines("/proc/self/smaps_rollup", parse_smaps_rollup)


@dataclass(frozen=True)
class ServerFacts:
    """What the lifecycle and the connections know, for status and the STATUS= line."""

    state: str                  # starting, serving, reloading, stopping
    socket: str
    activated: bool
    connections: int
    reloads: int
    uptime_s: float


def _switch_note(info: Mapping[str, Any]) -> str:
    """The weights switch (model.weights_map: auto after a miss) while it is pending or failed."""
    sw = (info.get("memory") or {}).get("weights_map_switch") or {}
    state = sw.get("state", "none")
    if state in ("building", "opening", "ready"):
        return f", weights {sw.get('from')} ({state} {sw.get('to')})"
    if state == "failed":
        return f", weights {sw.get('from')} (switch to {sw.get('to')} failed)"
    return ""


def status_line(server: ServerFacts, model_name: str, stats: Mapping[str, Any],
                info: Mapping[str, Any] | None = None) -> str:
    """systemd's STATUS= while serving: one line for ``systemctl status`` (``info``: the engine's,
    for a pending weights switch)."""
    extra = f", reloads={server.reloads}" if server.reloads else ""
    extra += _switch_note(info or {})
    act = " (socket-activated)" if server.activated else ""
    return (f"{server.state} {model_name} on {server.socket}{act}: {stats['slots_in_use']}/"
            f"{stats['slots_total']} slots, {stats['queued']} queued, {stats['tokens_per_s']:.1f} tok/s{extra}")


def status_document(server: ServerFacts, *, pid: int, info: Mapping[str, Any], stats: Mapping[str, Any],
                    n_ctx: int, prefill_tokens_per_step: int, limits: protocol.Limits,
                    process_memory: dict[str, int], system_memory: dict[str, int],
                    affinity: int) -> dict[str, Any]:
    """The ``status`` result (docs/PROTOCOL.md): plain msgpack-able values."""
    return {
        "server": {"version": __version__, "protocol": protocol.PROTOCOL_VERSION, "pid": pid,
                   "state": server.state, "uptime_s": round(server.uptime_s, 3),
                   "socket": server.socket, "socket_activated": server.activated,
                   "connections": server.connections, "reloads": server.reloads},
        "model": info,
        "scheduler": {**stats, "n_ctx": n_ctx, "prefill_tokens_per_step": prefill_tokens_per_step},
        "memory": {"process": process_memory, "system": system_memory,
                   "hugepages": (info.get("memory") or {}).get("hugepages"),
                   # model.weights_map as loaded, and the bytes served from the model file's mapping
                   "weights_map": (info.get("memory") or {}).get("weights_map"),
                   "file_mapped_bytes": (info.get("memory") or {}).get("file_mapped_bytes")},
        "cpu": {"affinity": affinity, "isa": info.get("isa"), "threads": info.get("threads"),
                "numa": info.get("numa")},
        "gpu": info.get("gpu") or {"backend": "cpu", "device": None},
        "limits": dict(vars(limits)),
    }


def loading_status_document(server: ServerFacts, *, pid: int, path: str, loading: Mapping[str, Any]) -> dict[str, Any]:
    """The ``status`` result while the model loads: the server part, the model's path and the
    load's progress (docs/PROTOCOL.md); the engine's parts come once it serves."""
    return {
        "server": {"version": __version__, "protocol": protocol.PROTOCOL_VERSION, "pid": pid,
                   "state": server.state, "uptime_s": round(server.uptime_s, 3),
                   "socket": server.socket, "socket_activated": server.activated,
                   "connections": server.connections, "reloads": server.reloads},
        "model": {"path": path or "", "name": os.path.basename(path or "")},
        "loading": dict(loading),
    }


class _Exposition:
    """Prometheus text lines: ``# HELP``, ``# TYPE`` and the samples of each metric."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        self.lines.append(f"# HELP ktd_{name} {help}")
        self.lines.append(f"# TYPE ktd_{name} {kind}")
        for labels, value in samples:
            self.lines.append(f"ktd_{name}{labels} {value:g}" if isinstance(value, float)
                              else f"ktd_{name}{labels} {value}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def by_prefix(counter: Mapping[str, int], prefix: str, label: str) -> list[tuple[str, float]]:
    """The counters named ``<prefix><value>`` as samples labelled ``{label="<value>"}``, sorted."""
    return [(f'{{{label}="{k[len(prefix):]}"}}', v) for k, v in sorted(counter.items())
            if k.startswith(prefix)]


def loading_metrics_text(*, requests: Mapping[str, int], connections: int, fraction: float | None) -> str:
    """The metrics while the model loads: ktd_up 0, the load's progress and the request counters."""
    m = _Exposition()
    m.add("up", "gauge", "1 while serving", [("", 0)])
    m.add("loading_progress", "gauge", "fraction of the model load done (while loading)",
          [("", float(fraction or 0.0))])
    m.add("requests_total", "counter", "requests received, by method", by_prefix(requests, "requests_", "method"))
    m.add("errors_total", "counter", "error responses, by code", by_prefix(requests, "errors_", "code"))
    m.add("connections", "gauge", "open client connections", [("", connections)])
    return m.text()


def metrics_text(*, up: bool, requests: Mapping[str, int], scheduler: Mapping[str, int],
                 stats: Mapping[str, Any], seconds: Mapping[str, float], connections: int) -> str:
    """Prometheus text exposition (version 0.0.4). ``requests``: the server's counters
    (requests_<method>, errors_<code>, rejected_<reason>); ``scheduler``: the scheduler's
    (finished_<reason>, generated_tokens, prompt_tokens); ``seconds``: step, forward, sample."""
    m = _Exposition()
    m.add("up", "gauge", "1 while serving", [("", 1 if up else 0)])
    m.add("requests_total", "counter", "requests received, by method", by_prefix(requests, "requests_", "method"))
    m.add("errors_total", "counter", "error responses, by code", by_prefix(requests, "errors_", "code"))
    m.add("rejected_connections_total", "counter", "connections refused, by reason",
          by_prefix(requests, "rejected_", "reason"))
    m.add("generate_finished_total", "counter", "generate requests ended, by reason",
          by_prefix(scheduler, "finished_", "reason"))
    m.add("generated_tokens_total", "counter", "tokens sampled", [("", scheduler.get("generated_tokens", 0))])
    m.add("prompt_tokens_total", "counter", "prompt tokens prefilled", [("", scheduler.get("prompt_tokens", 0))])
    m.add("steps_total", "counter", "engine batch steps", [("", stats["steps"])])
    m.add("step_seconds_total", "counter", "engine thread time in batch steps (batch assembly, "
          "forward, sampling, hand-off)", [("", float(seconds["step"]))])
    m.add("forward_seconds_total", "counter", "time spent in engine forward", [("", float(seconds["forward"]))])
    m.add("sample_seconds_total", "counter", "time spent sampling, detokenizing and handing "
          "results to the event loop", [("", float(seconds["sample"]))])
    m.add("tokens_per_second", "gauge", "generated tokens per second (10 s window)",
          [("", float(stats["tokens_per_s"]))])
    m.add("slots_in_use", "gauge", "KV slots holding a sequence", [("", stats["slots_in_use"])])
    m.add("slots_total", "gauge", "KV slots", [("", stats["slots_total"])])
    m.add("queue_length", "gauge", "requests waiting for a slot", [("", stats["queued"])])
    pc = stats.get("prefix_cache") or {}
    m.add("prefix_cache_hits_total", "counter", "generate requests that started from a cached prefix",
          [("", pc.get("hits", 0))])
    m.add("prefix_cache_misses_total", "counter", "generate requests that found no cached prefix "
          "(prefix cache on, cache_prompt true)", [("", pc.get("misses", 0))])
    m.add("prefix_cache_evictions_total", "counter", "cached sequences evicted (slots or max_bytes)",
          [("", pc.get("evictions", 0))])
    m.add("prefix_cache_cached_tokens_total", "counter", "prompt tokens taken from the prefix cache "
          "instead of computed", [("", pc.get("cached_tokens", 0))])
    m.add("prefix_cache_bytes", "gauge", "KV bytes held by the prefix cache", [("", pc.get("bytes_held", 0))])
    m.add("prefix_cache_entries", "gauge", "sequences held by the prefix cache", [("", pc.get("entries", 0))])
    m.add("connections", "gauge", "open client connections", [("", connections)])
    return m.text()


class Instrument:
    """Status, metrics and the STATUS= line of a serving daemon, from its engine, scheduler and
    request counters (``counters``: shared with the connections, which count into it)."""

    def __init__(self, engine: Engine, scheduler: Scheduler, counters: Counter[str], *,
                 read_process_memory: Callable[[], dict[str, int]] = read_smaps_rollup,
                 read_system_memory: Callable[[], dict[str, int]] = read_meminfo,
                 affinity: Callable[[], int] = lambda: len(os.sched_getaffinity(0)),
                 model_info: Callable[[], dict[str, Any]] | None = None):
        self.engine, self.scheduler, self.counters = engine, scheduler, counters
        # The status document's ``model`` (the daemon's adds the weights switch to the engine's info).
        self._model_info = model_info or engine.info
        self._read_process_memory = read_process_memory
        self._read_system_memory = read_system_memory
        self._affinity = affinity

    def status_line(self, server: ServerFacts) -> str:
        info = self._model_info()
        return status_line(server, info.get("name", "model"), self.scheduler.stats(), info)

    def status(self, server: ServerFacts, limits: protocol.Limits) -> dict[str, Any]:
        return status_document(server, pid=os.getpid(), info=self._model_info(), stats=self.scheduler.stats(),
                               n_ctx=self.engine.n_ctx,
                               prefill_tokens_per_step=self.scheduler.prefill_tokens_per_step,
                               limits=limits, process_memory=self._read_process_memory(),
                               system_memory=self._read_system_memory(), affinity=self._affinity())

    def metrics(self, *, up: bool, connections: int) -> str:
        s = self.scheduler
        return metrics_text(up=up, requests=self.counters, scheduler=s.counters, stats=s.stats(),
                            seconds={"step": s.step_seconds, "forward": s.forward_seconds,
                                     "sample": s.sample_seconds},
                            connections=connections)
