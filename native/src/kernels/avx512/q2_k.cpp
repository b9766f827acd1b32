// Q2_K weights × Q8_K activations, AVX-512 (BW + VNNI). Layout and definition in
// kernels/ref/q2_k.cpp. The 64 qs bytes are one vector; shift s gives elements 32s + (0..31) in
// the low half and 128 + 32s + (0..31) in the high half, and vshufi64x2 puts them in element
// order. vpmaddubsw, then vpdpwssd with the 4-bit scales (4 sub-blocks of 16 per vector); the
// mins through Q8_K's bsums.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 AVX-512 header false positives
#pragma GCC diagnostic ignored "-Wuninitialized"        // (GCC bug 105593, fixed in GCC 13)
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"

namespace ktd::avx512 {
namespace {

// The 4 vectors of 64 q (0..3) of a block in element order.
inline void unpack_q2(const block_q2_K &x, __m512i v[4]) {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m512i z = _mm512_loadu_si512(x.qs);
    const __m512i q0 = _mm512_and_si512(z, m3), q1 = _mm512_and_si512(_mm512_srli_epi16(z, 2), m3);
    const __m512i q2 = _mm512_and_si512(_mm512_srli_epi16(z, 4), m3), q3 = _mm512_and_si512(_mm512_srli_epi16(z, 6), m3);
    v[0] = _mm512_shuffle_i64x2(q0, q1, 0x44);
    v[1] = _mm512_shuffle_i64x2(q2, q3, 0x44);
    v[2] = _mm512_shuffle_i64x2(q0, q1, 0xEE);
    v[3] = _mm512_shuffle_i64x2(q2, q3, 0xEE);
}

// Word index vector for elements 64v..64v+63: word w → sub-block 4v + w/8.
inline __m512i quarter_index(int v) {
    const __m128i q0 = _mm_set1_epi16(int16_t(4 * v)), q1 = _mm_set1_epi16(int16_t(4 * v + 1));
    const __m128i q2 = _mm_set1_epi16(int16_t(4 * v + 2)), q3 = _mm_set1_epi16(int16_t(4 * v + 3));
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(q1, q0)), _mm256_set_m128i(q3, q2), 1);
}

void dequantize_row_q2_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q2_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d), dmin = f16(x[b].dmin);
        __m512i v[4];
        unpack_q2(x[b], v);
        for (int p = 0; p < 4; ++p) {
            alignas(64) uint8_t q[64];
            _mm512_store_si512(q, v[p]);
            for (int j = 0; j < 4; ++j) {
                const uint8_t sm = x[b].scales[4 * p + j];
                // gguf-py's order: (d·sc)·q − (dmin·m), each operation rounded.
                const __m512 r = _mm512_mul_ps(_mm512_set1_ps(d * float(sm & 0xF)),
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i *>(q + 16 * j)))));
                _mm512_storeu_ps(y + b * QK_K + 64 * p + 16 * j, _mm512_sub_ps(r, _mm512_set1_ps(dmin * float(sm >> 4))));
            }
        }
    }
}

struct Q2K {
    template <int NC>
    static void dot(int64_t nb, const block_q2_K *w, const block_q8_K *const *a, float *out) {
        const __m128i m4 = _mm_set1_epi8(0xF);
        __m512 acc[NC];
        __m256 accm[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps(), accm[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(w[b].scales));
            const __m512i sc512 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(raw, m4)));
            const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
            __m512i sv[4], v[4];
            for (int p = 0; p < 4; ++p) sv[p] = _mm512_permutexvar_epi16(quarter_index(p), sc512);
            unpack_q2(w[b], v);
            const float d = f16(w[b].d), dmin = f16(w[b].dmin);
            for (int c = 0; c < NC; ++c) {
                __m512i sumi = _mm512_setzero_si512();
                for (int p = 0; p < 4; ++p)
                    sumi = _mm512_dpwssd_epi32(sumi, sv[p], _mm512_maddubs_epi16(v[p], _mm512_loadu_si512(a[c][b].qs + 64 * p)));
                const __m256i pm = _mm256_madd_epi16(mins16, load256(a[c][b].bsums));
                acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(d * a[c][b].d), _mm512_cvtepi32_ps(sumi), acc[c]);
                accm[c] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * a[c][b].d), _mm256_cvtepi32_ps(pm), accm[c]);
            }
        }
        for (int c = 0; c < NC; ++c) out[c] = _mm512_reduce_add_ps(acc[c]) - hsum(accm[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX512, TypeKernels{GGMLType::Q2_K, GGMLType::Q8_K, dequantize_row_q2_K, quantize_row_q8_K,
                                              gemm_tile<block_q2_K, Q2K>});

}  // namespace ktd::avx512
