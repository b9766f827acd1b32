// Q2_K weights × Q8_K activations, scalar reference.
// Block of 256 = 16 sub-blocks of 16; scales[g] = scale (low 4 bits) | min (high 4 bits).
// Element e = 128t + 32s + l (l < 32) is bits 2s..2s+1 of qs[32t + l]:
// w = (d·sc[e/16]) · q − (dmin·m[e/16]), q in 0..3.
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::ref {
namespace {

inline int q2_K_value(const block_q2_K &x, int e) {
    const int t = e / 128, r = e % 128;
    return (x.qs[32 * t + r % 32] >> (2 * (r / 32))) & 3;
}

void dequantize_row_q2_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q2_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d), dmin = fp16_to_fp32(x[b].dmin);
        for (int e = 0; e < QK_K; ++e) {
            const float dl = d * float(x[b].scales[e / 16] & 0xF), ml = dmin * float(x[b].scales[e / 16] >> 4);
            y[b * QK_K + e] = dl * float(q2_K_value(x[b], e)) - ml;
        }
    }
}

float vec_dot_q2_K_q8_K(int64_t k, const block_q2_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sumq = 0, summ = 0;
        for (int g = 0; g < 16; ++g) {
            int32_t s = 0;
            for (int l = 0; l < 16; ++l) s += q2_K_value(w[b], 16 * g + l) * a[b].qs[16 * g + l];
            sumq += (w[b].scales[g] & 0xF) * s;
            summ += (w[b].scales[g] >> 4) * a[b].bsums[g];
        }
        sum += a[b].d * fp16_to_fp32(w[b].d) * float(sumq) - a[b].d * fp16_to_fp32(w[b].dmin) * float(summ);
    }
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::Q2_K, GGMLType::Q8_K, dequantize_row_q2_K, quantize_row_q8_K,
                                           gemm_rows<block_q2_K, block_q8_K, vec_dot_q2_K_q8_K>});

}  // namespace ktd::ref
