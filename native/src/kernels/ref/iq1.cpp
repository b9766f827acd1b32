// IQ1_S and IQ1_M weights × Q8_K activations, scalar reference (the specification).
//
// Each block holds 256 weights as 32 groups of 8; group g is one point of the ternary code book
// iq1s_grid (11-bit index, values −1, 0, 1) shifted by δ = ±1/8 (kernels/iq_grids.h):
//   w = dl · (grid[idx_g][e % 8] + δ)
//   IQ1_S: idx = qs[g] | ((qh[ib] >> 3(g % 4)) & 7) << 8, ib = g / 4; dl = d · (2·((qh[ib] >> 12) & 7) + 1);
//          δ = −1/8 if bit 15 of qh[ib] else +1/8 (per sub-block of 32).
//   IQ1_M: n = nibble g % 2 of qh[g / 2]: idx = qs[g] | (n & 7) << 8, δ = −1/8 if n & 8 (per 8);
//          3-bit scale s of weights 16h.. = bits 3(h % 4).. of the uint16 sc[h / 4] (4 of them in
//          `scales`), dl = d · (2s + 1); d = the fp16 whose nibble i is sc[i] >> 12.
// The dot product is exact in integers per scale group: Σ dl'·(Σ grid·q8 + δ·Σ q8), with
// dl' = 2s + 1 and δ·Σq8 kept as ±Σq8 (scaled by 1/8 at the end).
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/iq_grids.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::ref {
namespace {

// Group g of 8: its grid values, the sign of its shift (+1 or −1) and its 3-bit scale.
struct Group8 {
    int v[8];
    int delta_sign;
    int s;
};

inline void grid_values(int idx, int v[8]) {
    for (int j = 0; j < 8; ++j) v[j] = int(int8_t(uint8_t(iq1s_grid[idx] >> (8 * j))));
}

Group8 group_iq1_s(const block_iq1_s &x, int g) {
    const int ib = g / 4;
    Group8 out{};
    grid_values(x.qs[g] | ((x.qh[ib] >> (3 * (g % 4))) & 7) << 8, out.v);
    out.delta_sign = (x.qh[ib] & 0x8000) ? -1 : 1;
    out.s = (x.qh[ib] >> 12) & 7;
    return out;
}

inline uint16_t iq1_m_sc(const block_iq1_m &x, int i) { return uint16_t(x.scales[2 * i] | x.scales[2 * i + 1] << 8); }

float iq1_m_d(const block_iq1_m &x) {
    const uint16_t h = uint16_t((iq1_m_sc(x, 0) >> 12) | ((iq1_m_sc(x, 1) >> 8) & 0x00F0) |
                                ((iq1_m_sc(x, 2) >> 4) & 0x0F00) | (iq1_m_sc(x, 3) & 0xF000));
    return fp16_to_fp32(h);
}

Group8 group_iq1_m(const block_iq1_m &x, int g) {
    const int n = (x.qh[g / 2] >> (4 * (g % 2))) & 0xF;
    const int h = g / 2;  // group of 16
    Group8 out{};
    grid_values(x.qs[g] | (n & 7) << 8, out.v);
    out.delta_sign = (n & 8) ? -1 : 1;
    out.s = (iq1_m_sc(x, h / 4) >> (3 * (h % 4))) & 7;
    return out;
}

inline float d_of(const block_iq1_s &x) { return fp16_to_fp32(x.d); }
inline float d_of(const block_iq1_m &x) { return iq1_m_d(x); }

template <typename Block, Group8 (*Group)(const Block &, int)>
void dequantize_row(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const Block *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = d_of(x[b]);
        for (int g = 0; g < 32; ++g) {
            const Group8 gr = Group(x[b], g);
            const float dl = d * float(2 * gr.s + 1);
            const float delta = gr.delta_sign * kIQ1Delta;
            for (int j = 0; j < 8; ++j) y[b * QK_K + 8 * g + j] = dl * (float(gr.v[j]) + delta);
        }
    }
}

template <typename Block, Group8 (*Group)(const Block &, int)>
float vec_dot(int64_t k, const Block *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sum_grid = 0, sum_delta = 0;
        for (int g = 0; g < 32; ++g) {
            const Group8 gr = Group(w[b], g);
            int32_t s = 0, sq = 0;
            for (int j = 0; j < 8; ++j) {
                s += gr.v[j] * a[b].qs[8 * g + j];
                sq += a[b].qs[8 * g + j];
            }
            sum_grid += (2 * gr.s + 1) * s;
            sum_delta += (2 * gr.s + 1) * gr.delta_sign * sq;
        }
        sum += d_of(w[b]) * a[b].d * (float(sum_grid) + kIQ1Delta * float(sum_delta));
    }
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::IQ1_S, GGMLType::Q8_K, dequantize_row<block_iq1_s, group_iq1_s>,
                                           quantize_row_q8_K,
                                           gemm_rows<block_iq1_s, block_q8_K, vec_dot<block_iq1_s, group_iq1_s>>});
KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::IQ1_M, GGMLType::Q8_K, dequantize_row<block_iq1_m, group_iq1_m>,
                                           quantize_row_q8_K,
                                           gemm_rows<block_iq1_m, block_q8_K, vec_dot<block_iq1_m, group_iq1_m>>});

}  // namespace ktd::ref
