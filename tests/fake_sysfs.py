"""Fake sysfs trees (the files the native topology reader parses: cpu/online, node/online,
nodeN/cpulist, per-CPU topology), laid out as the kernel's sysfs ABI describes them
(Documentation/ABI/stable/sysfs-devices-node, sysfs-devices-system-cpu), and the placement
options that point a model or thread pool at one (sysfs_root + an affinity of its CPUs)."""

from __future__ import annotations

from pathlib import Path

from ktd import _native


def make_sysfs(
    root: Path,
    cpus_online: str | None,
    nodes: dict[int, str] | None,
    siblings: dict[int, str] | None = None,
    cores: dict[int, tuple[int, int]] | None = None,
    node_online: str | None = None,
) -> str:
    """A fake /sys: cpu/online, node/online + nodeN/cpulist, per-CPU topology files.

    nodes=None: no NUMA directory at all. siblings: cpu -> thread_siblings_list text.
    cores: cpu -> (physical_package_id, core_id), written when siblings is not given.
    """
    cpu_dir = root / "devices/system/cpu"
    cpu_dir.mkdir(parents=True)
    if cpus_online is not None:
        (cpu_dir / "online").write_text(cpus_online + "\n")
    all_cpus = set(_native.parse_cpulist(cpus_online or ""))
    for n_list in (nodes or {}).values():
        all_cpus |= set(_native.parse_cpulist(n_list))
    for cpu in all_cpus:
        topo = cpu_dir / f"cpu{cpu}/topology"
        topo.mkdir(parents=True)
        if siblings is not None and cpu in siblings:
            (topo / "thread_siblings_list").write_text(siblings[cpu] + "\n")
        elif cores is not None and cpu in cores:
            pkg, core = cores[cpu]
            (topo / "physical_package_id").write_text(f"{pkg}\n")
            (topo / "core_id").write_text(f"{core}\n")
    if nodes is not None:
        node_dir = root / "devices/system/node"
        node_dir.mkdir(parents=True)
        ids = sorted(nodes)
        (node_dir / "online").write_text((node_online or ",".join(map(str, ids))) + "\n")
        for n, cpulist in nodes.items():
            (node_dir / f"node{n}").mkdir()
            (node_dir / f"node{n}/cpulist").write_text(cpulist + "\n")
    return str(root)


def numa_machine(root: Path, n_nodes: int) -> dict:
    """A fake machine of n_nodes nodes with one CPU each (cpu i on node i) under root: the
    placement options (sysfs_root, affinity) of a model or thread pool that runs on it."""
    sysfs = make_sysfs(root, f"0-{n_nodes - 1}", {i: str(i) for i in range(n_nodes)})
    return {"sysfs_root": sysfs, "affinity": list(range(n_nodes))}
