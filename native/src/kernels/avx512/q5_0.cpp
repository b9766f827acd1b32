// Q5_0 weights (w = d·(q - 16)), AVX-512 BW/VL + VNNI; activations Q8_0. Definition in
// kernels/ref/q5_0.cpp; the 16-row layout in kernels/repacked_q32.h, its GEMM in kernels/avx512/q32_vnni.h.
// GCC 12's AVX-512 headers raise false -W(maybe-)uninitialized warnings from their own
// _mm512_undefined_* placeholders (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>

#include "kernels/avx512/q32_vnni.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/repacked_q32.h"

namespace ktd::avx512 {

namespace {
// The 32 q of a block as signed bytes q - 16 (-16..15), element order: low nibbles of qs are
// elements 0..15, high nibbles 16..31; qh bit e (little-endian u32) is element e's fifth bit,
// applied as a byte mask.
inline __m256i q5_signed(const block_q5_0 &x) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i *>(x.qs));
    const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
    uint32_t bits;
    std::memcpy(&bits, x.qh, 4);
    // Bit 4 set where the fifth bit is: q - 16 = lo - 16 + 16·bit = lo - 16 where the bit is clear.
    return _mm256_mask_sub_epi8(lo, __mmask32(~bits), lo, _mm256_set1_epi8(16));
}

void dequantize_row_q5_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q5_0 *>(vx);
    for (int64_t b = 0; b < k / QK5_0; ++b, y += QK5_0) {
        const __m512 d = _mm512_set1_ps(f16(x[b].d));
        const __m256i q = q5_signed(x[b]);
        _mm512_storeu_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))));
        _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))));
    }
}

// The plain-layout tile (used when weights are not repacked).
void gemm_q5_0(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y, size_t ldy,
               int nr, int nc) {
    // A closure, not the function itself: a function reference passed down the tile driver's
    // lambdas is called indirectly (measured 1.1-2.2x slower).
    gemm_plain<block_q5_0>(k, w, w_stride, xq, x_stride, y, ldy, nr, nc,
                           [](const block_q5_0 &x) { return q5_signed(x); });
}

struct Q5_0x16 {
    using GroupBlock = block_q5_0x16;
    static constexpr int kActOffset = 16;
    static inline __m256i scales(const GroupBlock &g) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.d));
    }
    static inline void load(const GroupBlock &g, __m512i v[8]) {
        const __m512i m4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
            const __m512i q = _mm512_loadu_si512(g.qs + 64 * i);
            const __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            v[i] = _mm512_mask_add_epi8(lo, _cvtu64_mask64(g.qh[i]), lo, b4);
            v[i + 4] = _mm512_mask_add_epi8(hi, _cvtu64_mask64(g.qh[i + 4]), hi, b4);
        }
    }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX512, TypeKernels{.type = GGMLType::Q5_0,
                                              .act_type = GGMLType::Q8_0,
                                              .dequantize_row = dequantize_row_q5_0,
                                              .quantize_act_row = avx2::quantize_row_q8_0,
                                              .gemm = gemm_q5_0,
                                              .repack_rows = kRepackRows16,
                                              .repack_layout = kRepackLayoutQ32x16,
                                              .repacked_group_bytes = ref::group_bytes_q5_0_x16,
                                              .repack = avx2::repack_q5_0_x16,
                                              .gemm_repacked = gemm_repacked_r16<Q5_0x16>});

}  // namespace ktd::avx512
