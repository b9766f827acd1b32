// Armv8.2-A + dot product + int8 matrix multiply (SMMLA) kernels: Q8_0, Q4_0 with the arm x4
// repacked layout, whose tile multiplies pairs of tokens by SMMLA (kernels/arm/q32_repack_neon.h),
// and Q4_K, Q6_K (kernels/arm/k_neon.h, the SDOT code). Types without an i8mm entry use the
// dotprod ones (isa_fallback).
#include "kernels/arm/register.h"

namespace ktd::i8mm {
KTD_REGISTER_KERNELS(Isa::I8MM, q8_entry(GGMLType::Q8_0, dequantize_row_q8<Q8_0Unpack>, gemm_q8<Q8_0Unpack>));
KTD_REGISTER_KERNELS(Isa::I8MM, q8_entry(GGMLType::Q4_0, dequantize_row_q8<Q4_0Unpack>, gemm_q8<Q4_0Unpack>));
KTD_REGISTER_KERNELS(Isa::I8MM, k_entry(GGMLType::Q4_K, dequantize_row_q4_K, gemm_k<block_q4_K, vec_dot_q4_K>));
KTD_REGISTER_KERNELS(Isa::I8MM, k_entry(GGMLType::Q6_K, dequantize_row_q6_K, gemm_k<block_q6_K, vec_dot_q6_K>));
}  // namespace ktd::i8mm
