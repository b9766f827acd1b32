"""ktd.ops.machine.describe(): plain data about this machine, checked against the kernel's files."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ktd import _native

from ktd.ops import machine
def test_describe_real_machine():
    d = machine.describe()
    json.dumps(d)  # plain data for `ktd inspect --json`
    flags = set(next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")).split(":")[1].split())
    assert set(d["cpu"]["flags"]) <= flags
    assert "avx2" not in flags or "avx2" in d["cpu"]["flags"]
    assert d["cpu"]["kernel_isa"] in ("ref", "avx2", "avx512")
    assert set(d["topology"]["allowed_cpus"]) == os.sched_getaffinity(0)
    assert d["thread_pool"]["n_threads"] == _native.ThreadPool().size
    assert set(d["thread_pool"]["cpus"]) <= os.sched_getaffinity(0)
    for p in d["hugepages"]["pools"]:
        base = Path("/sys/kernel/mm/hugepages") if p["node"] == -1 else Path(
            f"/sys/devices/system/node/node{p['node']}/hugepages")
        assert p["nr"] == int((base / f"hugepages-{p['page_size'] // 1024}kB/nr_hugepages").read_text())
    meminfo = {l.split(":")[0]: l.split()[1] for l in Path("/proc/meminfo").read_text().splitlines()}
    assert d["hugepages"]["HugePages_Total"] == int(meminfo["HugePages_Total"])
    assert d["hugepages"]["default_page_size"] == int(meminfo["Hugepagesize"]) * 1024
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists():
        assert f"[{d['thp']['enabled']}]" in thp.read_text()
    lines = machine.summary_lines(d)
    assert any(line.startswith("thread pool:") for line in lines)
    assert set(d["cuda"]) == {"available", "devices", "reason", "library"}
    assert any(line.startswith("cuda: ") and d["cuda"]["reason"] in line for line in lines)


def test_describe_fake_two_node_machine_warns_about_numa_balancing(tmp_path):
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    (sys_root / "devices/system/cpu").mkdir(parents=True)
    cpus = sorted(os.sched_getaffinity(0))
    (sys_root / "devices/system/cpu/online").write_text(f"0-{max(cpus)}\n")
    node_dir = sys_root / "devices/system/node"
    node_dir.mkdir(parents=True)
    (node_dir / "online").write_text("0-1\n")
    half = max(1, len(cpus) // 2)
    (node_dir / "node0").mkdir()
    (node_dir / "node0/cpulist").write_text(",".join(map(str, cpus[:half])) + "\n")
    (node_dir / "node1").mkdir()
    (node_dir / "node1/cpulist").write_text(",".join(map(str, cpus[half:])) + "\n")
    hp = node_dir / "node1/hugepages/hugepages-2048kB"
    hp.mkdir(parents=True)
    (hp / "nr_hugepages").write_text("6\n")
    (hp / "free_hugepages").write_text("4\n")
    (hp / "surplus_hugepages").write_text("0\n")
    (proc_root / "sys/kernel").mkdir(parents=True)
    (proc_root / "sys/kernel/numa_balancing").write_text("1\n")
    (proc_root / "meminfo").write_text(Path("/proc/meminfo").read_text())

    d = machine.describe(str(sys_root), str(proc_root))
    assert d["topology"]["numa"] and [n["id"] for n in d["topology"]["nodes"]] == [0, 1]
    assert d["thp"]["enabled"] is None  # no THP directory in the fake tree
    assert d["hugepages"]["pools"] == [
        {"page_size": 2 << 20, "node": 1, "nr": 6, "free": 4}
    ]
    if len(cpus) > 1:
        assert d["thread_pool"]["nodes"] == [0] * half + [1] * (len(cpus) - half)
        assert any("numa_balancing" in w for w in d["warnings"])


def test_last_level_cache_from_a_fake_sysfs(tmp_path):
    cache = tmp_path / "devices/system/cpu/cpu0/cache"
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"),
                                             (2, "Unified", "2048K"), (3, "Unified", "32768K")]):
        d = cache / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
        (d / "shared_cpu_list").write_text("0-7\n" if level == 3 else "0\n")
    assert machine.last_level_cache(str(tmp_path)) == {"level": 3, "bytes": 32 << 20, "shared_cpu_list": "0-7"}
    (cache / "index3/size").write_text("garbage\n")   # unreadable entries are skipped, not raised
    assert machine.last_level_cache(str(tmp_path))["level"] == 2
    assert machine.last_level_cache(str(tmp_path / "nowhere")) is None


def test_last_level_cache_matches_lscpu():
    import shutil
    import subprocess
    import pytest
    if not shutil.which("lscpu"):
        pytest.skip("lscpu (util-linux) is not installed: no independent figure to compare with")
    out = subprocess.run(["lscpu", "-B", "-C=NAME,ONE-SIZE"], capture_output=True, text=True)
    sizes = {line.split()[0]: int(line.split()[1]) for line in out.stdout.splitlines()[1:] if len(line.split()) == 2}
    llc = machine.last_level_cache()
    if not sizes or llc is None:
        pytest.skip("neither lscpu nor sysfs lists the caches on this machine (some VMs): nothing to compare")
    assert llc["bytes"] == sizes[f"L{llc['level']}"]


def test_kernel_isa_of_each_type_serves_it():
    """kernels_isa names an ISA that has kernels for the type and that this CPU runs; the types
    kernel_isa_by_type lists are exactly those whose ISA is not the active one."""
    k = _native.kernels
    runnable = machine.runnable_isas()
    types = sorted({t for i in runnable for t in k.supported_types(i)})
    assert types
    by_type = machine.kernel_isa_by_type()
    for t in types:
        isa = k.kernels_isa(t)
        assert isa in runnable and t in k.supported_types(isa), (t, isa)
        assert (t in by_type) == (isa != k.active_isa())
        if t in by_type:
            assert by_type[t] == isa


def test_kernel_isa_by_type_is_empty_when_the_isa_is_fixed():
    """KTD_ISA fixes the ISA for every type (no per-type preference), so nothing is listed."""
    import subprocess
    import sys

    env = dict(os.environ, KTD_ISA=_native.kernels.active_isa())
    out = subprocess.run([sys.executable, "-c", "from ktd.ops import machine; print(machine.kernel_isa_by_type())"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == "{}"


def test_kernel_isa_words():
    assert machine.kernel_isa_words("avx2", {}) == "avx2"
    assert machine.kernel_isa_words("avx2", None) == "avx2"
    assert (machine.kernel_isa_words("avx2", {"Q6_K": "avx512", "Q4_K": "avx512", "IQ1_S": "ref"})
            == "avx2 (avx512 for Q4_K, Q6_K; ref for IQ1_S)")
