// Armv8.2-A + dot product (SDOT) kernels of every weight type (kernels/arm/*.h; the list in
// register.h; the float types have no SDOT use and are the NEON code compiled for this ISA).
#include "kernels/arm/register.h"

namespace ktd::dotprod {
KTD_REGISTER_KERNELS(Isa::DOTPROD, q8_entry(GGMLType::Q8_0, dequantize_row_q8<Q8_0Unpack>, gemm_q8<Q8_0Unpack>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, q8_entry(GGMLType::Q4_0, dequantize_row_q8<Q4_0Unpack>, gemm_q8<Q4_0Unpack>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::Q4_K, dequantize_row_q4_K, gemm_k<block_q4_K, vec_dot_q4_K>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::Q6_K, dequantize_row_q6_K, gemm_k<block_q6_K, vec_dot_q6_K>));
// The other 32-element types (kernels/arm/q32_more_neon.h), the other K-quants, IQ4_XS
// and the ternary types (k_more_neon.h), the i-quants (iq_neon.h), the float types (float_neon.h).
KTD_REGISTER_KERNELS(Isa::DOTPROD, q8_entry(GGMLType::Q4_1, dequantize_row_q8_min<Q4_1Unpack>, gemm_q8_min<Q4_1Unpack>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, q8_entry(GGMLType::Q5_0, dequantize_row_q8<Q5_0Unpack>, gemm_q8<Q5_0Unpack>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, q8_entry(GGMLType::Q5_1, dequantize_row_q8_min<Q5_1Unpack>, gemm_q8_min<Q5_1Unpack>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, q8_entry(GGMLType::IQ4_NL, dequantize_row_q8<IQ4_NLUnpack>, gemm_q8<IQ4_NLUnpack>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::Q2_K, dequantize_row_q2_K, gemm_k<block_q2_K, vec_dot_q2_K>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::Q3_K, dequantize_row_q3_K, gemm_k<block_q3_K, vec_dot_q3_K>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::Q5_K, dequantize_row_q5_K, gemm_k<block_q5_K, vec_dot_q5_K>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::IQ4_XS, dequantize_row_iq4_xs, gemm_k<block_iq4_xs, vec_dot_iq4_xs>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::TQ1_0, dequantize_row_tq1_0, gemm_k<block_tq1_0, vec_dot_tq1_0>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::TQ2_0, dequantize_row_tq2_0, gemm_k<block_tq2_0, vec_dot_tq2_0>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::IQ1_S, dequantize_row_iq1<IQ1_S>, gemm_k<block_iq1_s, vec_dot_iq1<IQ1_S>>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::IQ1_M, dequantize_row_iq1<IQ1_M>, gemm_k<block_iq1_m, vec_dot_iq1<IQ1_M>>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::IQ2_XXS, dequantize_row_iq2<IQ2_XXS>, gemm_k<block_iq2_xxs, vec_dot_iq2<IQ2_XXS>>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::IQ2_XS, dequantize_row_iq2<IQ2_XS>, gemm_k<block_iq2_xs, vec_dot_iq2<IQ2_XS>>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::IQ2_S, dequantize_row_iq2<IQ2_S>, gemm_k<block_iq2_s, vec_dot_iq2<IQ2_S>>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::IQ3_XXS, dequantize_row_iq3_xxs, gemm_k<block_iq3_xxs, vec_dot_iq3_xxs>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, k_entry(GGMLType::IQ3_S, dequantize_row_iq3_s, gemm_k<block_iq3_s, vec_dot_iq3_s>));
KTD_REGISTER_KERNELS(Isa::DOTPROD, float_entry<F32Load>(GGMLType::F32));
KTD_REGISTER_KERNELS(Isa::DOTPROD, float_entry<F16Load>(GGMLType::F16));
KTD_REGISTER_KERNELS(Isa::DOTPROD, float_entry<BF16Load>(GGMLType::BF16));
}  // namespace ktd::dotprod
