// The 32-element types' row-interleaved layouts (kernels/repacked_q32.h), scalar: the repacks
// every ISA's entry uses, the element accessors that define the layouts, and the tile on the x8
// layouts that the reference entries register. That tile does the same integer sums and float
// operations as the reference's plain tile (vec_dot_*_q8_0 in kernels/ref/<type>.cpp; ggml's
// ggml_vec_dot_*_q8_0_generic), so the two agree bitwise.
#include <cstring>
#include <stdexcept>

#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_q32.h"

namespace ktd::ref {
namespace {

// Writes groups [g0, g1): each group block zeroed, then put(dst, r, block b of row r) for every
// row of the matrix in the group.
template <typename Group, typename Block, int R, typename Put>
void repack_groups(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out,
                   const Put &put) {
    const int64_t nb = k / 32;
    auto *o = static_cast<Group *>(out);
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            Group &dst = o[g * nb + b];
            std::memset(&dst, 0, sizeof dst);
            for (int r = 0; r < R && g * R + r < rows; ++r)
                put(dst, r, reinterpret_cast<const Block *>(static_cast<const char *>(w) + size_t(g * R + r) * w_stride)[b]);
        }
}

// ---- x8 --------------------------------------------------------------------------------------

// Row r's qs (byte j: element j low nibble, element j + 16 high) into the nibble layout: the
// layout keeps that pairing, so each 4-byte word is copied as is.
void put_nibbles(uint8_t *qs, int r, const uint8_t *src_qs) {
    for (int i = 0; i < 4; ++i) std::memcpy(qs + 32 * i + 4 * r, src_qs + 4 * i, 4);
}
// Row r's qh (bit e of the little-endian u32 = element e's fifth bit): byte t of the row gathers
// bits t, t + 4, ..., t + 28.
void put_bit4(uint8_t *qh, int r, const uint8_t *src_qh) {
    uint32_t bits;
    std::memcpy(&bits, src_qh, 4);
    for (int t = 0; t < 4; ++t) {
        uint32_t v = 0;
        for (int j = 0; j < 8; ++j) v |= ((bits >> (4 * j + t)) & 1u) << j;
        qh[4 * r + t] = uint8_t(v);
    }
}

// Element e (< 32) of row r: bits 0-3 from the nibble layout, bit 4 from qh.
int nibble(const uint8_t *qs, int r, int e) {
    const int x = e % 16;
    return (qs[32 * (x / 4) + 4 * r + x % 4] >> (4 * (e / 16))) & 0xF;
}
int bit4(const uint8_t *qh, int r, int e) { return ((qh[4 * r + e % 4] >> (e / 4)) & 1) << 4; }

// Per layout: put(dst, r, src) writes row r's block into the group block; value(g, r, e) reads
// back the integer v of element e of row r (w = d·v, or d·v + m where kMin) as the reference's
// plain dot product takes it.
struct Q4_0x8 {
    using Group = block_q4_0x8;
    using Block = block_q4_0;
    static constexpr bool kMin = false;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        put_nibbles(g.qs, r, x.qs);
    }
    static int value(const Group &g, int r, int e) { return nibble(g.qs, r, e) - 8; }
};
struct Q4_1x8 {
    using Group = block_q4_1x8;
    using Block = block_q4_1;
    static constexpr bool kMin = true;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        g.m[r] = x.m;
        put_nibbles(g.qs, r, x.qs);
    }
    static int value(const Group &g, int r, int e) { return nibble(g.qs, r, e); }
};
struct Q5_0x8 {
    using Group = block_q5_0x8;
    using Block = block_q5_0;
    static constexpr bool kMin = false;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        put_nibbles(g.qs, r, x.qs);
        put_bit4(g.qh, r, x.qh);
    }
    static int value(const Group &g, int r, int e) { return (nibble(g.qs, r, e) | bit4(g.qh, r, e)) - 16; }
};
struct Q5_1x8 {
    using Group = block_q5_1x8;
    using Block = block_q5_1;
    static constexpr bool kMin = true;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        g.m[r] = x.m;
        put_nibbles(g.qs, r, x.qs);
        put_bit4(g.qh, r, x.qh);
    }
    static int value(const Group &g, int r, int e) { return nibble(g.qs, r, e) | bit4(g.qh, r, e); }
};
struct Q8_0x8 {
    using Group = block_q8_0x8;
    using Block = block_q8_0;
    static constexpr bool kMin = false;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        for (int j = 0; j < 8; ++j) std::memcpy(g.qs + 32 * j + 4 * r, x.qs + 4 * j, 4);
    }
    static int value(const Group &g, int r, int e) { return g.qs[32 * (e / 4) + 4 * r + e % 4]; }
};
struct IQ4_NLx8 {
    using Group = block_iq4_nlx8;
    using Block = block_iq4_nl;
    static constexpr bool kMin = false;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        put_nibbles(g.qs, r, x.qs);
    }
    static int value(const Group &g, int r, int e) { return kvalues_iq4nl[nibble(g.qs, r, e)]; }
};

