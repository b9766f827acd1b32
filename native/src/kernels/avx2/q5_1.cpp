// Q5_1 weights (w = d * q + m), AVX2+FMA; activations Q8_0. The kernels are kernels/avx2/q32_kernels.h's.
#include "kernels/avx2/q32_kernels.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {

namespace {
struct Q5_1Values {
    static __m256i q(const block_q5_1 &x) { return _mm256_or_si256(unpack_nibbles(x.qs), expand_qh_bit4(x.qh)); }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, q32_entry(GGMLType::Q5_1, dequantize_row_min<block_q5_1, Q5_1Values>,
                                          gemm_q8_0_act<MinDot<block_q5_1, Q5_1Values>>,
                                          gemm_repacked_r8<MinDotX8<block_q5_1x8, true>>));

}  // namespace ktd::avx2
