// Q4_K weights × Q8_K activations, scalar reference.
// Block of 256 = 8 sub-blocks of 32; element e = 64c + 32h + l is nibble h of qs[32c + l] and
// belongs to sub-block e/32:  w = (d·sc) · q − (dmin·m).
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/ref/tile.h"

namespace ktd::ref {
namespace {

void dequantize_row_q4_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q4_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d), dmin = fp16_to_fp32(x[b].dmin);
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(x[b].scales, sc, m);
        for (int e = 0; e < QK_K; ++e) {
            const int c = e / 64, h = (e / 32) % 2, l = e % 32;
            const int q = (x[b].qs[32 * c + l] >> (4 * h)) & 0xF;
            const float dl = d * float(sc[e / 32]), ml = dmin * float(m[e / 32]);
            y[b * QK_K + e] = dl * float(q) - ml;
        }
    }
}

float vec_dot_q4_K_q8_K(int64_t k, const block_q4_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(w[b].scales, sc, m);
        int32_t sumq = 0, summ = 0;
        for (int j = 0; j < 8; ++j) {
            int32_t s = 0;
            for (int l = 0; l < 32; ++l) {
                const int e = 32 * j + l;
                const int q = (w[b].qs[32 * (e / 64) + l] >> (4 * (j % 2))) & 0xF;
                s += q * a[b].qs[e];
            }
            sumq += sc[j] * s;
            summ += m[j] * (a[b].bsums[2 * j] + a[b].bsums[2 * j + 1]);
        }
        sum += a[b].d * fp16_to_fp32(w[b].d) * float(sumq) - a[b].d * fp16_to_fp32(w[b].dmin) * float(summ);
    }
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::Q4_K, GGMLType::Q8_K, dequantize_row_q4_K, quantize_row_q8_K,
                                           gemm_tile<block_q4_K, block_q8_K, vec_dot_q4_K_q8_K>});

}  // namespace ktd::ref
