// GGUF parsing and validation. Every count, length, offset, dimension and type id read from the
// file is checked before use, with overflow-safe arithmetic:
//   - reads never go past the end of the mapping (Cursor);
//   - a string or array length must fit in the bytes that remain (an array of N elements needs
//     at least N × the smallest encoding of its element type), and so must the key and tensor
//     counts — so no allocation is driven by a length field beyond what the file really holds;
//   - value type ids and GGML type ids must be known; bools are 0 or 1; arrays nest at most
//     kMaxArrayDepth deep (recursion is bounded);
//   - keys and tensor names are valid UTF-8 and unique;
//   - general.alignment, when present, is a UINT32 power of two;
//   - tensors have 1..4 dims, each >= 1, an element count that fits in int64, a row length that
//     is a whole number of blocks, an aligned offset and data that lies inside the file and
//     overlaps no other tensor's.
#include "gguf/gguf_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <limits>

#include "common/error.h"

namespace ktd {

static_assert(std::endian::native == std::endian::little,
              "GGUFFile reads little-endian values with memcpy; a big-endian host needs byte swaps");
static_assert(std::is_same_v<std::variant_alternative_t<size_t(GGUFValueType::STRING), GGUFValue>,
                             std::string_view> &&
                  std::is_same_v<std::variant_alternative_t<size_t(GGUFValueType::ARRAY), GGUFValue>,
                                 GGUFArray> &&
                  std::is_same_v<std::variant_alternative_t<size_t(GGUFValueType::FLOAT64), GGUFValue>,
                                 double>,
              "GGUFValue's alternatives must be in GGUF value type id order");

namespace {

constexpr uint32_t kGGUFMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint32_t kDefaultAlignment = 32;
constexpr int kMaxArrayDepth = 8;  // arrays of arrays of ...: real files use at most 2
constexpr uint64_t kReserveCap = 4096;  // never reserve more elements than this up front

// Smallest encoding of a value of type t in bytes (a string: its u64 length; an array: element
// type + count). Used to bound counts by the bytes that remain.
uint64_t min_value_size(GGUFValueType t) {
    switch (t) {
        case GGUFValueType::UINT8: case GGUFValueType::INT8: case GGUFValueType::BOOL: return 1;
        case GGUFValueType::UINT16: case GGUFValueType::INT16: return 2;
        case GGUFValueType::UINT32: case GGUFValueType::INT32: case GGUFValueType::FLOAT32: return 4;
        case GGUFValueType::UINT64: case GGUFValueType::INT64: case GGUFValueType::FLOAT64: return 8;
        case GGUFValueType::STRING: return 8;
        case GGUFValueType::ARRAY: return 12;
    }
    return 1;
}

bool is_fixed_size(GGUFValueType t) { return t != GGUFValueType::STRING && t != GGUFValueType::ARRAY; }

bool valid_value_type(uint32_t id) { return id <= uint32_t(GGUFValueType::FLOAT64); }

bool valid_utf8(std::string_view s) {
    const auto *p = reinterpret_cast<const unsigned char *>(s.data());
    size_t n = s.size(), i = 0;
    while (i < n) {
        unsigned c = p[i];
        size_t len;
        uint32_t cp;
        if (c < 0x80) { i++; continue; }
        if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
        else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
        else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
        else return false;
        if (n - i < len) return false;
        for (size_t k = 1; k < len; k++) {
            if ((p[i + k] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (p[i + k] & 0x3F);
        }
        // Overlong encodings, surrogates and code points past U+10FFFF are invalid.
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
            (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF)
            return false;
        i += len;
    }
    return true;
}

// A name from the file, quoted for an error message: printable ASCII kept, other bytes as \xNN,
// cut after 96 bytes.
std::string quote(std::string_view s) {
    std::string out = "'";
    size_t n = std::min<size_t>(s.size(), 96);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = static_cast<unsigned char>(s[i]);
        if (c >= 0x20 && c < 0x7F && c != '\\' && c != '\'') {
            out += char(c);
        } else {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\x%02x", c);
            out += buf;
        }
    }
    if (s.size() > n) out += "...";
    return out + "'";
}

// Bounds-checked reader over the mapping. `ctx` names what is being parsed ("header",
// "key 'general.name'", "tensor 'output.weight'") for error messages.
class Cursor {
public:
    Cursor(const std::string &path, const uint8_t *base, uint64_t size) : path_(path), base_(base), size_(size) {}

    uint64_t pos() const { return pos_; }
    uint64_t remaining() const { return size_ - pos_; }
    void set_context(std::string ctx) { ctx_ = std::move(ctx); }
    const std::string &context() const { return ctx_; }

    [[noreturn]] void fail(uint64_t offset, const std::string &what) const {
        throw GGUFError(path_ + ": " + ctx_ + ": " + what + " at byte offset " + std::to_string(offset));
    }

    // Ensure n more bytes exist; `field` names what they hold.
    void need(uint64_t n, const char *field) const {
        if (n > remaining())
            fail(pos_, std::string(field) + " needs " + std::to_string(n) + " bytes but the file ends after " +
                           std::to_string(remaining()) + " (truncated)");
    }

    template <class T>
    T read(const char *field) {
        need(sizeof(T), field);
        T v;
        std::memcpy(&v, base_ + pos_, sizeof(T));
        pos_ += sizeof(T);
        return v;
    }

    const uint8_t *take(uint64_t n, const char *field) {
        need(n, field);
        const uint8_t *p = base_ + pos_;
        pos_ += n;
        return p;
    }

    std::string_view read_string(const char *field) {
        uint64_t at = pos_;
        uint64_t len = read<uint64_t>(field);
        if (len > remaining())
            fail(at, std::string(field) + " length " + std::to_string(len) + " exceeds the " +
                         std::to_string(remaining()) + " bytes left in the file");
        return {reinterpret_cast<const char *>(take(len, field)), size_t(len)};
    }

private:
    const std::string &path_;
    const uint8_t *base_;
    uint64_t size_;
    uint64_t pos_ = 0;
    std::string ctx_ = "header";
};

GGUFValue read_value(Cursor &cur, GGUFValueType type, int depth);

GGUFArray read_array(Cursor &cur, int depth) {
    uint64_t at = cur.pos();
    if (depth >= kMaxArrayDepth)
        cur.fail(at, "arrays nested more than " + std::to_string(kMaxArrayDepth) + " deep");
    uint32_t elem_id = cur.read<uint32_t>("array element type");
    if (!valid_value_type(elem_id)) cur.fail(at, "unknown array element type " + std::to_string(elem_id));
    GGUFArray arr;
    arr.elem_type = GGUFValueType(elem_id);
    uint64_t count_at = cur.pos();
    arr.size = cur.read<uint64_t>("array length");
    uint64_t min_size = min_value_size(arr.elem_type);
    if (arr.size > cur.remaining() / min_size)
        cur.fail(count_at, "array length " + std::to_string(arr.size) + " of " +
                               std::string(gguf_value_type_name(arr.elem_type)) + " needs at least " +
                               (arr.size > std::numeric_limits<uint64_t>::max() / min_size
                                    ? std::string("2^64")
                                    : std::to_string(arr.size * min_size)) +
                               " bytes but only " + std::to_string(cur.remaining()) + " remain");
    if (is_fixed_size(arr.elem_type)) {
        arr.data = cur.take(arr.size * min_size, "array data");
        if (arr.elem_type == GGUFValueType::BOOL)
            for (uint64_t i = 0; i < arr.size; i++)
                if (arr.data[i] > 1)
                    cur.fail(count_at + 8 + i, "array element " + std::to_string(i) + " is BOOL but holds " +
                                                   std::to_string(arr.data[i]) + " (must be 0 or 1)");
    } else if (arr.elem_type == GGUFValueType::STRING) {
        arr.strings.reserve(std::min(arr.size, kReserveCap));
        for (uint64_t i = 0; i < arr.size; i++) arr.strings.push_back(cur.read_string("array string"));
    } else {
        arr.arrays.reserve(std::min(arr.size, kReserveCap));
        for (uint64_t i = 0; i < arr.size; i++) arr.arrays.push_back(read_array(cur, depth + 1));
    }
    return arr;
}

template <class T>
GGUFValue read_scalar(Cursor &cur, const char *field) {
    return GGUFValue(std::in_place_type<T>, cur.read<T>(field));
}

GGUFValue read_value(Cursor &cur, GGUFValueType type, int depth) {
    switch (type) {
        case GGUFValueType::UINT8: return read_scalar<uint8_t>(cur, "UINT8 value");
        case GGUFValueType::INT8: return read_scalar<int8_t>(cur, "INT8 value");
        case GGUFValueType::UINT16: return read_scalar<uint16_t>(cur, "UINT16 value");
        case GGUFValueType::INT16: return read_scalar<int16_t>(cur, "INT16 value");
        case GGUFValueType::UINT32: return read_scalar<uint32_t>(cur, "UINT32 value");
        case GGUFValueType::INT32: return read_scalar<int32_t>(cur, "INT32 value");
        case GGUFValueType::FLOAT32: return read_scalar<float>(cur, "FLOAT32 value");
        case GGUFValueType::UINT64: return read_scalar<uint64_t>(cur, "UINT64 value");
        case GGUFValueType::INT64: return read_scalar<int64_t>(cur, "INT64 value");
        case GGUFValueType::FLOAT64: return read_scalar<double>(cur, "FLOAT64 value");
        case GGUFValueType::BOOL: {
            uint64_t at = cur.pos();
            uint8_t b = cur.read<uint8_t>("BOOL value");
            if (b > 1) cur.fail(at, "BOOL value is " + std::to_string(b) + " (must be 0 or 1)");
            return GGUFValue(std::in_place_type<bool>, b != 0);
        }
        case GGUFValueType::STRING:
            return GGUFValue(std::in_place_type<std::string_view>, cur.read_string("STRING value"));
        case GGUFValueType::ARRAY: return GGUFValue(std::in_place_type<GGUFArray>, read_array(cur, depth));
    }
    cur.fail(cur.pos(), "unknown value type");  // unreachable: the caller checked the id
}

}  // namespace

std::string_view gguf_value_type_name(GGUFValueType t) {
    static constexpr std::string_view names[] = {"UINT8", "INT8", "UINT16", "INT16", "UINT32",
                                                 "INT32", "FLOAT32", "BOOL", "STRING", "ARRAY",
                                                 "UINT64", "INT64", "FLOAT64"};
    auto i = static_cast<uint32_t>(t);
    return i < std::size(names) ? names[i] : "UNKNOWN";
}

GGUFFile GGUFFile::open(const std::string &path, const GGUFOpenOptions &opts) {
    GGUFFile f;
    f.path_ = path;
    if (path.find('\0') != std::string::npos) throw SysError("open (the path contains a NUL byte)", EINVAL);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw SysError("open " + path, errno);
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        int e = errno;
        ::close(fd);
        throw SysError("fstat " + path, e);
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        throw SysError("open " + path, S_ISDIR(st.st_mode) ? EISDIR : EINVAL);
    }
    f.size_ = uint64_t(st.st_size);
    if (f.size_ > 0) {
        void *p = ::mmap(nullptr, f.size_, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            ::close(fd);
            throw SysError("mmap " + path, e);
        }
        f.base_ = static_cast<const uint8_t *>(p);
        // Hints only: huge pages for a file mapping need a kernel with read-only file THP, and
        // WILLNEED just starts readahead. Failures change nothing but speed, so they are ignored.
        (void)::madvise(p, f.size_, MADV_HUGEPAGE);
        if (opts.willneed) (void)::madvise(p, f.size_, MADV_WILLNEED);
    }
    ::close(fd);  // the mapping keeps the file referenced
    f.parse();    // on a throw, f's destructor unmaps
    return f;
}

GGUFFile::GGUFFile(GGUFFile &&o) noexcept { *this = std::move(o); }

GGUFFile &GGUFFile::operator=(GGUFFile &&o) noexcept {
    if (this != &o) {
        release();
        path_ = std::move(o.path_);
        base_ = std::exchange(o.base_, nullptr);
        size_ = std::exchange(o.size_, 0);
        version_ = o.version_;
        alignment_ = o.alignment_;
        data_offset_ = o.data_offset_;
        detached_ = o.detached_;
        // string_views point into the mapping, which does not move: they stay valid.
        kv_ = std::move(o.kv_);
        kv_index_ = std::move(o.kv_index_);
        tensors_ = std::move(o.tensors_);
        tensor_index_ = std::move(o.tensor_index_);
    }
    return *this;
}

GGUFFile::~GGUFFile() { release(); }

void GGUFFile::release_pages(const GGUFTensorInfo &t) const {
    const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
    const uintptr_t begin = uintptr_t(tensor_data(t)), end = begin + t.nbytes;
    const uintptr_t first = (begin + page - 1) & ~(page - 1), last = end & ~(page - 1);
    if (last > first) (void)::madvise(reinterpret_cast<void *>(first), last - first, MADV_DONTNEED);
}

void GGUFFile::advise_willneed() const {
    if (base_ && !detached_) (void)::madvise(const_cast<uint8_t *>(base_), size_, MADV_WILLNEED);
}

void GGUFFile::detach_data() {
    if (detached_ || !base_) return;
    const size_t page = size_t(::sysconf(_SC_PAGESIZE));
    uint8_t *base = const_cast<uint8_t *>(base_);
    // The header's pages (the last one may hold the first tensor bytes too: copied with it).
    const size_t head = std::min<size_t>(size_t(size_), (size_t(data_offset_) + page - 1) / page * page);
    std::vector<uint8_t> copy(base, base + head);
    if (head) {
        void *p = ::mmap(base, head, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        if (p == MAP_FAILED) throw SysError("mmap (anonymous copy of the GGUF header of " + path_ + ")", errno);
        std::memcpy(base, copy.data(), head);
        (void)::mprotect(base, head, PROT_READ);
    }
    const size_t mapped = (size_t(size_) + page - 1) / page * page;
    if (mapped > head &&
        ::mmap(base + head, mapped - head, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
               0) == MAP_FAILED)
        throw SysError("mmap (reservation over the tensor data of " + path_ + ")", errno);
    detached_ = true;
}

void GGUFFile::release() noexcept {
    if (base_) ::munmap(const_cast<uint8_t *>(base_), size_);
    base_ = nullptr;
}

namespace {

struct GGUFCounts {
    uint64_t n_tensors, n_kv;
};

// The header: magic, version (v2 or v3, into `version`), the tensor and key/value counts, checked
// to fit in the bytes after it.
GGUFCounts read_header(Cursor &cur, const uint8_t *base, uint64_t size, uint32_t &version) {
    if (size == 0) cur.fail(0, "empty file, not a GGUF file");
    if (size < 4) cur.fail(0, "not a GGUF file: only " + std::to_string(size) + " bytes");
    uint32_t magic = cur.read<uint32_t>("magic");
    if (magic != kGGUFMagic) cur.fail(0, "not a GGUF file: magic is " +
                                             quote({reinterpret_cast<const char *>(base), 4}) +
                                             ", expected 'GGUF'");
    version = cur.read<uint32_t>("version");
    if (version != 2 && version != 3) {
        if ((version & 0xFFFF) == 0 && (__builtin_bswap32(version) == 2 || __builtin_bswap32(version) == 3))
            cur.fail(4, "big-endian GGUF files are not supported");
        if (version == 1)
            cur.fail(4, "GGUF version 1 is not supported (v2 and v3 are; re-convert the model)");
        cur.fail(4, "unsupported GGUF version " + std::to_string(version) + " (v2 and v3 are supported)");
    }
    uint64_t n_tensors = cur.read<uint64_t>("tensor count");
    uint64_t n_kv = cur.read<uint64_t>("metadata key/value count");
    // Smallest encodings: a key/value is key length (8) + type (4) + a 1-byte value; a tensor
    // info is name length (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
    constexpr uint64_t kMinKV = 13, kMinTensorInfo = 32;
    uint64_t need_kv = 0, need_t = 0, need_all = 0;
    if (__builtin_mul_overflow(n_kv, kMinKV, &need_kv) || __builtin_mul_overflow(n_tensors, kMinTensorInfo, &need_t) ||
        __builtin_add_overflow(need_kv, need_t, &need_all) || need_all > cur.remaining())
        cur.fail(8, std::to_string(n_tensors) + " tensors and " + std::to_string(n_kv) +
                        " metadata keys cannot fit in the " + std::to_string(cur.remaining()) +
                        " bytes after the header (corrupt counts or truncated file)");
    return {n_tensors, n_kv};
}

using NameIndex = std::unordered_map<std::string_view, size_t>;

// The n_kv metadata key/values into kv and index (keys valid UTF-8 and unique), and
// general.alignment (a UINT32 power of two) into `alignment`.
void read_metadata(Cursor &cur, uint64_t n_kv, std::vector<GGUFKeyValue> &kv, NameIndex &index,
                   uint32_t &alignment) {
    kv.reserve(std::min(n_kv, kReserveCap));
    for (uint64_t i = 0; i < n_kv; i++) {
        uint64_t at = cur.pos();
        cur.set_context("metadata key #" + std::to_string(i));
        std::string_view key = cur.read_string("key");
        if (!valid_utf8(key)) cur.fail(at, "key " + quote(key) + " is not valid UTF-8");
        cur.set_context("key " + quote(key));
        if (index.count(key)) cur.fail(at, "duplicate key");
        uint64_t type_at = cur.pos();
        uint32_t type_id = cur.read<uint32_t>("value type");
        if (!valid_value_type(type_id)) cur.fail(type_at, "unknown value type " + std::to_string(type_id));
        GGUFValue value = read_value(cur, GGUFValueType(type_id), 0);
        if (key == "general.alignment") {
            const auto *a = std::get_if<uint32_t>(&value);
            if (!a)
                cur.fail(type_at, "must be UINT32, not " +
                                      std::string(gguf_value_type_name(GGUFValueType(type_id))));
            if (*a == 0 || (*a & (*a - 1)) != 0)
                cur.fail(type_at + 4, "alignment " + std::to_string(*a) + " is not a power of two");
            alignment = *a;
        }
        index.emplace(key, kv.size());
        kv.push_back({key, std::move(value), at});
    }
}

// A tensor's n_dims (1..4) and dimensions (each >= 1; ne[d] = 1 beyond n_dims) with the element
// count, which must fit in int64.
void read_dims(Cursor &cur, GGUFTensorInfo &t) {
    uint64_t dims_at = cur.pos();
    t.n_dims = cur.read<uint32_t>("n_dims");
    if (t.n_dims < 1 || t.n_dims > 4)
        cur.fail(dims_at, "n_dims = " + std::to_string(t.n_dims) + " (must be 1..4)");
    t.n_elements = 1;
    for (uint32_t d = 0; d < 4; d++) {
        t.ne[d] = 1;
        if (d >= t.n_dims) continue;
        uint64_t dim_at = cur.pos();
        t.ne[d] = cur.read<uint64_t>("dimension");
        if (t.ne[d] == 0)
            cur.fail(dim_at, "dimension " + std::to_string(d) + " = 0 (dims must be >= 1)");
        if (__builtin_mul_overflow(t.n_elements, t.ne[d], &t.n_elements) ||
            t.n_elements > uint64_t(std::numeric_limits<int64_t>::max()))
            cur.fail(dim_at, "element count overflows int64 at dimension " + std::to_string(d) +
                                 " = " + std::to_string(t.ne[d]));
    }
}

// Tensor info #i: its name (valid UTF-8, not yet in index), dims, type (rows a whole number of
// its blocks), byte size and data offset (relative to the data section, a multiple of
// alignment; off_at: where that field is, for the errors found once the section is placed).
GGUFTensorInfo read_tensor_info(Cursor &cur, uint64_t i, const NameIndex &index, uint32_t alignment,
                                uint64_t &off_at) {
    uint64_t at = cur.pos();
    cur.set_context("tensor #" + std::to_string(i));
    GGUFTensorInfo t{};
    t.name = cur.read_string("tensor name");
    if (!valid_utf8(t.name)) cur.fail(at, "tensor name " + quote(t.name) + " is not valid UTF-8");
    cur.set_context("tensor " + quote(t.name));
    if (index.count(t.name)) cur.fail(at, "duplicate tensor name");

    uint64_t dims_at = cur.pos();
    read_dims(cur, t);
    uint64_t type_at = cur.pos();
    uint32_t type_id = cur.read<uint32_t>("tensor type");
    auto info = ggml_type_info(type_id);
    if (!info) cur.fail(type_at, "unknown GGML type id " + std::to_string(type_id));
    t.type = info->type;
    auto row = ggml_row_size(t.type, t.ne[0]);
    if (!row)
        cur.fail(dims_at + 4, "row length ne[0] = " + std::to_string(t.ne[0]) +
                                  " is not a multiple of the block size " +
                                  std::to_string(info->blck_size) + " of " + std::string(info->name));
    t.nbytes = *row;
    // n_elements fits in int64, and nbytes <= n_elements * type_size / blck_size, but check anyway.
    if (__builtin_mul_overflow(t.nbytes, t.ne[1], &t.nbytes) ||
        __builtin_mul_overflow(t.nbytes, t.ne[2], &t.nbytes) ||
        __builtin_mul_overflow(t.nbytes, t.ne[3], &t.nbytes))
        cur.fail(dims_at, "byte size overflows 64 bits");
    off_at = cur.pos();
    t.offset = cur.read<uint64_t>("data offset");
    if (t.offset % alignment != 0)
        cur.fail(off_at, "data offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
                             std::to_string(alignment));
    return t;
}

// Each tensor's offset made absolute (the data section starts at data_offset), its data checked
// to end inside the file of `size` bytes.
void place_tensors(Cursor &cur, std::vector<GGUFTensorInfo> &tensors, const std::vector<uint64_t> &offset_field_at,
                   uint64_t data_offset, uint64_t size) {
    for (size_t i = 0; i < tensors.size(); i++) {
        auto &t = tensors[i];
        cur.set_context("tensor " + quote(t.name));
        uint64_t begin = 0, end = 0;
        if (__builtin_add_overflow(data_offset, t.offset, &begin) ||
            __builtin_add_overflow(begin, t.nbytes, &end) || end > size)
            cur.fail(offset_field_at[i],
                     "data (offset " + std::to_string(t.offset) + " + " + std::to_string(t.nbytes) +
                         " bytes after the data section at " + std::to_string(data_offset) +
                         ") extends past the end of the file (" + std::to_string(size) + " bytes)");
        t.offset = begin;
    }
}

// Tensors must not share bytes (llama.cpp even requires them back to back): an overlap means
// corrupt offsets.
void check_no_overlap(Cursor &cur, const std::vector<GGUFTensorInfo> &tensors,
                      const std::vector<uint64_t> &offset_field_at) {
    std::vector<size_t> order(tensors.size());
    for (size_t i = 0; i < order.size(); i++) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tensors[a].offset < tensors[b].offset; });
    for (size_t k = 1; k < order.size(); k++) {
        const auto &prev = tensors[order[k - 1]], &t = tensors[order[k]];
        if (t.offset < prev.offset + prev.nbytes) {
            cur.set_context("tensor " + quote(t.name));
            cur.fail(offset_field_at[order[k]],
                     "data at file offset " + std::to_string(t.offset) + " overlaps tensor " + quote(prev.name) +
                         " (bytes " + std::to_string(prev.offset) + ".." + std::to_string(prev.offset + prev.nbytes) +
                         ")");
        }
    }
}

}  // namespace

