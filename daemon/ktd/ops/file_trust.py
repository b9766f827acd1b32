"""Who may have written a file the daemon or the gateway reads back: the rule for the routing
profile, the API-key file and the prepared-weights cache directory (the native loader keeps the
same rule for the cache's entries, native/src/model/weights_cache.cpp).

A checksum proves a file intact, not who wrote it. A file is read only when it and the directory
holding it belong to this process's user or to root, and neither may be written by its group or
by others; the file is opened without following a symbolic link (O_NOFOLLOW) and checked on the
open descriptor (fstat), so nothing can be swapped in between the check and the read. The
directory is opened too (a symbolic link to it is followed: operators link directories) and the
file opened relative to it, so the directory checked is the one read from.
"""

from __future__ import annotations

import errno
import os
import stat


class UntrustedFile(OSError):
    """A file (or its directory) that others control; ``str()`` says who and why."""


def problem(st: os.stat_result, what: str) -> str:
    """"" when ``st`` (of a file or a directory) passes the rule, else why not, naming ``what``."""
    me = os.geteuid()
    if st.st_uid not in (0, me):
        return (f"{what} is owned by uid {st.st_uid}, not by this process's user (uid {me}) or root")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{what} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                "chmod go-w it")
    return ""


def directory_problem(path: str) -> str:
    """"" when the directory ``path`` passes the rule, else why not (a missing one: its error)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return f"{path}: {e.strerror}"
    try:
        return problem(os.fstat(fd), f"the directory {path}")
    finally:
        os.close(fd)


def open_trusted(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the regular file ``path`` when it and its directory pass the
    rule; else ``UntrustedFile`` (FileNotFoundError when there is no such file)."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    directory = directory or "."
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        why = problem(os.fstat(dfd), f"the directory {directory}")
        if why:
            raise UntrustedFile(why)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UntrustedFile(f"{path} is a symbolic link (not followed)") from None
            raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    why = "" if stat.S_ISREG(st.st_mode) else f"{path} is not a regular file"
    why = why or problem(st, path)
    if why:
        os.close(fd)
        raise UntrustedFile(why)
    return fd