// Row r of a run of x8 group blocks · one activation row: per block the exact integer sums, then
//   sum += d·da·Σv·a             (kMin: + m·da·Σa)
// in the float operations of the plain reference.
template <typename L>
float vec_dot_x8(int64_t k, const typename L::Group *w, int r, const block_q8_0 *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / 32; ++b) {
        int32_t isum = 0, asum = 0;
        for (int e = 0; e < 32; ++e) {
            isum += L::value(w[b], r, e) * a[b].qs[e];
            asum += a[b].qs[e];
        }
        const float da = fp16_to_fp32(a[b].d);
        if constexpr (L::kMin)
            sum += fp16_to_fp32(w[b].d[r]) * da * float(isum) + fp16_to_fp32(w[b].m[r]) * da * float(asum);
        else
            sum += fp16_to_fp32(w[b].d[r]) * da * float(isum);
    }
    return sum;
}

// The entry points of layout L: its TypeKernels fields.
template <typename L>
size_t group_bytes_x8(int64_t k) {
    return size_t(k / 32) * sizeof(typename L::Group);
}
template <typename L>
void repack_x8(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    repack_groups<typename L::Group, typename L::Block, kRepackRowsQ32x8>(w, w_stride, rows, k, g0, g1, out, L::put);
}
template <typename L>
TypeKernels with_x8(TypeKernels tk) {
    tk.repack_rows = kRepackRowsQ32x8;
    tk.repack_layout = kRepackLayoutQ32x8;
    tk.repacked_group_bytes = group_bytes_x8<L>;
    tk.repack = repack_x8<L>;
    return tk;
}

// The scalar tile on layout L.
template <typename L>
void gemm_repacked_x8(int64_t k, const void *wp, size_t group_stride, const void *xq, size_t x_stride, float *y,
                      size_t ldy, int nr, int nc) {
    gemm_groups<typename L::Group, block_q8_0, kRepackRowsQ32x8, vec_dot_x8<L>>(k, wp, group_stride, xq, x_stride, y,
                                                                               ldy, nr, nc);
}

// f(L{}) for the layout of `type`.
template <typename F>
auto with_layout_of(GGMLType type, const F &f) {
    switch (type) {
        case GGMLType::Q4_0: return f(Q4_0x8{});
        case GGMLType::Q4_1: return f(Q4_1x8{});
        case GGMLType::Q5_0: return f(Q5_0x8{});
        case GGMLType::Q5_1: return f(Q5_1x8{});
        case GGMLType::Q8_0: return f(Q8_0x8{});
        case GGMLType::IQ4_NL: return f(IQ4_NLx8{});
        default: throw std::logic_error("not a 32-element type with an x8 layout");
    }
}

}  // namespace

TypeKernels with_x8_layout(TypeKernels tk) {
    return with_layout_of(tk.type, [&]<typename L>(L) { return with_x8<L>(tk); });
}

TypeKernels q32_type_kernels(GGMLType type, void (*dequantize_row)(const void *, float *, int64_t),
                             decltype(TypeKernels::gemm) gemm) {
    return with_layout_of(type, [&]<typename L>(L) {
        TypeKernels tk = with_x8<L>(TypeKernels{.type = type,
                                                .act_type = GGMLType::Q8_0,
                                                .dequantize_row = dequantize_row,
                                                .quantize_act_row = quantize_row_q8_0,
                                                .gemm = gemm});
        tk.gemm_repacked = gemm_repacked_x8<L>;
        return tk;
    });
}

// ---- x16 (the AVX-512 kernels' layouts; their tile's specification is the plain reference) ----
size_t group_bytes_q5_0_x16(int64_t k) { return size_t(k / 32) * sizeof(block_q5_0x16); }
void repack_q5_0_x16(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    repack_groups<block_q5_0x16, block_q5_0, kRepackRowsQ32x16>(
        w, w_stride, rows, k, g0, g1, out, [](block_q5_0x16 &dst, int r, const block_q5_0 &src) {
            dst.d[r] = src.d;
            // Each 4-byte word of the row's qs already pairs element 4i + t (low) with 16 + 4i + t.
            for (int i = 0; i < 4; ++i) std::memcpy(dst.qs + 64 * i + 4 * r, src.qs + 4 * i, 4);
            uint32_t bits;
            std::memcpy(&bits, src.qh, 4);
            for (int e = 0; e < 32; ++e) dst.qh[e / 4] |= uint64_t((bits >> e) & 1u) << (4 * r + e % 4);
        });
}

