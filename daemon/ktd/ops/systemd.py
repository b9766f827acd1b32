"""The daemon's only contact with systemd: sd_notify, socket activation, watchdog, journal.

Built on systemd-python (``systemd.daemon``, ``systemd.journal``; docs/OPERATIONS.md, "systemd-python"). Every
function is a no-op outside systemd (no NOTIFY_SOCKET / LISTEN_FDS / WATCHDOG_USEC /
JOURNAL_STREAM) and when systemd-python cannot be imported.
"""

from __future__ import annotations

import logging
import os
import socket
import time

try:
    from systemd import daemon as _daemon
except ImportError:  # the wrapper degrades to no-ops
    _daemon = None

try:
    from systemd import journal as _journal
except ImportError:
    _journal = None

log = logging.getLogger("ktd.ops.systemd")


def available() -> bool:
    return _daemon is not None


def notify(*lines: str) -> bool:
    """Send ``KEY=VALUE`` lines in one datagram; False outside systemd."""
    if _daemon is None or not os.environ.get("NOTIFY_SOCKET"):
        return False
    try:
        return bool(_daemon.notify("\n".join(lines)))
    except OSError as e:
        log.warning("sd_notify failed: %s", e)
        return False


def ready(status: str) -> bool:
    return notify("READY=1", f"STATUS={status}")


def status(text: str) -> bool:
    return notify(f"STATUS={text}")


def extend_timeout(seconds: float) -> bool:
    """During a long load: systemd waits this much longer for the next message (re-send each step)."""
    return notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")


def reloading() -> bool:
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify("RELOADING=1", f"MONOTONIC_USEC={usec}")


def stopping() -> bool:
    return notify("STOPPING=1")


def watchdog_ping() -> bool:
    return notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when not enabled.
    systemd-python has no watchdog helper; this follows sd_watchdog_enabled(3)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec:
        return None
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring invalid WATCHDOG_USEC=%r", usec)
        return None
    return value / 2e6 if value > 0 else None


def listen_sockets() -> list[tuple[socket.socket, str]]:
    """Listening sockets passed by socket activation (LISTEN_FDS/LISTEN_PID), with their names.

    The environment variables are removed so children do not inherit them. Empty outside
    socket activation or when LISTEN_PID names another process.
    """
    if _daemon is None or not os.environ.get("LISTEN_FDS"):
        return []
    try:
        pairs = _daemon.listen_fds_with_names(True)
    except (AttributeError, TypeError):  # older systemd-python: no names
        pairs = {fd: "unknown" for fd in _daemon.listen_fds(True)}
    out = []
    for fd, name in (pairs.items() if isinstance(pairs, dict) else pairs):
        sock = socket.socket(fileno=fd)
        out.append((sock, name or "unknown"))
    return out


def under_journal() -> bool:
    """stderr is connected to the journal: JOURNAL_STREAM names its device:inode (systemd.exec(5);
    a shell redirect under a unit changes stderr and then plain lines are right)."""
    value = os.environ.get("JOURNAL_STREAM")
    if not value or _journal is None:
        return False
    try:
        dev, ino = (int(v) for v in value.split(":"))
        st = os.fstat(2)
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def log_handler(identifier: str = "ktd") -> logging.Handler:
    """JournalHandler (structured fields from ``extra=``) under systemd, else stderr."""
    if under_journal():
        return _journal.JournalHandler(SYSLOG_IDENTIFIER=identifier)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s {identifier} %(levelname)s %(name)s: %(message)s"))
    return handler
