// Q4_1 weights (w = d * q + m), AVX2+FMA; activations Q8_0. The kernels are kernels/avx2/q32_min.h's.
#include "kernels/avx2/q32_min.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {

namespace {
struct Q4_1Values {
    static __m256i q(const block_q4_1 &x) { return unpack_nibbles(x.qs); }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{.type = GGMLType::Q4_1,
                                            .act_type = GGMLType::Q8_0,
                                            .dequantize_row = dequantize_row_min<block_q4_1, Q4_1Values>,
                                            .quantize_act_row = quantize_row_q8_0,
                                            .gemm = gemm_q8_0_act<MinDot<block_q4_1, Q4_1Values>>,
                                            .repack_rows = kRepackRows,
                                            .repack_layout = kRepackLayoutQ32x8,
                                            .repacked_group_bytes = ref::group_bytes_q4_1_x8,
                                            .repack = ref::repack_q4_1_x8,
                                            .gemm_repacked = gemm_repacked_r8<MinDotX8<block_q4_1x8, false>>});

}  // namespace ktd::avx2
