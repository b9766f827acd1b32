// Q6_K weights × Q8_K activations, scalar reference.
// Block of 256 = 16 sub-blocks of 16 with int8 scales. Element e = 128t + 64h + m (m < 64) has
// its low 4 bits in nibble h of ql[64t + m]; element e = 128t + 32s + l (l < 32) has its high
// 2 bits at bit 2s of qh[32t + l]:  w = (d·sc[e/16]) · (q − 32), q in 0..63.
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/ref/tile.h"

namespace ktd::ref {
namespace {

inline int q6_K_value(const block_q6_K &x, int e) {
    const int t = e / 128, r = e % 128;
    const int lo = (x.ql[64 * t + r % 64] >> (4 * (r / 64))) & 0xF;
    const int hi = (x.qh[32 * t + r % 32] >> (2 * (r / 32))) & 3;
    return (lo | (hi << 4)) - 32;
}

void dequantize_row_q6_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q6_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d);
        for (int e = 0; e < QK_K; ++e) {
            const float dl = d * float(x[b].scales[e / 16]);
            y[b * QK_K + e] = dl * float(q6_K_value(x[b], e));
        }
    }
}

float vec_dot_q6_K_q8_K(int64_t k, const block_q6_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sumq = 0;
        for (int g = 0; g < 16; ++g) {
            int32_t s = 0;
            for (int l = 0; l < 16; ++l) s += q6_K_value(w[b], 16 * g + l) * a[b].qs[16 * g + l];
            sumq += w[b].scales[g] * s;
        }
        sum += a[b].d * fp16_to_fp32(w[b].d) * float(sumq);
    }
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::Q6_K, GGMLType::Q8_K, dequantize_row_q6_K, quantize_row_q8_K,
                                           gemm_tile<block_q6_K, block_q8_K, vec_dot_q6_K_q8_K>});

}  // namespace ktd::ref
