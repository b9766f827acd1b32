// Q3_K weights × Q8_K activations, scalar reference.
// Block of 256 = 16 sub-blocks of 16 with 6-bit signed scales (see unpack_scales_q3_K).
// Element e = 128t + 32s + l (l < 32): low 2 bits at bit 2s of qs[32t + l]; element
// e = 32u + l: "high" bit at bit u of hmask[l], and q = low − (high bit clear ? 4 : 0):
// w = (d·sc[e/16]) · q, q in −4..3.
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::ref {
namespace {

inline int q3_K_value(const block_q3_K &x, int e) {
    const int t = e / 128, r = e % 128;
    const int lo = (x.qs[32 * t + r % 32] >> (2 * (r / 32))) & 3;
    const int hbit = (x.hmask[e % 32] >> (e / 32)) & 1;
    return lo - (hbit ? 0 : 4);
}

void dequantize_row_q3_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q3_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d);
        int8_t sc[16];
        unpack_scales_q3_K(x[b].scales, sc);
        for (int e = 0; e < QK_K; ++e) y[b * QK_K + e] = (d * float(sc[e / 16])) * float(q3_K_value(x[b], e));
    }
}

float vec_dot_q3_K_q8_K(int64_t k, const block_q3_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int8_t sc[16];
        unpack_scales_q3_K(w[b].scales, sc);
        int32_t sumq = 0;
        for (int g = 0; g < 16; ++g) {
            int32_t s = 0;
            for (int l = 0; l < 16; ++l) s += q3_K_value(w[b], 16 * g + l) * a[b].qs[16 * g + l];
            sumq += sc[g] * s;
        }
        sum += a[b].d * fp16_to_fp32(w[b].d) * float(sumq);
    }
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::Q3_K, GGMLType::Q8_K, dequantize_row_q3_K, quantize_row_q8_K,
                                           gemm_rows<block_q3_K, block_q8_K, vec_dot_q3_K_q8_K>});

}  // namespace ktd::ref
