"""The weights arena: which pages it really got, read back independently from the kernel.

Each test parses /proc/self/smaps itself (its own little parser below, not the native one) for
the arena's address range and compares with what the arena reports. Huge page pools are raised
by the test when it can (root) and always restored.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

import ktd
from host_memory import thp_mode
from ktd import _native

MiB = 1 << 20
PAGE_2M = 2 * MiB
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


def smaps_of(address: int, length: int) -> dict[str, int]:
    """Independent parse of /proc/self/smaps: sum of kB fields (in bytes) over VMAs in range."""
    out: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < address + length and address < hi
            continue
        parts = line.split()
        if inside and len(parts) == 3 and parts[2] == "kB":
            key = parts[0][:-1]
            value = int(parts[1]) * 1024
            out[key] = max(out.get(key, 0), value) if key == "KernelPageSize" else out.get(key, 0) + value
    return out


def meminfo() -> dict[str, int]:
    return {l.split(":")[0]: int(l.split()[1]) for l in Path("/proc/meminfo").read_text().splitlines()}


@pytest.fixture
def hugepages_2m():
    """Reserve 2 MiB huge pages for the test, then restore vm.nr_hugepages."""

    def reserve(pages: int) -> int:
        if os.geteuid() != 0 or not os.access(NR_HUGEPAGES, os.W_OK):
            pytest.skip("raising vm.nr_hugepages needs root (writable /proc/sys/vm/nr_hugepages)")
        state["original"] = int(NR_HUGEPAGES.read_text())
        NR_HUGEPAGES.write_text(str(state["original"] + pages))
        got = int(NR_HUGEPAGES.read_text()) - state["original"]
        if got < pages:
            pytest.skip(f"the kernel could reserve only {got} of {pages} huge pages (memory fragmented)")
        return pages

    state: dict[str, int] = {}
    try:
        yield reserve
    finally:
        if "original" in state:
            NR_HUGEPAGES.write_text(str(state["original"]))


@pytest.fixture
def hugepages_1g():
    """Reserve 1 GiB huge pages at run time (works on a fresh machine), then restore."""
    path = Path("/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages")
    state: dict[str, int] = {}

    def reserve(pages: int) -> int:
        if not path.exists():
            pytest.skip("this kernel offers no 1 GiB huge pages")
        if os.geteuid() != 0 or not os.access(path, os.W_OK):
            pytest.skip(f"reserving 1 GiB pages needs root (writable {path})")
        if meminfo()["MemAvailable"] < (pages + 2) * (1 << 20):  # kB: keep 2 GiB spare
            pytest.skip(f"not enough free memory to reserve {pages} x 1 GiB pages")
        state["original"] = int(path.read_text())
        path.write_text(str(state["original"] + pages))
        got = int(path.read_text()) - state["original"]
        if got < pages:
            pytest.skip(f"the kernel could reserve only {got} of {pages} 1 GiB pages (memory fragmented)")
        return pages

    try:
        yield reserve
    finally:
        if "original" in state:
            path.write_text(str(state["original"]))


def fill_and_check(arena):
    view = np.frombuffer(arena, dtype=np.uint8)
    assert view.size == arena.capacity
    view[:] = np.arange(view.size, dtype=np.uint64).astype(np.uint8)
    assert view[12345] == 12345 % 256
    return view


# ---- hugetlb --------------------------------------------------------------------------------

def test_hugetlb_2m_is_what_smaps_shows(hugepages_2m):
    hugepages_2m(8)
    free_before = meminfo()["HugePages_Free"]
    arena = _native.Arena(6 * MiB + 1, hugepages="hugetlb")
    try:
        assert arena.kind == "hugetlb_2M" and arena.page_size == PAGE_2M
        assert arena.capacity == 8 * MiB  # rounded up to whole 2 MiB pages
        assert arena.fallback_reason == ""
        # Prefaulted at creation: the pages have left the free pool already.
        assert meminfo()["HugePages_Free"] == free_before - 4
        fill_and_check(arena)
        s = smaps_of(arena.address, arena.capacity)
        assert s["KernelPageSize"] == PAGE_2M
        assert s["Private_Hugetlb"] + s.get("Shared_Hugetlb", 0) == 8 * MiB
        assert s["Rss"] == 0  # hugetlb memory is not counted in RSS
        mine = arena.smaps()
        for key in ("KernelPageSize", "Private_Hugetlb", "Rss", "AnonHugePages", "Size"):
            assert mine[key] == s[key], key
    finally:
        del arena


def test_auto_takes_hugetlb_when_the_pool_has_pages(hugepages_2m):
    hugepages_2m(2)
    arena = _native.Arena(4 * MiB, hugepages="auto")
    assert arena.kind == "hugetlb_2M" and arena.fallback_reason == ""
    assert smaps_of(arena.address, arena.capacity)["Private_Hugetlb"] == 4 * MiB
    del arena


@pytest.mark.slow  # compacting memory for a 1 GiB page takes seconds
def test_hugetlb_1g(hugepages_1g):
    hugepages_1g(1)
    arena = _native.Arena(100 * MiB, hugepages="hugetlb", hugetlb_page_size=1 << 30)
    try:
        assert arena.kind == "hugetlb_1G" and arena.capacity == 1 << 30
        view = np.frombuffer(arena, dtype=np.uint8)
        view[:: 1 << 20] = 7
        s = smaps_of(arena.address, arena.capacity)
        assert s["KernelPageSize"] == 1 << 30
        assert s["Private_Hugetlb"] + s.get("Shared_Hugetlb", 0) == 1 << 30
        assert s["Rss"] == 0
    finally:
        del view, arena


def test_hugetlb_bound_to_node_0(hugepages_2m):
    hugepages_2m(2)
    arena = _native.Arena(4 * MiB, hugepages="hugetlb", node=0)
    fill_and_check(arena)
    assert _native.page_nodes(arena.address, arena.capacity, PAGE_2M) == [0, 0]
    del arena


def test_hugetlb_shortfall_message_says_how_to_reserve():
    info = meminfo()
    free = info["HugePages_Free"] - info["HugePages_Rsvd"]
    pages = free + 3
    with pytest.raises(ktd.ResourceError) as e:
        _native.Arena(pages * PAGE_2M, hugepages="hugetlb")
    msg = str(e.value)
    assert f"need {pages} pages" in msg
    target = int(NR_HUGEPAGES.read_text()) + pages - free
    assert f"vm.nr_hugepages={target}" in msg
    assert "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages" in msg


def test_hugetlb_shortfall_for_a_node_names_the_per_node_pool():
    info = meminfo()
    pages = info["HugePages_Free"] - info["HugePages_Rsvd"] + 1
    with pytest.raises(ktd.ResourceError) as e:
        _native.Arena(pages * PAGE_2M, hugepages="hugetlb", node=0)
    assert "on node 0" in str(e.value)
    assert "/sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages" in str(e.value)


def test_thp_demanded_on_a_kernel_without_thp(tmp_path):
    with pytest.raises(ktd.ResourceError, match="the kernel has none"):
        _native.Arena(4 * MiB, hugepages="thp", sysfs_root=str(tmp_path))


def test_hugetlb_1g_shortfall_mentions_kernel_command_line():
    pools = {p["page_size"]: p for p in _native.hugepage_pools() if p["node"] == -1}
    if 1 << 30 not in pools:
        pytest.skip("this kernel offers no 1 GiB huge pages")
    avail = pools[1 << 30]["free"] - pools[1 << 30]["resv"]
    with pytest.raises(ktd.ResourceError, match="hugepagesz=1G"):
        _native.Arena((avail + 1) << 30, hugepages="hugetlb", hugetlb_page_size=1 << 30)


# ---- fallback, THP, off -----------------------------------------------------------------------

def test_auto_falls_back_and_says_why():
    info = meminfo()
    pages = info["HugePages_Free"] - info["HugePages_Rsvd"] + 2
    arena = _native.Arena(pages * PAGE_2M, hugepages="auto")
    expected = {"madvise": "thp", "always": "thp"}.get(thp_mode(), "normal")
    assert arena.kind == expected
    assert "hugetlb 2 MiB pages" in arena.fallback_reason
    assert f"need {pages} pages" in arena.fallback_reason


def test_thp_gives_anon_huge_pages():
    if thp_mode() not in ("madvise", "always"):
        pytest.skip(f"THP mode is '{thp_mode()}', not madvise/always")
    arena = _native.Arena(8 * MiB, hugepages="thp")
    assert arena.kind == "thp" and arena.address % PAGE_2M == 0
    fill_and_check(arena)
    s = smaps_of(arena.address, arena.capacity)
    assert s["AnonHugePages"] > 0, "MADV_HUGEPAGE range got no huge pages (memory fragmented?)"
    assert s.get("Private_Hugetlb", 0) == 0
    assert arena.smaps()["AnonHugePages"] == s["AnonHugePages"]


def test_off_gives_neither():
    arena = _native.Arena(8 * MiB, hugepages="off")
    assert arena.kind == "normal" and arena.page_size == 4096
    fill_and_check(arena)
    s = smaps_of(arena.address, arena.capacity)
    assert s["AnonHugePages"] == 0 and s.get("Private_Hugetlb", 0) == 0
    assert s["Rss"] == 8 * MiB and s["KernelPageSize"] == 4096


def fake_thp_root(tmp_path: Path, mode_line: str) -> str:
    d = tmp_path / "kernel/mm/transparent_hugepage"
    d.mkdir(parents=True)
    (d / "enabled").write_text(mode_line + "\n")
    return str(tmp_path)


def test_thp_demanded_but_disabled(tmp_path):
    root = fake_thp_root(tmp_path, "always madvise [never]")
    with pytest.raises(ktd.ResourceError, match="'never'"):
        _native.Arena(4 * MiB, hugepages="thp", sysfs_root=root)


def test_auto_with_neither_available_uses_normal_pages(tmp_path):
    info = meminfo()
    if info["HugePages_Free"] - info["HugePages_Rsvd"] >= 2:
        pytest.skip("the real hugetlb pool has free pages; this test needs it short")
    root = fake_thp_root(tmp_path, "always madvise [never]")
    arena = _native.Arena(4 * MiB, hugepages="auto", sysfs_root=root)
    assert arena.kind == "normal"
    assert "hugetlb" in arena.fallback_reason and "transparent huge pages are disabled" in arena.fallback_reason
    assert smaps_of(arena.address, arena.capacity).get("AnonHugePages", 0) == 0


def test_mlock_locks_the_arena():
    if os.geteuid() != 0:
        pytest.skip("mlock of 4 MiB may exceed RLIMIT_MEMLOCK without root")
    arena = _native.Arena(4 * MiB, hugepages="off", mlock=True)
    assert arena.locked
    assert smaps_of(arena.address, arena.capacity)["Locked"] == 4 * MiB


# ---- NUMA placement -------------------------------------------------------------------------

def test_bind_to_node_0_places_pages_there():
    arena = _native.Arena(4 * MiB, hugepages="off", node=0)
    fill_and_check(arena)
    assert set(_native.page_nodes(arena.address, arena.capacity)) == {0}


def test_bind_to_missing_node_is_an_oserror():
    if Path("/sys/devices/system/node/node1").exists():
        pytest.skip("this machine has a NUMA node 1; the test needs a one-node machine")
    with pytest.raises(OSError) as e:
        _native.Arena(4 * MiB, hugepages="off", node=1)
    assert e.value.errno == errno.EINVAL and "mbind" in str(e.value)
    arena = _native.Arena(4 * MiB, hugepages="off")
    with pytest.raises(OSError) as e2:
        _native.bind_range_to_node(arena.address, arena.capacity, 1)
    assert e2.value.errno == errno.EINVAL and "mbind" in str(e2.value) and "node 1" in str(e2.value)
    with pytest.raises(OSError) as e3:
        _native.bind_thread_memory(1)
    assert e3.value.errno == errno.EINVAL and "set_mempolicy" in str(e3.value)
    _native.bind_thread_memory(0)
    _native.bind_thread_memory(-1)


def test_interleave_over_the_real_nodes_places_pages_on_them():
    online = Path("/sys/devices/system/node/online")
    nodes = _native.parse_cpulist(online.read_text()) if online.exists() else [0]
    arena = _native.Arena(4 * MiB, hugepages="off", interleave=nodes)
    fill_and_check(arena)
    on = _native.page_nodes(arena.address, arena.capacity)
    assert set(on) == set(nodes)
    if len(nodes) > 1:  # round-robin page by page (from the interleave start node)
        assert all(on[i] != on[i + 1] for i in range(len(on) - 1))


def test_interleave_keeps_only_the_nodes_the_kernel_has():
    if Path("/sys/devices/system/node/node1").exists():
        pytest.skip("this machine has a NUMA node 1; the test needs a one-node machine")
    # The kernel intersects the list with its memory nodes: {0, 1} becomes {0}, silently (which
    # is why the model reads the policy back), and {1} alone is EINVAL.
    arena = _native.Arena(4 * MiB, hugepages="off", interleave=[0, 1])
    assert _native.range_policy_nodes(arena.address) == [0]
    with pytest.raises(OSError) as e:
        _native.Arena(4 * MiB, hugepages="off", interleave=[1])
    assert e.value.errno == errno.EINVAL and "MPOL_INTERLEAVE, nodes 1" in str(e.value)
    arena = _native.Arena(4 * MiB, hugepages="off")
    assert _native.range_policy_nodes(arena.address) == []
    with pytest.raises(ValueError, match="no nodes"):
        _native.interleave_range(arena.address, arena.capacity, [])
    with pytest.raises(ValueError, match="bound to one node or interleaved"):
        _native.Arena(4 * MiB, hugepages="off", node=0, interleave=[0])


def test_untouched_pages_have_no_node():
    arena = _native.Arena(4 * MiB, hugepages="off")
    assert set(_native.page_nodes(arena.address, arena.capacity)) == {-errno.ENOENT}


# ---- allocation and bad input ---------------------------------------------------------------

def test_bump_allocation():
    arena = _native.Arena(1 * MiB, hugepages="off")
    offsets = [arena.alloc(100), arena.alloc(1, 4096), arena.alloc(7), arena.alloc(64, 64)]
    assert offsets == [0, 4096, 4160, 4224]  # default align 64
    assert arena.used == 4288
    with pytest.raises(ktd.ResourceError, match="arena full"):
        arena.alloc(MiB)
    assert arena.used == 4288
    arena.alloc(MiB - 4288, 1)
    assert arena.used == arena.capacity
    with pytest.raises(ktd.ResourceError):
        arena.alloc(1, 1)
    arena.alloc(0, 1)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(capacity=0), ValueError, "capacity"),
        (dict(capacity=MiB, hugepages="yes"), ValueError, "auto, hugetlb, thp, off"),
        (dict(capacity=MiB, hugetlb_page_size=4096), ValueError, "2 MiB or 1 GiB"),
        (dict(capacity=MiB, node=-2), ValueError, "node"),
        (dict(capacity=MiB, hugepages="off", node=5000), ValueError, "NUMA node"),
        (dict(capacity=(1 << 64) - 1, hugepages="off"), ValueError, "too large"),
    ],
)
def test_bad_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        _native.Arena(**kwargs)


def test_bad_alignment():
    arena = _native.Arena(MiB, hugepages="off")
    with pytest.raises(ValueError, match="power of two"):
        arena.alloc(8, 3)


def test_page_report_functions():
    info = _native.read_meminfo()
    assert info["MemTotal"] == meminfo()["MemTotal"] * 1024
    assert info["HugePages_Total"] == meminfo()["HugePages_Total"]
    pools = _native.hugepage_pools()
    sizes = sorted(int(p.name[len("hugepages-") : -2]) * 1024 for p in Path("/sys/kernel/mm/hugepages").iterdir())
    assert sorted(p["page_size"] for p in pools if p["node"] == -1) == sizes
    for p in pools:
        if p["node"] == -1:
            d = Path(f"/sys/kernel/mm/hugepages/hugepages-{p['page_size'] // 1024}kB")
            assert p["nr"] == int((d / "nr_hugepages").read_text())
    assert _native.thp_setting() == thp_mode()


# ---- the config-facing wrapper --------------------------------------------------------------

def test_open_arena_logs_the_fallback(caplog):
    from ktd.ops import weights_arena
    info = meminfo()
    pages = info["HugePages_Free"] - info["HugePages_Rsvd"] + 1
    with caplog.at_level("INFO", logger="ktd.arena"):
        arena = weights_arena.open_arena(pages * PAGE_2M, hugepages="auto")
    assert any(r.levelname == "WARNING" and "fell back" in r.getMessage() and "need" in r.getMessage()
               for r in caplog.records)
    fill_and_check(arena)
    rep = weights_arena.report(arena)
    s = smaps_of(arena.address, arena.capacity)
    assert rep["anon_huge_pages"] == s["AnonHugePages"] and rep["rss"] == s["Rss"]
    assert rep["hugetlb"] == 0 and rep["kind"] == arena.kind


def test_open_arena_rejects_bad_config():
    from ktd.ops import weights_arena
    with pytest.raises(ValueError, match="hugepages must be one of"):
        weights_arena.open_arena(MiB, hugepages="2M")
    with pytest.raises(ValueError, match="2M or 1G"):
        weights_arena.open_arena(MiB, hugetlb_page_size="4K")


def test_smaps_range_sums_overlapping_vmas(tmp_path):
    # Two VMAs inside the range (e.g. split by madvise), one outside, and junk lines.
    text = """\
