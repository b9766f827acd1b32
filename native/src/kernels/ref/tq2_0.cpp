// TQ2_0 (ternary, BitNet b1.58) weights × Q8_K activations, scalar reference.
// Element e = 128t + 32s + l (l < 32) is bits 2s..2s+1 of qs[32t + l]:  w = d · (q − 1),
// q in {0, 1, 2}. The −1 offset is applied through Q8_K's bsums.
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::ref {
namespace {

inline int tq2_0_value(const block_tq2_0 &x, int e) {
    const int t = e / 128, r = e % 128;
    return (x.qs[32 * t + r % 32] >> (2 * (r / 32))) & 3;
}

void dequantize_row_tq2_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_tq2_0 *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d);
        for (int e = 0; e < QK_K; ++e) y[b * QK_K + e] = d * float(tq2_0_value(x[b], e) - 1);
    }
}

float vec_dot_tq2_0_q8_K(int64_t k, const block_tq2_0 *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t s = 0, asum = 0;
        for (int e = 0; e < QK_K; ++e) s += tq2_0_value(w[b], e) * a[b].qs[e];
        for (int g = 0; g < 16; ++g) asum += a[b].bsums[g];
        sum += a[b].d * fp16_to_fp32(w[b].d) * float(s - asum);
    }
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::TQ2_0, GGMLType::Q8_K, dequantize_row_tq2_0, quantize_row_q8_K,
                                           gemm_rows<block_tq2_0, block_q8_K, vec_dot_tq2_0_q8_K>});

}  // namespace ktd::ref
