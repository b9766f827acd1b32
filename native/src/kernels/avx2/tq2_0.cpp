// TQ2_0 weights × Q8_K activations, AVX2 (layout and definition in kernels/ref/tq2_0.cpp).
// q (0..3) is used unsigned with vpmaddubsw; the −1 offset is Σ a, from Q8_K's bsums. The eight
// int16 partial sums per block stay below 8 · 2 · 3 · 127 = 6096, so they are added as int16
// and widened once per block.
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {
namespace {

void dequantize_row_tq2_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_tq2_0 *>(vx);
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d);
        for (int t = 0; t < 2; ++t) {
            const __m256i bits = load256(x[b].qs + 32 * t);
            for (int s = 0; s < 4; ++s) {
                const __m256i q = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(bits, 2 * s), m3), one);
                dequant_x32<true, false>(q, d, 0.0f, y + b * QK_K + 128 * t + 32 * s);
            }
        }
    }
}

struct TQ2 {
    template <int NC>
    static void dot(int64_t nb, const block_tq2_0 *w, const block_q8_K *const *a, float *out) {
        const __m256i m3 = _mm256_set1_epi8(3), ones16 = _mm256_set1_epi16(1);
        __m256 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m256i sum16[NC];
            for (int c = 0; c < NC; ++c) sum16[c] = _mm256_setzero_si256();
            for (int t = 0; t < 2; ++t) {
                const __m256i bits = load256(w[b].qs + 32 * t);
                __m256i q[4];
                for (int s = 0; s < 4; ++s) q[s] = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * s), m3);
                for (int c = 0; c < NC; ++c) {
                    const int8_t *aq = a[c][b].qs + 128 * t;
                    const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], load256(aq)),
                                                         _mm256_maddubs_epi16(q[1], load256(aq + 32)));
                    const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], load256(aq + 64)),
                                                         _mm256_maddubs_epi16(q[3], load256(aq + 96)));
                    sum16[c] = _mm256_add_epi16(sum16[c], _mm256_add_epi16(p01, p23));
                }
            }
            const float d = f16(w[b].d);
            for (int c = 0; c < NC; ++c) {
                // Σ q·a − Σ a: subtract the bsums (16 int16, summing to Σ a) before widening.
                const __m256i s = _mm256_madd_epi16(_mm256_sub_epi16(sum16[c], load256(a[c][b].bsums)), ones16);
                acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[c][b].d), _mm256_cvtepi32_ps(s), acc[c]);
            }
        }
        for (int c = 0; c < NC; ++c) out[c] = hsum(acc[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::TQ2_0, GGMLType::Q8_K, dequantize_row_tq2_0, quantize_row_q8_K,
                                            gemm_tile<block_tq2_0, TQ2>});

}  // namespace ktd::avx2
