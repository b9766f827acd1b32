// The AVX2 kernels of the 32-element types with a min, w = d·q + m (Q4_1, Q5_1; activations Q8_0):
// the two differ only in how the unsigned q of a block are unpacked. Included only by
// kernels/avx2/q4_1.cpp and q5_1.cpp.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "kernels/avx2/q32.h"
#include "kernels/blocks.h"
#include "kernels/repacked_q32.h"

namespace ktd::avx2 {

// Values: static __m256i q(const Block &) → the block's 32 q (unsigned bytes, element order).
template <typename Block, typename Values>
void dequantize_row_min(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const Block *>(vx);
    for (int64_t b = 0; b < k / 32; ++b, y += 32) {
        const __m256 d = _mm256_set1_ps(f16(x[b].d)), m = _mm256_set1_ps(f16(x[b].m));
        alignas(32) uint8_t v[32];
        _mm256_store_si256(reinterpret_cast<__m256i *>(v), Values::q(x[b]));
        for (int i = 0; i < 4; ++i) {
            const __m128i qi = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(v + 8 * i));
            __m256 dq = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(qi)));
            // Keep the product rounded on its own: the specification (gguf-py) is (d·q) + m, not an FMA.
            __asm__("" : "+x"(dq));
            _mm256_storeu_ps(y + 8 * i, _mm256_add_ps(dq, m));
        }
    }
}

// The plain layout's block dot (gemm_q8_0_act traits): acc += d·da·Σq·a + m·da·Σa.
template <typename B, typename Values>
struct MinDot {
    using Block = B;
    template <int NC>
    static inline void dot_block(const Block &w, const block_q8_0 *const *a, __m256 *acc) {
        const __m256i qu = Values::q(w);
        const __m256i ones = _mm256_set1_epi8(1);
        const float dw = f16(w.d), mw = f16(w.m);
        for (int c = 0; c < NC; ++c) {
            const __m256i s = loadu_q8(*a[c]);
            const float da = f16(a[c]->d);
            const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(qu, s));
            const __m256 sa = _mm256_cvtepi32_ps(dot_u8s8(ones, s));
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * da), p, acc[c]);
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(mw * da), sa, acc[c]);
        }
    }
};

// The x8 layout's group dot (gemm_repacked_r8 traits; kBit4: the 5-bit layout, fifth bits in qh):
// acc += d·da·Σq·a + m·da·Σa per row lane (asum = Σa).
template <typename G, bool kBit4>
struct MinDotX8 {
    using GroupBlock = G;
    static constexpr int kActSumScale = 1;
    template <int NC>
    static inline void dot_group(const GroupBlock &g, const block_q8_0 *const *a, const int32_t *asum, __m256 *acc) {
        const __m256 d8 = f16x8(g.d), m8 = f16x8(g.m);
        __m256i v[8];
        load_nibbles(g.qs, v);
        if constexpr (kBit4) add_bit4(g.qh, v);
        for (int c = 0; c < NC; ++c) {
            const float da = f16(a[c]->d);
            const __m256i isum = kBit4 ? dot_group_u5(v, *a[c]) : dot_group_u4(v, *a[c]);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_set1_ps(da)), acc[c]);
            acc[c] = _mm256_fmadd_ps(m8, _mm256_set1_ps(da * float(asum[c])), acc[c]);
        }
    }
};

}  // namespace ktd::avx2
