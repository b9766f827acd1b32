// Q2_K weights × Q8_K activations, AVX2 (layout and definition in kernels/ref/q2_k.cpp).
// Per 128 elements: one 32-byte load of qs holds four vectors of 2-bit q; each 32 elements
// span two sub-blocks of 16 (one per 128-bit lane), so the scale vector carries sc[g] in the
// low lane and sc[g+1] in the high lane. Mins through Q8_K's bsums: Σ_g m_g · bsum_g.
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {
namespace {

// int16 vector: sub-block scale g in the low lane, g+1 in the high lane (from 16 uint8).
inline __m256i lane_scales(__m128i sc8, int g) {
    const __m128i shuf = _mm_set_epi64x(0x0101010101010101LL * (g + 1), 0x0101010101010101LL * g);
    return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sc8, shuf));
}

void dequantize_row_q2_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q2_K *>(vx);
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d), dmin = f16(x[b].dmin);
        for (int t = 0; t < 2; ++t) {
            const __m256i bits = load256(x[b].qs + 32 * t);
            for (int s = 0; s < 4; ++s) {
                const __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * s), m3);
                const int g = 8 * t + 2 * s;
                __m256 v[4];
                cvt_x32_ps<false>(q, v);
                float *out = y + b * QK_K + 128 * t + 32 * s;
                for (int i = 0; i < 4; ++i) {
                    const uint8_t sm = x[b].scales[g + i / 2];
                    const __m256 r = _mm256_mul_ps(_mm256_set1_ps(d * float(sm & 0xF)), v[i]);
                    _mm256_storeu_ps(out + 8 * i, _mm256_sub_ps(r, _mm256_set1_ps(dmin * float(sm >> 4))));
                }
            }
        }
    }
}

struct Q2K {
    template <int NC>
    static void dot(int64_t nb, const block_q2_K *w, const block_q8_K *const *a, float *out) {
        const __m256i m3 = _mm256_set1_epi8(3);
        const __m128i m4 = _mm_set1_epi8(0xF);
        __m256 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(w[b].scales));
            const __m128i sc8 = _mm_and_si128(raw, m4);
            const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
            __m256i sumi[NC];
            for (int c = 0; c < NC; ++c) sumi[c] = _mm256_setzero_si256();
            for (int t = 0; t < 2; ++t) {
                const __m256i bits = load256(w[b].qs + 32 * t);
                __m256i q[4], s[4];
                for (int i = 0; i < 4; ++i) {
                    q[i] = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * i), m3);
                    s[i] = lane_scales(sc8, 8 * t + 2 * i);
                }
                for (int c = 0; c < NC; ++c) {
                    const int8_t *aq = a[c][b].qs + 128 * t;
                    const __m256i p0 = _mm256_madd_epi16(s[0], _mm256_maddubs_epi16(q[0], load256(aq)));
                    const __m256i p1 = _mm256_madd_epi16(s[1], _mm256_maddubs_epi16(q[1], load256(aq + 32)));
                    const __m256i p2 = _mm256_madd_epi16(s[2], _mm256_maddubs_epi16(q[2], load256(aq + 64)));
                    const __m256i p3 = _mm256_madd_epi16(s[3], _mm256_maddubs_epi16(q[3], load256(aq + 96)));
                    sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
                }
            }
            const float d = f16(w[b].d), dmin = f16(w[b].dmin);
            for (int c = 0; c < NC; ++c) {
                const __m256i pm = _mm256_madd_epi16(mins16, load256(a[c][b].bsums));
                acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[c][b].d), _mm256_cvtepi32_ps(sumi[c]), acc[c]);
                acc[c] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * a[c][b].d), _mm256_cvtepi32_ps(pm), acc[c]);
            }
        }
        for (int c = 0; c < NC; ++c) out[c] = hsum(acc[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::Q2_K, GGMLType::Q8_K, dequantize_row_q2_K, quantize_row_q8_K,
                                            gemm_tile<block_q2_K, Q2K>});

}  // namespace ktd::avx2
