// The NEON / dotprod / i8mm entries, included once by kernels/neon/kernels.cpp,
// kernels/dotprod/kernels.cpp and kernels/i8mm/kernels.cpp: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL
// (Q8_0 activations; q32_neon.h, q32_more_neon.h), Q4_K, Q6_K, Q2_K, Q3_K, Q5_K, IQ4_XS, TQ1_0,
// TQ2_0 (Q8_K; k_neon.h, k_more_neon.h), the i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
// IQ3_XXS, IQ3_S (Q8_K; iq_neon.h) and F32, F16, BF16 (F32; float_neon.h). Activations: the
// reference quantizers (baseline code, not inline, so calling them from an ISA object is safe).
// The 32-element types' entries (q8_entry) and the Q4_K and Q6_K entries (k_entry) also carry the
// arm x4 repacked layout (kernels/repacked_q32.h, repacked_k.h) and this ISA's tile on it
// (kernels/arm/q32_repack_neon.h, k_repack_neon.h); the other types use the plain layout. The
// i8mm object registers only those eight; the rest fall back to dotprod's.
#pragma once
#include "kernels/arm/float_neon.h"
#include "kernels/arm/iq_neon.h"
#include "kernels/arm/k_more_neon.h"
#include "kernels/arm/k_neon.h"
#include "kernels/arm/q32_more_neon.h"
#include "kernels/arm/q32_neon.h"
#include "kernels/arm/q32_repack_neon.h"
#include "kernels/arm/k_repack_neon.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::KTD_ARM_NS {
namespace {
// One entry for every quantized type: its activation type decides the reference quantizer and
// which arm x4 layout it may carry (Q8_0: with_arm_x4_layout, for every 32-element type; Q8_K:
// with_arm_k_x4_layout, for Q4_K and Q6_K; every other type keeps the plain layout).
template <GGMLType Act>
TypeKernels quant_entry(GGMLType type, decltype(TypeKernels::dequantize_row) dq, decltype(TypeKernels::gemm) gemm) {
    static_assert(Act == GGMLType::Q8_0 || Act == GGMLType::Q8_K);
    TypeKernels tk;
    tk.type = type;
    tk.act_type = Act;
    tk.dequantize_row = dq;
    tk.gemm = gemm;
    if constexpr (Act == GGMLType::Q8_0) {
        tk.quantize_act_row = ref::quantize_row_q8_0;
        return with_arm_x4_layout(tk);
    } else {
        tk.quantize_act_row = ref::quantize_row_q8_K;
        return with_arm_k_x4_layout(tk);
    }
}
// The 32-element types (Q8_0 activations) and the 256-element ones (Q8_K activations).
constexpr auto q8_entry = quant_entry<GGMLType::Q8_0>;
constexpr auto k_entry = quant_entry<GGMLType::Q8_K>;
// Float weights: F32 activations (a copy of the row), kernels/arm/float_neon.h.
template <typename L>
TypeKernels float_entry(GGMLType type) {
    TypeKernels tk;
    tk.type = type;
    tk.act_type = GGMLType::F32;
    tk.dequantize_row = dequantize_row_float<L>;
    tk.quantize_act_row = ref::copy_row_f32;
    tk.gemm = gemm_float<L>;
    return tk;
}
}  // namespace

}  // namespace ktd::KTD_ARM_NS
