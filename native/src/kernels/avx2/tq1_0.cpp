// TQ1_0 weights × Q8_K activations, AVX2 (layout and definition in kernels/ref/tq1_0.cpp).
// Trit i of a byte is ((byte · 3^i) mod 256 · 3) >> 8. Per 16-bit word: the byte of interest is
// put in the high half (low half zero), vpmullw by 3^i leaves (byte · 3^i) mod 256 there, and
// vpmulhuw by 3 gives the trit; even and odd bytes are done separately and recombined.
// The 256 trits are eight vectors of 32: qs[0..31] × 3^0..3^4, then qs[32..47] (in both lanes)
// × (1|3), (9|27), and (81 | qh[0..3] repeated, × 1,1,3,3,9,9,27,27 per word).
#include <immintrin.h>

#include <cstring>

#include "kernels/avx2/k_common.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {
namespace {

inline __m256i trits(__m256i x, __m256i pow3) {
    const __m256i three = _mm256_set1_epi16(3);
    const __m256i even = _mm256_mulhi_epu16(_mm256_mullo_epi16(_mm256_slli_epi16(x, 8), pow3), three);
    const __m256i odd = _mm256_mulhi_epu16(_mm256_mullo_epi16(_mm256_and_si256(x, _mm256_set1_epi16(int16_t(0xFF00))), pow3), three);
    return _mm256_or_si256(even, _mm256_slli_epi16(odd, 8));
}

// The 256 trits (0..2) of a block in element order.
inline void unpack_tq1(const block_tq1_0 &x, __m256i q[8]) {
    const __m256i head = load256(x.qs);
    const int16_t p3[5] = {1, 3, 9, 27, 81};
    for (int i = 0; i < 5; ++i) q[i] = trits(head, _mm256_set1_epi16(p3[i]));
    const __m128i mid = _mm_loadu_si128(reinterpret_cast<const __m128i *>(x.qs + 32));
    uint32_t qh;
    std::memcpy(&qh, x.qh, 4);
    const __m256i tail = _mm256_broadcastsi128_si256(mid);
    q[5] = trits(tail, _mm256_setr_epi16(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3));
    q[6] = trits(tail, _mm256_setr_epi16(9, 9, 9, 9, 9, 9, 9, 9, 27, 27, 27, 27, 27, 27, 27, 27));
    q[7] = trits(_mm256_set_m128i(_mm_set1_epi32(int(qh)), mid),
                 _mm256_setr_epi16(81, 81, 81, 81, 81, 81, 81, 81, 1, 1, 3, 3, 9, 9, 27, 27));
}

void dequantize_row_tq1_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_tq1_0 *>(vx);
    const __m256i one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32_f16c(x[b].d);
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
            const float d = fp16_to_fp32_f16c(w[b].d);
            for (int c = 0; c < NC; ++c) {
                // Eight int16 partial sums of at most 2 · 2 · 127 each: no overflow.
                __m256i s = _mm256_sub_epi16(_mm256_setzero_si256(), load256(a[c][b].bsums));
                for (int i = 0; i < 8; ++i) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(q[i], load256(a[c][b].qs + 32 * i)));
                acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[c][b].d), _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones16)), acc[c]);
            }
        }
        for (int c = 0; c < NC; ++c) out[c] = hsum_ps(acc[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::TQ1_0, GGMLType::Q8_K, dequantize_row_tq1_0, quantize_row_q8_K,
                                            gemm_tile<block_tq1_0, TQ1>});

}  // namespace ktd::avx2
