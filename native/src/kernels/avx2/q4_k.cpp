// Q4_K weights × Q8_K activations, AVX2 (layout and definition in kernels/ref/q4_k.cpp).
// Per 64 elements: one 32-byte load of qs gives the nibbles of sub-blocks 2j (low) and 2j+1
// (high); vpmaddubsw with the int8 activations, vpmaddwd with the broadcast 6-bit scale. The
// mins are applied once per block through Q8_K's bsums: Σ m_j · Σ_{sub-block j} a.
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/x86/k_repack.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"
#include "kernels/repacked_k.h"

namespace ktd::avx2 {
namespace {

// Byte shuffle broadcasting int16 element i of each 128-bit lane.
inline __m256i scale_shuffle(int i) { return _mm256_set1_epi16(int16_t((2 * i) | ((2 * i + 1) << 8))); }

void dequantize_row_q4_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q4_K *>(vx);
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d), dmin = f16(x[b].dmin);
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(x[b].scales, sc, m);
        for (int j = 0; j < 4; ++j) {
            const __m256i bits = load256(x[b].qs + 32 * j);
            float *out = y + b * QK_K + 64 * j;
            dequant_x32<false, true>(_mm256_and_si256(bits, m4), d * float(sc[2 * j]), dmin * float(m[2 * j]), out);
            dequant_x32<false, true>(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), d * float(sc[2 * j + 1]),
                                     dmin * float(m[2 * j + 1]), out + 32);
        }
    }
}

struct Q4K {
    template <int NC>
    static void dot(int64_t nb, const block_q4_K *w, const block_q8_K *const *a, float *out) {
        const __m256i m4 = _mm256_set1_epi8(0xF);
        __m256 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            // int16 ×16: low lane the 8 scales, high lane the 8 mins.
            const __m256i sm = _mm256_cvtepu8_epi16(unpack_scale_min_k4_simd(w[b].scales));
            const __m128i mins = _mm256_extracti128_si256(sm, 1);
            const __m256i scales = _mm256_permute2x128_si256(sm, sm, 0x00);
            __m256i sumi[NC];
            for (int c = 0; c < NC; ++c) sumi[c] = _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) {
                const __m256i sl = _mm256_shuffle_epi8(scales, scale_shuffle(2 * j));
                const __m256i sh = _mm256_shuffle_epi8(scales, scale_shuffle(2 * j + 1));
                const __m256i bits = load256(w[b].qs + 32 * j);
                const __m256i ql = _mm256_and_si256(bits, m4);
                const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                for (int c = 0; c < NC; ++c) {
                    const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(ql, load256(a[c][b].qs + 64 * j)));
                    const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(qh, load256(a[c][b].qs + 64 * j + 32)));
                    sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(pl, ph));
                }
            }
            const float d = f16(w[b].d), dmin = f16(w[b].dmin);
            for (int c = 0; c < NC; ++c) {
                const __m128i pm = _mm_madd_epi16(mins, bsums_32(a[c][b]));
                acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[c][b].d), _mm256_cvtepi32_ps(sumi[c]), acc[c]);
                acc[c] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * a[c][b].d), _mm256_zextps128_ps256(_mm_cvtepi32_ps(pm)), acc[c]);
            }
        }
        for (int c = 0; c < NC; ++c) out[c] = hsum(acc[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{.type = GGMLType::Q4_K,
                                            .act_type = GGMLType::Q8_K,
                                            .dequantize_row = dequantize_row_q4_K,
                                            .quantize_act_row = quantize_row_q8_K,
                                            .gemm = gemm_tile<block_q4_K, Q4K>,
                                            .repack_rows = kRepackRowsK,
                                            .repack_layout = kRepackLayoutQ4_K,
                                            .repacked_group_bytes = ref::group_bytes_q4_K_x8,
                                            .repack = avx2::repack_q4_K_x8,
                                            .gemm_repacked = gemm_repacked_k8<Q4_Kx8>});

}  // namespace ktd::avx2
