// Q4_0 weights (w = d * (q - 8)), AVX2+FMA; activations Q8_0. The kernels are kernels/avx2/q32_kernels.h's.
#include "kernels/avx2/q32_kernels.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {

namespace {
struct Q4_0Values {
    static __m256i q(const block_q4_0 &x) { return unpack_nibbles(x.qs); }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, q32_entry(GGMLType::Q4_0, dequantize_row_signed<block_q4_0, Q4_0Values, 8>,
                                          gemm_q8_0_act<OffsetDot<block_q4_0, Q4_0Values, 8>>,
                                          gemm_repacked_r8<OffsetDotX8<block_q4_0x8, false, 8>>));

}  // namespace ktd::avx2
