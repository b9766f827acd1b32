"""Lifecycle under a fake systemd: NOTIFY_SOCKET (a datagram socket bound here), LISTEN_FDS set
via `exec` (docs/DEVELOPMENT.md, "Testing the systemd integration"), WATCHDOG_USEC, SIGHUP
reload, SIGTERM drain."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import stat
import sys
import time

import pytest

from daemon_helpers import LAUNCHER, DaemonProcess, NotifySocket, wait_for
from ktd.client import Cancelled, Client, TooLarge


def activated_command(d: DaemonProcess, fd: int) -> list[str]:
    """bash puts the listening socket on fd 3 and execs the daemon, so LISTEN_PID=$$ is its pid."""
    script = f'exec 3<&{fd} {fd}<&-; LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=ktd.socket exec "$0" "$@"'
    return ["bash", "-c", script, sys.executable, LAUNCHER, json.dumps(d.fake), "--", "serve",
            "--config", d.config_path]


def test_socket_activation_ready_watchdog_reload_and_drain():
    d = DaemonProcess(fake={"step_delay_s": 0.01, "load_steps": 4, "load_delay_s": 0.4},
                      server={"drain_timeout_s": 1.0},
                      env={"WATCHDOG_USEC": "200000"})
    notify = NotifySocket(os.path.join(d.dir, "notify"))
    d.env["NOTIFY_SOCKET"] = notify.path
    act_path = os.path.join(d.dir, "act.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(act_path)
    listener.listen(16)
    fd = fcntl.fcntl(listener.fileno(), fcntl.F_DUPFD, 10)  # not 3: `exec 3<&3 3<&-` would close it
    try:
        proc = d.spawn(activated_command(d, fd), pass_fds=(fd,))
        os.close(fd)
        ready = notify.wait("READY", "1")
        before = notify.messages[:ready]
        assert any(m.get("STATUS", "").startswith("loading") for _, m in before)
        assert any("EXTEND_TIMEOUT_USEC" in m for _, m in before)
        assert "(socket-activated)" in notify.messages[ready][1]["STATUS"]
        assert not os.path.exists(d.socket)  # the configured path was not bound
        with Client(act_path) as c:
            st = c.status()["server"]
            assert st["socket_activated"] is True and st["pid"] == proc.pid
        # watchdog pings from the event loop, every WATCHDOG_USEC/2, only after READY
        assert notify.index("WATCHDOG", "1") > ready
        assert wait_for(lambda: sum(1 for t, m in notify.messages if "WATCHDOG" in m) >= 3, 10)

        # SIGHUP: a live key (limits.max_tokens) applies, a restart-only key (model.n_ctx) is kept
        d.write_config(limits={"max_tokens": 10}, model={"n_ctx": 512})
        mark = len(notify.messages)
        proc.send_signal(signal.SIGHUP)
        i = notify.wait("RELOADING", "1", start=mark)
        assert int(notify.messages[i][1]["MONOTONIC_USEC"]) > 0
        j = notify.wait("READY", "1", start=i)
        assert "reloads=1" in notify.messages[j][1]["STATUS"]
        with Client(act_path) as c:
            with pytest.raises(TooLarge):
                c.generate("x", max_tokens=11)
            assert c.hello()["n_ctx"] == 256
        assert "model.n_ctx changed but needs a restart" in d.log()
        # an invalid file: the running configuration stays, READY=1 says why
        d.sections["bogus"] = {"x": 1}
        d.write_config()
        del d.sections["bogus"]
        mark = len(notify.messages)
        proc.send_signal(signal.SIGHUP)
        k = notify.wait("READY", "1", start=notify.wait("RELOADING", "1", start=mark))
        assert "reload failed" in notify.messages[k][1]["STATUS"] and "bogus" in notify.messages[k][1]["STATUS"]
        with Client(act_path) as c:
            with pytest.raises(TooLarge):
                c.generate("x", max_tokens=11)

        # SIGTERM: STOPPING=1, the short request finishes, the long one is cancelled, exit 0
        short, long_ = Client(act_path), Client(act_path)
        d.write_config(limits={"max_tokens": 4096})
        mark = len(notify.messages)
        proc.send_signal(signal.SIGHUP)
        notify.wait("READY", "1", start=notify.wait("RELOADING", "1", start=mark))
        s_long = long_.stream("b", max_tokens=250, ignore_eos=True)  # ~2.5 s > drain_timeout_s
        next(iter(s_long))
        s_short = short.stream("a", max_tokens=30, ignore_eos=True)
        first = next(iter(s_short))  # admitted before the signal
        mark = len(notify.messages)
        proc.send_signal(signal.SIGTERM)
        assert first + s_short.text() and s_short.result["finish_reason"] == "length"
        with pytest.raises(Cancelled, match="shutting down"):
            s_long.text()
        assert proc.wait(30) == 0
        notify.wait("STOPPING", "1", start=mark)
        assert os.path.exists(act_path)  # the activated socket belongs to the socket unit
        short.close()
        long_.close()
    finally:
        notify.close()
        listener.close()
        d.close()


def test_self_bound_socket_mode_stale_socket_and_ready():
    d = DaemonProcess(server={"socket_mode": 0o600})
    notify = NotifySocket(os.path.join(d.dir, "notify"))
    d.env["NOTIFY_SOCKET"] = notify.path
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(d.socket)  # a socket file nobody listens on: a crashed daemon's leftover
    stale.close()
    try:
        d.start()
        notify.wait("READY", "1")
        assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
        assert "WATCHDOG" not in notify.keys()  # no WATCHDOG_USEC: no pings
        # a second daemon on the same path refuses to start, with one line
        second = DaemonProcess()
        second.write_config(server={"socket": d.socket})
        second.spawn()
        assert second.proc.wait(30) == 1
        assert f"another daemon is listening on {d.socket}" in second.log()
        assert "Traceback" not in second.log()
        second.close()
        assert d.stop() == 0
        assert not os.path.exists(d.socket)
    finally:
        notify.close()
        d.close()


def test_wedged_engine_stops_watchdog_pings():
    d = DaemonProcess(fake={"wedge_after_steps": 3}, env={"WATCHDOG_USEC": "200000"})
    notify = NotifySocket(os.path.join(d.dir, "notify"))
    d.env["NOTIFY_SOCKET"] = notify.path
    try:
        d.start()
        assert wait_for(lambda: notify.keys().count("WATCHDOG") >= 2, 10)  # idle: pings
        c = d.client(timeout=30)
        c.send_request("generate", [{"prompt": "x", "max_tokens": 50, "ignore_eos": True}])
        assert wait_for(lambda: "watchdog not fed" in d.log(), 10)
        n = notify.keys().count("WATCHDOG")
        time.sleep(1.0)  # about 10 ping intervals
        assert notify.keys().count("WATCHDOG") == n
        c.close()
    finally:
        notify.close()
        d.proc.kill()
        d.close()


def test_load_failure_is_one_line_and_releases_the_socket():
    d = DaemonProcess(fake={"n_ctx": "not a number"})  # FakeEngine(n_ctx=...) conflicts: TypeError
    d.write_config(logging={"level": "info"})  # debug would add the traceback on purpose
    try:
        d.spawn()
        assert d.proc.wait(30) == 1
        log = d.log()
        assert "ktd: error: cannot load the model:" in log and "Traceback" not in log
        assert not os.path.exists(d.socket)
    finally:
        d.close()


def test_sigterm_during_model_load_stops_at_once_and_cleanly():
    # a 600 s load (60 progress steps): the daemon must not wait for it
    d = DaemonProcess(fake={"load_steps": 60, "load_delay_s": 600.0})
    notify = NotifySocket(os.path.join(d.dir, "notify"))
    d.env["NOTIFY_SOCKET"] = notify.path
    try:
        d.spawn()
        notify.wait("STATUS", "loading: loading fake weights 1/60 (2%)")
        assert wait_for(lambda: os.path.exists(d.socket), 10)
        # a reload request while loading is logged and ignored (SIGHUP's default would kill)
        d.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "reload ignored: the model is loading" in d.log(), 20), d.log()
        assert d.proc.poll() is None
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(60) == 0  # systemd counts exit 0 after a stop request as clean
        notify.wait("STOPPING", "1")
        assert notify.index("READY", "1") < 0
        log = d.log()
        assert "stopping: a stop was requested while the model was loading" in log
        assert "Traceback" not in log
        assert not os.path.exists(d.socket)  # a self-bound socket is removed
    finally:
        notify.close()
        d.close()