7f0000000000-7f0000200000 rw-p 00000000 00:00 0
Size:               2048 kB
Rss:                2048 kB
AnonHugePages:      2048 kB
KernelPageSize:        4 kB
THPeligible:    1
VmFlags: rd wr mr mw me ac hg
7f0000200000-7f0000400000 rw-p 00000000 00:00 0
Size:               2048 kB
Rss:                 100 kB
AnonHugePages:         0 kB
KernelPageSize:        4 kB
THPeligible:    0
7f0000400000-7f0000600000 rw-p 00000000 00:00 0
Size:               2048 kB
Rss:                2048 kB
ffffffffffffffffffff-0 garbage line
Bogus line without colon
"""
    path = tmp_path / "smaps"
    path.write_text(text)
    s = _native.smaps_range(0x7F0000000000, 0x400000, str(path))
    assert s["vmas"] == 2
    assert s["Size"] == 4096 * 1024 and s["Rss"] == 2148 * 1024
    assert s["AnonHugePages"] == 2048 * 1024
    assert s["KernelPageSize"] == 4096 and s["THPeligible"] == 1
    assert _native.smaps_range(0x1000, 0x1000, str(path))["vmas"] == 0
    with pytest.raises(RuntimeError, match="cannot read"):
        _native.smaps_range(0, 1, str(tmp_path / "missing"))
