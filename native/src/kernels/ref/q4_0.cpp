// Q4_0 weights (w = d * (q - 8)), scalar reference; activations Q8_0.
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_q32.h"

namespace ktd::ref {

namespace {
void dequantize_row_q4_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q4_0 *>(vx);
    for (int64_t b = 0; b < k / QK4_0; ++b, y += QK4_0) {
        const float d = fp16_to_fp32(x[b].d);
        for (int j = 0; j < QK4_0 / 2; ++j) {
            y[j] = d * float((x[b].qs[j] & 0x0F) - 8);
            y[j + QK4_0 / 2] = d * float((x[b].qs[j] >> 4) - 8);
        }
    }
}

float vec_dot_q4_0_q8_0(int64_t k, const block_q4_0 *w, const block_q8_0 *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK4_0; ++b) {
        int32_t isum = 0;
        for (int j = 0; j < QK4_0 / 2; ++j)
            isum += ((w[b].qs[j] & 0x0F) - 8) * a[b].qs[j] + ((w[b].qs[j] >> 4) - 8) * a[b].qs[j + QK4_0 / 2];
        sum += fp16_to_fp32(w[b].d) * fp16_to_fp32(a[b].d) * float(isum);
    }
    return sum;
}
}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, q32_type_kernels(GGMLType::Q4_0, dequantize_row_q4_0,
                                                gemm_rows<block_q4_0, block_q8_0, vec_dot_q4_0_q8_0>));

}  // namespace ktd::ref
