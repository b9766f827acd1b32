"""The daemon sees a peer's supplementary groups (SO_PEERGROUPS): a member of group ktd whose
primary group is another one (`adduser alice ktd`, the ktd-http user) is allowed. The peer is a
forked child that sets its own uid/gids (needs root)."""

from __future__ import annotations

import os
import shutil
import socket

import pytest

from daemon_helpers import short_tmpdir
from ktd.server.sockets import peer_credentials


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a child's uid and groups needs root")
@pytest.mark.parametrize("n_groups", [2, 300])  # 300: beyond what one getsockopt buffer holds
def test_peer_supplementary_groups(n_groups):
    d = short_tmpdir()  # pytest's tmp_path is 0700 root: the child could not reach the socket
    path = os.path.join(d, "s.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.settimeout(20)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(1)
    groups = list(range(40000, 40000 + n_groups))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only os/socket calls, then _exit
        try:
            os.setgroups(groups)
            os.setgid(65534)
            os.setuid(65534)
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(path)
            os.read(r, 1)  # hold the connection until the parent has looked
        finally:
            os._exit(0)
    try:
        conn, _ = server.accept()
        got_pid, uid, gid, got_groups = peer_credentials(conn)
        assert (got_pid, uid, gid) == (pid, 65534, 65534)
        assert got_groups == frozenset(groups)
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)
        server.close()
        shutil.rmtree(d, ignore_errors=True)
