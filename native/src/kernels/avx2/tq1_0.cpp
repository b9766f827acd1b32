// TQ1_0 weights × Q8_K activations, AVX2 (layout and definition in kernels/ref/tq1_0.cpp).
// Trit i of a byte b is ((b · 3^i) mod 256 · 3) >> 8. Without multiplies: b · 3 = b + b + b and
// b · 9 = (b << 3) + b in byte arithmetic (the 16-bit shift's carried-in bits masked off), and
// (p · 3) >> 8 = avg(q, avg(q, 0)) >> 6 with q = p −sat 1 (exact for all 256 bytes: the rounding
// of the two averages is cancelled by the −1), so only vpmaddubsw uses the multipliers.
// The 256 trits are eight vectors of 32 in element order: qs[0..31] × 3^0..3^4, then
// [M | M·3], [M·9 | M·27], [M·81 | QH·(1,3,9,27)] with M = qs[32..47] and QH = qh[0..3]
// repeated four times (each 4-byte group its own power).
#include <immintrin.h>

#include <cstring>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {
namespace {

template <typename V>
inline V times3(V x);
template <>
inline __m256i times3(__m256i x) { return _mm256_add_epi8(x, _mm256_add_epi8(x, x)); }
template <>
inline __m128i times3(__m128i x) { return _mm_add_epi8(x, _mm_add_epi8(x, x)); }

inline __m256i times9(__m256i x) {
    return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(x, 3), _mm256_set1_epi8(int8_t(0xF8))), x);
}
inline __m128i times9(__m128i x) { return _mm_add_epi8(_mm_and_si128(_mm_slli_epi16(x, 3), _mm_set1_epi8(int8_t(0xF8))), x); }

// The top trit of each byte: (p · 3) >> 8, in 0..2.
inline __m256i top_trit(__m256i p) {
    const __m256i q = _mm256_subs_epu8(p, _mm256_set1_epi8(1));
    const __m256i t = _mm256_avg_epu8(q, _mm256_avg_epu8(q, _mm256_setzero_si256()));
    return _mm256_and_si256(_mm256_srli_epi16(t, 6), _mm256_set1_epi8(3));
}

// The 256 trits (0..2) of a block in element order.
inline void unpack_tq1(const block_tq1_0 &x, __m256i q[8]) {
    const __m256i h1 = load256(x.qs);
    const __m256i h3 = times3(h1), h9 = times9(h1), h27 = times9(h3), h81 = times9(h9);
    q[0] = top_trit(h1);
    q[1] = top_trit(h3);
    q[2] = top_trit(h9);
    q[3] = top_trit(h27);
    q[4] = top_trit(h81);
    const __m128i m1 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(x.qs + 32));
    const __m128i m3 = times3(m1), m9 = times9(m1), m27 = times9(m3), m81 = times9(m9);
    uint32_t qhw;
    std::memcpy(&qhw, x.qh, 4);
    const __m128i g1 = _mm_set1_epi32(int(qhw)), g3 = times3(g1), g9 = times9(g1), g27 = times9(g3);
    const __m128i g = _mm_blend_epi32(_mm_blend_epi32(g1, g3, 0x2), _mm_blend_epi32(g9, g27, 0x8), 0xC);
    q[5] = top_trit(_mm256_set_m128i(m3, m1));
    q[6] = top_trit(_mm256_set_m128i(m27, m9));
    q[7] = top_trit(_mm256_set_m128i(g, m81));
}

void dequantize_row_tq1_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_tq1_0 *>(vx);
    const __m256i one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d);
        __m256i q[8];
        unpack_tq1(x[b], q);
        for (int i = 0; i < 8; ++i) dequant_x32<true, false>(_mm256_sub_epi8(q[i], one), d, 0.0f, y + b * QK_K + 32 * i);
    }
}

struct TQ1 {
    template <int NC>
    static void dot(int64_t nb, const block_tq1_0 *w, const block_q8_K *const *a, float *out) {
        const __m256i ones16 = _mm256_set1_epi16(1);
        __m256 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m256i q[8];
            unpack_tq1(w[b], q);
            const float d = f16(w[b].d);
            for (int c = 0; c < NC; ++c) {
                // Eight int16 partial sums of at most 2 · 2 · 127 each: no overflow.
                __m256i s = _mm256_sub_epi16(_mm256_setzero_si256(), load256(a[c][b].bsums));
                for (int i = 0; i < 8; ++i) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(q[i], load256(a[c][b].qs + 32 * i)));
                acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[c][b].d), _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones16)), acc[c]);
            }
        }
        for (int c = 0; c < NC; ++c) out[c] = hsum(acc[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::TQ1_0, GGMLType::Q8_K, dequantize_row_tq1_0, quantize_row_q8_K,
                                            gemm_tile<block_tq1_0, TQ1>});

}  // namespace ktd::avx2
