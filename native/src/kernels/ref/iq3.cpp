// IQ3_XXS and IQ3_S weights × Q8_K activations, scalar reference (the specification).
//
// Each block holds 256 weights as 64 groups of 4, each group one point of a 4-dimensional code
// book (kernels/iq_grids.h), a sign per element and a 4-bit scale ls per sub-block of 32:
//   IQ3_XXS: w = (d · (0.5 + ls) · 0.5) · iq3xxs_grid[qs[q]][e % 4] · sign, q = e / 4 (magnitudes
//            4..62). Sub-block ib's uint32 a = qs[64 + 4ib ..] holds the 7-bit sign codes of its
//            4 groups of 8 (group l in bits 7l.., iq_signs_from7) and ls = a >> 28.
//   IQ3_S:   w = (d · (1 + 2·ls)) · iq3s_grid[idx][e % 4] · sign (magnitudes 1..15), idx =
//            qs[q] | bit q % 8 of qh[q / 8] << 8; sign = bit e % 8 of signs[e / 8]; ls = nibble
//            ib % 2 of scales[ib / 2].
// The dot product is exact in integers per sub-block: Σ ls'·Σ(±grid·q8), with ls' = 2·ls + 1,
// then d · d8 · Σ / 4 (IQ3_XXS) or d · d8 · Σ (IQ3_S).
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/iq_grids.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::ref {
namespace {

inline uint32_t le32(const uint8_t *p) {
    return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// The signed grid values of the 32 weights of sub-block ib, and its 4-bit scale.
struct Sub32 {
    int v[32];
    int ls;
};

Sub32 sub_iq3_xxs(const block_iq3_xxs &x, int ib) {
    const uint32_t a = le32(x.qs + 64 + 4 * ib);
    Sub32 out{};
    for (int e = 0; e < 32; ++e) {
        const uint32_t point = iq3xxs_grid[x.qs[8 * ib + e / 4]];
        const int v = int((point >> (8 * (e % 4))) & 0xFF);
        const uint32_t signs = iq_signs_from7((a >> (7 * (e / 8))) & 0x7F);
        out.v[e] = (signs >> (e % 8)) & 1 ? -v : v;
    }
    out.ls = int(a >> 28);
    return out;
}

Sub32 sub_iq3_s(const block_iq3_s &x, int ib) {
    Sub32 out{};
    for (int e = 0; e < 32; ++e) {
        const int q = 8 * ib + e / 4;  // group of 4 in the block
        const int idx = x.qs[q] | ((x.qh[q / 8] >> (q % 8)) & 1) << 8;
        const int v = int((iq3s_grid[idx] >> (8 * (e % 4))) & 0xFF);
        const int eb = 32 * ib + e;  // element in the block
        out.v[e] = (x.signs[eb / 8] >> (eb % 8)) & 1 ? -v : v;
    }
    out.ls = (x.scales[ib / 2] >> (4 * (ib % 2))) & 0xF;
    return out;
}

void dequantize_row_iq3_xxs(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_iq3_xxs *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d);
        for (int ib = 0; ib < 8; ++ib) {
            const Sub32 s = sub_iq3_xxs(x[b], ib);
            const float db = d * (0.5f + float(s.ls)) * 0.5f;
            for (int e = 0; e < 32; ++e) y[b * QK_K + 32 * ib + e] = db * float(s.v[e]);
        }
    }
}

void dequantize_row_iq3_s(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_iq3_s *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d);
        for (int ib = 0; ib < 8; ++ib) {
            const Sub32 s = sub_iq3_s(x[b], ib);
            const float db = d * float(1 + 2 * s.ls);
            for (int e = 0; e < 32; ++e) y[b * QK_K + 32 * ib + e] = db * float(s.v[e]);
        }
    }
}

template <typename Block, Sub32 (*Sub)(const Block &, int)>
int32_t block_sum(const Block &w, const block_q8_K &a) {
    int32_t sumi = 0;
    for (int ib = 0; ib < 8; ++ib) {
        const Sub32 s = Sub(w, ib);
        int32_t t = 0;
        for (int e = 0; e < 32; ++e) t += s.v[e] * a.qs[32 * ib + e];
        sumi += (2 * s.ls + 1) * t;
    }
    return sumi;
}

float vec_dot_iq3_xxs_q8_K(int64_t k, const block_iq3_xxs *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b)
        sum += fp16_to_fp32(w[b].d) * a[b].d * float(block_sum<block_iq3_xxs, sub_iq3_xxs>(w[b], a[b])) * 0.25f;
    return sum;
}

float vec_dot_iq3_s_q8_K(int64_t k, const block_iq3_s *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b)
        sum += fp16_to_fp32(w[b].d) * a[b].d * float(block_sum<block_iq3_s, sub_iq3_s>(w[b], a[b]));
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::IQ3_XXS, GGMLType::Q8_K, dequantize_row_iq3_xxs, quantize_row_q8_K,
                                           gemm_rows<block_iq3_xxs, block_q8_K, vec_dot_iq3_xxs_q8_K>});
KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::IQ3_S, GGMLType::Q8_K, dequantize_row_iq3_s, quantize_row_q8_K,
                                           gemm_rows<block_iq3_s, block_q8_K, vec_dot_iq3_s_q8_K>});

}  // namespace ktd::ref
