// The prepared-weights cache: a model's arenas (everything the forward reads, repacked or copied
// by the loader) written to one file after a load, and read back into freshly mapped arenas on
// the next start instead of being prepared again from the GGUF.
//
// Layout is implicit: the loader allocates from the arenas in a fixed order, so the same file,
// build and placement give the same offsets. A cache entry therefore holds the arenas' bytes and a
// key naming everything the layout depends on, and a load that hits runs the loader in "attach"
// mode (the same allocations, nothing written) over the bytes read from the entry.
//
// The key (text, "name=value" lines) has two parts:
//   identity  the GGUF: its real path, size, mtime (ns) and the CRC-32C of its header and tensor
//             table (every byte before the tensor data)
//   layout    the cache format, the native module's build id (GNU build-id: any rebuild may change
//             a repacked layout), the active ISA, allow_repack, the pool's NUMA nodes, whether
//             experts are sharded and dense weights replicated, and each arena's planned size
// An entry is used only when both match exactly; the file name is derived from the model's real
// path and the layout part, so a model file replaced on disk maps to the same name and its stale
// entry is overwritten by the next load.
//
// File format (little-endian), version 1:
//   0   char[8]  "KTDWCACH"
//   8   u32      format version (1)
//   12  u32      CRC-32C of bytes [16, header_bytes)
//   16  u64      header_bytes (a multiple of 4096; the sections start here)
//   24  u64      file_bytes (the whole file: a truncated entry is caught before any read)
//   32  u64      chunk_bytes (checksum granularity)
//   40  u32      n_sections, u32 key_len
//   48  key[key_len], zero padding to 8
//       n_sections × {u64 offset, u64 bytes}
//       per section, per chunk of chunk_bytes: 4 × u32 crc32c_x4 of the chunk
//       zero padding to header_bytes
//   sections: the arenas' used bytes, each at a 4096-aligned offset (written at 2 MiB-aligned
//             offsets, so that a mapped section's 2 MiB page-cache folios map with one PMD each)
// Written to a temporary file in the same directory and renamed over the entry (atomic: a reader
// sees the old entry or the new one, two processes writing at once each rename a complete file).
// Not fsync'ed: after a crash a partly written entry fails its checksums and is rebuilt.
// Trust: the checksums prove an entry intact, not who wrote it. An entry is read only when it and
// its directory belong to this process's user or root and neither is writable by group or others,
// and it is opened without following a symbolic link (O_NOFOLLOW, checked on the descriptor);
// otherwise the reason says which rule failed (and the entry is rebuilt, or in a directory others
// may write, nothing is read or written). Nothing is written into a directory others may write.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/thread_pool.h"
#include "memory/arena.h"

