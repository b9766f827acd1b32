// Q5_K weights × Q8_K activations, AVX-512 (BW + VNNI). Layout and definition in
// kernels/ref/q5_k.cpp; the kernel is the AVX-512 Q4_K one (kernels/avx512/q4_k.cpp) plus the
// fifth bits: the 32 qh bytes broadcast to both halves of a vector and shifted per half
// (vpsrlvw) so that bit s of qh[l] lands in bit 4 of element 32s + l.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 AVX-512 header false positives
#pragma GCC diagnostic ignored "-Wuninitialized"        // (GCC bug 105593, fixed in GCC 13)
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"

namespace ktd::avx512 {
namespace {

// Word vector: words 0..15 = lo, words 16..31 = hi.
inline __m512i halves16(int lo, int hi) {
    return _mm512_inserti64x4(_mm512_set1_epi16(int16_t(lo)), _mm256_set1_epi16(int16_t(hi)), 1);
}

// The 4 vectors of 64 q (0..31) of a block in element order.
inline void unpack_q5(const block_q5_K &x, __m512i v[4]) {
    const __m512i m4 = _mm512_set1_epi8(0xF), m1 = _mm512_set1_epi8(1);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(x.qh)));
    for (int h = 0; h < 2; ++h) {
        const __m512i z = _mm512_loadu_si512(x.qs + 64 * h);
        const __m512i lo = _mm512_and_si512(z, m4), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
        for (int i = 0; i < 2; ++i) {
            const int p = 2 * h + i;  // elements 64p..64p+63: sub-blocks 2p and 2p+1
            const __m512i q4 = _mm512_shuffle_i64x2(lo, hi, i ? 0xEE : 0x44);
            const __m512i h5 = _mm512_and_si512(_mm512_srlv_epi16(qh, halves16(2 * p, 2 * p + 1)), m1);
            v[p] = _mm512_or_si512(q4, _mm512_slli_epi16(h5, 4));
        }
    }
}

void dequantize_row_q5_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q5_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d), dmin = f16(x[b].dmin);
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(x[b].scales, sc, m);
        __m512i v[4];
        unpack_q5(x[b], v);
        for (int p = 0; p < 4; ++p) {
            alignas(64) uint8_t q[64];
            _mm512_store_si512(q, v[p]);
            for (int j = 0; j < 4; ++j) {
                const int s = 2 * p + j / 2;
                // gguf-py's order: (d·sc)·q − (dmin·m), each operation rounded.
                const __m512 r = _mm512_mul_ps(_mm512_set1_ps(d * float(sc[s])),
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i *>(q + 16 * j)))));
                _mm512_storeu_ps(y + b * QK_K + 64 * p + 16 * j, _mm512_sub_ps(r, _mm512_set1_ps(dmin * float(m[s]))));
            }
        }
    }
}

struct Q5K {
    template <int NC>
    static void dot(int64_t nb, const block_q5_K *w, const block_q8_K *const *a, float *out) {
        __m512 acc[NC];
        __m128 accm[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps(), accm[c] = _mm_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            // int16 ×16: words 0..7 the scales, 8..15 the mins.
            const __m256i sm = _mm256_cvtepu8_epi16(unpack_scale_min_k4_simd(w[b].scales));
            const __m128i mins = _mm256_extracti128_si256(sm, 1);
            const __m512i sm512 = _mm512_castsi256_si512(sm);
            __m512i sv[4], v[4];
            for (int p = 0; p < 4; ++p) sv[p] = _mm512_permutexvar_epi16(halves16(2 * p, 2 * p + 1), sm512);
            unpack_q5(w[b], v);
            const float d = f16(w[b].d), dmin = f16(w[b].dmin);
            for (int c = 0; c < NC; ++c) {
                __m512i sumi = _mm512_setzero_si512();
                for (int p = 0; p < 4; ++p)
                    sumi = _mm512_dpwssd_epi32(sumi, sv[p], _mm512_maddubs_epi16(v[p], _mm512_loadu_si512(a[c][b].qs + 64 * p)));
                const __m128i pm = _mm_madd_epi16(mins, bsums_32(a[c][b]));
                acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(d * a[c][b].d), _mm512_cvtepi32_ps(sumi), acc[c]);
                accm[c] = _mm_fmadd_ps(_mm_set1_ps(dmin * a[c][b].d), _mm_cvtepi32_ps(pm), accm[c]);
            }
        }
        for (int c = 0; c < NC; ++c) out[c] = _mm512_reduce_add_ps(acc[c]) - hsum(accm[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX512, TypeKernels{GGMLType::Q5_K, GGMLType::Q8_K, dequantize_row_q5_K, quantize_row_q8_K,
                                              gemm_tile<block_q5_K, Q5K>});

}  // namespace ktd::avx512
