// IQ4_XS weights × Q8_K activations, AVX2 (layout and definition in kernels/ref/iq4_xs.cpp).
// Per 64 elements (sub-blocks 2p, 2p+1): the nibbles index the code book with vpshufb; the
// signed products use vpmaddubsw(|w|, sign(a, w)) (|w| ≤ 127, so pairs never saturate).
#include <immintrin.h>

#include <cstring>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {
namespace {

// Code-book values of sub-blocks 2p (lo) and 2p+1 (hi): low lane the low nibbles of their 16
// bytes, high lane the high nibbles — the element order of the format.
inline void unpack_iq4(const block_iq4_xs &x, int p, __m256i &lo, __m256i &hi) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(kvalues_iq4nl)));
    const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(x.qs + 32 * p));
    const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(x.qs + 32 * p + 16));
    const __m256i v0 = _mm256_set_m128i(_mm_srli_epi16(b0, 4), b0);
    const __m256i v1 = _mm256_set_m128i(_mm_srli_epi16(b1, 4), b1);
    lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v0, m4));
    hi = _mm256_shuffle_epi8(table, _mm256_and_si256(v1, m4));
}

// The 8 sub-block scales (−32..31) as int16 in both 128-bit lanes.
inline __m256i iq4_xs_scales16(const block_iq4_xs &x) {
    uint32_t sl;
    std::memcpy(&sl, x.scales_l, 4);
    // Low 4 bits: byte j = nibble j%2 of scales_l[j/2] (words hold the byte twice, then each
    // half keeps its nibble).
    const __m128i twice = _mm_shuffle_epi8(_mm_cvtsi32_si128(int(sl)), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m128i lo = _mm_or_si128(_mm_and_si128(twice, _mm_set1_epi16(0x000F)),
                                    _mm_and_si128(_mm_srli_epi16(twice, 4), _mm_set1_epi16(0x0F00)));
    // High 2 bits: bits 2j..2j+1 of scales_h.
    const __m256i h32 = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(x.scales_h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), _mm256_set1_epi32(3));
    const __m128i hi = _mm_packs_epi32(_mm256_castsi256_si128(h32), _mm256_extracti128_si256(h32, 1));
    const __m128i sc = _mm_sub_epi16(_mm_or_si128(_mm_cvtepu8_epi16(lo), _mm_slli_epi16(hi, 4)), _mm_set1_epi16(32));
    return _mm256_broadcastsi128_si256(sc);
}

// Byte shuffle broadcasting int16 element i of each 128-bit lane.
inline __m256i word_shuffle(int i) { return _mm256_set1_epi16(int16_t((2 * i) | ((2 * i + 1) << 8))); }

void dequantize_row_iq4_xs(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_iq4_xs *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d);
        for (int p = 0; p < 4; ++p) {
            __m256i lo, hi;
            unpack_iq4(x[b], p, lo, hi);
            float *out = y + b * QK_K + 64 * p;
            dequant_x32<true, false>(lo, d * float(iq4_xs_scale(x[b].scales_l, x[b].scales_h, 2 * p)), 0.0f, out);
            dequant_x32<true, false>(hi, d * float(iq4_xs_scale(x[b].scales_l, x[b].scales_h, 2 * p + 1)), 0.0f, out + 32);
        }
    }
}

struct IQ4XS {
    template <int NC>
    static void dot(int64_t nb, const block_iq4_xs *w, const block_q8_K *const *a, float *out) {
        __m256 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m256i sumi[NC];
            for (int c = 0; c < NC; ++c) sumi[c] = _mm256_setzero_si256();
            const __m256i scales = iq4_xs_scales16(w[b]);
            for (int p = 0; p < 4; ++p) {
                __m256i lo, hi;
                unpack_iq4(w[b], p, lo, hi);
                const __m256i slo = _mm256_shuffle_epi8(scales, word_shuffle(2 * p));
                const __m256i shi = _mm256_shuffle_epi8(scales, word_shuffle(2 * p + 1));
                const __m256i alo = _mm256_sign_epi8(lo, lo), ahi = _mm256_sign_epi8(hi, hi);
                for (int c = 0; c < NC; ++c) {
                    const __m256i a0 = load256(a[c][b].qs + 64 * p), a1 = load256(a[c][b].qs + 64 * p + 32);
                    const __m256i p0 = _mm256_madd_epi16(slo, _mm256_maddubs_epi16(alo, _mm256_sign_epi8(a0, lo)));
                    const __m256i p1 = _mm256_madd_epi16(shi, _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(a1, hi)));
                    sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(p0, p1));
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

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::IQ4_XS, GGMLType::Q8_K, dequantize_row_iq4_xs, quantize_row_q8_K,
                                            gemm_tile<block_iq4_xs, IQ4XS>});

}  // namespace ktd::avx2
