// Q4_1 weights (w = d * q + m), AVX2+FMA; activations Q8_0. The kernels are kernels/avx2/q32_kernels.h's.
#include "kernels/avx2/q32_kernels.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {

namespace {
struct Q4_1Values {
    static __m256i q(const block_q4_1 &x) { return unpack_nibbles(x.qs); }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, q32_entry(GGMLType::Q4_1, dequantize_row_min<block_q4_1, Q4_1Values>,
                                          gemm_q8_0_act<MinDot<block_q4_1, Q4_1Values>>,
                                          gemm_repacked_r8<MinDotX8<block_q4_1x8, false>>));

}  // namespace ktd::avx2
