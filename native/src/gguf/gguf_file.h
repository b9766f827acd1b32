// GGUFFile: a GGUF v2/v3 model file, mapped read-only and validated up front.
//
// open() maps the whole file, parses the header, every metadata key/value and every tensor info,
// and checks everything read from the file before it is used (see gguf_file.cpp for the list).
// Any violation throws GGUFError naming the field, the key or tensor, and the byte offset; a
// failing system call throws SysError. Once open() returns, every accessor is safe: tensor data
// lies inside the mapping, is aligned to `alignment()`, and `nbytes` is exact.
//
// Metadata values point into the mapping (strings are string_views, numeric arrays are raw
// little-endian bytes), so nothing large is copied and the GGUFFile must outlive them. The
// mapping is released by the destructor; a GGUFFile is movable, not copyable.
// Like any file mapping, it assumes the file is not truncated while open (reading a page past the
// new end would raise SIGBUS). A loader that has copied every tensor it needs calls detach_data():
// from then on the file is no longer mapped and nothing it does to the file can reach the process.
//
// Layout reminder (GGUF v3, little-endian; v2 is identical):
//   magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv | n_kv × (string key, u32 type, value)
//   | n_tensors × (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
//   | padding to `general.alignment` (default 32) | tensor data (offsets relative to here)
// A string is u64 length + bytes (no terminator); an array is u32 element type + u64 count +
// elements.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "common/ggml_types.h"

namespace ktd {

// GGUF metadata value types; the ids are the format's.
enum class GGUFValueType : uint32_t {
    UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6, BOOL = 7,
    STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

std::string_view gguf_value_type_name(GGUFValueType t);

// An array value. Elements of a fixed-size type (numbers, bool) are `size` raw little-endian
// values at `data` inside the mapping (not necessarily aligned: read them with element<T>());
// strings are in `strings`, nested arrays in `arrays`.
struct GGUFArray {
    GGUFValueType elem_type = GGUFValueType::UINT8;
    uint64_t size = 0;
    const uint8_t *data = nullptr;        // fixed-size element types only
    std::vector<std::string_view> strings;  // elem_type == STRING
    std::vector<GGUFArray> arrays;          // elem_type == ARRAY

    // Element i of a fixed-size array whose element type is T's (checked by the caller).
    template <class T>
    T element(uint64_t i) const {
        T v;
        std::memcpy(&v, data + i * sizeof(T), sizeof(T));
        return v;
    }
};

// A metadata value. The variant's index IS the GGUF value type id (static_assert in the .cpp),
// so `GGUFValueType(value.index())` names the type.
using GGUFValue = std::variant<uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, float, bool,
                               std::string_view, GGUFArray, uint64_t, int64_t, double>;

inline GGUFValueType gguf_value_type(const GGUFValue &v) { return GGUFValueType(v.index()); }

struct GGUFKeyValue {
    std::string_view key;
    GGUFValue value;
    uint64_t offset;  // byte offset of the key's length field in the file
};

struct GGUFTensorInfo {
    std::string_view name;
    GGMLType type;
    uint32_t n_dims;      // 1..4
    uint64_t ne[4];       // GGML order: ne[0] = row length (contiguous); unused dims are 1
    uint64_t n_elements;  // ne[0]·ne[1]·ne[2]·ne[3]
    uint64_t offset;      // absolute byte offset of the data in the file (data_offset + relative)
    uint64_t nbytes;      // exact size of the data
};

struct GGUFOpenOptions {
    // madvise(MADV_WILLNEED) the whole mapping (start reading ahead). Skip it when only the
    // header is needed (inspect).
    bool willneed = true;
};

class GGUFFile {
public:
    static GGUFFile open(const std::string &path, const GGUFOpenOptions &opts = {});

    GGUFFile(GGUFFile &&other) noexcept;
    GGUFFile &operator=(GGUFFile &&other) noexcept;
    GGUFFile(const GGUFFile &) = delete;
    GGUFFile &operator=(const GGUFFile &) = delete;
    ~GGUFFile();

    const std::string &path() const { return path_; }
    uint32_t version() const { return version_; }
    uint64_t file_size() const { return size_; }
    uint32_t alignment() const { return alignment_; }
    uint64_t data_offset() const { return data_offset_; }  // start of the tensor data section
    const uint8_t *base() const { return base_; }            // start of the mapping

    // Metadata in file order.
    const std::vector<GGUFKeyValue> &metadata() const { return kv_; }
    const GGUFKeyValue *find_key(std::string_view key) const;  // nullptr if absent

    // Typed access for loaders: throws GGUFError naming the key if it is absent or has another
    // type. get_uint accepts any unsigned or non-negative signed integer type.
    uint64_t get_uint(std::string_view key) const;
    std::string_view get_string(std::string_view key) const;

    // Tensor infos in file order.
    const std::vector<GGUFTensorInfo> &tensors() const { return tensors_; }
    const GGUFTensorInfo *find_tensor(std::string_view name) const;  // nullptr if absent
    // Throws std::logic_error after detach_data().
    const uint8_t *tensor_data(const GGUFTensorInfo &t) const {
        if (detached_) throw std::logic_error("GGUFFile::tensor_data after detach_data (" + path_ + ")");
        return base_ + t.offset;
    }
    // Ends the file mapping: the header (everything before the tensor data: metadata, tensor
    // infos, which the string_views and arrays point into) is replaced by an anonymous copy at the
    // same addresses, the tensor data by an inaccessible reservation (a stray read faults loudly
    // instead of reading another mapping). Every accessor but tensor_data stays valid; the file
    // may then be truncated, rewritten or deleted without effect on this process. SysError if the
    // kernel refuses the new mappings (the file mapping is then kept).
    void detach_data();
    // madvise(MADV_WILLNEED) over the tensor data (open() with willneed = false, then the loader
    // finds it has to read the tensors after all).
    void advise_willneed() const;
    bool detached() const { return detached_; }
    // Advice, for a tensor whose bytes the loader has copied (repacked) and will not read again:
    // unmaps its whole pages from this process (MADV_DONTNEED; a partial page shared with a
    // neighbour stays). The page cache keeps them and a later read faults them back in, so
    // tensor_data() stays valid; meanwhile the process's RSS no longer counts them and the kernel
    // reclaims them like any unmapped cache page. Failure changes nothing: ignored.
    void release_pages(const GGUFTensorInfo &t) const;

private:
    GGUFFile() = default;
    void parse();
    void release() noexcept;

    std::string path_;
    const uint8_t *base_ = nullptr;
    uint64_t size_ = 0;
    uint32_t version_ = 0;
    uint32_t alignment_ = 32;
    uint64_t data_offset_ = 0;
    bool detached_ = false;
    std::vector<GGUFKeyValue> kv_;
    std::unordered_map<std::string_view, size_t> kv_index_;
    std::vector<GGUFTensorInfo> tensors_;
    std::unordered_map<std::string_view, size_t> tensor_index_;
};

}  // namespace ktd