// The header, the metadata, the tensor infos, then the data section placed after them.
void GGUFFile::parse() {
    Cursor cur(path_, base_, size_);
    const GGUFCounts counts = read_header(cur, base_, size_, version_);
    read_metadata(cur, counts.n_kv, kv_, kv_index_, alignment_);

    // Tensor infos. Relative offsets are checked against the data section once its start is known.
    std::vector<uint64_t> offset_field_at;
    tensors_.reserve(std::min(counts.n_tensors, kReserveCap));
    offset_field_at.reserve(std::min(counts.n_tensors, kReserveCap));
    for (uint64_t i = 0; i < counts.n_tensors; i++) {
        uint64_t off_at = 0;
        const GGUFTensorInfo t = read_tensor_info(cur, i, tensor_index_, alignment_, off_at);
        tensor_index_.emplace(t.name, tensors_.size());
        tensors_.push_back(t);
        offset_field_at.push_back(off_at);
    }

    // Data section: starts at the next multiple of the alignment after the tensor infos.
    uint64_t pad = (alignment_ - cur.pos() % alignment_) % alignment_;
    if (__builtin_add_overflow(cur.pos(), pad, &data_offset_))
        cur.fail(cur.pos(), "data section offset overflows");
    place_tensors(cur, tensors_, offset_field_at, data_offset_, size_);
    check_no_overlap(cur, tensors_, offset_field_at);
}

