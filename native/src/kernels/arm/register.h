// The NEON / dotprod entries of Q8_0, Q4_0 (Q8_0 activations) and Q4_K, Q6_K (Q8_K activations),
// included once by kernels/neon/kernels.cpp and kernels/dotprod/kernels.cpp. Activations: the
// reference quantizers (baseline code, not inline, so calling them from an ISA object is safe).
// The plain layout only: no repacked layout yet (repack_rows = 0), so the weights are used as
// they are in the file.
#pragma once
#include "kernels/arm/k_neon.h"
#include "kernels/arm/q32_neon.h"
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
    return tk;
}
TypeKernels k_entry(GGMLType type, decltype(TypeKernels::dequantize_row) dq, decltype(TypeKernels::gemm) gemm) {
    TypeKernels tk;
    tk.type = type;
    tk.act_type = GGMLType::Q8_K;
    tk.dequantize_row = dq;
    tk.quantize_act_row = ref::quantize_row_q8_K;
    tk.gemm = gemm;
    return tk;
}
}  // namespace

}  // namespace ktd::KTD_ARM_NS
