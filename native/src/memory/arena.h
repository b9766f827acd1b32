// The weights arena: memory the core owns for weights (repacked tensors), mapped once at its
// full capacity (the loader knows the total size up front) and handed out by bump allocation.
//
// Backing, per ArenaOptions::hugepages ("auto" tries them in this order):
//   hugetlb  anonymous MAP_HUGETLB (2 MiB or 1 GiB) from the reserved pool; reserved at mmap and
//            prefaulted (MADV_POPULATE_WRITE) so a short pool fails here, never as SIGBUS later
//   thp      2 MiB-aligned anonymous memory + MADV_HUGEPAGE (best effort, no reservation)
//   normal   4 KiB pages, MADV_NOHUGEPAGE so that "off" also means off under THP=always
// When hugetlb is demanded explicitly and the pool is short, construction throws ResourceError
// saying how many pages are needed and how to reserve them; with auto the reason is kept in
// fallback_reason() for the caller to log. What was obtained is read back with smaps().
//
// node >= 0: the range is mbind()-ed to that node before anything touches it; interleave (with
// node = -1): mbind(MPOL_INTERLEAVE) over those nodes instead. Prefaulting by
// that node's pinned workers (parallel first touch) is a later optimisation; today the pages of
// thp/normal arenas are faulted by whoever writes them first, on the bound node.
// mlock: locks thp/normal arenas (hugetlb pages are never swapped; not locked).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace ktd {

enum class HugePages { Auto, HugeTLB, THP, Off };
enum class ArenaKind { HugeTLB2M, HugeTLB1G, THP, Normal };

// "auto", "hugetlb", "thp", "off" (the config values). Throws std::invalid_argument.
HugePages parse_hugepages(const std::string &text);
// "hugetlb_2M", "hugetlb_1G", "thp", "normal".
const char *arena_kind_name(ArenaKind kind);

constexpr size_t kPage2M = size_t(2) << 20;
constexpr size_t kPage1G = size_t(1) << 30;

struct ArenaOptions {
    HugePages hugepages = HugePages::Auto;
    size_t hugetlb_page_size = kPage2M;  // kPage2M or kPage1G
    bool mlock = false;
    int node = -1;                       // -1: no NUMA binding
    std::vector<int> interleave;         // with node = -1: pages interleaved over these nodes
    std::string sysfs_root = "/sys";     // where huge page pools and THP mode are read
};

class Arena {
public:
    // Maps capacity bytes (rounded up to the page size obtained). Throws std::invalid_argument
    // (bad options), ResourceError (demanded backing unavailable), SysError (mmap, mbind, mlock).
    Arena(size_t capacity, const ArenaOptions &opts = {});
    ~Arena();
    Arena(const Arena &) = delete;
    Arena &operator=(const Arena &) = delete;

    // Bump allocation: bytes at an address aligned to align (a power of two). Throws
    // ResourceError when the arena is full, std::invalid_argument for a bad align.
    void *alloc(size_t bytes, size_t align = 64);
    // Forgets every allocation (the pages stay mapped with their bytes): the loader allocating the
    // same layout again.
    void reset() { used_ = 0; }

    void *base() const { return base_; }
    size_t capacity() const { return capacity_; }  // mapped bytes
    size_t requested() const { return requested_; }  // the capacity asked for
    size_t used() const { return used_; }
    size_t page_size() const { return page_size_; }  // of the backing (4 KiB for thp/normal)
    ArenaKind kind() const { return kind_; }
    int node() const { return node_; }
    bool locked() const { return locked_; }
    // Why the better kinds were not used ("" when the first choice worked), for the log.
    const std::string &fallback_reason() const { return fallback_reason_; }
    // smaps_range() over the arena's mapping.
    std::map<std::string, uint64_t> smaps() const;

    // The first `bytes` of the arena become a private mapping of fd's bytes [offset, offset +
    // bytes) (MAP_FIXED over the anonymous pages, PROT_READ|PROT_WRITE, copy-on-write): the page
    // cache's pages are mapped rather than copied into fresh pages, so nothing is zeroed or copied
    // (a prepared-weights cache hit). Only for an unbound, unlocked thp or normal arena: the file's
    // pages are wherever the page cache put them (no NUMA placement), and a thp arena maps them
    // with MADV_HUGEPAGE (the kernel maps a file's 2 MiB folios with one PMD when the offset is
    // 2 MiB-aligned, as the base is), a normal one with MADV_NOHUGEPAGE. Returns "" or why not
    // (nothing changed then). used() is not changed.
    std::string map_file(int fd, uint64_t offset, size_t bytes);
    // map_file's writable twin for a first load: the whole arena (capacity() bytes) becomes a
    // shared mapping of fd's bytes [offset, offset + capacity()) (MAP_SHARED|MAP_FIXED), so that
    // what the loader writes lands in the file's page cache (a prepared-weights cache entry being
    // written) instead of in fresh anonymous pages that would be copied to the file afterwards.
    // The file must already have those bytes allocated (posix_fallocate: a full disk cannot fault
    // a write later). Same conditions as map_file; "" or why not (nothing changed then).
    std::string map_file_shared(int fd, uint64_t offset);
    // After a map_file_shared: the arena's bytes from `bytes` on (page-rounded) become anonymous
    // again, so that the file may be truncated there (a mapping beyond a file's end faults).
    void trim_file(size_t bytes);
    // Whether map_file() or map_file_shared() replaced the arena's start; unmap_file() puts fresh anonymous memory of
    // the arena's kind back (the file's bytes are gone from the arena then).
    bool file_mapped() const { return file_bytes_ != 0; }
    void unmap_file();

private:
    void *base_ = nullptr;
    size_t capacity_ = 0, requested_ = 0, used_ = 0, page_size_ = 4096;
    ArenaKind kind_ = ArenaKind::Normal;
    int node_ = -1;
    bool locked_ = false;
    bool bound_ = false;  // node or interleave policy applied
    std::string file_mapping_refusal(uint64_t offset) const;
    size_t file_bytes_ = 0;  // mapped from a file by map_file()
    std::string fallback_reason_;
};

}  // namespace ktd
