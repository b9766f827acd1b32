// Vector math for the NEON float kernels (element-wise activations, sampling), the twin of
// kernels/avx2/vec_math.h step for step. Included only by files under kernels/neon/, so these
// inline functions are always compiled with the NEON flags (and live in ktd::neon).
#pragma once
#include <arm_neon.h>

namespace ktd::neon {

// e^x, Cephes' expf polynomial (max relative error ~2 ulp), as avx2::exp_ps: the same clamps
// (maxNum/minNum: a NaN argument becomes the clamp bound, as _mm256_max_ps/min_ps with the
// constant second), round to nearest even, the same fused multiply-adds (vfmaq/vfmsq = FMA3's
// fmadd/fnmadd), 2^n through the exponent bits; +inf above 88.72.
inline float32x4_t exp_ps(float32x4_t x) {
    const uint32x4_t overflow = vcgtq_f32(x, vdupq_n_f32(88.7228f));
    x = vmaxnmq_f32(x, vdupq_n_f32(-87.33654f));
    x = vminnmq_f32(x, vdupq_n_f32(88.37626f));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    // r = x - n·ln2, with ln2 split in two parts so that n·ln2_hi is exact.
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    const float32x4_t y = vaddq_f32(vfmaq_f32(r, vmulq_f32(p, r), r), vdupq_n_f32(1.0f));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vbslq_f32(overflow, vdupq_n_f32(__builtin_inff()), vmulq_f32(y, vreinterpretq_f32_s32(e)));
}

// Lanes [0, m) of x (m < 4) into a zeroed vector, and back: the tails go through the same vector
// code as the body, so every element is computed the same way whatever its index.
inline float32x4_t load_head(const float *x, int64_t m) {
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t i = 0; i < m; ++i) t[i] = x[i];
    return vld1q_f32(t);
}
inline void store_head(float *y, float32x4_t v, int64_t m) {
    float t[4];
    vst1q_f32(t, v);
    for (int64_t i = 0; i < m; ++i) y[i] = t[i];
}

}  // namespace ktd::neon
