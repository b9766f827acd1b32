"""model.weights_map: auto: a load that misses the prepared-weights cache serves from the model
file at once (the native loader's cache state ``absent``) and leaves the entry to a process of its
own, started here: ``python -m ktd.cache_builder OPTIONS_JSON``, at nice 19 and SCHED_IDLE (it
takes only CPU time nobody else wants, so it does not slow the serving daemon's decode), which
loads the model as ``weights_map: arena`` with the same placement, i.e. prepares the weights
straight into the new entry (temporary file, checksums, rename: the native writer's guarantees),
and exits. The next start then maps the entry (a hit). The running process keeps serving from the
file: switching it to the prepared entry would drop its KV and prefix caches once, and is not done.

Two processes building the same entry at once are safe (the native writer renames atomically; the
last rename wins, with identical bytes). The builder is a child of the process that started it:
under systemd it is in the service's cgroup and stops with it; its log lines go to the same stderr.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger("ktd.engine")

# The native Model keywords a build passes on (placement: they are part of the entry's key).
_PASSED = ("allow_repack", "nodes", "smt", "sysfs_root", "affinity", "hugepages", "hugetlb_page_size", "mlock",
           "numa_experts", "numa_dense", "cache_map")


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
    return subprocess.Popen([sys.executable, "-m", "ktd.cache_builder", json.dumps(opts)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            close_fds=True)


def watch(proc: subprocess.Popen, entry: str) -> threading.Thread:
    """Logs the builder's end (a daemon thread): the entry written, or why not."""
    t0 = time.monotonic()

    def wait() -> None:
        _, err = proc.communicate()
        text = err.decode(errors="replace").strip()
        if proc.returncode == 0:
            log.info("prepared-weights cache: background build written in %.1f s to %s (%s); the next start "
                     "maps it", time.monotonic() - t0, entry, text.splitlines()[-1] if text else "")
        else:
            log.warning("prepared-weights cache: background build failed (exit %s): %s", proc.returncode,
                        text[-2000:] or "no message")

    t = threading.Thread(target=wait, name="ktd-cache-build", daemon=True)
    t.start()
    return t


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ktd.cache_builder OPTIONS_JSON (started by model.weights_map: auto)", file=sys.stderr)
        return 2
    _lower_priority()
    opts = json.loads(args[0])
    from ktd import _native

    path, cache_dir, threads = opts.pop("path"), opts.pop("cache_dir"), opts.pop("threads")
    model = _native.Model(path, n_threads=threads, pin=False, cache_dir=cache_dir, weights_map="arena", **opts)
    c = model.cache
    if c["state"] in ("written", "hit"):
        print(f"{c['state']}: {c['bytes']} bytes", file=sys.stderr)
        return 0
    print(f"not written ({c['state']}): {c['reason']}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
