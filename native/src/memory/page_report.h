// What the kernel actually gave us, read back rather than assumed: per-mapping page counters
// from /proc/self/smaps, the huge page pools from /proc/meminfo and sysfs, the THP mode.
// Note hugetlb memory appears as Private_Hugetlb/Shared_Hugetlb and is NOT counted in Rss.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace ktd {

// Sums the smaps entries of every VMA overlapping [addr, addr+len). Fields given in kB
// (Size, Rss, Private_Hugetlb, AnonHugePages, FilePmdMapped, Locked, ...) are returned in
// bytes under their smaps names; KernelPageSize/MMUPageSize are the largest seen (bytes);
// THPeligible is 1 if any VMA is eligible; "vmas" is the number of VMAs summed.
// Throws std::runtime_error if the file cannot be read.
std::map<std::string, uint64_t> smaps_range(const void *addr, size_t len,
                                            const std::string &path = "/proc/self/smaps");

// /proc/meminfo as name -> value; "kB" values converted to bytes, counts (HugePages_*) as is.
std::map<std::string, uint64_t> read_meminfo(const std::string &path = "/proc/meminfo");

struct HugePagePool {
    uint64_t page_size = 0;  // bytes
    int node = -1;           // -1: the system-wide pool, else that NUMA node's share
    uint64_t nr = 0, free = 0, resv = 0, surplus = 0;  // pages; resv/surplus only system-wide
};

// Every huge page size under <root>/kernel/mm/hugepages, system-wide, then per node from
// <root>/devices/system/node/node*/hugepages. Missing directories give no entries.
std::vector<HugePagePool> hugepage_pools(const std::string &sysfs_root = "/sys");

// The selected value of <root>/kernel/mm/transparent_hugepage/<file> ("enabled" or "defrag"):
// "always", "madvise", "never", ...; "" when the file is absent (kernel without THP).
std::string thp_setting(const std::string &file = "enabled", const std::string &sysfs_root = "/sys");

}  // namespace ktd
