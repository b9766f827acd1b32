"""model.weights_map: auto: a load that misses the prepared-weights cache serves from the model
file at once (the native loader's cache state ``absent``) and leaves the entry to a process of its
own, started here: ``python -m ktd.ops.cache_builder OPTIONS_JSON``, at nice 19 and SCHED_IDLE (it
takes only CPU time nobody else wants, so it does not slow the serving daemon's decode), which
loads the model as ``weights_map: arena`` with the same placement, i.e. prepares the weights
straight into the new entry (temporary file, checksums, rename: the native writer's guarantees),
and exits. The daemon's weights manager (ktd.server.weights) then opens the entry (mapped,
checksums verified) and switches the engine to it when no request is in flight (its KV and prefix
caches start empty); the next start maps the entry (a hit).

Two processes building the same entry at once are safe (the native writer renames atomically; the
last rename wins, with identical bytes). The builder is a child of the process that started it:
under systemd it is in the service's cgroup and stops with it; its log lines go to the same stderr.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ktd.server.engine")

# The native Model keywords a build passes on (placement: they are part of the entry's key).
_PASSED = ("allow_repack", "nodes", "smt", "sysfs_root", "affinity", "hugepages", "hugetlb_page_size", "mlock",
           "numa_experts", "numa_dense", "cache_map")


def _end_with_parent(period_s: float = 1.0) -> None:
    """A thread that ends the builder once the process that started it is gone (reparented: a
    daemon killed outside systemd's cgroup leaves no builder behind; its temporary file is what
    ``ktd cache prune`` removes). Not PR_SET_PDEATHSIG: that fires when the *thread* that
    started the builder ends, and the daemon's load thread ends right after the load."""
    parent = os.getppid()

    def check() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(3)

    threading.Thread(target=check, name="ktd-builder-parent", daemon=True).start()


def _test_hooks() -> int | None:
    """Tests only: KTD_TEST_CACHE_BUILD_GATE=PATH makes the builder wait until PATH exists before
    it starts (a test sends requests "during the build" without depending on the machine's
    speed); KTD_TEST_CACHE_BUILD_FAIL=1 makes it fail (exit 1) without writing; with
    KTD_TEST_CACHE_BUILD_CORRUPT=1 it flips a byte of the entry it wrote (the engine's checksum
    check must refuse it). Returns an exit status to end with, or None to build."""
    gate = os.environ.get("KTD_TEST_CACHE_BUILD_GATE")
    while gate and not os.path.exists(gate):
        time.sleep(0.01)
    if os.environ.get("KTD_TEST_CACHE_BUILD_FAIL") == "1":
        print("KTD_TEST_CACHE_BUILD_FAIL=1: failing as asked", file=sys.stderr)
        return 1
    return None


def _corrupt_for_test(entry: str) -> None:
    """KTD_TEST_CACHE_BUILD_CORRUPT=1: flips the first byte of the entry's first non-empty section
    (native/src/model/weights_cache.h: u32 n_sections, u32 key_len at 40, the key at 48, padded to
    8, then {u64 offset, u64 bytes} per section)."""
    if os.environ.get("KTD_TEST_CACHE_BUILD_CORRUPT") != "1":
        return
    import struct
    with open(entry, "r+b") as f:
        head = f.read(48)
        n_sections, key_len = struct.unpack_from("<II", head, 40)
        f.seek(48 + (key_len + 7) // 8 * 8)
        table = struct.unpack(f"<{2 * n_sections}Q", f.read(16 * n_sections))
        offset = next(o for o, n in zip(table[::2], table[1::2]) if n)
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _lower_priority() -> None:
    """The builder's first act: nice 19 and SCHED_IDLE (Linux); what the kernel refuses is skipped.
    (Here rather than in a preexec_fn, which is unsafe in the daemon's threaded process.)"""
    try:
        os.nice(19)
    except OSError:
        pass
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        pass


def spawn(path: str, cache_dir: str, threads: int, placement: dict[str, Any]) -> subprocess.Popen:
    """Starts the builder of `path`'s entry in `cache_dir` (placement: Engine.open's native keywords)."""
    opts = {"path": path, "cache_dir": cache_dir, "threads": threads,
            **{k: v for k, v in placement.items() if k in _PASSED}}
    return subprocess.Popen([sys.executable, "-m", "ktd.ops.cache_builder", json.dumps(opts)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            close_fds=True)


def watch(proc: subprocess.Popen, entry: str,
          on_end: Callable[[bool, str], None] | None = None) -> threading.Thread:
    """Logs the builder's end (a daemon thread): the entry written, or why not; then, on that
    thread, ``on_end(written, why not)`` (the weights manager's switch to the entry)."""
    t0 = time.monotonic()

    def wait() -> None:
        _, err = proc.communicate()
        text = err.decode(errors="replace").strip()
        ok = proc.returncode == 0
        why = ""
        if ok:
            log.info("prepared-weights cache: background build written in %.1f s to %s (%s)",
                     time.monotonic() - t0, entry, text.splitlines()[-1] if text else "")
        elif proc.returncode == -signal.SIGTERM:  # WeightsManager.close (the daemon stopping) or the operator
            why = "stopped (SIGTERM) before it was written"
            log.info("prepared-weights cache: background build %s; the next start builds it again", why)
        else:
            why = f"exit {proc.returncode}: {text[-2000:] or 'no message'}"
            log.warning("prepared-weights cache: background build failed (%s)", why)
        if on_end is not None:
            on_end(ok, why)

    t = threading.Thread(target=wait, name="ktd-cache-build", daemon=True)
    t.start()
    return t


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ktd.ops.cache_builder OPTIONS_JSON (started by model.weights_map: auto)", file=sys.stderr)
        return 2
    _end_with_parent()
    _lower_priority()
    opts = json.loads(args[0])
    if (rc := _test_hooks()) is not None:
        return rc
    from ktd import _native

    path, cache_dir, threads = opts.pop("path"), opts.pop("cache_dir"), opts.pop("threads")
    model = _native.Model(path, n_threads=threads, pin=False, cache_dir=cache_dir, weights_map="arena", **opts)
    c = model.cache
    if c["state"] in ("written", "hit"):
        _corrupt_for_test(c["path"])
        print(f"{c['state']}: {c['bytes']} bytes", file=sys.stderr)
        return 0
    print(f"not written ({c['state']}): {c['reason']}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
