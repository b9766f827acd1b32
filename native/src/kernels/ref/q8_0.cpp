// Q8_0 weights, scalar reference. Also the reference quantizer of the Q8_0 activation format
// shared by all 32-element block types (declared in kernels/ref/ref.h).
#include <cmath>

#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_q32.h"

namespace ktd::ref {

void quantize_row_q8_0(const float *x, void *vy, int64_t k) {
    auto *y = static_cast<block_q8_0 *>(vy);
    for (int64_t b = 0; b < k / QK8_0; ++b, x += QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; ++j) amax = std::fmax(amax, std::fabs(x[j]));
        const float d = amax / 127.0f;
        const float id = d ? 1.0f / d : 0.0f;
        y[b].d = fp32_to_fp16(d);
        for (int j = 0; j < QK8_0; ++j) y[b].qs[j] = int8_t(std::lround(x[j] * id));
    }
}

namespace {
void dequantize_row_q8_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q8_0 *>(vx);
    for (int64_t b = 0; b < k / QK8_0; ++b) {
        const float d = fp16_to_fp32(x[b].d);
        for (int j = 0; j < QK8_0; ++j) y[b * QK8_0 + j] = d * x[b].qs[j];
    }
}

float vec_dot_q8_0_q8_0(int64_t k, const block_q8_0 *w, const block_q8_0 *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK8_0; ++b) {
        int32_t isum = 0;
        for (int j = 0; j < QK8_0; ++j) isum += int32_t(w[b].qs[j]) * a[b].qs[j];
        sum += fp16_to_fp32(w[b].d) * fp16_to_fp32(a[b].d) * float(isum);
    }
    return sum;
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, q32_type_kernels(GGMLType::Q8_0, dequantize_row_q8_0,
                                                gemm_rows<block_q8_0, block_q8_0, vec_dot_q8_0_q8_0>));

}  // namespace ktd::ref
