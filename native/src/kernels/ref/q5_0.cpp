// Q5_0 weights (w = d * (q - 16)), scalar reference; activations Q8_0.
#include <cstring>

#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_q32.h"

namespace ktd::ref {

namespace {
// The 5-bit value of element j (0..31) of a block: low nibble from qs, bit 4 from qh.
inline int q5_value(const uint8_t *qs, uint32_t qh, int j) {
    const int lo = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
    return lo | int(((qh >> j) & 1u) << 4);
}

void dequantize_row_q5_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q5_0 *>(vx);
    for (int64_t b = 0; b < k / QK5_0; ++b, y += QK5_0) {
        const float d = fp16_to_fp32(x[b].d);
        uint32_t qh;
        std::memcpy(&qh, x[b].qh, 4);
        for (int j = 0; j < QK5_0; ++j) y[j] = d * float(q5_value(x[b].qs, qh, j) - 16);
    }
}

float vec_dot_q5_0_q8_0(int64_t k, const block_q5_0 *w, const block_q8_0 *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK5_0; ++b) {
        uint32_t qh;
        std::memcpy(&qh, w[b].qh, 4);
        int32_t isum = 0;
        for (int j = 0; j < QK5_0; ++j) isum += (q5_value(w[b].qs, qh, j) - 16) * a[b].qs[j];
        sum += fp16_to_fp32(w[b].d) * fp16_to_fp32(a[b].d) * float(isum);
    }
    return sum;
}
}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, q32_type_kernels(GGMLType::Q5_0, dequantize_row_q5_0,
                                                gemm_rows<block_q5_0, block_q8_0, vec_dot_q5_0_q8_0>));

}  // namespace ktd::ref
