"""What this machine offers ktd: CPU features and the kernel ISA chosen, NUMA topology as the
process may use it, the thread pool a default config would start, huge page pools and the THP
mode. ``describe()`` returns plain data (JSON-serialisable) for ``ktd inspect`` and the logs.

Everything is read when called (sysfs, /proc, CPUID), nothing at import time.
"""

from __future__ import annotations

from pathlib import Path



def prefetch_name(mode: int | bool | str | None) -> str:
    """The decode prefetch mode's name (off, l1, l2) from its number, a name, or the on/off of
    results written before the modes (True: l1)."""
    if isinstance(mode, str):
        return mode
    if isinstance(mode, bool) or mode is None:
        return "l1" if mode else "off"
    from ktd import _native
    names = _native.kernels.decode_prefetch_modes()
    return names[mode] if 0 <= mode < len(names) else str(mode)


def runnable_isas() -> list[str]:
    """The kernel ISAs this build has and this CPU runs."""
    from ktd import _native

    k = _native.kernels
    return [i for i in ("ref", "avx2", "avx512", "neon", "dotprod", "i8mm") if k.isa_compiled(i) and k.isa_supported(i)]


def kernel_isa_by_type() -> dict[str, str]:
    """The types whose matrices run another ISA's kernels than the active one (``kernels_isa``: the
    AVX-512 kernels of the types measured faster with them on an AVX2-default build, or an ISA's
    fallbacks for types it has none of), type name -> ISA."""
    from ktd import _native

    k = _native.kernels
    active = k.active_isa()
    types = sorted({t for i in runnable_isas() for t in k.supported_types(i)})
    return {t: isa for t in types if (isa := k.kernels_isa(t)) is not None and isa != active}


def kernel_isa_words(active: str, by_type: dict[str, str] | None) -> str:
    """'avx2', or 'avx2 (avx512 for Q4_K, Q6_K)': the active ISA and the types that run another's."""
    if not by_type:
        return active
    groups: dict[str, list[str]] = {}
    for t, isa in by_type.items():
        groups.setdefault(isa, []).append(t)
    return f"{active} ({'; '.join(f'{isa} for ' + ', '.join(sorted(ts)) for isa, ts in sorted(groups.items()))})"


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


_SIZE_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache(sysfs_root: str = "/sys", cpu: int = 0) -> dict | None:
    """The largest data/unified cache the kernel lists for ``cpu``: {level, bytes, shared_cpu_list}.

    None where sysfs has no cache directory (some VMs and containers). Benchmarks use it to flag
    models whose bytes per token a cache of this size holds in part (docs/PERFORMANCE.md).
    """
    best = None
    for index in sorted(Path(sysfs_root, f"devices/system/cpu/cpu{cpu}/cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip() if (index / "shared_cpu_list").exists() else None
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not text:
            continue
        try:
            size = int(text[:-1]) * _SIZE_SUFFIX[text[-1]] if text[-1] in _SIZE_SUFFIX else int(text)
        except ValueError:
            continue
        if best is None or (level, size) > (best["level"], best["bytes"]):
            best = {"level": level, "bytes": size, "shared_cpu_list": shared}
    return best


def cpuid_l3_bytes() -> int | None:
    """The L3 size glibc reports from CPUID (``getconf LEVEL3_CACHE_SIZE``), or None.

    It can differ from the sysfs figure: a KVM guest on an AMD EPYC may see the package's total
    L3 here (hundreds of MiB over many CCDs) and one CCD's 32 MiB in sysfs. Reported beside it so
    a benchmark reader knows which machine kind the figures come from.
    """
    import ctypes
    import platform
    if platform.libc_ver()[0] != "glibc":   # the constant below is glibc's numbering
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.sysconf.restype = ctypes.c_long
        n = libc.sysconf(194)   # _SC_LEVEL3_CACHE_SIZE in glibc's <bits/confname.h>
    except (OSError, AttributeError):
        return None
    return int(n) if n > 0 else None


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
            "kernel_isa_by_type": kernel_isa_by_type(),
            "kernel_decode_prefetch": prefetch_name(_native.kernels.decode_prefetch()),
            # env, set, default, tuning (the first one-row forwards try each mode) or tuned
            "kernel_decode_prefetch_source": _native.kernels.decode_prefetch_state()["source"],
            "kernel_isas_runnable": runnable_isas(),
            "last_level_cache": last_level_cache(sysfs_root),
            "cpuid_l3_bytes": cpuid_l3_bytes(),
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
        # The optional CUDA backend (libktd_cuda.so): whether it can run here, or why not.
        "cuda": _native.cuda_status(),
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
    llc = cpu.get("last_level_cache")
    llc_text = f", L{llc['level']} {_size(llc['bytes'])}" if llc else ""
    lines = [
        f"cpu: {cpu['model_name'] or cpu['vendor']}{llc_text} — kernels: "
        f"{kernel_isa_words(cpu['kernel_isa'], cpu.get('kernel_isa_by_type'))} "
        f"(runnable: {', '.join(cpu['kernel_isas_runnable'])}; decode prefetch "
        f"{prefetch_name(cpu.get('kernel_decode_prefetch'))}"
        f"{', ' + cpu['kernel_decode_prefetch_source'] if cpu.get('kernel_decode_prefetch_source') else ''})",
        f"numa: {'yes' if topo['numa'] else 'no'}, {nodes}; usable cpus {len(topo['usable_cpus'])}",
        f"thread pool: {pool['n_threads']} workers on cpus {pool['cpus']}",
        f"huge pages: {pools or 'none'}; THP {d['thp']['enabled'] or 'unavailable'}",
    ]
    cuda = d.get("cuda")
    if cuda is not None:
        lines.append(f"cuda: {cuda['reason']}" if cuda["available"] else f"cuda: not used: {cuda['reason']}")
    lines += [f"warning: {w}" for w in d["warnings"]]
    return lines