namespace ktd {

constexpr uint32_t kWeightsCacheVersion = 1;

// Progress of a load, read by another thread while Model::open runs (the daemon's STATUS= line,
// `ktd run`'s bar): the phase and bytes done of the phase's total.
struct LoadProgress {
    enum Phase : int { Starting = 0, ReadingCache = 1, Preparing = 2, WritingCache = 3, Done = 4 };
    std::atomic<int> phase{Starting};
    std::atomic<uint64_t> done{0}, total{0};
    void start(Phase p, uint64_t bytes) {
        done = 0;
        total = bytes;
        phase = p;
    }
    void add(uint64_t bytes) { done.fetch_add(bytes, std::memory_order_relaxed); }
};

// What the load did with the cache (Model::cache(), logged by the engine).
struct WeightsCacheStatus {
    std::string path;    // the entry's file ("" when the cache is off)
    std::string state;   // "off", "hit", "written", "not written"
    std::string reason;  // why an existing entry was not used ("" on a hit or when none existed),
                         // or why the entry was not written
    uint64_t bytes = 0;  // the entry's size (hit or written)
    double seconds = 0;  // reading (hit) or writing (written) it, wall clock
    bool mapped = false;  // a hit: every section mapped from the entry, none read (cache_map)
    bool direct = false;  // written: prepared straight into the entry's pages (WeightsCacheWriter),
                          // which the model serves from
};

// The native module's build id (hex), "" when it has none.
std::string native_build_id();

// The entry's file name for a model (real path) and a layout key, inside dir.
std::string weights_cache_path(const std::string &dir, const std::string &model_realpath, const std::string &layout);

// Reads the entry at path into the arenas (sections in order; each must have at least the
// entry's bytes of capacity). Returns the sections' used bytes, or an empty vector with `reason`
// set (no entry: reason empty; other key; truncated; a checksum; an I/O error). The pool reads
// and checks the chunks in parallel; the arenas' pages are first touched by the reading workers.
// map: a section whose arena allows it (Arena::map_file: thp or normal pages, no NUMA placement,
// not locked) is mapped from the entry instead of read (no page zeroed, no byte copied: the page
// cache's pages, 2 MiB folios mapped whole where the kernel has them) and its checksums are
// computed over the mapping, in parallel; `mapped` (when given) says how many sections were. A
// failed check puts anonymous memory back under every mapped arena. The trade-off: a mapped
// entry truncated in place by something other than ktd (ktd only renames a new entry over it or
// unlinks it, which a mapping survives) would fault the daemon (SIGBUS), as a mapped GGUF would.
std::vector<uint64_t> read_weights_cache(const std::string &path, const std::string &key,
                                         const std::vector<Arena *> &arenas, ThreadPool &pool,
                                         std::string &reason, LoadProgress *progress = nullptr,
                                         bool map = false, size_t *mapped = nullptr);

// Writes the arenas' used bytes under path atomically. Returns "" or why it could not.
// pool null: on the calling thread only. cancel: checked between chunks (then "cancelled").
std::string write_weights_cache(const std::string &path, const std::string &key, const std::vector<Arena *> &arenas,
                                ThreadPool *pool, LoadProgress *progress = nullptr,
                                const std::atomic<bool> *cancel = nullptr);

// A new entry written while the model is prepared (a first load with cache_map): begin() creates
// the temporary file with every section's space reserved and maps each arena shared over its
// section (Arena::map_file_shared), so the loader's repacks and copies write the entry's page-cache
// pages directly: no anonymous page is zeroed for them and nothing is copied afterwards, and the
// model then serves from those pages as a hit that maps the entry does. commit() computes the
// checksums over them on the pool, writes the header and renames the file over the entry. The
// temporary file is unlinked when the writer goes without a commit (an exception in the load) or
// the commit fails (the arenas keep their bytes: an unlinked file's pages stay while mapped); a
// process killed before the rename leaves only the temporary file, which no reader opens (ktd
// cache prune removes it after an hour). Sections are laid out by the arenas' capacities (known
// before the load) at 2 MiB offsets; the header records the bytes used.
class WeightsCacheWriter {
public:
    WeightsCacheWriter() = default;
    WeightsCacheWriter(const WeightsCacheWriter &) = delete;
    WeightsCacheWriter &operator=(const WeightsCacheWriter &) = delete;
    ~WeightsCacheWriter();
    // "" or why not; on failure nothing is left (the arenas anonymous again, no temporary file).
    std::string begin(const std::string &path, const std::string &key, const std::vector<Arena *> &arenas);
    // "" or why not (the entry is then not written; the arenas keep their bytes).
    std::string commit(ThreadPool &pool, LoadProgress *progress = nullptr);
    bool active() const { return fd_ >= 0; }

private:
    std::string path_, tmp_, key_;
    std::vector<Arena *> arenas_;
    std::vector<uint64_t> offset_;
    uint64_t header_bytes_ = 0, file_bytes_ = 0;
    int fd_ = -1;
    void abandon();
};

// A cache file's header (ktd cache list/verify). ok = false: `problem` says what is wrong.
struct WeightsCacheHeader {
    bool ok = false;
    std::string problem;
    std::string key;
    uint64_t file_bytes = 0;
    std::vector<uint64_t> section_bytes;
};
WeightsCacheHeader read_weights_cache_header(const std::string &path);
// Every checksum of a cache file (single thread): "" or the first problem.
std::string verify_weights_cache(const std::string &path);

}  // namespace ktd
