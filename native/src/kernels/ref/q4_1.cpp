// Q4_1 weights (w = d * q + m), scalar reference; activations Q8_0.
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_q32.h"

namespace ktd::ref {

namespace {
void dequantize_row_q4_1(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q4_1 *>(vx);
    for (int64_t b = 0; b < k / QK4_1; ++b, y += QK4_1) {
        const float d = fp16_to_fp32(x[b].d), m = fp16_to_fp32(x[b].m);
        for (int j = 0; j < QK4_1 / 2; ++j) {
            y[j] = d * float(x[b].qs[j] & 0x0F) + m;
            y[j + QK4_1 / 2] = d * float(x[b].qs[j] >> 4) + m;
        }
    }
}

// Σ_j (d q_j + m) · da a_j = d·da Σ q_j a_j + m·da Σ a_j.
float vec_dot_q4_1_q8_0(int64_t k, const block_q4_1 *w, const block_q8_0 *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK4_1; ++b) {
        int32_t isum = 0, asum = 0;
        for (int j = 0; j < QK4_1 / 2; ++j) {
            isum += (w[b].qs[j] & 0x0F) * a[b].qs[j] + (w[b].qs[j] >> 4) * a[b].qs[j + QK4_1 / 2];
            asum += a[b].qs[j] + a[b].qs[j + QK4_1 / 2];
        }
        const float da = fp16_to_fp32(a[b].d);
        sum += fp16_to_fp32(w[b].d) * da * float(isum) + fp16_to_fp32(w[b].m) * da * float(asum);
    }
    return sum;
}
}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, q32_type_kernels(GGMLType::Q4_1, dequantize_row_q4_1,
                                                gemm_rows<block_q4_1, block_q8_0, vec_dot_q4_1_q8_0>));

}  // namespace ktd::ref
