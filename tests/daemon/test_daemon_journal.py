"""The daemon's journal logging end to end, without systemd: the daemon runs in a private mount
namespace where /run/systemd/journal/socket is a datagram socket bound by this test, with
JOURNAL_STREAM naming its stderr (what systemd sets for a unit). sd_journal_sendv (libsystemd,
through systemd-python's JournalHandler) writes the native journal protocol to that socket;
the test parses it and checks the structured fields. What stays unverified: that a real
journald accepts and indexes these fields (it keeps upper-case field names, which these are).
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys

import pytest

from daemon_helpers import DaemonProcess, wait_for


def parse_native(datagram: bytes) -> dict[str, str]:
    """One journal-protocol datagram: ``KEY=value\\n`` lines, or ``KEY\\n`` + le64 size + data
    + ``\\n`` for values with newlines (systemd.journal-fields(7), "native protocol")."""
    fields, i = {}, 0
    while i < len(datagram):
        nl = datagram.index(b"\n", i)
        line = datagram[i:nl]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            i = nl + 1
        else:
            key = line
            (size,) = struct.unpack_from("<Q", datagram, nl + 1)
            value = datagram[nl + 9:nl + 9 + size]
            i = nl + 9 + size + 1
        fields[key.decode()] = value.decode(errors="replace")
    return fields


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return r.returncode == 0


def test_journal_records_carry_request_id_and_peer_uid():
    pytest.importorskip("systemd.journal", reason="systemd-python is not installed")
    if not _can_unshare():
        pytest.skip("needs a private mount namespace (unshare -m: root or CAP_SYS_ADMIN)")
    d = DaemonProcess()
    d.write_config(logging={"level": "info"})
    jdir = os.path.join(d.dir, "journal")
    os.mkdir(jdir)
    journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journal.bind(os.path.join(jdir, "socket"))
    journal.settimeout(0.2)
    records: list[dict[str, str]] = []

    def collect() -> None:
        while True:
            try:
                records.append(parse_native(journal.recv(1 << 20)))
            except (TimeoutError, BlockingIOError):
                return

    script = ('mount -t tmpfs ktd-test /run && mkdir -p /run/systemd/journal && '
              f'mount --bind "{jdir}" /run/systemd/journal && '
              'export JOURNAL_STREAM=$(stat -L -c "%d:%i" /proc/self/fd/2) && exec "$@"')
    try:
        d.spawn(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *d.command()])
        d.wait_ready()
        with d.client() as c:
            text = "".join(c.stream(prompt="hi", max_tokens=3))
        assert text
        assert wait_for(lambda: (collect(), any("KTD_REQUEST_ID" in r and "tokens" in r.get("MESSAGE", "")
                                                 for r in records))[1], 10), records
        d.stop()
        collect()
        stderr = d.log()
    finally:
        d.close()
        journal.close()
    assert stderr == "", "under the journal nothing goes to stderr"
    gen = [r for r in records if r.get("KTD_REQUEST_ID") == "r1"]
    assert gen, records
    for r in gen:
        assert r["KTD_PEER_UID"] == str(os.getuid())
        assert r["SYSLOG_IDENTIFIER"] == "ktd"
        assert r["PRIORITY"] == "6"  # info
        assert r["LOGGER"] == "ktd.server.daemon"
    messages = [r["MESSAGE"] for r in gen]
    assert any("generate" in m for m in messages) and any("stop" in m or "length" in m for m in messages)
    assert any(r.get("MESSAGE", "").startswith("serving on") for r in records)
