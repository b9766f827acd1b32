"""The prepared-weights cache as the operator sees it: where it lives (``model.weights_cache``),
what the load did with it (one log line), and ``ktd cache list|prune|verify``.

The entries themselves are written, checked and read by the native loader
(native/src/model/weights_cache.h): one ``*.ktdw`` file per model and placement, keyed by the
model file's identity (real path, size, mtime, a checksum of its header), the native build and
the layout choices; a stale, truncated or corrupted entry is never used and is rebuilt.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ktd.ops import file_trust

log = logging.getLogger("ktd.server.engine")

SUFFIX = ".ktdw"
TMP_MARK = SUFFIX + ".tmp-"
TMP_STALE_S = 3600.0  # a temporary file older than this is left over from a crash


def default_dir() -> str:
    """``auto``: systemd's CacheDirectory= ($CACHE_DIRECTORY, /var/cache/ktd in the package), else
    $XDG_CACHE_HOME/ktd/weights (~/.cache/ktd/weights)."""
    if os.environ.get("CACHE_DIRECTORY"):
        return os.environ["CACHE_DIRECTORY"].split(":")[0]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ktd", "weights")


def configured_dir(value: str) -> str | None:
    """The directory of a ``model.weights_cache`` value; None when it is off."""
    if value == "off":
        return None
    return default_dir() if value == "auto" else value


def prepare_dir(value: str) -> tuple[str, str]:
    """(directory to pass to the loader or "" for none, why none). Creates an ``auto`` directory
    (0750); a missing or unusable configured one is reported, not created elsewhere. A directory
    others control (ktd.ops.file_trust: not this user's or root's, or writable by group or
    others) is not used at all: whoever may write it could plant an entry with valid checksums.
    One this process may not write is still read (root's entries; the loader says why none is
    written)."""
    d = configured_dir(value)
    if d is None:
        return "", "model.weights_cache is off"
    try:
        if value == "auto":
            os.makedirs(d, mode=0o750, exist_ok=True)
        if not os.path.isdir(d):
            return "", f"{d} is not a directory"
    except OSError as e:
        return "", f"cannot create {d}: {e.strerror}"
    why = file_trust.directory_problem(d)
    if why:
        return "", f"not used: {why}"
    return d, ""


def log_load(cache: dict[str, Any], why_off: str = "", building: bool = True) -> None:
    """One log line: what the load did with the cache (``building``: an auto miss starts the
    background build)."""
    state, reason = cache["state"], cache["reason"]
    size = f"{cache['bytes'] / (1 << 20):.0f} MiB"
    if state == "off":
        log.info("prepared-weights cache: off (%s)", why_off or reason or "not configured")
    elif state == "writing":
        log.info("prepared-weights cache: %swriting %s in the background",
                 f"rebuilding ({reason}), " if reason else "", cache["path"])
    elif state == "absent" and building:
        log.info("prepared-weights cache: no entry (%s); weights_map: auto serves from the model file now and "
                 "prepares %s in a background process (nice 19, SCHED_IDLE), then switches to it", reason or "miss",
                 cache["path"])
    elif state == "absent":
        log.info("prepared-weights cache: no entry (%s); weights_map: auto serves from the model file now "
                 "(no background build here; `ktd run --prepare` or `ktd inspect --prepare` writes %s)",
                 reason or "miss", cache["path"])
    elif state == "hit":
        log.info("prepared-weights cache: read %s%s in %.2f s from %s", size,
                 " (mapped: the page cache's pages, not copied)" if cache.get("mapped") else "", cache["seconds"],
                 cache["path"])
    elif state == "written" and cache.get("direct"):
        log.info("prepared-weights cache: %swritten while preparing (%s, checksummed in %.2f s) to %s; "
                 "the weights are served from its pages", f"rebuilt ({reason}), " if reason else "", size,
                 cache["seconds"], cache["path"])
    elif state == "written":
        log.info("prepared-weights cache: %swritten (%s in %.2f s) to %s",
                 f"rebuilt ({reason}), " if reason else "", size, cache["seconds"], cache["path"])
    else:
        log.warning("prepared-weights cache: running without it: %s", reason)


def log_when_written(model: Any, period_s: float = 1.0) -> threading.Thread:
    """Logs the end of a background write (a daemon thread polling ``model.cache``)."""
    def wait() -> None:
        while model.cache["state"] == "writing":
            time.sleep(period_s)
        log_load(model.cache)

    t = threading.Thread(target=wait, name="ktd-cache-write", daemon=True)
    t.start()
    return t


def entries(directory: str) -> list[dict[str, Any]]:
    """Every entry of a cache directory with its header (ok, problem, key, file_bytes) and, for
    a readable one, whether it is current: its model still has the size and mtime it was built
    from, and it was built by this native module."""
    from ktd import _native

    out = []
    build_id = _native.native_build_id()
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    dir_problem = file_trust.directory_problem(directory)
    for name in names:
        path = os.path.join(directory, name)
        if name.endswith(SUFFIX):
            h = _native.weights_cache_header(path)
            st = os.lstat(path)
            e = {"path": path, "bytes": st.st_size, **h, "stale": "",
                 "untrusted": dir_problem or ("a symbolic link" if os.path.islink(path) else "")
                 or file_trust.problem(st, "the entry")}
            if h["ok"]:
                e["stale"] = _staleness(h["key"], build_id)
            out.append(e)
        elif TMP_MARK in name:
            st = os.stat(path)
            out.append({"path": path, "bytes": st.st_size, "ok": False, "key": {}, "stale": "", "untrusted": "",
                        "problem": "temporary file (a write in progress, or left by a crash)",
                        "tmp_age_s": time.time() - st.st_mtime})
    return out


def _staleness(key: dict[str, str], build_id: str) -> str:
    model = key.get("model", "")
    try:
        st = os.stat(model)
    except OSError as e:
        return f"the model {model} is gone ({e.strerror})"
    if str(st.st_size) != key.get("size") or str(st.st_mtime_ns) != key.get("mtime_ns"):
        return f"the model {model} has changed since"
    if key.get("build_id") != build_id:
        return "built by another ktd build"
    return ""


def for_model(directory: str | None, model: str) -> list[dict[str, Any]]:
    """The readable entries of a model file (by real path)."""
    if not directory:
        return []
    real = os.path.realpath(model)
    return [e for e in entries(directory) if e["ok"] and e["key"].get("model") == real]


def prune(directory: str, everything: bool = False) -> list[tuple[str, int, str]]:
    """Removes unusable entries (unreadable, stale, temporary files older than an hour), or all
    with ``everything``. Returns (path, bytes, why) of each removed. An entry unusable only
    because this user may not trust it (another user's, as root sees the daemon's) is left to
    its owner: its load replaces it, ``--all`` removes it."""
    removed = []
    for e in entries(directory):
        why = "all requested" if everything else ("" if e["untrusted"] else (e["problem"] or e["stale"]))
        if not why or ("tmp_age_s" in e and not everything and e["tmp_age_s"] < TMP_STALE_S):
            continue
        try:
            os.unlink(e["path"])
        except FileNotFoundError:
            continue
        removed.append((e["path"], e["bytes"], why))
    return removed


def verify(directory: str) -> list[tuple[str, str]]:
    """(path, "" or the first problem) for every entry: the header and every checksum."""
    from ktd import _native

    return [(str(p), _native.weights_cache_verify(str(p))) for p in sorted(Path(directory).glob("*" + SUFFIX))]
