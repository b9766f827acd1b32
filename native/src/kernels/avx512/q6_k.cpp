// Q6_K weights × Q8_K activations, AVX-512 (BW + VNNI). Layout and definition in
// kernels/ref/q6_k.cpp. Per 128 elements: the 64 ql bytes give the low 4 bits of elements
// 0..63 (low nibbles) and 64..127 (high nibbles) already in order; the 32 qh bytes, broadcast
// to both halves, are shifted per half (vpsllvw/vpsrlvw) into bits 4-5. vpmaddubsw, then
// vpdpwssd with the int8 scales (4 sub-blocks of 16 per vector); the −32 offset through bsums.
// GCC 12's AVX-512 headers raise false -W(maybe-)uninitialized warnings from their own
// _mm512_undefined_* placeholders (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/x86/k_repack.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/repacked_k.h"

namespace ktd::avx512 {
namespace {

// The 4 vectors of 64 q (0..63) of a block in element order.
inline void unpack_q6(const block_q6_K &x, __m512i v[4]) {
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    for (int t = 0; t < 2; ++t) {
        const __m512i z = _mm512_loadu_si512(x.ql + 64 * t);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(x.qh + 32 * t)));
        v[2 * t] = _mm512_or_si512(_mm512_and_si512(z, m4), _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30));
        v[2 * t + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(z, 4), m4),
                                       _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30));
    }
}

// Word index vector for elements 64v..64v+63: word w → sub-block 4v + w/8.
inline __m512i quarter_index(int v) {
    const __m128i q0 = _mm_set1_epi16(int16_t(4 * v)), q1 = _mm_set1_epi16(int16_t(4 * v + 1));
    const __m128i q2 = _mm_set1_epi16(int16_t(4 * v + 2)), q3 = _mm_set1_epi16(int16_t(4 * v + 3));
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(q1, q0)), _mm256_set_m128i(q3, q2), 1);
}

void dequantize_row_q6_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q6_K *>(vx);
    const __m512i m32 = _mm512_set1_epi8(32);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = f16(x[b].d);
        __m512i v[4];
        unpack_q6(x[b], v);
        for (int i = 0; i < 4; ++i) {
            // 64 values q − 32 (int8), converted 16 at a time: one sub-block, one scale.
            alignas(64) int8_t q[64];
            _mm512_store_si512(q, _mm512_sub_epi8(v[i], m32));
            for (int j = 0; j < 4; ++j) {
                const int g = 4 * i + j;
                const __m512 vq = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i *>(q + 16 * j))));
                _mm512_storeu_ps(y + b * QK_K + 16 * g, _mm512_mul_ps(_mm512_set1_ps(d * float(x[b].scales[g])), vq));
            }
        }
    }
}

struct Q6K {
    template <int NC>
    static void dot(int64_t nb, const block_q6_K *w, const block_q8_K *const *a, float *out) {
        __m512 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w[b].scales)));
            const __m512i sc512 = _mm512_castsi256_si512(sc16);
            __m512i sv[4], v[4];
            for (int p = 0; p < 4; ++p) sv[p] = _mm512_permutexvar_epi16(quarter_index(p), sc512);
            unpack_q6(w[b], v);
            const float d = f16(w[b].d);
            for (int c = 0; c < NC; ++c) {
                // Start from −32 · Σ_g sc_g · bsum_g.
                const __m256i corr = _mm256_slli_epi32(
                    _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(sc16, load256(a[c][b].bsums))), 5);
                __m512i sumi = _mm512_zextsi256_si512(corr);
                for (int p = 0; p < 4; ++p)
                    sumi = _mm512_dpwssd_epi32(sumi, sv[p], _mm512_maddubs_epi16(v[p], _mm512_loadu_si512(a[c][b].qs + 64 * p)));
                acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(d * a[c][b].d), _mm512_cvtepi32_ps(sumi), acc[c]);
            }
        }
        for (int c = 0; c < NC; ++c) out[c] = _mm512_reduce_add_ps(acc[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX512, TypeKernels{.type = GGMLType::Q6_K,
                                              .act_type = GGMLType::Q8_K,
                                              .dequantize_row = dequantize_row_q6_K,
                                              .quantize_act_row = quantize_row_q8_K,
                                              .gemm = gemm_tile<block_q6_K, Q6K>,
                                              .repack_rows = kRepackRowsK,
                                              .repack_layout = kRepackLayoutQ6_K,
                                              .repacked_group_bytes = ref::group_bytes_q6_K_x8,
                                              .repack = avx2::repack_q6_K_x8,
                                              .gemm_repacked = gemm_repacked_k8<Q6_Kx8>});

}  // namespace ktd::avx512
