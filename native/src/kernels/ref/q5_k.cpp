// Q5_K weights × Q8_K activations, scalar reference.
// As Q4_K plus a fifth bit: element e = 64c + 32h + l has its low 4 bits in nibble h of
// qs[32c + l] and bit 4 in bit e/32 of qh[l]:  w = (d·sc) · q − (dmin·m), q in 0..31.
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::ref {
namespace {

inline int q5_K_value(const block_q5_K &x, int e) {
    const int l = e % 32;
    const int lo = (x.qs[32 * (e / 64) + l] >> (4 * ((e / 32) % 2))) & 0xF;
    const int hi = (x.qh[l] >> (e / 32)) & 1;
    return lo | (hi << 4);
}

void dequantize_row_q5_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q5_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d), dmin = fp16_to_fp32(x[b].dmin);
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(x[b].scales, sc, m);
        for (int e = 0; e < QK_K; ++e) {
            const float dl = d * float(sc[e / 32]), ml = dmin * float(m[e / 32]);
            y[b * QK_K + e] = dl * float(q5_K_value(x[b], e)) - ml;
        }
    }
}

float vec_dot_q5_K_q8_K(int64_t k, const block_q5_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(w[b].scales, sc, m);
        int32_t sumq = 0, summ = 0;
        for (int j = 0; j < 8; ++j) {
            int32_t s = 0;
            for (int l = 0; l < 32; ++l) s += q5_K_value(w[b], 32 * j + l) * a[b].qs[32 * j + l];
            sumq += sc[j] * s;
            summ += m[j] * (a[b].bsums[2 * j] + a[b].bsums[2 * j + 1]);
        }
        sum += a[b].d * fp16_to_fp32(w[b].d) * float(sumq) - a[b].d * fp16_to_fp32(w[b].dmin) * float(summ);
    }
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::Q5_K, GGMLType::Q8_K, dequantize_row_q5_K, quantize_row_q8_K,
                                           gemm_rows<block_q5_K, block_q8_K, vec_dot_q5_K_q8_K>});

}  // namespace ktd::ref
