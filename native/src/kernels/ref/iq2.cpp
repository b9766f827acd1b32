// IQ2_XXS, IQ2_XS, IQ2_S weights × Q8_K activations, scalar reference (the specification).
//
// Each block holds 256 weights as 32 groups of 8. Group g (elements 8g..8g+7) is one point of an
// 8-dimensional code book (kernels/iq_grids.h: magnitudes in {8, 25, 43}) with a sign per element
// and a scale per 32 (IQ2_XXS) or per 16 (IQ2_XS, IQ2_S) weights:
//   w = (d · (0.5 + ls) · 0.25) · grid[idx_g][e % 8] · (−1 if sign bit e % 8 of group g)
// with ls the 4-bit scale. Where the group's indices and signs are stored:
//   IQ2_XXS: sub-block ib = g / 4 is the uint32 pair a0 = qs[4ib] | qs[4ib+1] << 16 (4 index
//            bytes, group g%4 in byte g%4) and a1 = qs[4ib+2] | qs[4ib+3] << 16 (7-bit sign code of
//            group l in bits 7l..7l+6, iq_signs_from7; ls = a1 >> 28).
//   IQ2_XS:  qs[g] = idx (9 bits) | sign code (7 bits) << 9; ls of weights 16h.. = nibble h % 2 of scales[h / 2].
//   IQ2_S:   idx = qs[g] | ((qh[g / 4] >> 2(g % 4)) & 3) << 8; the sign byte qs[32 + g]; ls as IQ2_XS.
// The dot product is exact in integers per scale group: Σ ls'·Σ(±grid·q8) with ls' = 2·ls + 1,
// then d · d8 · Σ / 8.
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/iq_grids.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::ref {
namespace {

inline int grid_byte(uint64_t point, int j) { return int((point >> (8 * j)) & 0xFF); }
inline int signed_value(uint64_t point, uint32_t signs, int j) {
    const int v = grid_byte(point, j);
    return (signs >> j) & 1 ? -v : v;
}

// Signed grid values of the 8 elements of group g, and the 4-bit scale of the group's weights.
struct Group8 {
    int v[8];
    int ls;
};

Group8 group_iq2_xxs(const block_iq2_xxs &x, int g) {
    const int ib = g / 4, l = g % 4;
    const uint32_t a0 = uint32_t(x.qs[4 * ib]) | uint32_t(x.qs[4 * ib + 1]) << 16;
    const uint32_t a1 = uint32_t(x.qs[4 * ib + 2]) | uint32_t(x.qs[4 * ib + 3]) << 16;
    const uint64_t point = iq2xxs_grid[(a0 >> (8 * l)) & 0xFF];
    const uint32_t signs = iq_signs_from7((a1 >> (7 * l)) & 0x7F);
    Group8 out{};
    for (int j = 0; j < 8; ++j) out.v[j] = signed_value(point, signs, j);
    out.ls = int(a1 >> 28);
    return out;
}

Group8 group_iq2_xs(const block_iq2_xs &x, int g) {
    const uint64_t point = iq2xs_grid[x.qs[g] & 511];
    const uint32_t signs = iq_signs_from7(x.qs[g] >> 9);
    Group8 out{};
    for (int j = 0; j < 8; ++j) out.v[j] = signed_value(point, signs, j);
    out.ls = (x.scales[g / 4] >> (4 * ((g / 2) % 2))) & 0xF;
    return out;
}

Group8 group_iq2_s(const block_iq2_s &x, int g) {
    const int idx = x.qs[g] | ((x.qh[g / 4] >> (2 * (g % 4))) & 3) << 8;
    const uint64_t point = iq2s_grid[idx];
    const uint32_t signs = x.qs[32 + g];
    Group8 out{};
    for (int j = 0; j < 8; ++j) out.v[j] = signed_value(point, signs, j);
    out.ls = (x.scales[g / 4] >> (4 * ((g / 2) % 2))) & 0xF;
    return out;
}

template <typename Block, Group8 (*Group)(const Block &, int)>
void dequantize_row(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const Block *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d);
        for (int g = 0; g < 32; ++g) {
            const Group8 gr = Group(x[b], g);
            const float db = d * (0.5f + float(gr.ls)) * 0.25f;
            for (int j = 0; j < 8; ++j) y[b * QK_K + 8 * g + j] = db * float(gr.v[j]);
        }
    }
}

template <typename Block, Group8 (*Group)(const Block &, int)>
float vec_dot(int64_t k, const Block *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sumi = 0;
        for (int g = 0; g < 32; ++g) {
            const Group8 gr = Group(w[b], g);
            int32_t s = 0;
            for (int j = 0; j < 8; ++j) s += gr.v[j] * a[b].qs[8 * g + j];
            sumi += (2 * gr.ls + 1) * s;
        }
        sum += fp16_to_fp32(w[b].d) * a[b].d * float(sumi) * 0.125f;
    }
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::IQ2_XXS, GGMLType::Q8_K,
                                           dequantize_row<block_iq2_xxs, group_iq2_xxs>, quantize_row_q8_K,
                                           gemm_rows<block_iq2_xxs, block_q8_K, vec_dot<block_iq2_xxs, group_iq2_xxs>>});
KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::IQ2_XS, GGMLType::Q8_K,
                                           dequantize_row<block_iq2_xs, group_iq2_xs>, quantize_row_q8_K,
                                           gemm_rows<block_iq2_xs, block_q8_K, vec_dot<block_iq2_xs, group_iq2_xs>>});
KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::IQ2_S, GGMLType::Q8_K,
                                           dequantize_row<block_iq2_s, group_iq2_s>, quantize_row_q8_K,
                                           gemm_rows<block_iq2_s, block_q8_K, vec_dot<block_iq2_s, group_iq2_s>>});

}  // namespace ktd::ref
