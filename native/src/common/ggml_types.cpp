#include "common/ggml_types.h"

#include <array>
#include <stdexcept>

namespace ktd {

namespace {
using T = GGMLType;
constexpr std::array kTypes = {
    GGMLTypeInfo{T::F32, "F32", 1, 4},          GGMLTypeInfo{T::F16, "F16", 1, 2},
    GGMLTypeInfo{T::Q4_0, "Q4_0", 32, 18},      GGMLTypeInfo{T::Q4_1, "Q4_1", 32, 20},
    GGMLTypeInfo{T::Q5_0, "Q5_0", 32, 22},      GGMLTypeInfo{T::Q5_1, "Q5_1", 32, 24},
    GGMLTypeInfo{T::Q8_0, "Q8_0", 32, 34},      GGMLTypeInfo{T::Q8_1, "Q8_1", 32, 40},
    GGMLTypeInfo{T::Q2_K, "Q2_K", 256, 84},     GGMLTypeInfo{T::Q3_K, "Q3_K", 256, 110},
    GGMLTypeInfo{T::Q4_K, "Q4_K", 256, 144},    GGMLTypeInfo{T::Q5_K, "Q5_K", 256, 176},
    GGMLTypeInfo{T::Q6_K, "Q6_K", 256, 210},    GGMLTypeInfo{T::Q8_K, "Q8_K", 256, 292},
    GGMLTypeInfo{T::IQ2_XXS, "IQ2_XXS", 256, 66}, GGMLTypeInfo{T::IQ2_XS, "IQ2_XS", 256, 74},
    GGMLTypeInfo{T::IQ3_XXS, "IQ3_XXS", 256, 98}, GGMLTypeInfo{T::IQ1_S, "IQ1_S", 256, 50},
    GGMLTypeInfo{T::IQ4_NL, "IQ4_NL", 32, 18},  GGMLTypeInfo{T::IQ3_S, "IQ3_S", 256, 110},
    GGMLTypeInfo{T::IQ2_S, "IQ2_S", 256, 82},   GGMLTypeInfo{T::IQ4_XS, "IQ4_XS", 256, 136},
    GGMLTypeInfo{T::I8, "I8", 1, 1},            GGMLTypeInfo{T::I16, "I16", 1, 2},
    GGMLTypeInfo{T::I32, "I32", 1, 4},          GGMLTypeInfo{T::I64, "I64", 1, 8},
    GGMLTypeInfo{T::F64, "F64", 1, 8},          GGMLTypeInfo{T::IQ1_M, "IQ1_M", 256, 56},
    GGMLTypeInfo{T::BF16, "BF16", 1, 2},        GGMLTypeInfo{T::TQ1_0, "TQ1_0", 256, 54},
    GGMLTypeInfo{T::TQ2_0, "TQ2_0", 256, 66},   GGMLTypeInfo{T::MXFP4, "MXFP4", 32, 17},
    GGMLTypeInfo{T::NVFP4, "NVFP4", 64, 36},    GGMLTypeInfo{T::Q1_0, "Q1_0", 128, 18},
};
}  // namespace

std::optional<GGMLTypeInfo> ggml_type_info(uint32_t id) {
    for (const auto &t : kTypes)
        if (static_cast<uint32_t>(t.type) == id) return t;
    return std::nullopt;
}

const GGMLTypeInfo &ggml_type_info(GGMLType t) {
    for (const auto &info : kTypes)
        if (info.type == t) return info;
    throw std::invalid_argument("unknown GGMLType");
}

std::string_view ggml_type_name(GGMLType t) { return ggml_type_info(t).name; }

std::optional<uint64_t> ggml_row_size(GGMLType t, uint64_t n) {
    const auto &info = ggml_type_info(t);
    if (n % info.blck_size != 0) return std::nullopt;
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(n / info.blck_size, uint64_t{info.type_size}, &bytes)) return std::nullopt;
    return bytes;
}

}  // namespace ktd
