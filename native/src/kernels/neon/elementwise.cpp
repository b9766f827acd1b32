// NEON element-wise activations (kernels/elementwise.h): 4 floats at a time with the vector exp of
// neon/vec_math.h, the twin of kernels/avx2/elementwise.cpp (same formulas and operation order);
// the last n % 4 elements go through the same vector code, so every element is computed the same
// way. Within the tolerance of the reference that tests/kernels/test_elementwise.py gives every ISA.
// dotprod and i8mm use these (isa_fallback).
#include <arm_neon.h>

#include "kernels/elementwise.h"
#include "kernels/neon/vec_math.h"

namespace ktd::neon {

namespace {

float32x4_t silu_mul(float32x4_t x, float32x4_t y) {
    const float32x4_t den = vaddq_f32(vdupq_n_f32(1.0f), exp_ps(vnegq_f32(x)));
    return vmulq_f32(vdivq_f32(x, den), y);
}

// Same operation order as the reference: u2 = ((-2·√(2/π))·x)·(1 + 0.044715·x·x).
float32x4_t gelu_mul(float32x4_t x, float32x4_t y) {
    const float32x4_t x2 = vmulq_f32(vmulq_f32(vdupq_n_f32(0.044715f), x), x);
    const float32x4_t u2 =
        vmulq_f32(vmulq_f32(vdupq_n_f32(-2.0f * 0.79788456080286535588f), x), vaddq_f32(vdupq_n_f32(1.0f), x2));
    const float32x4_t den = vaddq_f32(vdupq_n_f32(1.0f), exp_ps(u2));
    return vmulq_f32(vdivq_f32(x, den), y);
}

float32x4_t relu2_mul(float32x4_t x, float32x4_t y) {
    const float32x4_t r = vmaxq_f32(x, vdupq_n_f32(0.0f));
    return vmulq_f32(vmulq_f32(r, r), y);
}

template <float32x4_t (*Op)(float32x4_t, float32x4_t)>
void apply(float *a, const float *b, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(a + i, Op(vld1q_f32(a + i), vld1q_f32(b + i)));
    if (i < n) store_head(a + i, Op(load_head(a + i, n - i), load_head(b + i, n - i)), n - i);
}

}  // namespace

KTD_REGISTER_GLU(Glu::SwiGLU, Isa::NEON, apply<silu_mul>);
KTD_REGISTER_GLU(Glu::GeGLU, Isa::NEON, apply<gelu_mul>);
KTD_REGISTER_GLU(Glu::ReLU2, Isa::NEON, apply<relu2_mul>);

}  // namespace ktd::neon
