// TQ2_0 weights × Q8_K activations, AVX-512 (BW + VNNI). Layout and definition in
// kernels/ref/tq2_0.cpp. The 64 qs bytes are one vector; shift s gives elements 32s + (0..31) in
// the low half and 128 + 32s + (0..31) in the high half, and vshufi64x2 puts them in element
// order. The unsigned 2-bit values go straight into vpdpbusd (no scales); the −1 offset is
// Σ a, from Q8_K's bsums (the accumulator starts at −bsums).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 AVX-512 header false positives
#pragma GCC diagnostic ignored "-Wuninitialized"        // (GCC bug 105593, fixed in GCC 13)
#include <immintrin.h>

#include "kernels/avx2/k_common.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"

namespace ktd::avx512 {
namespace {

// The 4 vectors of 64 q (0..3) of a block in element order.
inline void unpack_tq2(const block_tq2_0 &x, __m512i v[4]) {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m512i z = _mm512_loadu_si512(x.qs);
    const __m512i q0 = _mm512_and_si512(z, m3), q1 = _mm512_and_si512(_mm512_srli_epi16(z, 2), m3);
    const __m512i q2 = _mm512_and_si512(_mm512_srli_epi16(z, 4), m3), q3 = _mm512_and_si512(_mm512_srli_epi16(z, 6), m3);
    v[0] = _mm512_shuffle_i64x2(q0, q1, 0x44);  // elements 0..63
    v[1] = _mm512_shuffle_i64x2(q2, q3, 0x44);  // 64..127
    v[2] = _mm512_shuffle_i64x2(q0, q1, 0xEE);  // 128..191
    v[3] = _mm512_shuffle_i64x2(q2, q3, 0xEE);  // 192..255
}

void dequantize_row_tq2_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_tq2_0 *>(vx);
    const __m512i one = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(x[b].d));
        __m512i v[4];
        unpack_tq2(x[b], v);
        for (int i = 0; i < 4; ++i) {
            alignas(64) int8_t q[64];
            _mm512_store_si512(q, _mm512_sub_epi8(v[i], one));
            for (int j = 0; j < 4; ++j) {
                const __m512 vq = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i *>(q + 16 * j))));
                _mm512_storeu_ps(y + b * QK_K + 64 * i + 16 * j, _mm512_mul_ps(d, vq));
            }
        }
    }
}

struct TQ2 {
    template <int NC>
    static void dot(int64_t nb, const block_tq2_0 *w, const block_q8_K *const *a, float *out) {
        __m512 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m512i v[4];
            unpack_tq2(w[b], v);
            const float d = _cvtsh_ss(w[b].d);
            for (int c = 0; c < NC; ++c) {
                __m512i sumi = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_cvtepi16_epi32(load256(a[c][b].bsums)));
                for (int p = 0; p < 4; ++p) sumi = _mm512_dpbusd_epi32(sumi, v[p], _mm512_loadu_si512(a[c][b].qs + 64 * p));
                acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(d * a[c][b].d), _mm512_cvtepi32_ps(sumi), acc[c]);
            }
        }
        for (int c = 0; c < NC; ++c) out[c] = _mm512_reduce_add_ps(acc[c]);
    }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX512, TypeKernels{GGMLType::TQ2_0, GGMLType::Q8_K, dequantize_row_tq2_0, quantize_row_q8_K,
                                              gemm_tile<block_tq2_0, TQ2>});

}  // namespace ktd::avx512
