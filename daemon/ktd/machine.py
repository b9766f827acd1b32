"""What this machine offers ktd: CPU features and the kernel ISA chosen, NUMA topology as the
process may use it, the thread pool a default config would start, huge page pools and the THP
mode. ``describe()`` returns plain data (JSON-serialisable) for ``ktd inspect`` and the logs.

Everything is read when called (sysfs, /proc, CPUID), nothing at import time.
"""

from __future__ import annotations

from pathlib import Path


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def describe(sysfs_root: str = "/sys", proc_root: str = "/proc") -> dict:
    """The machine as ktd sees it; sizes in bytes, CPU and node ids as the kernel numbers them."""
    from ktd import _native

    features = _native.cpu_features()
    topo = _native.read_topology(sysfs_root)
    try:
        pool = _native.choose_cpus(topo)
        pool_error = None
    except ValueError as e:  # no usable CPU on any node: reported, not raised
        pool, pool_error = [], str(e)
    meminfo = _native.read_meminfo(f"{proc_root}/meminfo")
    numa_balancing = _read_int(Path(proc_root) / "sys/kernel/numa_balancing")

    warnings = []
    n_cpu_nodes = sum(1 for n in topo.nodes if n.cpus)
    if numa_balancing and n_cpu_nodes > 1:
        warnings.append(
            "automatic NUMA balancing is on (kernel.numa_balancing=1): it migrates pinned workers' "
            "pages; set kernel.numa_balancing=0 for pinned deployments"
        )
    if pool_error:
        warnings.append(pool_error)

    return {
        "cpu": {
            "vendor": features.vendor,
            "model_name": features.model_name,
            "family": features.family,
            "model": features.model,
            "stepping": features.stepping,
            "flags": sorted(name for name, on in features.flags().items() if on),
            "kernel_isa": _native.kernels.active_isa(),
            "kernel_isas_runnable": [i for i in ("ref", "avx2", "avx512") if _native.kernels.isa_compiled(i) and _native.kernels.isa_supported(i)],
        },
        "topology": {
            "numa": topo.numa,
            "online_cpus": topo.online_cpus,
            "allowed_cpus": topo.allowed_cpus,
            "usable_cpus": topo.cpus,
            "smt": any(len(core.cpus) > 1 for n in topo.nodes for core in n.cores),
            "nodes": [
                {"id": n.id, "cpus": n.cpus, "physical_cores": [core.cpus for core in n.cores]}
                for n in topo.nodes
            ],
        },
        "thread_pool": {
            "n_threads": len(pool),
            "cpus": [cpu for cpu, _ in pool],
            "nodes": [node for _, node in pool],
            "smt": False,
        },
        "hugepages": {
            "default_page_size": meminfo.get("Hugepagesize"),
            "HugePages_Total": meminfo.get("HugePages_Total"),
            "HugePages_Free": meminfo.get("HugePages_Free"),
            "HugePages_Rsvd": meminfo.get("HugePages_Rsvd"),
            "HugePages_Surp": meminfo.get("HugePages_Surp"),
            "pools": _native.hugepage_pools(sysfs_root),
        },
        "thp": {
            "enabled": _native.thp_setting("enabled", sysfs_root) or None,
            "defrag": _native.thp_setting("defrag", sysfs_root) or None,
        },
        "numa_balancing": numa_balancing,
        "warnings": warnings,
    }


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def summary_lines(d: dict) -> list[str]:
    """A few human-readable lines of describe()'s result, for ``ktd inspect``."""
    cpu, topo, pool, hp = d["cpu"], d["topology"], d["thread_pool"], d["hugepages"]
    nodes = ", ".join(
        f"node {n['id']}: {len(n['physical_cores'])} cores/{len(n['cpus'])} cpus" for n in topo["nodes"]
    )
    pools = ", ".join(
        f"{_size(p['page_size'])}: {p['free']}/{p['nr']} free" for p in hp["pools"] if p["node"] == -1
    )
    lines = [
        f"cpu: {cpu['model_name'] or cpu['vendor']} — kernels: {cpu['kernel_isa']} "
        f"(runnable: {', '.join(cpu['kernel_isas_runnable'])})",
        f"numa: {'yes' if topo['numa'] else 'no'}, {nodes}; usable cpus {len(topo['usable_cpus'])}",
        f"thread pool: {pool['n_threads']} workers on cpus {pool['cpus']}",
        f"huge pages: {pools or 'none'}; THP {d['thp']['enabled'] or 'unavailable'}",
    ]
    lines += [f"warning: {w}" for w in d["warnings"]]
    return lines
