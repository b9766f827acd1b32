#include "model/weights_cache.h"

#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <utility>

#include "common/crc32c.h"

namespace ktd {

namespace {

constexpr char kMagic[8] = {'K', 'T', 'D', 'W', 'C', 'A', 'C', 'H'};
constexpr uint64_t kAlign = 4096;
constexpr uint64_t kSectionAlign = uint64_t(2) << 20;  // where the writer puts sections (mappable as PMDs)
constexpr uint64_t kChunk = uint64_t(8) << 20;   // checksum and I/O unit
constexpr uint64_t kMaxHeader = uint64_t(1) << 30;

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

struct Fd {
    int fd = -1;
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
};

std::string errno_text(const std::string &what, int e) { return what + ": " + std::strerror(e); }

// Who may have written a file (ktd.ops.file_trust has the same rule for the daemon's other files):
// CRC-32C proves an entry intact, not who wrote it. An entry is trusted only when it and its
// directory belong to this process's user or root and neither is writable by group or others.
std::string untrusted(const struct stat &st, const std::string &what) {
    const uid_t me = ::geteuid();
    if (st.st_uid != me && st.st_uid != 0)
        return what + " is owned by uid " + std::to_string(st.st_uid) + ", not by this process's user (uid " +
               std::to_string(me) + ") or root";
    if (st.st_mode & (S_IWGRP | S_IWOTH)) {
        char mode[8];
        std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
        return what + " is writable by its group or others (mode " + mode + "); chmod go-w it";
    }
    return "";
}

// The entry's directory, opened (a symbolic link to it is followed) and checked on the
// descriptor: -1 with `reason` set when it cannot be opened or is not trusted.
int open_cache_dir(const std::string &path, std::string &reason) {
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        reason = errno_text("open " + dir, errno);
        return -1;
    }
    struct stat st {};
    if (::fstat(dfd, &st) != 0) reason = errno_text("fstat " + dir, errno);
    else reason = untrusted(st, "the cache directory " + dir);
    if (!reason.empty()) {
        ::close(dfd);
        return -1;
    }
    return dfd;
}

// The entry at `path` for reading: opened inside its checked directory without following a
// symbolic link (O_NOFOLLOW), then checked on the descriptor, so nothing is swapped in between.
// -1 with `reason` set ("" and errno ENOENT when there is no entry); `st` filled on success.
int open_entry(const std::string &path, struct stat &st, std::string &reason) {
    reason.clear();
    Fd dir;
    dir.fd = open_cache_dir(path, reason);
    if (dir.fd < 0) return -1;
    const std::string name = path.substr(path.rfind('/') + 1);
    const int fd = ::openat(dir.fd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        const int e = errno;
        if (e == ELOOP) reason = path + " is a symbolic link (not followed)";
        else if (e != ENOENT) reason = errno_text("open", e);
        errno = e;
        return -1;
    }
    if (::fstat(fd, &st) != 0) reason = errno_text("fstat", errno);
    else if (!S_ISREG(st.st_mode)) reason = path + " is not a regular file";
    else reason = untrusted(st, "the entry");
    if (!reason.empty()) {
        ::close(fd);
        return -1;
    }
    return fd;
}

// Full pread/pwrite (short transfers continued); false with errno set on failure, EIO for an
// unexpected end of file.
bool pread_all(int fd, void *buf, size_t n, uint64_t off) {
    auto *p = static_cast<uint8_t *>(buf);
    while (n) {
        const ssize_t r = ::pread(fd, p, n, off_t(off));
        if (r < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        if (r == 0) {
            errno = EIO;
            return false;
        }
        p += r;
        n -= size_t(r);
        off += uint64_t(r);
    }
    return true;
}

bool pwrite_all(int fd, const void *buf, size_t n, uint64_t off) {
    const auto *p = static_cast<const uint8_t *>(buf);
    while (n) {
        const ssize_t r = ::pwrite(fd, p, n, off_t(off));
        if (r < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        p += r;
        n -= size_t(r);
        off += uint64_t(r);
    }
    return true;
}

template <class T>
void put(std::vector<uint8_t> &b, size_t at, T v) {
    std::memcpy(b.data() + at, &v, sizeof v);
}
template <class T>
T get(const std::vector<uint8_t> &b, size_t at) {
    T v;
    std::memcpy(&v, b.data() + at, sizeof v);
    return v;
}

uint64_t n_chunks(uint64_t bytes) { return (bytes + kChunk - 1) / kChunk; }

// The parsed header of a file (the whole header read and its CRC checked).
struct Parsed {
    uint64_t header_bytes = 0, file_bytes = 0, chunk_bytes = 0;
    std::string key;
    std::vector<uint64_t> offset, bytes;
    std::vector<std::vector<std::array<uint32_t, 4>>> crcs;  // [section][chunk]
};

// "" or the problem.
std::string parse_header(int fd, uint64_t actual_size, Parsed &h) {
    std::vector<uint8_t> b(48);
    if (actual_size < 48) return "truncated (" + std::to_string(actual_size) + " bytes, no header)";
    if (!pread_all(fd, b.data(), 48, 0)) return errno_text("read", errno);
    if (std::memcmp(b.data(), kMagic, 8) != 0) return "not a ktd weights cache file (bad magic)";
    if (const uint32_t v = get<uint32_t>(b, 8); v != kWeightsCacheVersion)
        return "cache format version " + std::to_string(v) + ", this ktd reads version " +
               std::to_string(kWeightsCacheVersion);
    const uint32_t header_crc = get<uint32_t>(b, 12);
    h.header_bytes = get<uint64_t>(b, 16);
    h.file_bytes = get<uint64_t>(b, 24);
    h.chunk_bytes = get<uint64_t>(b, 32);
    const uint32_t n_sections = get<uint32_t>(b, 40), key_len = get<uint32_t>(b, 44);
    if (h.file_bytes != actual_size)
        return "truncated or extended: " + std::to_string(actual_size) + " bytes, the header says " +
               std::to_string(h.file_bytes);
    if (h.header_bytes < 48 || h.header_bytes > kMaxHeader || h.header_bytes > h.file_bytes || h.header_bytes % kAlign)
        return "bad header size " + std::to_string(h.header_bytes);
    if (h.chunk_bytes != kChunk) return "chunk size " + std::to_string(h.chunk_bytes) + " (expected " +
                                        std::to_string(kChunk) + ")";
    b.resize(size_t(h.header_bytes));
    if (!pread_all(fd, b.data() + 48, size_t(h.header_bytes) - 48, 48)) return errno_text("read", errno);
    if (crc32c(b.data() + 16, b.size() - 16) != header_crc) return "header checksum mismatch";
    size_t at = 48;
    auto room = [&](uint64_t n) { return n <= b.size() && at <= b.size() - n; };
    if (!room(key_len)) return "key outside the header";
    h.key.assign(reinterpret_cast<const char *>(b.data() + at), key_len);
    at = size_t(align_up(at + key_len, 8));
    if (n_sections > 4096 || !room(uint64_t(n_sections) * 16)) return "bad section count";
    for (uint32_t s = 0; s < n_sections; ++s, at += 16) {
        const uint64_t off = get<uint64_t>(b, at), bytes = get<uint64_t>(b, at + 8);
        if (off % kAlign || off < h.header_bytes || off > h.file_bytes || bytes > h.file_bytes - off)
            return "section " + std::to_string(s) + " outside the file";
        h.offset.push_back(off);
        h.bytes.push_back(bytes);
    }
    for (uint32_t s = 0; s < n_sections; ++s) {
        const uint64_t n = n_chunks(h.bytes[s]);
        if (!room(n * 16)) return "checksum table outside the header";
        std::vector<std::array<uint32_t, 4>> c(static_cast<size_t>(n));
        std::memcpy(c.data(), b.data() + at, size_t(n) * 16);
        at += size_t(n) * 16;
        h.crcs.push_back(std::move(c));
    }
    return "";
}

// The first line that differs between two keys (for the log).
std::string key_difference(const std::string &want, const std::string &have) {
    size_t a = 0, b = 0;
    while (a < want.size() || b < have.size()) {
        const size_t ea = std::min(want.find('\n', a), want.size()), eb = std::min(have.find('\n', b), have.size());
        const std::string la = want.substr(a, ea - a), lb = have.substr(b, eb - b);
        if (la != lb) {
            const std::string name = la.substr(0, la.find('='));
            return name + " differs (entry: " + (lb.empty() ? "<none>" : lb) + ", now: " + la + ")";
        }
        a = ea + 1;
        b = eb + 1;
    }
    return "";
}

}  // namespace

std::string native_build_id() {
    struct Ctx {
        uintptr_t addr;
        std::string id;
    } ctx{reinterpret_cast<uintptr_t>(&native_build_id), ""};
    dl_iterate_phdr(
        [](dl_phdr_info *info, size_t, void *data) -> int {
            auto *c = static_cast<Ctx *>(data);
            bool mine = false;
            for (int i = 0; i < info->dlpi_phnum; ++i) {
                const auto &ph = info->dlpi_phdr[i];
                const uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
                if (ph.p_type == PT_LOAD && c->addr >= lo && c->addr < lo + ph.p_memsz) mine = true;
            }
            if (!mine) return 0;
            for (int i = 0; i < info->dlpi_phnum; ++i) {
                const auto &ph = info->dlpi_phdr[i];
                if (ph.p_type != PT_NOTE) continue;
                const auto *p = reinterpret_cast<const uint8_t *>(info->dlpi_addr + ph.p_vaddr);
                const uint8_t *end = p + ph.p_memsz;
                while (p + sizeof(ElfW(Nhdr)) <= end) {
                    ElfW(Nhdr) nh;
                    std::memcpy(&nh, p, sizeof nh);
                    const uint8_t *name = p + sizeof nh, *desc = name + align_up(nh.n_namesz, 4);
                    if (desc + nh.n_descsz > end) break;
                    if (nh.n_type == NT_GNU_BUILD_ID && nh.n_namesz == 4 && std::memcmp(name, "GNU", 4) == 0) {
                        static const char *hex = "0123456789abcdef";
                        for (uint32_t k = 0; k < nh.n_descsz; ++k) {
                            c->id += hex[desc[k] >> 4];
                            c->id += hex[desc[k] & 15];
                        }
                        return 1;
                    }
                    p = desc + align_up(nh.n_descsz, 4);
                }
            }
            return 1;
        },
        &ctx);
    return ctx.id;
}

std::string weights_cache_path(const std::string &dir, const std::string &model_realpath, const std::string &layout) {
    std::string stem = model_realpath.substr(model_realpath.rfind('/') + 1);
    if (stem.size() > 5 && stem.compare(stem.size() - 5, 5, ".gguf") == 0) stem.resize(stem.size() - 5);
    if (stem.size() > 120) stem.resize(120);
    const std::string both = model_realpath + '\n' + layout;
    const uint32_t h1 = crc32c(both.data(), both.size()), h2 = crc32c(both.data(), both.size(), 0x9E3779B9u);
    char hex[17];
    std::snprintf(hex, sizeof hex, "%08x%08x", h1, h2);
    return dir + (dir.empty() || dir.back() == '/' ? "" : "/") + stem + "." + hex + ".ktdw";
}

std::vector<uint64_t> read_weights_cache(const std::string &path, const std::string &key,
                                         const std::vector<Arena *> &arenas, ThreadPool &pool,
                                         std::string &reason, LoadProgress *progress, bool map,
                                         size_t *mapped) {
    reason.clear();
    if (mapped) *mapped = 0;
    Fd f;
    struct stat st {};
    f.fd = open_entry(path, st, reason);
    if (f.fd < 0) return {};
    Parsed h;
    if (std::string p = parse_header(f.fd, uint64_t(st.st_size), h); !p.empty()) {
        reason = p;
        return {};
    }
    if (h.key != key) {
        reason = "stale: " + key_difference(key, h.key);
        return {};
    }
    if (h.bytes.size() != arenas.size()) {
        reason = "stale: " + std::to_string(h.bytes.size()) + " sections, the model has " +
                 std::to_string(arenas.size()) + " arenas";
        return {};
    }
    for (size_t s = 0; s < arenas.size(); ++s)
        if (h.bytes[s] > arenas[s]->capacity()) {
            reason = "section " + std::to_string(s) + " larger than its arena";
            return {};
        }
    // Sections mapped from the entry rather than read (map_file says why not: then read).
    std::vector<bool> is_mapped(arenas.size(), false);
    struct Unmap {  // a failed check: the arenas get anonymous memory back
        const std::vector<Arena *> &arenas;
        bool armed = true;
        ~Unmap() {
            if (armed)
                for (Arena *a : arenas) a->unmap_file();
        }
    } unmap{arenas};
    for (size_t s = 0; map && s < arenas.size(); ++s)
        if (h.bytes[s] && arenas[s]->map_file(f.fd, h.offset[s], size_t(h.bytes[s])).empty()) {
            is_mapped[s] = true;
            if (mapped) ++*mapped;
        }
    struct Item {
        size_t s;
        uint64_t c;
    };
    std::vector<Item> items;
    for (size_t s = 0; s < arenas.size(); ++s)
        for (uint64_t c = 0; c < n_chunks(h.bytes[s]); ++c) items.push_back({s, c});
    if (progress) {
        uint64_t total = 0;
        for (uint64_t b : h.bytes) total += b;
        progress->start(LoadProgress::ReadingCache, total);
    }
    std::mutex mu;
    std::atomic<bool> failed{false};
    pool.for_each_item(items.size(), [&](size_t i, int) {
        if (failed.load(std::memory_order_relaxed)) return;
        const Item it = items[i];
        const uint64_t off = it.c * kChunk, n = std::min(kChunk, h.bytes[it.s] - off);
        uint8_t *dst = static_cast<uint8_t *>(arenas[it.s]->base()) + off;
        std::string problem;
        if (!is_mapped[it.s] && !pread_all(f.fd, dst, size_t(n), h.offset[it.s] + off))
            problem = errno_text("read", errno);
        else if (crc32c_x4(dst, size_t(n)) != h.crcs[it.s][size_t(it.c)])
            problem = "checksum mismatch in section " + std::to_string(it.s) + " at byte " + std::to_string(off);
        if (progress) progress->add(n);
        if (!problem.empty()) {
            std::lock_guard<std::mutex> l(mu);
            if (!failed.exchange(true)) reason = problem;
        }
    });
    if (failed) return {};
    unmap.armed = false;
    return h.bytes;
}

std::string write_weights_cache(const std::string &path, const std::string &key, const std::vector<Arena *> &arenas,
                                ThreadPool *pool, LoadProgress *progress, const std::atomic<bool> *cancel) {
    // The header.
    size_t at = size_t(align_up(48 + key.size(), 8));
    const size_t sections_at = at;
    at += arenas.size() * 16;
    std::vector<uint64_t> offset(arenas.size());
    uint64_t table_bytes = 0;
    for (Arena *a : arenas) table_bytes += n_chunks(a->used()) * 16;
    const uint64_t header_bytes = align_up(at + table_bytes, kAlign);
    uint64_t end = header_bytes;
    for (size_t s = 0; s < arenas.size(); ++s) {
        offset[s] = align_up(end, kSectionAlign);
        end = align_up(offset[s] + arenas[s]->used(), kAlign);
    }
    std::vector<uint8_t> b(size_t(header_bytes), 0);
    std::memcpy(b.data(), kMagic, 8);
    put<uint32_t>(b, 8, kWeightsCacheVersion);
    put<uint64_t>(b, 16, header_bytes);
    put<uint64_t>(b, 24, end);
    put<uint64_t>(b, 32, kChunk);
    put<uint32_t>(b, 40, uint32_t(arenas.size()));
    put<uint32_t>(b, 44, uint32_t(key.size()));
    std::memcpy(b.data() + 48, key.data(), key.size());
    for (size_t s = 0; s < arenas.size(); ++s) {
        put<uint64_t>(b, sections_at + 16 * s, offset[s]);
        put<uint64_t>(b, sections_at + 16 * s + 8, arenas[s]->used());
    }

    // A temporary file next to the entry, renamed over it when complete; never in a directory
    // others may write (they could replace the entry after us).
    if (std::string why; Fd{open_cache_dir(path, why)}.fd < 0) return why;
    static std::atomic<unsigned> counter{0};
    const std::string tmp = path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    Fd f;
    f.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (f.fd < 0) return errno_text("cannot create " + tmp, errno);
    auto fail = [&](const std::string &why) {
        ::unlink(tmp.c_str());
        return why;
    };
    // Reserve the space first: a full disk fails here, before gigabytes are written.
    if (int e = ::posix_fallocate(f.fd, 0, off_t(end)); e != 0 && e != EOPNOTSUPP && e != EINVAL)
        return fail(errno_text("cannot reserve " + std::to_string(end) + " bytes for " + tmp, e));
    struct Item {
        size_t s;
        uint64_t c;
    };
    std::vector<Item> items;
    size_t crc_at = at;
    std::vector<size_t> crc_base(arenas.size());
    for (size_t s = 0; s < arenas.size(); ++s) {
        crc_base[s] = crc_at;
        for (uint64_t c = 0; c < n_chunks(arenas[s]->used()); ++c) items.push_back({s, c});
        crc_at += size_t(n_chunks(arenas[s]->used())) * 16;
    }
    if (progress) {
        uint64_t total = 0;
        for (Arena *a : arenas) total += a->used();
        progress->start(LoadProgress::WritingCache, total);
    }
    std::mutex mu;
    std::string error;
    auto write_item = [&](size_t i, int) {
        if (cancel && cancel->load(std::memory_order_relaxed)) {
            std::lock_guard<std::mutex> l(mu);
            if (error.empty()) error = "cancelled (the model was closed)";
            return;
        }
        const Item it = items[i];
        const uint64_t off = it.c * kChunk, n = std::min(kChunk, arenas[it.s]->used() - off);
        const uint8_t *src = static_cast<const uint8_t *>(arenas[it.s]->base()) + off;
        const std::array<uint32_t, 4> crc = crc32c_x4(src, size_t(n));
        std::memcpy(b.data() + crc_base[it.s] + size_t(it.c) * 16, crc.data(), 16);
        const bool ok = pwrite_all(f.fd, src, size_t(n), offset[it.s] + off);
        if (progress) progress->add(n);
        if (!ok) {
            const int e = errno;
            std::lock_guard<std::mutex> l(mu);
            if (error.empty()) error = errno_text("write " + tmp, e);
        }
    };
    if (pool) pool->for_each_item(items.size(), write_item);
    else
        for (size_t i = 0; i < items.size() && error.empty(); ++i) write_item(i, 0);
    if (!error.empty()) return fail(error);
    put<uint32_t>(b, 12, crc32c(b.data() + 16, b.size() - 16));
    if (!pwrite_all(f.fd, b.data(), b.size(), 0)) return fail(errno_text("write " + tmp, errno));
    if (::ftruncate(f.fd, off_t(end)) != 0) return fail(errno_text("truncate " + tmp, errno));
    if (::close(std::exchange(f.fd, -1)) != 0) return fail(errno_text("close " + tmp, errno));
    if (::rename(tmp.c_str(), path.c_str()) != 0) return fail(errno_text("rename to " + path, errno));
    return "";
}

WeightsCacheWriter::~WeightsCacheWriter() { abandon(); }

void WeightsCacheWriter::abandon() {
    if (fd_ < 0) return;
    ::close(std::exchange(fd_, -1));
    ::unlink(tmp_.c_str());
}

std::string WeightsCacheWriter::begin(const std::string &path, const std::string &key,
                                      const std::vector<Arena *> &arenas) {
    path_ = path;
    key_ = key;
    arenas_ = arenas;
    // The header's room: the key, the section table and the checksums of every arena's capacity
    // (an upper bound of the bytes it will use).
    uint64_t table_bytes = 0;
    for (Arena *a : arenas) table_bytes += n_chunks(a->capacity()) * 16;
    header_bytes_ = align_up(align_up(48 + key.size(), 8) + arenas.size() * 16 + table_bytes, kAlign);
    uint64_t end = header_bytes_;
    offset_.assign(arenas.size(), 0);
    // By the sizes the plan asked for (the bytes the load uses, normally all of them): the file
    // then needs no truncation at the end, which would split and unmap the large folio at its end.
    // A section's mapping covers its arena's capacity, up to the next 2 MiB offset or past the
    // file's end (never touched there: the load writes only what it allocates).
    for (size_t s = 0; s < arenas.size(); ++s) {
        offset_[s] = align_up(end, kSectionAlign);
        end = offset_[s] + arenas[s]->requested();
    }
    file_bytes_ = align_up(end, kAlign);
    if (std::string why; Fd{open_cache_dir(path, why)}.fd < 0) return why;  // as write_weights_cache
    static std::atomic<unsigned> counter{0};
    tmp_ = path + ".tmp-" + std::to_string(::getpid()) + "-d" + std::to_string(counter++);
    fd_ = ::open(tmp_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) return errno_text("cannot create " + tmp_, errno);
    // Every byte reserved before anything is mapped: a write through the mapping can then never
    // meet a full disk (which would be SIGBUS, not an error).
    if (int e = ::posix_fallocate(fd_, 0, off_t(file_bytes_)); e != 0) {
        abandon();
        return errno_text("cannot reserve " + std::to_string(file_bytes_) + " bytes for " + tmp_, e);
    }
    for (size_t s = 0; s < arenas.size(); ++s)
        if (std::string why = arenas[s]->map_file_shared(fd_, offset_[s]); !why.empty()) {
            for (size_t t = 0; t < s; ++t) arenas[t]->unmap_file();
            abandon();
            return "arena " + std::to_string(s) + ": " + why;
        }
    return "";
}

std::string WeightsCacheWriter::commit(ThreadPool &pool, LoadProgress *progress) {
    if (fd_ < 0) return "no entry being written";
    std::vector<uint8_t> b(size_t(header_bytes_), 0);
    std::memcpy(b.data(), kMagic, 8);
    put<uint32_t>(b, 8, kWeightsCacheVersion);
    put<uint64_t>(b, 16, header_bytes_);
    put<uint64_t>(b, 32, kChunk);
    put<uint32_t>(b, 40, uint32_t(arenas_.size()));
    put<uint32_t>(b, 44, uint32_t(key_.size()));
    std::memcpy(b.data() + 48, key_.data(), key_.size());
    size_t at = size_t(align_up(48 + key_.size(), 8));
    for (size_t s = 0; s < arenas_.size(); ++s, at += 16) {
        put<uint64_t>(b, at, offset_[s]);
        put<uint64_t>(b, at + 8, arenas_[s]->used());
    }
    struct Item {
        size_t s;
        uint64_t c;
    };
    std::vector<Item> items;
    std::vector<size_t> crc_at(arenas_.size());
    uint64_t total = 0;
    for (size_t s = 0; s < arenas_.size(); ++s) {
        crc_at[s] = at;
        for (uint64_t c = 0; c < n_chunks(arenas_[s]->used()); ++c) items.push_back({s, c});
        at += size_t(n_chunks(arenas_[s]->used())) * 16;
        total += arenas_[s]->used();
    }
    if (progress) progress->start(LoadProgress::WritingCache, total);
    pool.for_each_item(items.size(), [&](size_t i, int) {
        const Item it = items[i];
        const uint64_t off = it.c * kChunk, n = std::min(kChunk, arenas_[it.s]->used() - off);
        const std::array<uint32_t, 4> crc =
            crc32c_x4(static_cast<const uint8_t *>(arenas_[it.s]->base()) + off, size_t(n));
        std::memcpy(b.data() + crc_at[it.s] + size_t(it.c) * 16, crc.data(), 16);
        if (progress) progress->add(n);
    });
    // The file ends where the last section's bytes do (as an entry written after a load): the
    // arenas' unused tails are taken off the file first.
    for (Arena *a : arenas_) a->trim_file(a->used());
    const uint64_t end = arenas_.empty() ? header_bytes_ : align_up(offset_.back() + arenas_.back()->used(), kAlign);
    put<uint64_t>(b, 24, end);
    put<uint32_t>(b, 12, crc32c(b.data() + 16, b.size() - 16));
    std::string err;
    if (end != file_bytes_ && ::ftruncate(fd_, off_t(end)) != 0) err = errno_text("truncate " + tmp_, errno);
    else if (!pwrite_all(fd_, b.data(), b.size(), 0)) err = errno_text("write " + tmp_, errno);
    else if (::rename(tmp_.c_str(), path_.c_str()) != 0) err = errno_text("rename to " + path_, errno);
    if (!err.empty()) {
        abandon();  // the arenas' mappings keep the unlinked file's pages
        return err;
    }
    // The mappings keep the file open; the descriptor is not needed any more.
    ::close(std::exchange(fd_, -1));
    return "";
}

WeightsCacheHeader read_weights_cache_header(const std::string &path) {
    WeightsCacheHeader out;
    Fd f;
    struct stat st {};
    f.fd = open_entry(path, st, out.problem);
    if (f.fd < 0) {
        if (out.problem.empty()) out.problem = errno_text("open", errno);
        return out;
    }
    Parsed h;
    out.problem = parse_header(f.fd, uint64_t(st.st_size), h);
    out.ok = out.problem.empty();
    out.key = h.key;
    out.file_bytes = uint64_t(st.st_size);
    out.section_bytes = h.bytes;
    return out;
}

std::string verify_weights_cache(const std::string &path) {
    Fd f;
    struct stat st {};
    std::string why;
    f.fd = open_entry(path, st, why);
    if (f.fd < 0) return why.empty() ? errno_text("open", errno) : why;
    Parsed h;
    if (std::string p = parse_header(f.fd, uint64_t(st.st_size), h); !p.empty()) return p;
    std::vector<uint8_t> buf(kChunk);
    for (size_t s = 0; s < h.bytes.size(); ++s)
        for (uint64_t c = 0; c < n_chunks(h.bytes[s]); ++c) {
            const uint64_t off = c * kChunk, n = std::min(kChunk, h.bytes[s] - off);
            if (!pread_all(f.fd, buf.data(), size_t(n), h.offset[s] + off)) return errno_text("read", errno);
            if (crc32c_x4(buf.data(), size_t(n)) != h.crcs[s][size_t(c)])
                return "checksum mismatch in section " + std::to_string(s) + " at byte " + std::to_string(off);
        }
    return "";
}

}  // namespace ktd
