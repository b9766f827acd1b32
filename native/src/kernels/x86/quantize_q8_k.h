// Q8_K activation quantizer, AVX2 instructions (also compiled into the AVX-512 kernels). Bitwise
// identical to ktd::ref::quantize_row_q8_K (see there for the definition): the same float
// products, rounded to nearest even by cvtps2dq under the default MXCSR, and the same choice of
// the first element of largest magnitude. Inline, in the including file's ISA namespace
// (kernels/x86/common.h).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/blocks.h"
#include "kernels/x86/common.h"

namespace ktd::KTD_SIMD_NS {

inline void quantize_row_q8_K(const float *x, void *vy, int64_t k) {
    auto *y = static_cast<block_q8_K *>(vy);
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i ones8 = _mm256_set1_epi8(1);
    const __m256i ones16 = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < k / QK_K; ++b, x += QK_K) {
        // max(|x|), and whether any |x| is Inf or NaN (not less than Inf: unordered or equal).
        __m256 vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int j = 0; j < QK_K; j += 8) {
            const __m256 ax = _mm256_andnot_ps(sign_mask, _mm256_loadu_ps(x + j));
            vmax = _mm256_max_ps(ax, vmax);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(ax, inf, _CMP_NLT_UQ));
        }
        if (_mm256_movemask_ps(bad)) {
            y[b].d = std::numeric_limits<float>::quiet_NaN();
            std::memset(y[b].qs, 0, sizeof(y[b].qs));
            std::memset(y[b].bsums, 0, sizeof(y[b].bsums));
            continue;
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        if (amax == 0.0f) {
            y[b].d = 0.0f;
            std::memset(y[b].qs, 0, sizeof(y[b].qs));
            std::memset(y[b].bsums, 0, sizeof(y[b].bsums));
            continue;
        }
        // The first element whose magnitude is amax (there is one: amax is one of them).
        float max = x[0];
        const __m256 vamax = _mm256_set1_ps(amax);
        for (int j = 0; j < QK_K; j += 8) {
            const int mask = _mm256_movemask_ps(
                _mm256_cmp_ps(_mm256_andnot_ps(sign_mask, _mm256_loadu_ps(x + j)), vamax, _CMP_EQ_OQ));
            if (mask) {
                max = x[j + __builtin_ctz(unsigned(mask))];
                break;
            }
        }
        const float iscale = -127.0f / max;
        const __m256 vis = _mm256_set1_ps(iscale);
        const __m256i v127 = _mm256_set1_epi32(127);
        for (int j = 0; j < QK_K; j += 32) {
            __m256i i0 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vis, _mm256_loadu_ps(x + j))), v127);
            __m256i i1 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vis, _mm256_loadu_ps(x + j + 8))), v127);
            __m256i i2 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vis, _mm256_loadu_ps(x + j + 16))), v127);
            __m256i i3 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vis, _mm256_loadu_ps(x + j + 24))), v127);
            const __m256i q = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)), perm);
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(y[b].qs + j), q);
            // Sums of the two groups of 16: low lane → group j/16, high lane → group j/16 + 1.
            __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16);
            s = _mm256_hadd_epi32(s, s);
            s = _mm256_hadd_epi32(s, s);
            y[b].bsums[j / 16] = int16_t(_mm256_extract_epi32(s, 0));
            y[b].bsums[j / 16 + 1] = int16_t(_mm256_extract_epi32(s, 4));
        }
        y[b].d = 1.0f / iscale;
    }
}

}  // namespace ktd::KTD_SIMD_NS
