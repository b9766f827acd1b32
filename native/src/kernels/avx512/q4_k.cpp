// Q4_K weights × Q8_K activations, AVX-512 (BW + VNNI). Layout and definition in
// kernels/ref/q4_k.cpp. A 64-byte load of qs holds the nibbles of 128 elements: low nibbles
// [elements 0..31 | 64..95], high nibbles [32..63 | 96..127]; vshufi64x2 puts them back in
// element order, two sub-blocks of 32 per 512-bit vector. vpmaddubsw with the activations, then
// vpdpwssd with the per-half scales (multiply by the 6-bit scale and accumulate in one op).
// Mins through Q8_K's bsums as in the AVX2 kernel.
// GCC 12's AVX-512 headers raise false -W(maybe-)uninitialized warnings from their own
// _mm512_undefined_* placeholders (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/x86/k_repack.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"
#include "kernels/repacked_k.h"

namespace ktd::avx512 {
namespace {

// The 4 vectors of 64 q (0..15) of a block in element order.
inline void unpack_q4(const block_q4_K &x, __m512i v[4]) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    for (int h = 0; h < 2; ++h) {
        const __m512i z = _mm512_loadu_si512(x.qs + 64 * h);
        const __m512i lo = _mm512_and_si512(z, m4), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
        v[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);
        v[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);
    }
}

// Word index vector: words 0..15 select element i, words 16..31 element i + 1.
inline __m512i half_index(int i) {
    return _mm512_inserti64x4(_mm512_set1_epi16(int16_t(i)), _mm256_set1_epi16(int16_t(i + 1)), 1);
}

void dequantize_row_q4_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q4_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d), dmin = f16(x[b].dmin);
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(x[b].scales, sc, m);
        __m512i v[4];
        unpack_q4(x[b], v);
        for (int s = 0; s < 8; ++s) {
            const __m256i q = s % 2 ? _mm512_extracti64x4_epi64(v[s / 2], 1) : _mm512_castsi512_si256(v[s / 2]);
            // gguf-py's order: (d·sc)·q − (dmin·m), each operation rounded.
            const __m512 dl = _mm512_set1_ps(d * float(sc[s])), ml = _mm512_set1_ps(dmin * float(m[s]));
            for (int i = 0; i < 2; ++i) {
                const __m128i part = i ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
                const __m512 r = _mm512_mul_ps(dl, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part)));
                _mm512_storeu_ps(y + b * QK_K + 32 * s + 16 * i, _mm512_sub_ps(r, ml));
            }
        }
    }
}

struct Q4K {
    template <int NC>
    static void dot(int64_t nb, const block_q4_K *w, const block_q8_K *const *a, float *out) {
        __m512 acc[NC];
        __m128 accm[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps(), accm[c] = _mm_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            // int16 ×16: words 0..7 the scales, 8..15 the mins.
            const __m256i sm = _mm256_cvtepu8_epi16(unpack_scale_min_k4_simd(w[b].scales));
            const __m128i mins = _mm256_extracti128_si256(sm, 1);
            const __m512i sm512 = _mm512_castsi256_si512(sm);
            __m512i sv[4], v[4];
            for (int p = 0; p < 4; ++p) sv[p] = _mm512_permutexvar_epi16(half_index(2 * p), sm512);
            unpack_q4(w[b], v);
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

// The repacked layout runs the shared 8-row tile (kernels/x86/k_repack.h: 256-bit, VNNI dpbusd),
// decode with the software prefetch where k_decode_prefetch() says so. A 512-bit decode kernel on
// an activation row expanded to 2 KiB per super-block was this entry's decode once: on a Zen 4 it
// streamed at half the tile's rate once the row outgrew L1d (k = 4864).
KTD_REGISTER_KERNELS(Isa::AVX512, TypeKernels{.type = GGMLType::Q4_K,
                                              .act_type = GGMLType::Q8_K,
                                              .dequantize_row = dequantize_row_q4_K,
                                              .quantize_act_row = quantize_row_q8_K,
                                              .gemm = gemm_tile<block_q4_K, Q4K>,
                                              .repack_rows = kRepackRowsK,
                                              .repack_layout = kRepackLayoutQ4_K,
                                              .repacked_group_bytes = ref::group_bytes_q4_K_x8,
                                              .repack = avx2::repack_q4_K_x8,
                                              .gemm_repacked = gemm_repacked_k8<Q4_Kx8>});

}  // namespace ktd::avx512
