// Q3_K weights × Q8_K activations, AVX-512 (BW + VNNI). Layout and definition in
// kernels/ref/q3_k.cpp. The low 2 bits are unpacked as in the AVX-512 Q2_K kernel; the "high"
// bits (bit u of hmask[l] for element 32u + l) come from the 32 hmask bytes broadcast to both
// halves and shifted per half (vpsrlvw). As in the AVX2 kernel the value is used unsigned,
// q' = q + 4 (0..7), and Σ sc·q·a = Σ sc·q'·a − 4 · Σ_g sc_g · bsum_g.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 AVX-512 header false positives
#pragma GCC diagnostic ignored "-Wuninitialized"        // (GCC bug 105593, fixed in GCC 13)
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"

namespace ktd::avx512 {
namespace {

inline __m512i halves16(int lo, int hi) {
    return _mm512_inserti64x4(_mm512_set1_epi16(int16_t(lo)), _mm256_set1_epi16(int16_t(hi)), 1);
}

// The 4 vectors of 64 q' = q + 4 (0..7) of a block in element order.
inline void unpack_q3(const block_q3_K &x, __m512i v[4]) {
    const __m512i m3 = _mm512_set1_epi8(3), m1 = _mm512_set1_epi8(1);
    const __m512i z = _mm512_loadu_si512(x.qs);
    const __m512i q0 = _mm512_and_si512(z, m3), q1 = _mm512_and_si512(_mm512_srli_epi16(z, 2), m3);
    const __m512i q2 = _mm512_and_si512(_mm512_srli_epi16(z, 4), m3), q3 = _mm512_and_si512(_mm512_srli_epi16(z, 6), m3);
    const __m512i lo[4] = {_mm512_shuffle_i64x2(q0, q1, 0x44), _mm512_shuffle_i64x2(q2, q3, 0x44),
                           _mm512_shuffle_i64x2(q0, q1, 0xEE), _mm512_shuffle_i64x2(q2, q3, 0xEE)};
    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(x.hmask)));
    for (int p = 0; p < 4; ++p) {
        const __m512i h = _mm512_and_si512(_mm512_srlv_epi16(hm, halves16(2 * p, 2 * p + 1)), m1);
        v[p] = _mm512_or_si512(lo[p], _mm512_slli_epi16(h, 2));
    }
}

inline __m512i quarter_index(int v) {
    const __m128i q0 = _mm_set1_epi16(int16_t(4 * v)), q1 = _mm_set1_epi16(int16_t(4 * v + 1));
    const __m128i q2 = _mm_set1_epi16(int16_t(4 * v + 2)), q3 = _mm_set1_epi16(int16_t(4 * v + 3));
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(q1, q0)), _mm256_set_m128i(q3, q2), 1);
}

void dequantize_row_q3_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q3_K *>(vx);
    const __m512i m4 = _mm512_set1_epi8(4);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d);
        int8_t sc[16];
        unpack_scales_q3_K(x[b].scales, sc);
        __m512i v[4];
        unpack_q3(x[b], v);
        for (int p = 0; p < 4; ++p) {
            alignas(64) int8_t q[64];
            _mm512_store_si512(q, _mm512_sub_epi8(v[p], m4));
            for (int j = 0; j < 4; ++j) {
                const __m512 vq = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i *>(q + 16 * j))));
                _mm512_storeu_ps(y + b * QK_K + 64 * p + 16 * j, _mm512_mul_ps(_mm512_set1_ps(d * float(sc[4 * p + j])), vq));
            }
        }
    }
}

struct Q3K {
    template <int NC>
    static void dot(int64_t nb, const block_q3_K *w, const block_q8_K *const *a, float *out) {
        __m512 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const __m128i sc8 = unpack_scales_q3_K_simd(w[b].scales);
            const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
            const __m512i sc512 = _mm512_castsi256_si512(sc16);
            __m512i sv[4], v[4];
            for (int p = 0; p < 4; ++p) sv[p] = _mm512_permutexvar_epi16(quarter_index(p), sc512);
            unpack_q3(w[b], v);
            const float d = f16(w[b].d);
            for (int c = 0; c < NC; ++c) {
                // Start from −4 · Σ_g sc_g · bsum_g.
                const __m256i corr = _mm256_slli_epi32(
                    _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(sc16, load256(a[c][b].bsums))), 2);
                __m512i sumi = _mm512_zextsi256_si512(corr);
                for (int p = 0; p < 4; ++p)
                    sumi = _mm512_dpwssd_epi32(sumi, sv[p], _mm512_maddubs_epi16(v[p], _mm512_loadu_si512(a[c][b].qs + 64 * p)));
                acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(d * a[c][b].d), _mm512_cvtepi32_ps(sumi), acc[c]);
            }
        }
        for (int c = 0; c < NC; ++c) out[c] = _mm512_reduce_add_ps(acc[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX512, TypeKernels{GGMLType::Q3_K, GGMLType::Q8_K, dequantize_row_q3_K, quantize_row_q8_K,
                                              gemm_tile<block_q3_K, Q3K>});

}  // namespace ktd::avx512
