// Q3_K weights × Q8_K activations, AVX2 (layout and definition in kernels/ref/q3_k.cpp).
// The 3-bit value is used unsigned, q' = low | high << 2 = q + 4 (0..7), and the offset is
// applied once per block through Q8_K's bsums: Σ sc·q·a = Σ sc·q'·a − 4 · Σ_g sc_g · bsum_g.
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {
namespace {

// int16 vector: sub-block scale g in the low lane, g+1 in the high lane (from 16 int8).
inline __m256i lane_scales(__m128i sc8, int g) {
    const __m128i shuf = _mm_set_epi64x(0x0101010101010101LL * (g + 1), 0x0101010101010101LL * g);
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, shuf));
}

// q' (0..7) of elements 128t + 32i + (0..31), i = 0..3.
inline void unpack_q3(const block_q3_K &x, __m256i hbits, int t, __m256i q[4]) {
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
    const __m256i bits = load256(x.qs + 32 * t);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
        // Bit 4t+i of hmask[l] → bit 2 of the byte.
        const int u = 4 * t + i;
        const __m256i h = _mm256_slli_epi16(_mm256_srli_epi16(hbits, u), 2);
        q[i] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 2 * i), m3), _mm256_and_si256(h, m4));
    }
}

void dequantize_row_q3_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q3_K *>(vx);
    const __m256i m4 = _mm256_set1_epi8(4);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d);
        int8_t sc[16];
        unpack_scales_q3_K(x[b].scales, sc);
        const __m256i hbits = load256(x[b].hmask);
        for (int t = 0; t < 2; ++t) {
            __m256i q[4];
            unpack_q3(x[b], hbits, t, q);
            for (int i = 0; i < 4; ++i) {
                const int g = 8 * t + 2 * i;
                __m256 v[4];
                cvt_x32_ps<true>(_mm256_sub_epi8(q[i], m4), v);
                float *out = y + b * QK_K + 128 * t + 32 * i;
                for (int p = 0; p < 4; ++p)
                    _mm256_storeu_ps(out + 8 * p, _mm256_mul_ps(_mm256_set1_ps(d * float(sc[g + p / 2])), v[p]));
            }
        }
    }
}

struct Q3K {
    template <int NC>
    static void dot(int64_t nb, const block_q3_K *w, const block_q8_K *const *a, float *out) {
        __m256 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const __m128i sc8 = unpack_scales_q3_K_simd(w[b].scales);
            const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
            const __m256i hbits = load256(w[b].hmask);
            __m256i sumi[NC];
            for (int c = 0; c < NC; ++c)
                sumi[c] = _mm256_slli_epi32(
                    _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(sc16, load256(a[c][b].bsums))), 2);
#pragma GCC unroll 2
            for (int t = 0; t < 2; ++t) {
                __m256i q[4], s[4];
                unpack_q3(w[b], hbits, t, q);
#pragma GCC unroll 4
                for (int i = 0; i < 4; ++i) s[i] = lane_scales(sc8, 8 * t + 2 * i);
                for (int c = 0; c < NC; ++c) {
                    const int8_t *aq = a[c][b].qs + 128 * t;
                    const __m256i p0 = _mm256_madd_epi16(s[0], _mm256_maddubs_epi16(q[0], load256(aq)));
                    const __m256i p1 = _mm256_madd_epi16(s[1], _mm256_maddubs_epi16(q[1], load256(aq + 32)));
                    const __m256i p2 = _mm256_madd_epi16(s[2], _mm256_maddubs_epi16(q[2], load256(aq + 64)));
                    const __m256i p3 = _mm256_madd_epi16(s[3], _mm256_maddubs_epi16(q[3], load256(aq + 96)));
                    sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
                }
            }
            const float d = f16(w[b].d);
            for (int c = 0; c < NC; ++c)
                acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[c][b].d), _mm256_cvtepi32_ps(sumi[c]), acc[c]);
        }
        for (int c = 0; c < NC; ++c) out[c] = hsum(acc[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::Q3_K, GGMLType::Q8_K, dequantize_row_q3_K, quantize_row_q8_K,
                                            gemm_tile<block_q3_K, Q3K>});

}  // namespace ktd::avx2
