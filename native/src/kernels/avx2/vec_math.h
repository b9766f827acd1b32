// Vector math for the AVX2 float kernels (attention, element-wise activations). Included only by
// files under kernels/avx2/, so these inline functions are always compiled with AVX2 flags.
#pragma once
#include <immintrin.h>

namespace ktd::avx2 {

// e^x, Cephes' expf polynomial (max relative error ~2 ulp); +inf above 88.72 (where expf
// overflows). Below -87.34 the result is ~1e-38 rather than a subnormal or 0 (callers that need
// exact zeros mask them).
inline __m256 exp_ps(__m256 x) {
    const __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(88.7228f), _CMP_GT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.37626f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // r = x - n·ln2, with ln2 split in two parts so that n·ln2_hi is exact.
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    // 2^n through the exponent bits (n in [-126, 128) after the clamp: a normal number, or 2^127·2).
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), _mm256_set1_ps(__builtin_inff()), overflow);
}

}  // namespace ktd::avx2
