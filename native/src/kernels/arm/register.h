// The NEON / dotprod / i8mm entries of Q8_0, Q4_0 (Q8_0 activations) and Q4_K, Q6_K (Q8_K
// activations), included once by kernels/neon/kernels.cpp, kernels/dotprod/kernels.cpp and
// kernels/i8mm/kernels.cpp. Activations: the
// reference quantizers (baseline code, not inline, so calling them from an ISA object is safe).
// Q8_0 and Q4_0 entries (q8_entry) and Q4_K and Q6_K entries (k_entry) also carry the arm x4
// repacked layout (kernels/repacked_q32.h, repacked_k.h) and this ISA's tile on it
// (kernels/arm/q32_repack_neon.h, k_repack_neon.h); other types use the plain layout.
#pragma once
#include "kernels/arm/k_neon.h"
#include "kernels/arm/q32_neon.h"
#include "kernels/arm/q32_repack_neon.h"
#include "kernels/arm/k_repack_neon.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::KTD_ARM_NS {
namespace {
TypeKernels q8_entry(GGMLType type, decltype(TypeKernels::dequantize_row) dq, decltype(TypeKernels::gemm) gemm) {
    TypeKernels tk;
    tk.type = type;
    tk.act_type = GGMLType::Q8_0;
    tk.dequantize_row = dq;
    tk.quantize_act_row = ref::quantize_row_q8_0;
    tk.gemm = gemm;
    return with_arm_x4_layout(tk);
}
TypeKernels k_entry(GGMLType type, decltype(TypeKernels::dequantize_row) dq, decltype(TypeKernels::gemm) gemm) {
    TypeKernels tk;
    tk.type = type;
    tk.act_type = GGMLType::Q8_K;
    tk.dequantize_row = dq;
    tk.quantize_act_row = ref::quantize_row_q8_K;
    tk.gemm = gemm;
    return with_arm_k_x4_layout(tk);
}
}  // namespace

}  // namespace ktd::KTD_ARM_NS
