"""CPU topology from sysfs: fake machines built in tmp_path, then the real one.

The expected values are written from the kernel's sysfs ABI (Documentation/ABI/stable/
sysfs-devices-node, sysfs-devices-system-cpu) for each fake tree, not from the parser.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fake_sysfs import make_sysfs
from ktd import _native


def node_view(topo):
    return {n.id: (n.cpus, [c.cpus for c in n.cores]) for n in topo.nodes}


# ---- cpulist syntax -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, expected",
    [
        ("", []),
        ("\n", []),
        ("0", [0]),
        ("0-3", [0, 1, 2, 3]),
        ("0-3,8-11\n", [0, 1, 2, 3, 8, 9, 10, 11]),
        ("0,2", [0, 2]),
        ("5,1,3-4", [1, 3, 4, 5]),
        ("0-6:2", [0, 2, 4, 6]),                  # every 2nd
        ("0-15:2/4", [0, 1, 4, 5, 8, 9, 12, 13]),  # kernel pattern: first 2 of each group of 4
        ("1-1", [1]),
        ("0-2,1-3", [0, 1, 2, 3]),
    ],
)
def test_parse_cpulist(text, expected):
    assert _native.parse_cpulist(text) == expected


@pytest.mark.parametrize("text", ["a", "3-1", "0-", "-1", "1,,2", "0-6:0", "0-7:3/2", "99999999", "1 2"])
def test_parse_cpulist_rejects(text):
    with pytest.raises(ValueError, match="cpulist"):
        _native.parse_cpulist(text)


# ---- fake machines --------------------------------------------------------------------------

def two_socket_smt(tmp_path):
    # 2 sockets x 4 cores x 2 threads; the second thread of core c is CPU c + 8.
    sib = {c: f"{c % 8},{c % 8 + 8}" for c in range(16)}
    return make_sysfs(tmp_path, "0-15", {0: "0-3,8-11", 1: "4-7,12-15"}, siblings=sib)


def test_two_nodes_with_smt_siblings(tmp_path):
    root = two_socket_smt(tmp_path)
    t = _native.read_topology(root, affinity=list(range(16)))
    assert t.numa
    assert node_view(t) == {
        0: ([0, 1, 2, 3, 8, 9, 10, 11], [[0, 8], [1, 9], [2, 10], [3, 11]]),
        1: ([4, 5, 6, 7, 12, 13, 14, 15], [[4, 12], [5, 13], [6, 14], [7, 15]]),
    }
    assert t.node_of_cpu(13) == 1 and t.node_of_cpu(16) == -1
    # One worker per physical core, grouped by node.
    assert _native.choose_cpus(t) == [(c, 0) for c in range(4)] + [(c, 1) for c in range(4, 8)]
    # With SMT: first threads of every core, then the siblings.
    assert _native.choose_cpus(t, smt=True) == (
        [(c, 0) for c in [0, 1, 2, 3, 8, 9, 10, 11]] + [(c, 1) for c in [4, 5, 6, 7, 12, 13, 14, 15]]
    )
    # Fewer threads: split evenly over the nodes, still grouped.
    assert _native.choose_cpus(t, n_threads=4) == [(0, 0), (1, 0), (4, 1), (5, 1)]
    assert _native.choose_cpus(t, n_threads=3) == [(0, 0), (1, 0), (4, 1)]
    assert _native.choose_cpus(t, nodes=[1], n_threads=2) == [(4, 1), (5, 1)]
    with pytest.raises(ValueError, match="exceeds the 8 usable physical cores"):
        _native.choose_cpus(t, n_threads=9)
    assert len(_native.choose_cpus(t, n_threads=16, smt=True)) == 16


def test_affinity_mask_is_respected(tmp_path):
    root = two_socket_smt(tmp_path)
    t = _native.read_topology(root, affinity=[2, 3, 4])
    assert t.cpus == [2, 3, 4]
    assert node_view(t) == {0: ([2, 3], [[2], [3]]), 1: ([4], [[4]])}
    # SMT sibling of an allowed CPU, when allowed itself, joins the same core.
    t2 = _native.read_topology(root, affinity=[2, 10, 4])
    assert node_view(t2)[0] == ([2, 10], [[2, 10]])
    assert _native.choose_cpus(t2) == [(2, 0), (4, 1)]


def test_four_nodes_and_node_selection(tmp_path):
    nodes = {n: f"{4 * n}-{4 * n + 3}" for n in range(4)}
    root = make_sysfs(tmp_path, "0-15", nodes, siblings={c: str(c) for c in range(16)})
    t = _native.read_topology(root, affinity=list(range(16)))
    assert [n.id for n in t.nodes] == [0, 1, 2, 3]
    assert _native.choose_cpus(t, nodes=[3, 1]) == [(c, 1) for c in range(4, 8)] + [(c, 3) for c in range(12, 16)]
    assert _native.choose_cpus(t, n_threads=6) == [(0, 0), (1, 0), (4, 1), (5, 1), (8, 2), (12, 3)]
    with pytest.raises(ValueError, match="node 5 is not online"):
        _native.choose_cpus(t, nodes=[5])


def test_offline_cpus(tmp_path):
    # CPU 3 is offline (the node cpulist still names it here; the online list wins).
    root = make_sysfs(tmp_path, "0-2,4-7", {0: "0-3", 1: "4-7"}, siblings={c: str(c) for c in range(8)})
    t = _native.read_topology(root, affinity=list(range(8)))
    assert t.online_cpus == [0, 1, 2, 4, 5, 6, 7]
    assert node_view(t)[0][0] == [0, 1, 2]


def test_cpu_less_node(tmp_path):
    # Node 1 is memory only (CXL/HBM): empty cpulist.
    root = make_sysfs(tmp_path, "0-3", {0: "0-3", 1: ""}, siblings={c: str(c) for c in range(4)})
    t = _native.read_topology(root, affinity=list(range(4)))
    assert node_view(t) == {0: ([0, 1, 2, 3], [[0], [1], [2], [3]]), 1: ([], [])}
    assert [s[1] for s in _native.choose_cpus(t)] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="no usable CPU"):
        _native.choose_cpus(t, nodes=[1])


def test_sparse_online_nodes(tmp_path):
    root = make_sysfs(tmp_path, "0-7", {0: "0-3", 2: "4-7"}, siblings={c: str(c) for c in range(8)}, node_online="0,2")
    t = _native.read_topology(root, affinity=list(range(8)))
    assert [n.id for n in t.nodes] == [0, 2]
    assert _native.choose_cpus(t, n_threads=2) == [(0, 0), (4, 2)]
    with pytest.raises(ValueError, match="node 1 is not online"):
        _native.choose_cpus(t, nodes=[1])


def test_strided_cpulist_in_sysfs(tmp_path):
    root = make_sysfs(tmp_path, "0-7", {0: "0-6:2", 1: "1-7:2"}, siblings={c: str(c) for c in range(8)})
    t = _native.read_topology(root, affinity=list(range(8)))
    assert node_view(t)[0][0] == [0, 2, 4, 6]
    assert node_view(t)[1][0] == [1, 3, 5, 7]


def test_no_numa_directory(tmp_path):
    root = make_sysfs(tmp_path, "0-3", None, siblings={0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"})
    t = _native.read_topology(root, affinity=list(range(4)))
    assert not t.numa
    assert node_view(t) == {0: ([0, 1, 2, 3], [[0, 1], [2, 3]])}
    assert _native.choose_cpus(t) == [(0, 0), (2, 0)]


def test_siblings_from_core_id_and_package(tmp_path):
    # No thread_siblings_list: (physical_package_id, core_id) identifies the core.
    cores = {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1), 4: (1, 0), 5: (1, 0)}
    root = make_sysfs(tmp_path, "0-5", {0: "0-3", 1: "4-5"}, cores=cores)
    t = _native.read_topology(root, affinity=list(range(6)))
    assert node_view(t) == {0: ([0, 1, 2, 3], [[0, 2], [1, 3]]), 1: ([4, 5], [[4, 5]])}


def test_cpu_online_file_missing(tmp_path):
    # Without cpu/online, every cpuN directory counts unless its own "online" says 0.
    root = make_sysfs(tmp_path, None, {0: "0-2"}, siblings={c: str(c) for c in range(3)})
    (tmp_path / "devices/system/cpu/cpu1/online").write_text("0\n")
    t = _native.read_topology(root, affinity=[0, 1, 2])
    assert t.online_cpus == [0, 2]


def test_malformed_sysfs_names_the_file(tmp_path):
    root = make_sysfs(tmp_path, "0-3", {0: "0-3"}, siblings={c: str(c) for c in range(4)})
    (tmp_path / "devices/system/node/node0/cpulist").write_text("zero\n")
    with pytest.raises(RuntimeError, match="node0/cpulist"):
        _native.read_topology(root, affinity=[0])


def test_missing_sysfs(tmp_path):
    with pytest.raises(RuntimeError, match="devices/system/cpu"):
        _native.read_topology(str(tmp_path), affinity=[0])


# ---- the real machine -----------------------------------------------------------------------

def test_real_topology_matches_sysfs_and_affinity():
    t = _native.read_topology()
    affinity = os.sched_getaffinity(0)
    assert set(t.allowed_cpus) == affinity
    assert set(_native.process_affinity()) == affinity
    assert set(t.cpus) <= affinity
    node_root = Path("/sys/devices/system/node")
    if (node_root / "online").exists():
        online = _native.parse_cpulist((node_root / "online").read_text())
        assert [n.id for n in t.nodes] == online
    all_node_cpus = sorted(c for n in t.nodes for c in n.cpus)
    assert all_node_cpus == t.cpus
    assert sorted(c for n in t.nodes for core in n.cores for c in core.cpus) == t.cpus
    # os.cpu_count() counts online+offline possible CPUs; every usable CPU is below it.
    assert all(c < (os.cpu_count() or 1) for c in t.cpus)


def test_real_topology_with_explicit_affinity():
    t = _native.read_topology(affinity=[0])
    assert t.cpus == [0]
    assert _native.choose_cpus(t) == [(0, t.node_of_cpu(0))]
