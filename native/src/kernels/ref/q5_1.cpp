// Q5_1 weights (w = d * q + m), scalar reference; activations Q8_0.
#include <cstring>

#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_q32.h"

namespace ktd::ref {

namespace {
inline int q5_value(const uint8_t *qs, uint32_t qh, int j) {
    const int lo = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
    return lo | int(((qh >> j) & 1u) << 4);
}

void dequantize_row_q5_1(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q5_1 *>(vx);
    for (int64_t b = 0; b < k / QK5_1; ++b, y += QK5_1) {
        const float d = fp16_to_fp32(x[b].d), m = fp16_to_fp32(x[b].m);
        uint32_t qh;
        std::memcpy(&qh, x[b].qh, 4);
        for (int j = 0; j < QK5_1; ++j) y[j] = d * float(q5_value(x[b].qs, qh, j)) + m;
    }
}

// Σ_j (d q_j + m) · da a_j = d·da Σ q_j a_j + m·da Σ a_j.
float vec_dot_q5_1_q8_0(int64_t k, const block_q5_1 *w, const block_q8_0 *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK5_1; ++b) {
        uint32_t qh;
        std::memcpy(&qh, w[b].qh, 4);
        int32_t isum = 0, asum = 0;
        for (int j = 0; j < QK5_1; ++j) {
            isum += q5_value(w[b].qs, qh, j) * a[b].qs[j];
            asum += a[b].qs[j];
        }
        const float da = fp16_to_fp32(a[b].d);
        sum += fp16_to_fp32(w[b].d) * da * float(isum) + fp16_to_fp32(w[b].m) * da * float(asum);
    }
    return sum;
}
}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, q32_type_kernels(GGMLType::Q5_1, dequantize_row_q5_1,
                                                gemm_rows<block_q5_1, block_q8_0, vec_dot_q5_1_q8_0>));

}  // namespace ktd::ref
