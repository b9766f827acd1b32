// The AVX2 kernels of the 32-element types (activations Q8_0), in the three ways a block's values
// enter the dot product; within a family the types differ only in how a block's 32 values are
// unpacked (Values::q(const Block &) → 32 bytes, element order) or a group's loaded:
//   offset  w = d·(q − o), q unsigned        Q4_0 (o = 8), Q5_0 (o = 16)
//   signed  w = d·v, v signed bytes          Q8_0, IQ4_NL (v = code book value)
//   min     w = d·q + m, q unsigned          Q4_1, Q5_1
// Included only by the type files under kernels/avx2/.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "kernels/avx2/q32.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/repacked_q32.h"

namespace ktd::avx2 {

// The AVX2 entry of a 32-element type: its kernels on Q8_0 activations, and its x8 layout.
inline TypeKernels q32_entry(GGMLType type, void (*dequantize_row)(const void *, float *, int64_t),
                             decltype(TypeKernels::gemm) gemm, decltype(TypeKernels::gemm_repacked) gemm_repacked) {
    return ref::with_x8_layout(TypeKernels{.type = type,
                                           .act_type = GGMLType::Q8_0,
                                           .dequantize_row = dequantize_row,
                                           .quantize_act_row = quantize_row_q8_0,
                                           .gemm = gemm,
                                           .gemm_repacked = gemm_repacked});
}

// ---- offset and signed -----------------------------------------------------------------------

// w = d·(q − kOff) (kOff = 0: the signed values as they are), d·v rounded once as gguf-py does.
template <typename Block, typename Values, int kOff>
void dequantize_row_signed(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const Block *>(vx);
    for (int64_t b = 0; b < k / 32; ++b, y += 32) {
        const __m256 d = _mm256_set1_ps(f16(x[b].d));
        __m256i q = Values::q(x[b]);
        if constexpr (kOff != 0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(kOff));
        alignas(32) int8_t v[32];
        _mm256_store_si256(reinterpret_cast<__m256i *>(v), q);
        for (int i = 0; i < 4; ++i) {
            const __m128i qi = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(v + 8 * i));
            _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qi))));
        }
    }
}

// Plain layout (gemm_q8_0_act traits), offset family: acc += d·da·Σ(q − kOff)·a.
template <typename B, typename Values, int kOff>
struct OffsetDot {
    using Block = B;
    template <int NC>
    static inline void dot_block(const Block &w, const block_q8_0 *const *a, __m256 *acc) {
        const __m256i qu = Values::q(w);
        const __m256i off = _mm256_set1_epi8(kOff);
        const float dw = f16(w.d);
        for (int c = 0; c < NC; ++c) {
            const __m256 p = _mm256_cvtepi32_ps(dot_u8s8_offset(qu, loadu_q8(*a[c]), off));
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * f16(a[c]->d)), p, acc[c]);
        }
    }
};

// x8 layout (gemm_repacked_r8 traits), offset family (kBit4: fifth bits in qh):
// acc += d·da·(Σq·a − kOff·Σa) per row lane.
template <typename G, bool kBit4, int kOff>
struct OffsetDotX8 {
    using GroupBlock = G;
    static constexpr int kActSumScale = kOff;
    template <int NC>
    static inline void dot_group(const GroupBlock &g, const block_q8_0 *const *a, const int32_t *off, __m256 *acc) {
        const __m256 d8 = f16x8(g.d);
        __m256i v[8];
        load_nibbles(g.qs, v);
        if constexpr (kBit4) add_bit4(g.qh, v);
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
            const __m256i s = kBit4 ? dot_group_u5(v, *a[c]) : dot_group_u4(v, *a[c]);
            const __m256i isum = _mm256_sub_epi32(s, _mm256_set1_epi32(off[c]));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_set1_ps(f16(a[c]->d))), acc[c]);
        }
    }
};

// Plain layout, signed family: acc += d·da·Σv·a (sign trick: |v| unsigned, a with v's sign).
template <typename B, typename Values>
struct SignedDot {
    using Block = B;
    template <int NC>
    static inline void dot_block(const Block &w, const block_q8_0 *const *a, __m256 *acc) {
        const __m256i qw = Values::q(w);
        const __m256i aw = _mm256_sign_epi8(qw, qw);
        const float dw = f16(w.d);
        for (int c = 0; c < NC; ++c) {
            const __m256i s = _mm256_sign_epi8(loadu_q8(*a[c]), qw);
            const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(aw, s));
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * f16(a[c]->d)), p, acc[c]);
        }
    }
};

// x8 layout, signed family: Load::load(g, v) → the 8 registers of signed values.
template <typename G, typename Load>
struct SignedDotX8 {
    using GroupBlock = G;
    static constexpr int kActSumScale = 0;
    template <int NC>
    static inline void dot_group(const GroupBlock &g, const block_q8_0 *const *a, const int32_t *, __m256 *acc) {
        const __m256 d8 = f16x8(g.d);
        __m256i v[8];
        Load::load(g, v);
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
            __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) isum = _mm256_add_epi32(isum, dot_s8s8(v[j], act_quad(*a[c], j)));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_set1_ps(f16(a[c]->d))), acc[c]);
        }
    }
};

// ---- min -------------------------------------------------------------------------------------

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

// Plain layout, min family: acc += d·da·Σq·a + m·da·Σa.
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

// x8 layout, min family (kBit4: fifth bits in qh): acc += d·da·Σq·a + m·da·Σa per row lane
// (asum = Σa).
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