size_t group_bytes_q8_0_x16(int64_t k) { return size_t(k / 32) * sizeof(block_q8_0x16); }
void repack_q8_0_x16(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    repack_groups<block_q8_0x16, block_q8_0, kRepackRowsQ32x16>(
        w, w_stride, rows, k, g0, g1, out, [](block_q8_0x16 &dst, int r, const block_q8_0 &src) {
            dst.d[r] = src.d;
            for (int e = 0; e < 32; ++e) dst.qs[64 * (e / 4) + 4 * r + e % 4] = uint8_t(src.qs[e]) ^ 0x80u;
        });
}

// ---- arm x4 (the aarch64 kernels' layouts; their tile's specification is the plain reference) ----
namespace {

// Row r's 16 qs bytes into the 4-bit qs layout: its 8-byte halves copied as is.
void put_nibbles_x4(uint8_t *qs, int r, const uint8_t *src_qs) {
    for (int h = 0; h < 2; ++h) std::memcpy(qs + 32 * h + 8 * r, src_qs + 8 * h, 8);
}
// Row r's qh (bit e of the little-endian u32 = element e's fifth bit) into the qh layout: element
// 8c + t's bit goes to bit 2c + r/2 of byte 8(r % 2) + t.
void put_bit4_x4(uint8_t *qh, int r, const uint8_t *src_qh) {
    uint32_t bits;
    std::memcpy(&bits, src_qh, 4);
    for (int e = 0; e < 32; ++e) qh[8 * (r % 2) + e % 8] |= uint8_t(((bits >> e) & 1u) << (2 * (e / 8) + r / 2));
}

// Per layout: put(dst, r, src) writes row r's block into the (zeroed) group block.
struct Q8_0x4 {
    using Group = block_q8_0x4;
    using Block = block_q8_0;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        for (int c = 0; c < 4; ++c) std::memcpy(g.qs + 32 * c + 8 * r, x.qs + 8 * c, 8);
    }
};
struct Q4_0x4 {
    using Group = block_q4_0x4;
    using Block = block_q4_0;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        put_nibbles_x4(g.qs, r, x.qs);
    }
};
struct Q4_1x4 {
    using Group = block_q4_1x4;
    using Block = block_q4_1;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        g.m[r] = x.m;
        put_nibbles_x4(g.qs, r, x.qs);
    }
};
struct Q5_0x4 {
    using Group = block_q5_0x4;
    using Block = block_q5_0;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        put_bit4_x4(g.qh, r, x.qh);
        put_nibbles_x4(g.qs, r, x.qs);
    }
};
struct Q5_1x4 {
    using Group = block_q5_1x4;
    using Block = block_q5_1;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        g.m[r] = x.m;
        put_bit4_x4(g.qh, r, x.qh);
        put_nibbles_x4(g.qs, r, x.qs);
    }
};
struct IQ4_NLx4 {
    using Group = block_iq4_nlx4;
    using Block = block_iq4_nl;
    static void put(Group &g, int r, const Block &x) {
        g.d[r] = x.d;
        put_nibbles_x4(g.qs, r, x.qs);
    }
};

template <typename L>
size_t group_bytes_x4(int64_t k) {
    return size_t(k / 32) * sizeof(typename L::Group);
}
template <typename L>
void repack_x4(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    repack_groups<typename L::Group, typename L::Block, kRepackRowsQ32x4>(w, w_stride, rows, k, g0, g1, out, L::put);
}
template <typename L>
TypeKernels with_x4(TypeKernels tk) {
    tk.repack_rows = kRepackRowsQ32x4;
    tk.repack_layout = kRepackLayoutQ32ArmX4;
    tk.repacked_group_bytes = group_bytes_x4<L>;
    tk.repack = repack_x4<L>;
    return tk;
}

}  // namespace

TypeKernels with_arm_x4_layout(TypeKernels tk) {
    switch (tk.type) {
        case GGMLType::Q8_0: return with_x4<Q8_0x4>(tk);
        case GGMLType::Q4_0: return with_x4<Q4_0x4>(tk);
        case GGMLType::Q4_1: return with_x4<Q4_1x4>(tk);
        case GGMLType::Q5_0: return with_x4<Q5_0x4>(tk);
        case GGMLType::Q5_1: return with_x4<Q5_1x4>(tk);
        case GGMLType::IQ4_NL: return with_x4<IQ4_NLx4>(tk);
        default: throw std::logic_error("not a 32-element type with an arm x4 layout");
    }
}

}  // namespace ktd::ref
