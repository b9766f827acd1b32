#include "memory/arena.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "common/error.h"
#include "memory/numa_policy.h"
#include "memory/page_report.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
#ifndef MAP_HUGE_SHIFT
#define MAP_HUGE_SHIFT 26
#endif

namespace ktd {

namespace {

constexpr size_t kSmallPage = 4096;

std::string human(size_t bytes) {
    if (bytes >= kPage1G && bytes % kPage1G == 0) return std::to_string(bytes / kPage1G) + " GiB";
    if (bytes >= (size_t(1) << 20) && bytes % (size_t(1) << 20) == 0)
        return std::to_string(bytes >> 20) + " MiB";
    return std::to_string(bytes) + " bytes";
}

size_t round_up(size_t x, size_t align) {
    if (x > SIZE_MAX - (align - 1)) throw std::invalid_argument("arena capacity " + std::to_string(x) + " too large");
    return (x + align - 1) / align * align;
}

struct Mapping {
    void *base = nullptr;
    size_t len = 0;
};

// Why a hugetlb mapping of `pages` pages could not be had, with the numbers of the pool and
// how to reserve enough.
std::string hugetlb_shortfall(size_t pages, size_t psize, int node, const std::string &sysfs_root,
                              const std::string &what_failed) {
    const std::string size_dir = "hugepages-" + std::to_string(psize / 1024) + "kB";
    std::string msg = "hugetlb " + human(psize) + " pages: " + what_failed + "; need " +
                      std::to_string(pages) + " pages (" + human(pages * psize) + ")" +
                      (node >= 0 ? " on node " + std::to_string(node) : "");
    const HugePagePool *global = nullptr, *on_node = nullptr;
    std::vector<HugePagePool> pools = hugepage_pools(sysfs_root);
    for (const auto &p : pools)
        if (p.page_size == psize) {
            if (p.node < 0) global = &p;
            else if (p.node == node) on_node = &p;
        }
    if (!global)
        return msg + "; the kernel offers no " + human(psize) + " huge pages (no " + sysfs_root +
               "/kernel/mm/hugepages/" + size_dir + ")";
    const uint64_t avail = global->free > global->resv ? global->free - global->resv : 0;
    msg += "; the pool has " + std::to_string(avail) + " available (nr_hugepages " +
           std::to_string(global->nr) + ", free " + std::to_string(global->free) + ", reserved " +
           std::to_string(global->resv) + ")";
    uint64_t usable = avail;
    if (on_node) {
        msg += ", node " + std::to_string(node) + " has " + std::to_string(on_node->free) + " free";
        usable = std::min<uint64_t>(usable, on_node->free);
    }
    const uint64_t short_by = pages > usable ? pages - usable : pages;
    const uint64_t target = global->nr + short_by;
    msg += ". Reserve at least " + std::to_string(short_by) + " more: ";
    const auto meminfo = read_meminfo();
    const auto hp = meminfo.find("Hugepagesize");
    const bool default_size = hp != meminfo.end() && hp->second == psize;
    if (default_size) msg += "sysctl -w vm.nr_hugepages=" + std::to_string(target) + " (persist in /etc/sysctl.d/), or ";
    msg += "echo " + std::to_string(target) + " > /sys/kernel/mm/hugepages/" + size_dir + "/nr_hugepages";
    if (node >= 0)
        msg += "; per node: /sys/devices/system/node/node" + std::to_string(node) + "/hugepages/" +
               size_dir + "/nr_hugepages";
    if (psize == kPage1G)
        msg += "; 1 GiB pages are best reserved at boot (kernel command line: hugepagesz=1G hugepages=" +
               std::to_string(target) + "), run-time reservation fails once memory is fragmented";
    return msg;
}

// Anonymous MAP_HUGETLB mapping, bound and prefaulted; nullopt (reason set) when unavailable.
std::optional<Mapping> map_hugetlb(size_t capacity, const ArenaOptions &o, std::string &reason) {
    const size_t psize = o.hugetlb_page_size;
    const size_t len = round_up(capacity, psize);
    const int size_flag = (psize == kPage1G ? 30 : 21) << MAP_HUGE_SHIFT;
    void *p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | size_flag,
                   -1, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        reason = hugetlb_shortfall(len / psize, psize, o.node, o.sysfs_root,
                                   std::string("mmap(MAP_HUGETLB) failed: ") + std::strerror(e));
        return std::nullopt;
    }
    if (o.node >= 0 || !o.interleave.empty()) {
        try {
            if (o.node >= 0) bind_range_to_node(p, len, o.node);
            else interleave_range(p, len, o.interleave);
        } catch (...) {
            munmap(p, len);
            throw;
        }
    }
    // The pages are reserved system-wide at mmap, but a node-bound fault can still find its
    // node empty (SIGBUS on touch); MADV_POPULATE_WRITE reports that as an error instead.
    if (madvise(p, len, MADV_POPULATE_WRITE) != 0) {
        int e = errno;
        if (e == EINVAL && o.node < 0) {
            // Kernel before 5.14: the mmap reservation guarantees the pages; touch them.
            for (size_t off = 0; off < len; off += psize) static_cast<volatile char *>(p)[off] = 0;
        } else {
            munmap(p, len);
            reason = hugetlb_shortfall(len / psize, psize, o.node, o.sysfs_root,
                                       std::string("prefaulting (MADV_POPULATE_WRITE) failed: ") + std::strerror(e));
            return std::nullopt;
        }
    }
    return Mapping{p, len};
}

// Maps len bytes of anonymous memory aligned to align (a power of two >= 4 KiB).
Mapping map_aligned(size_t len, size_t align) {
    const size_t extra = align > kSmallPage ? align : 0;
    void *p = mmap(nullptr, len + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (p == MAP_FAILED) throw SysError("mmap(" + human(len) + ")", errno);
    if (!extra) return Mapping{p, len};
    uintptr_t a = reinterpret_cast<uintptr_t>(p), aligned = (a + align - 1) & ~(uintptr_t(align) - 1);
    if (aligned > a) munmap(p, aligned - a);
    size_t tail = (a + len + extra) - (aligned + len);
    if (tail) munmap(reinterpret_cast<void *>(aligned + len), tail);
    return Mapping{reinterpret_cast<void *>(aligned), len};
}

std::optional<Mapping> map_thp(size_t capacity, const ArenaOptions &o, std::string &reason) {
    const std::string mode = thp_setting("enabled", o.sysfs_root);
    const std::string file = o.sysfs_root + "/kernel/mm/transparent_hugepage/enabled";
    if (mode.empty()) {
        reason = "transparent huge pages: the kernel has none (no " + file + ")";
        return std::nullopt;
    }
    if (mode == "never") {
        reason = "transparent huge pages are disabled (" + file + " is 'never'; set it to 'madvise')";
        return std::nullopt;
    }
    const size_t len = round_up(capacity, kPage2M);
    Mapping m = map_aligned(len, kPage2M);
    if (madvise(m.base, m.len, MADV_HUGEPAGE) != 0) {
        int e = errno;
        munmap(m.base, m.len);
        reason = std::string("transparent huge pages: madvise(MADV_HUGEPAGE) failed: ") + std::strerror(e);
        return std::nullopt;
    }
    return m;
}

Mapping map_normal(size_t capacity) {
    Mapping m = map_aligned(round_up(capacity, kSmallPage), kSmallPage);
    // Without THP compiled in this fails with EINVAL, and there is nothing to turn off then.
    madvise(m.base, m.len, MADV_NOHUGEPAGE);
    return m;
}

void append(std::string &reasons, const std::string &r) {
    if (!reasons.empty()) reasons += "; ";
    reasons += r;
}

}  // namespace

HugePages parse_hugepages(const std::string &text) {
    if (text == "auto") return HugePages::Auto;
    if (text == "hugetlb") return HugePages::HugeTLB;
    if (text == "thp") return HugePages::THP;
    if (text == "off") return HugePages::Off;
    throw std::invalid_argument("hugepages must be one of auto, hugetlb, thp, off; got '" + text + "'");
}

const char *arena_kind_name(ArenaKind kind) {
    switch (kind) {
        case ArenaKind::HugeTLB2M: return "hugetlb_2M";
        case ArenaKind::HugeTLB1G: return "hugetlb_1G";
        case ArenaKind::THP: return "thp";
        case ArenaKind::Normal: return "normal";
    }
    return "unknown";
}

Arena::Arena(size_t capacity, const ArenaOptions &opts) : requested_(capacity), node_(opts.node) {
    if (capacity == 0) throw std::invalid_argument("arena capacity must be > 0");
    if (opts.hugetlb_page_size != kPage2M && opts.hugetlb_page_size != kPage1G)
        throw std::invalid_argument("hugetlb page size must be 2 MiB or 1 GiB, got " +
                                    std::to_string(opts.hugetlb_page_size) + " bytes");
    if (opts.node < -1) throw std::invalid_argument("node must be -1 (no binding) or a node id");
    if (opts.node >= 0 && !opts.interleave.empty())
        throw std::invalid_argument("an arena is bound to one node or interleaved, not both");

    const HugePages mode = opts.hugepages;
    std::optional<Mapping> m;
    bool bound = false;  // the hugetlb path binds before prefaulting
    if (mode == HugePages::Auto || mode == HugePages::HugeTLB) {
        std::string reason;
        m = map_hugetlb(capacity, opts, reason);
        if (m) {
            kind_ = opts.hugetlb_page_size == kPage1G ? ArenaKind::HugeTLB1G : ArenaKind::HugeTLB2M;
            page_size_ = opts.hugetlb_page_size;
            bound = true;
        } else if (mode == HugePages::HugeTLB) {
            throw ResourceError(reason);
        } else {
            append(fallback_reason_, reason);
        }
    }
    if (!m && (mode == HugePages::Auto || mode == HugePages::THP)) {
        std::string reason;
        m = map_thp(capacity, opts, reason);
        if (m) kind_ = ArenaKind::THP;
        else if (mode == HugePages::THP) throw ResourceError(reason);
        else append(fallback_reason_, reason);
    }
    if (!m) {
        m = map_normal(capacity);
        kind_ = ArenaKind::Normal;
    }
    base_ = m->base;
    capacity_ = m->len;
    try {
        bound_ = opts.node >= 0 || !opts.interleave.empty();
        if (opts.node >= 0 && !bound) bind_range_to_node(base_, capacity_, opts.node);
        if (!opts.interleave.empty() && !bound) interleave_range(base_, capacity_, opts.interleave);
        if (opts.mlock && kind_ != ArenaKind::HugeTLB2M && kind_ != ArenaKind::HugeTLB1G) {
            if (::mlock(base_, capacity_) != 0)
                throw SysError("mlock(" + human(capacity_) + "; raise RLIMIT_MEMLOCK, systemd LimitMEMLOCK=)", errno);
            locked_ = true;
        }
    } catch (...) {
        munmap(base_, capacity_);
        throw;
    }
}

Arena::~Arena() {
    if (base_) munmap(base_, capacity_);
}

void *Arena::alloc(size_t bytes, size_t align) {
    if (align == 0 || (align & (align - 1)) != 0)
        throw std::invalid_argument("alignment must be a power of two, got " + std::to_string(align));
    const uintptr_t b = reinterpret_cast<uintptr_t>(base_);
    const uintptr_t cur = b + used_;
    const uintptr_t start = (cur + align - 1) & ~(uintptr_t(align) - 1);
    if (start < cur || start - b > capacity_ || bytes > capacity_ - (start - b))
        throw ResourceError("weights arena full: " + std::to_string(bytes) + " bytes (align " +
                            std::to_string(align) + ") requested, " + std::to_string(used_) + " of " +
                            std::to_string(capacity_) + " used");
    used_ = start - b + bytes;
    return reinterpret_cast<void *>(start);
}

std::map<std::string, uint64_t> Arena::smaps() const { return smaps_range(base_, capacity_); }

// Why the arena's start cannot become a file mapping at `offset` ("" when it can): the conditions
// map_file and map_file_shared share.
std::string Arena::file_mapping_refusal(uint64_t offset) const {
    if (kind_ != ArenaKind::THP && kind_ != ArenaKind::Normal) return "the arena is on reserved huge pages";
    if (bound_) return "the arena has a NUMA placement";
    if (locked_) return "the arena is locked (mlock)";
    if (offset % kSmallPage) return "the offset is not page-aligned";
    return "";
}

std::string Arena::map_file(int fd, uint64_t offset, size_t bytes) {
    if (std::string why = file_mapping_refusal(offset); !why.empty()) return why;
    const size_t len = round_up(bytes, kSmallPage);
    if (len == 0 || len > capacity_) return "the bytes do not fit the arena";
    if (file_bytes_ > len) unmap_file();  // a longer earlier mapping: its tail must not stay the file's
    void *p = ::mmap(base_, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, off_t(offset));
    if (p == MAP_FAILED) {
        const int e = errno;
        file_bytes_ = len;  // MAP_FIXED may have removed the old pages: fresh ones
        unmap_file();
        return std::string("mmap: ") + std::strerror(e);
    }
    file_bytes_ = len;
    madvise(base_, len, kind_ == ArenaKind::THP ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    return "";
}

std::string Arena::map_file_shared(int fd, uint64_t offset) {
    if (std::string why = file_mapping_refusal(offset); !why.empty()) return why;
    if (file_bytes_) unmap_file();
    void *p = ::mmap(base_, capacity_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, off_t(offset));
    if (p == MAP_FAILED) {
        const int e = errno;
        file_bytes_ = capacity_;  // MAP_FIXED may have removed the old pages: fresh ones
        unmap_file();
        return std::string("mmap (shared): ") + std::strerror(e);
    }
    file_bytes_ = capacity_;
    madvise(base_, capacity_, kind_ == ArenaKind::THP ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    return "";
}

void Arena::trim_file(size_t bytes) {
    const size_t len = round_up(bytes, kSmallPage);
    if (len >= file_bytes_) return;
    if (len == 0) {
        unmap_file();
        return;
    }
    void *tail = static_cast<uint8_t *>(base_) + len;
    void *p = ::mmap(tail, file_bytes_ - len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) throw SysError("mmap (weights arena)", errno);
    madvise(tail, file_bytes_ - len, kind_ == ArenaKind::THP ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    file_bytes_ = len;
}

void Arena::unmap_file() {
    if (!file_bytes_) return;
    const size_t len = file_bytes_;
    void *p = ::mmap(base_, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) throw SysError("mmap (weights arena)", errno);
    madvise(base_, len, kind_ == ArenaKind::THP ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    file_bytes_ = 0;
}

}  // namespace ktd
