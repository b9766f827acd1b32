// IQ4_XS weights × Q8_K activations, AVX-512 (BW + VNNI). Layout and definition in
// kernels/ref/iq4_xs.cpp. A 64-byte load of qs holds sub-blocks 0..3 (or 4..7), one per 128-bit
// lane, low nibbles first; vpermt2q interleaves the low- and high-nibble vectors into element
// order and vpshufb looks the code book up. Signed × signed products as vpmaddubsw(|w|, ±a)
// (the sign applied with a masked subtract; |w| ≤ 127 so pairs never saturate), then vpdpwssd
// with the per-half scales.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 AVX-512 header false positives
#pragma GCC diagnostic ignored "-Wuninitialized"        // (GCC bug 105593, fixed in GCC 13)
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"

namespace ktd::avx512 {
namespace {

// The 4 vectors of 64 code-book values (int8) of a block in element order.
inline void unpack_iq4(const block_iq4_xs &x, __m512i v[4]) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i *>(kvalues_iq4nl)));
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int h = 0; h < 2; ++h) {
        const __m512i z = _mm512_loadu_si512(x.qs + 64 * h);
        const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(z, m4));
        const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(z, 4), m4));
        v[2 * h] = _mm512_permutex2var_epi64(lo, first, hi);
        v[2 * h + 1] = _mm512_permutex2var_epi64(lo, second, hi);
    }
}

inline __m512i halves16(int lo, int hi) {
    return _mm512_inserti64x4(_mm512_set1_epi16(int16_t(lo)), _mm256_set1_epi16(int16_t(hi)), 1);
}

void dequantize_row_iq4_xs(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_iq4_xs *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d);
        __m512i v[4];
        unpack_iq4(x[b], v);
        for (int p = 0; p < 4; ++p) {
            alignas(64) int8_t q[64];
            _mm512_store_si512(q, v[p]);
            for (int j = 0; j < 4; ++j) {
                const float dl = d * float(iq4_xs_scale(x[b].scales_l, x[b].scales_h, 2 * p + j / 2));
                const __m512 vq = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i *>(q + 16 * j))));
                _mm512_storeu_ps(y + b * QK_K + 64 * p + 16 * j, _mm512_mul_ps(_mm512_set1_ps(dl), vq));
            }
        }
    }
}

struct IQ4XS {
    template <int NC>
    static void dot(int64_t nb, const block_iq4_xs *w, const block_q8_K *const *a, float *out) {
        __m512 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m512i v[4], sv[4];
            __mmask64 neg[4];
            unpack_iq4(w[b], v);
            for (int p = 0; p < 4; ++p) {
                sv[p] = halves16(iq4_xs_scale(w[b].scales_l, w[b].scales_h, 2 * p),
                                 iq4_xs_scale(w[b].scales_l, w[b].scales_h, 2 * p + 1));
                neg[p] = _mm512_movepi8_mask(v[p]);
                v[p] = _mm512_abs_epi8(v[p]);
            }
            const float d = f16(w[b].d);
            for (int c = 0; c < NC; ++c) {
                __m512i sumi = _mm512_setzero_si512();
                for (int p = 0; p < 4; ++p) {
                    const __m512i av = _mm512_loadu_si512(a[c][b].qs + 64 * p);
                    const __m512i sa = _mm512_mask_sub_epi8(av, neg[p], _mm512_setzero_si512(), av);
                    sumi = _mm512_dpwssd_epi32(sumi, sv[p], _mm512_maddubs_epi16(v[p], sa));
                }
                acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(d * a[c][b].d), _mm512_cvtepi32_ps(sumi), acc[c]);
            }
        }
        for (int c = 0; c < NC; ++c) out[c] = _mm512_reduce_add_ps(acc[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX512, TypeKernels{GGMLType::IQ4_XS, GGMLType::Q8_K, dequantize_row_iq4_xs, quantize_row_q8_K,
                                              gemm_tile<block_iq4_xs, IQ4XS>});

}  // namespace ktd::avx512
