// Q5_0 weights (w = d * (q - 16)), AVX2+FMA; activations Q8_0. The kernels are kernels/avx2/q32_kernels.h's.
#include "kernels/avx2/q32_kernels.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {

namespace {
struct Q5_0Values {
    static __m256i q(const block_q5_0 &x) { return _mm256_or_si256(unpack_nibbles(x.qs), expand_qh_bit4(x.qh)); }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, q32_entry(GGMLType::Q5_0, dequantize_row_signed<block_q5_0, Q5_0Values, 16>,
                                          gemm_q8_0_act<OffsetDot<block_q5_0, Q5_0Values, 16>>,
                                          gemm_repacked_r8<OffsetDotX8<block_q5_0x8, true, 16>>));

}  // namespace ktd::avx2
