// IQ4_XS weights × Q8_K activations, scalar reference.
// Block of 256 = 8 sub-blocks of 32 with 6-bit signed scales; element e = 32j + 16h + l
// (l < 16) is nibble h of qs[16j + l], an index into the IQ4_NL code book:
// w = (d·sc[j]) · kvalues_iq4nl[q].
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::ref {
namespace {

inline int iq4_xs_value(const block_iq4_xs &x, int e) {
    const int j = e / 32, h = (e / 16) % 2, l = e % 16;
    return kvalues_iq4nl[(x.qs[16 * j + l] >> (4 * h)) & 0xF];
}

void dequantize_row_iq4_xs(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_iq4_xs *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d);
        for (int e = 0; e < QK_K; ++e) {
            const float dl = d * float(iq4_xs_scale(x[b].scales_l, x[b].scales_h, e / 32));
            y[b * QK_K + e] = dl * float(iq4_xs_value(x[b], e));
        }
    }
}

float vec_dot_iq4_xs_q8_K(int64_t k, const block_iq4_xs *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sumq = 0;
        for (int j = 0; j < 8; ++j) {
            int32_t s = 0;
            for (int l = 0; l < 32; ++l) s += iq4_xs_value(w[b], 32 * j + l) * a[b].qs[32 * j + l];
            sumq += iq4_xs_scale(w[b].scales_l, w[b].scales_h, j) * s;
        }
        sum += a[b].d * fp16_to_fp32(w[b].d) * float(sumq);
    }
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::IQ4_XS, GGMLType::Q8_K, dequantize_row_iq4_xs, quantize_row_q8_K,
                                           gemm_rows<block_iq4_xs, block_q8_K, vec_dot_iq4_xs_q8_K>});

}  // namespace ktd::ref
