"""ktd.ops.systemd outside and inside a (fake) systemd environment."""

from __future__ import annotations

import logging
import os
import socket

import pytest

from ktd.ops import systemd
@pytest.fixture
def clean_env(monkeypatch):
    for k in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC",
              "WATCHDOG_PID", "JOURNAL_STREAM"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_no_ops_outside_systemd(clean_env):
    assert systemd.notify("READY=1") is False
    assert systemd.watchdog_interval() is None
    assert systemd.listen_sockets() == []
    assert isinstance(systemd.log_handler(), logging.StreamHandler)


def test_notify_sends_one_datagram(clean_env, tmp_path):
    if not systemd.available():
        pytest.skip("systemd-python is not installed")
    path = str(tmp_path / "n")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(path)
    rx.settimeout(5)
    clean_env.setenv("NOTIFY_SOCKET", path)
    assert systemd.reloading()
    fields = dict(line.split("=", 1) for line in rx.recv(4096).decode().splitlines())
    assert fields["RELOADING"] == "1" and int(fields["MONOTONIC_USEC"]) > 0
    assert systemd.extend_timeout(2.5)
    assert rx.recv(4096) == b"EXTEND_TIMEOUT_USEC=2500000"
    rx.close()


def test_watchdog_interval(clean_env):
    clean_env.setenv("WATCHDOG_USEC", "30000000")
    assert systemd.watchdog_interval() == 15.0
    clean_env.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert systemd.watchdog_interval() is None
    clean_env.setenv("WATCHDOG_PID", str(os.getpid()))
    clean_env.setenv("WATCHDOG_USEC", "junk")
    assert systemd.watchdog_interval() is None


def test_journal_handler_under_systemd(clean_env):
    if not systemd.available():
        pytest.skip("systemd-python is not installed")
    from systemd.journal import JournalHandler

    st = os.fstat(2)
    clean_env.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    assert isinstance(systemd.log_handler(), JournalHandler)
    clean_env.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")  # stderr redirected elsewhere
    assert not isinstance(systemd.log_handler(), JournalHandler)
