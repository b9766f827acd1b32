// What the AVX-512 TQ1_0 and TQ2_0 kernels share once a block is unpacked into four vectors of
// 64 unsigned trits (0..2) in element order: dequantization (d · (q − 1)) and the Q8_K dot,
// where the trits go straight into vpdpbusd and the −1 offset is Σ a from the bsums (the
// accumulator starts at −bsums). Included only by kernels/avx512/ files (internal linkage).
#pragma once
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"

namespace ktd::avx512 {
namespace {

// Unpack: a type with `static void unpack(const Block &, __m512i v[4])` (a class, not a function
// pointer: a pointer type with __m512i parameters loses its vector attributes as a template argument).
template <class Block, class Unpack>
void dequantize_row_ternary(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const Block *>(vx);
    const __m512i one = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const __m512 d = _mm512_set1_ps(f16(x[b].d));
        __m512i v[4];
        Unpack::unpack(x[b], v);
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

template <class Block, class Unpack>
struct TernaryDot {
    template <int NC>
    static void dot(int64_t nb, const Block *w, const block_q8_K *const *a, float *out) {
        __m512 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m512i v[4];
            Unpack::unpack(w[b], v);
            const float d = f16(w[b].d);
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
}  // namespace ktd::avx512
