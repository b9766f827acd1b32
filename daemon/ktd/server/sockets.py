"""The daemon's Unix sockets: the listening one (inherited from systemd by socket activation, or
bound here) and the kernel's word on who a peer is."""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import socket
import stat
import struct

from ktd.ops import systemd
log = logging.getLogger("ktd.server.daemon")

_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


class StartupError(Exception):
    """The daemon cannot start (socket, model): one line for the operator, exit 1."""


def bind_socket(path: str, mode: int, group: str | None) -> socket.socket:
    """Bind and listen on ``path`` with ``mode`` set by umask at bind time (no chmod window)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o755, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise StartupError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # stale socket of a dead daemon
        else:
            raise StartupError(f"another daemon is listening on {path}")
        finally:
            probe.close()
    # Bound and listening under a temporary name, then renamed into place: a client never finds
    # the path before the socket listens (it would be refused instead of queued).
    tmp = os.path.join(parent, f".{os.getpid()}.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        try:
            sock.bind(tmp)
        except OSError:  # e.g. the temporary name is too long for sun_path: bind in place
            tmp = path
            sock.bind(path)
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot bind {path}: {e.strerror}") from None
    finally:
        os.umask(old)
    if group is not None:
        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
            os.chown(tmp, -1, gid)
        except KeyError:
            log.warning("socket group %r does not exist; %s keeps the daemon's group", group, path)
        except PermissionError:
            log.warning("cannot give %s to group %r (not permitted); it keeps the daemon's group",
                        path, group)
    sock.listen(128)
    if tmp != path:
        try:
            os.rename(tmp, path)
        except OSError as e:
            sock.close()
            os.unlink(tmp)
            raise StartupError(f"cannot bind {path}: {e.strerror}") from None
    return sock


def listening_socket(path: str, mode: int, group: str | None) -> tuple[socket.socket, str, bool]:
    """(socket, its path, socket-activated): the first inherited Unix stream socket (the other
    inherited fds are closed), else one bound at ``path``."""
    inherited = systemd.listen_sockets()
    for sock, name in inherited:
        if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM:
            for other, _ in inherited:
                if other is not sock:
                    other.close()
            path = sock.getsockname() or path
            log.info("using socket-activated fd %d (%s) %s", sock.fileno(), name, path)
            return sock, path, True
    for sock, name in inherited:
        log.warning("ignoring inherited fd %d (%s): not a Unix stream socket", sock.fileno(), name)
        sock.close()
    return bind_socket(path, mode, group), path, False


def peer_credentials(sock: socket.socket) -> tuple[int, int, int, frozenset[int]]:
    """(pid, uid, gid, supplementary gids) of a Unix-socket peer, from the kernel."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    groups: frozenset[int] = frozenset()
    try:
        # Python's getsockopt refuses buffers above 1024 bytes (256 groups; ERANGE beyond)
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)
        groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:  # more than 256 groups, or a kernel without SO_PEERGROUPS: ask /proc
        groups = _proc_groups(pid)
    return pid, uid, gid, groups


def _proc_groups(pid: int) -> frozenset[int]:
    """The supplementary gids of process ``pid`` (/proc/PID/status ``Groups:``), empty if unknown."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Groups:"):
                return frozenset(int(g) for g in line.split()[1:])
    return frozenset()
