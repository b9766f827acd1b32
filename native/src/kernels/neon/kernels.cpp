// Armv8-A Advanced SIMD kernels: Q8_0, Q4_0 (kernels/arm/q32_neon.h), Q4_K, Q6_K (kernels/arm/k_neon.h).
#include "kernels/arm/register.h"

namespace ktd::neon {
KTD_REGISTER_KERNELS(Isa::NEON, q8_entry(GGMLType::Q8_0, dequantize_row_q8<Q8_0Unpack>, gemm_q8<Q8_0Unpack>));
KTD_REGISTER_KERNELS(Isa::NEON, q8_entry(GGMLType::Q4_0, dequantize_row_q8<Q4_0Unpack>, gemm_q8<Q4_0Unpack>));
KTD_REGISTER_KERNELS(Isa::NEON, k_entry(GGMLType::Q4_K, dequantize_row_q4_K, gemm_k<block_q4_K, vec_dot_q4_K>));
KTD_REGISTER_KERNELS(Isa::NEON, k_entry(GGMLType::Q6_K, dequantize_row_q6_K, gemm_k<block_q6_K, vec_dot_q6_K>));
}  // namespace ktd::neon
