// Armv8.2-A + dot product + int8 matrix multiply (SMMLA) kernels: the types with an arm x4 repacked
// layout, whose tiles multiply pairs of tokens by SMMLA: the 32-element types Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1, IQ4_NL (kernels/arm/q32_repack_neon.h) and Q4_K, Q6_K (k_repack_neon.h); their plain
// kernels are the SDOT code (q32_neon.h, q32_more_neon.h, k_neon.h). Types without an i8mm entry
// use the dotprod ones (isa_fallback).
#include "kernels/arm/register.h"

namespace ktd::i8mm {
KTD_REGISTER_KERNELS(Isa::I8MM, q8_entry(GGMLType::Q8_0, dequantize_row_q8<Q8_0Unpack>, gemm_q8<Q8_0Unpack>));
KTD_REGISTER_KERNELS(Isa::I8MM, q8_entry(GGMLType::Q4_0, dequantize_row_q8<Q4_0Unpack>, gemm_q8<Q4_0Unpack>));
KTD_REGISTER_KERNELS(Isa::I8MM, q8_entry(GGMLType::Q4_1, dequantize_row_q8_min<Q4_1Unpack>, gemm_q8_min<Q4_1Unpack>));
KTD_REGISTER_KERNELS(Isa::I8MM, q8_entry(GGMLType::Q5_0, dequantize_row_q8<Q5_0Unpack>, gemm_q8<Q5_0Unpack>));
KTD_REGISTER_KERNELS(Isa::I8MM, q8_entry(GGMLType::Q5_1, dequantize_row_q8_min<Q5_1Unpack>, gemm_q8_min<Q5_1Unpack>));
KTD_REGISTER_KERNELS(Isa::I8MM, q8_entry(GGMLType::IQ4_NL, dequantize_row_q8<IQ4_NLUnpack>, gemm_q8<IQ4_NLUnpack>));
KTD_REGISTER_KERNELS(Isa::I8MM, k_entry(GGMLType::Q4_K, dequantize_row_q4_K, gemm_k<block_q4_K, vec_dot_q4_K>));
KTD_REGISTER_KERNELS(Isa::I8MM, k_entry(GGMLType::Q6_K, dequantize_row_q6_K, gemm_k<block_q6_K, vec_dot_q6_K>));
}  // namespace ktd::i8mm
