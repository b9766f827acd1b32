"""The shipped unit files: `systemd-analyze verify` must print nothing (docs/OPERATIONS.md, "systemd units":
verify exits 0 on unknown keys, so any output is a failure)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from paths import ROOT

UNITS = os.path.join(str(ROOT), "packaging", "systemd")


def test_units_match_the_daemon():
    service = open(os.path.join(UNITS, "ktd.service")).read()
    socket_unit = open(os.path.join(UNITS, "ktd.socket")).read()
    assert "ExecStart=/opt/ktd/bin/ktd serve --config /etc/ktd/ktd.yaml" in service
    assert "Type=notify" in service and "WatchdogSec=" in service
    assert "\nRuntimeDirectory=" not in service  # OPS.md pitfall 1
    assert "~@resources" not in service.replace("Never add ~@resources", "")
    assert "ListenStream=/run/ktd/ktd.sock" in socket_unit and "RemoveOnStop=yes" in socket_unit


def test_gateway_units():
    service = open(os.path.join(UNITS, "ktd-http.service")).read()
    socket_unit = open(os.path.join(UNITS, "ktd-http.socket")).read()
    assert "ExecStart=/opt/ktd/bin/ktd-http --socket /run/ktd/ktd.sock" in service
    assert "Type=notify" in service and "User=ktd-http" in service and "SupplementaryGroups=ktd" in service
    assert "PrivateNetwork=yes" in service  # it only uses the sockets ktd-http.socket passes it
    listens = [line for line in socket_unit.splitlines() if line.startswith("ListenStream=")]
    assert listens == ["ListenStream=127.0.0.1:11435"]  # loopback only by default


def test_gateway_descriptor_limit_fits_its_connection_cap():
    """LimitNOFILE must hold the default --max-connections plus what the gateway keeps besides
    (ktd.http.limits.fd_budget's reserve): else silent clients make accept() fail with EMFILE."""
    from ktd.http import limits

    service = open(os.path.join(UNITS, "ktd-http.service")).read()
    (nofile,) = [int(line.split("=", 1)[1]) for line in service.splitlines() if line.startswith("LimitNOFILE=")]
    assert nofile >= limits.MAX_CONNECTIONS + limits.MAX_LINGERING + limits.FD_RESERVE


def test_systemd_analyze_verify_prints_nothing(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt package systemd)")
    # verify needs ExecStart's binary to exist: point it at an executable in tmp
    fake_bin = tmp_path / "ktd"
    fake_bin.write_text("#!/bin/sh\nexit 0\n")
    fake_bin.chmod(0o755)
    names = ("ktd.socket", "ktd.service", "ktd-http.socket", "ktd-http.service")
    for name in names:
        text = open(os.path.join(UNITS, name)).read().replace("/opt/ktd/bin/ktd-http", str(fake_bin))
        (tmp_path / name).write_text(text.replace("/opt/ktd/bin/ktd", str(fake_bin)))
    r = subprocess.run([tool, "verify", "--man=no", *(str(tmp_path / n) for n in names)],
                       capture_output=True, text=True, cwd=tmp_path)
    out = (r.stdout + r.stderr).strip()
    if r.returncode != 0 and ("System has not been booted with systemd" in out or "Failed to connect" in out
                              or "Failed to initialize manager" in out):
        pytest.skip(f"systemd-analyze verify cannot run here (PID 1 is not systemd): {out.splitlines()[0]}")
    assert out == "" and r.returncode == 0
