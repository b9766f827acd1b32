// TQ1_0 (ternary, BitNet b1.58, 1.6875 bits/weight) weights × Q8_K activations, scalar reference.
// Trits are packed base 3, most significant first, as a fixed-point fraction: a byte b holding
// trits t0..t4 is ceil(Σ t_i 3^(4−i) · 256 / 243). Trit i is recovered by multiplying by 3^i
// (mod 256, which shifts the fraction left by i trits) and taking the top trit: (u8 · 3) >> 8.
// Element e < 160: byte qs[e % 32], trit e / 32; 160 ≤ e < 240: byte qs[32 + (e−160) % 16],
// trit (e−160) / 16; e ≥ 240: byte qh[(e−240) % 4], trit (e−240) / 4.  w = d · (t − 1).
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::ref {
namespace {

constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};

inline int trit(uint8_t byte, int i) { return (int(uint8_t(byte * kPow3[i])) * 3) >> 8; }

inline int tq1_0_value(const block_tq1_0 &x, int e) {
    if (e < 160) return trit(x.qs[e % 32], e / 32);
    if (e < 240) return trit(x.qs[32 + (e - 160) % 16], (e - 160) / 16);
    return trit(x.qh[(e - 240) % 4], (e - 240) / 4);
}

void dequantize_row_tq1_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_tq1_0 *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d);
        for (int e = 0; e < QK_K; ++e) y[b * QK_K + e] = d * float(tq1_0_value(x[b], e) - 1);
    }
}

float vec_dot_tq1_0_q8_K(int64_t k, const block_tq1_0 *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t s = 0, asum = 0;
        for (int e = 0; e < QK_K; ++e) s += tq1_0_value(w[b], e) * a[b].qs[e];
        for (int g = 0; g < 16; ++g) asum += a[b].bsums[g];
        sum += a[b].d * fp16_to_fp32(w[b].d) * float(s - asum);
    }
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::TQ1_0, GGMLType::Q8_K, dequantize_row_tq1_0, quantize_row_q8_K,
                                           gemm_rows<block_tq1_0, block_q8_K, vec_dot_tq1_0_q8_K>});

}  // namespace ktd::ref
