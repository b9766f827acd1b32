"""Opening the weights arena from config values, logging what was obtained.

The native ``ktd._native.Arena`` does the mapping; this module turns the config's
``hugepages: auto|hugetlb|thp|off``, ``hugetlb_page_size: 2M|1G`` and ``mlock`` into its
arguments, logs a fallback (never silent) and reports the pages the kernel actually gave
(smaps of the arena's range, read after the weights are in).
"""

from __future__ import annotations

import logging

log = logging.getLogger("ktd.arena")

HUGEPAGES_MODES = ("auto", "hugetlb", "thp", "off")
HUGETLB_PAGE_SIZES = {"2M": 2 << 20, "1G": 1 << 30}


def open_arena(capacity: int, hugepages: str = "auto", hugetlb_page_size: str = "2M",
               mlock: bool = False, node: int = -1):
    """Map an arena of `capacity` bytes. Raises ValueError for bad config values,
    ktd.ResourceError when the demanded backing is unavailable (the message says how to fix it),
    OSError from mmap/mbind/mlock."""
    from ktd import _native

    if hugepages not in HUGEPAGES_MODES:
        raise ValueError(f"hugepages must be one of {', '.join(HUGEPAGES_MODES)}; got {hugepages!r}")
    if hugetlb_page_size not in HUGETLB_PAGE_SIZES:
        raise ValueError(f"hugetlb_page_size must be 2M or 1G; got {hugetlb_page_size!r}")
    arena = _native.Arena(capacity, hugepages=hugepages, hugetlb_page_size=HUGETLB_PAGE_SIZES[hugetlb_page_size],
                          mlock=mlock, node=node)
    if arena.fallback_reason:
        log.warning("weights arena: hugepages=%s fell back to %s: %s", hugepages, arena.kind, arena.fallback_reason)
    log.info("weights arena: %d bytes, %s pages%s%s", arena.capacity, arena.kind,
             f", bound to node {node}" if node >= 0 else "", ", locked" if arena.locked else "")
    return arena


def report(arena) -> dict:
    """What the kernel gave the arena now (bytes), from /proc/self/smaps — not assumed.

    Hugetlb memory shows as Private_Hugetlb and is not part of Rss; THP as AnonHugePages."""
    s = arena.smaps()
    return {
        "kind": arena.kind,
        "fallback_reason": arena.fallback_reason,
        "capacity": arena.capacity,
        "used": arena.used,
        "node": arena.node,
        "locked": arena.locked,
        "kernel_page_size": s.get("KernelPageSize", 0),
        "hugetlb": s.get("Private_Hugetlb", 0) + s.get("Shared_Hugetlb", 0),
        "anon_huge_pages": s.get("AnonHugePages", 0),
        "rss": s.get("Rss", 0),
        "locked_bytes": s.get("Locked", 0),
    }
