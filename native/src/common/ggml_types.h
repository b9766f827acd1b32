// The GGML tensor types that can appear in a GGUF file: id, name, block size (elements per
// block) and type size (bytes per block). Ids and sizes are the GGUF format's (they match
// gguf-py's GGML_QUANT_SIZES; tests/test_ggml_types.py cross-checks). A row of k elements of
// type t takes k / blck_size * type_size bytes and k must be a whole number of blocks.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace ktd {

enum class GGMLType : uint32_t {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
    Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
    IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
    IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
    TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39, NVFP4 = 40, Q1_0 = 41,
};

struct GGMLTypeInfo {
    GGMLType type;
    std::string_view name;
    uint32_t blck_size;  // elements per block
    uint32_t type_size;  // bytes per block
};

// nullopt for an id that is not a known type (removed ids 4, 5, 31-33, 36-38 included).
std::optional<GGMLTypeInfo> ggml_type_info(uint32_t id);
const GGMLTypeInfo &ggml_type_info(GGMLType t);  // t must be a known type
std::string_view ggml_type_name(GGMLType t);

// Bytes of a row of n elements; nullopt if n is not a whole number of blocks or the size
// overflows 64 bits.
std::optional<uint64_t> ggml_row_size(GGMLType t, uint64_t n);

}  // namespace ktd
