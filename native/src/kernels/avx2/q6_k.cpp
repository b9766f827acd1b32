// Q6_K weights × Q8_K activations, AVX2 (layout and definition in kernels/ref/q6_k.cpp).
// Per 128 elements: two 32-byte loads of ql and one of qh give four vectors of unsigned 6-bit
// q (0..63); vpmaddubsw with the activations, vpmaddwd with the int8 scales (one per 16, i.e.
// one per 128-bit lane). The −32 offset is applied once per block through Q8_K's bsums:
// Σ sc·(q−32)·a = Σ sc·q·a − 32 · Σ_g sc_g · bsum_g.
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/x86/k_repack.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/repacked_k.h"

namespace ktd::avx2 {
namespace {

// The four vectors of q (0..63) of elements 128t + 32i + (0..31), i = 0..3.
inline void unpack_q6(const block_q6_K &x, int t, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    const __m256i ql0 = load256(x.ql + 64 * t), ql1 = load256(x.ql + 64 * t + 32);
    const __m256i qh = load256(x.qh + 32 * t);
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
}

void dequantize_row_q6_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q6_K *>(vx);
    const __m256i m32 = _mm256_set1_epi8(32);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d);
        for (int t = 0; t < 2; ++t) {
            __m256i q[4];
            unpack_q6(x[b], t, q);
            for (int i = 0; i < 4; ++i) {
                // Sub-blocks of 16: two per 32 elements, so convert the halves separately.
                const int g = 8 * t + 2 * i;
                float *out = y + b * QK_K + 128 * t + 32 * i;
                const __m256i qs = _mm256_sub_epi8(q[i], m32);
                __m256 v[4];
                cvt_x32_ps<true>(qs, v);
                const __m256 d0 = _mm256_set1_ps(d * float(x[b].scales[g])), d1 = _mm256_set1_ps(d * float(x[b].scales[g + 1]));
                _mm256_storeu_ps(out, _mm256_mul_ps(d0, v[0]));
                _mm256_storeu_ps(out + 8, _mm256_mul_ps(d0, v[1]));
                _mm256_storeu_ps(out + 16, _mm256_mul_ps(d1, v[2]));
                _mm256_storeu_ps(out + 24, _mm256_mul_ps(d1, v[3]));
            }
        }
    }
}

struct Q6K {
    template <int NC>
    static void dot(int64_t nb, const block_q6_K *w, const block_q8_K *const *a, float *out) {
        __m256 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(w[b].scales));
            const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
            __m256i sumi[NC];
            for (int c = 0; c < NC; ++c) {
                // −32 · Σ_g sc_g · bsum_g, to be added to the Σ sc·q·a below.
                const __m256i bs = load256(a[c][b].bsums);
                sumi[c] = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(sc16, bs)), 5);
            }
            for (int t = 0; t < 2; ++t) {
                __m256i q[4];
                unpack_q6(w[b], t, q);
                __m256i s[4];
                for (int i = 0; i < 4; ++i) {
                    // Low lane: the scale of sub-block 8t+2i, high lane: 8t+2i+1.
                    const int g = 8 * t + 2 * i;
                    const __m128i shuf = _mm_set_epi64x(0x0101010101010101LL * (g + 1), 0x0101010101010101LL * g);
                    s[i] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, shuf));
                }
                for (int c = 0; c < NC; ++c) {
                    const int8_t *aq = a[c][b].qs + 128 * t;
                    const __m256i p0 = _mm256_madd_epi16(s[0], _mm256_maddubs_epi16(q[0], load256(aq)));
                    const __m256i p1 = _mm256_madd_epi16(s[1], _mm256_maddubs_epi16(q[1], load256(aq + 32)));
                    const __m256i p2 = _mm256_madd_epi16(s[2], _mm256_maddubs_epi16(q[2], load256(aq + 64)));
                    const __m256i p3 = _mm256_madd_epi16(s[3], _mm256_maddubs_epi16(q[3], load256(aq + 96)));
                    sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
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

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{.type = GGMLType::Q6_K,
                                            .act_type = GGMLType::Q8_K,
                                            .dequantize_row = dequantize_row_q6_K,
                                            .quantize_act_row = quantize_row_q8_K,
                                            .gemm = gemm_tile<block_q6_K, Q6K>,
                                            .repack_rows = kRepackRowsK,
                                            .repack_layout = kRepackLayoutQ6_K,
                                            .repacked_group_bytes = ref::group_bytes_q6_K_x8,
                                            .repack = avx2::repack_q6_K_x8,
                                            .gemm_repacked = gemm_repacked_k8<Q6_Kx8>});

}  // namespace ktd::avx2
