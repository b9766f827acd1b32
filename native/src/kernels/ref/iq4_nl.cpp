// IQ4_NL weights (w = d * kvalues_iq4nl[q]), scalar reference; activations Q8_0.
#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_q32.h"

namespace ktd::ref {

namespace {
void dequantize_row_iq4_nl(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_iq4_nl *>(vx);
    for (int64_t b = 0; b < k / QK4_NL; ++b, y += QK4_NL) {
        const float d = fp16_to_fp32(x[b].d);
        for (int j = 0; j < QK4_NL / 2; ++j) {
            y[j] = d * float(kvalues_iq4nl[x[b].qs[j] & 0x0F]);
            y[j + QK4_NL / 2] = d * float(kvalues_iq4nl[x[b].qs[j] >> 4]);
        }
    }
}

float vec_dot_iq4_nl_q8_0(int64_t k, const block_iq4_nl *w, const block_q8_0 *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK4_NL; ++b) {
        int32_t isum = 0;
        for (int j = 0; j < QK4_NL / 2; ++j)
            isum += kvalues_iq4nl[w[b].qs[j] & 0x0F] * a[b].qs[j] +
                    kvalues_iq4nl[w[b].qs[j] >> 4] * a[b].qs[j + QK4_NL / 2];
        sum += fp16_to_fp32(w[b].d) * fp16_to_fp32(a[b].d) * float(isum);
    }
    return sum;
}
}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, q32_type_kernels(GGMLType::IQ4_NL, dequantize_row_iq4_nl,
                                                gemm_rows<block_iq4_nl, block_q8_0, vec_dot_iq4_nl_q8_0>));

}  // namespace ktd::ref