const GGUFKeyValue *GGUFFile::find_key(std::string_view key) const {
    auto it = kv_index_.find(key);
    return it == kv_index_.end() ? nullptr : &kv_[it->second];
}

const GGUFTensorInfo *GGUFFile::find_tensor(std::string_view name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

uint64_t GGUFFile::get_uint(std::string_view key) const {
    const GGUFKeyValue *kv = find_key(key);
    if (!kv) throw GGUFError(path_ + ": key " + quote(key) + " is missing");
    std::optional<uint64_t> r = std::visit(
        [](const auto &v) -> std::optional<uint64_t> {
            using V = std::decay_t<decltype(v)>;
            if constexpr (std::is_integral_v<V> && !std::is_same_v<V, bool>) {
                if constexpr (std::is_signed_v<V>)
                    if (v < 0) return std::nullopt;
                return uint64_t(v);
            }
            return std::nullopt;
        },
        kv->value);
    if (!r)
        throw GGUFError(path_ + ": key " + quote(key) + ": expected a non-negative integer, found " +
                        std::string(gguf_value_type_name(gguf_value_type(kv->value))) + " at byte offset " +
                        std::to_string(kv->offset));
    return *r;
}

std::string_view GGUFFile::get_string(std::string_view key) const {
    const GGUFKeyValue *kv = find_key(key);
    if (!kv) throw GGUFError(path_ + ": key " + quote(key) + " is missing");
    const auto *s = std::get_if<std::string_view>(&kv->value);
    if (!s)
        throw GGUFError(path_ + ": key " + quote(key) + ": expected STRING, found " +
                        std::string(gguf_value_type_name(gguf_value_type(kv->value))) + " at byte offset " +
                        std::to_string(kv->offset));
    return *s;
}

}  // namespace ktd
