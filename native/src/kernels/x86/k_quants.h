// What the AVX2 and AVX-512 kernels of the 256-element block types (Q8_K activations) share:
// the plain-layout tile, the scale unpacking, the dequantization of 32 values and the Q8_K
// activation quantizer. Inline, in the including file's ISA namespace (kernels/x86/common.h).
#pragma once
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/blocks.h"
#include "kernels/x86/common.h"
#include "kernels/x86/quantize_q8_k.h"

namespace ktd::KTD_SIMD_NS {

// Columns processed together per weight row: the unpacked weights of one block stay in
// registers while up to this many activation columns are dotted with them.
constexpr int kMaxCols = 4;

// Weight bytes of the rows processed together per column group: small enough to stay in L2
// while the column groups pass over them.
constexpr size_t kRowChunkBytes = 256 * 1024;

// The plain-layout tile of a row kernel: Kernel::dot<NC>(nb, w, a, out) computes out[c] = dot(w,
// a[c]) for NC ≤ kMaxCols activation columns. Rows are taken in chunks of ~kRowChunkBytes (the
// tile driver), so for decode (nc ≤ kMaxCols) the weights are read from memory once.
template <typename BlockW, typename Kernel>
void gemm_tile(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y,
               size_t ldy, int nr, int nc) {
    const int64_t nb = k / QK_K;
    const int chunk = w_stride >= kRowChunkBytes ? 1 : int(kRowChunkBytes / w_stride);
    const auto tile = [&]<int NC>(int r, int c0, const block_q8_K *const *a) {
        const auto *wr = reinterpret_cast<const BlockW *>(static_cast<const char *>(w) + r * w_stride);
        float out[NC];
        Kernel::template dot<NC>(nb, wr, a, out);
        for (int c = 0; c < NC; ++c) y[(c0 + c) * ldy + r] = out[c];
    };
    for_each_tile<block_q8_K, kMaxCols>(nr, chunk, xq, x_stride, nc, tile);
}

// Q3_K packed 6-bit scales (kernels/k_scales.h) → 16 int8 scales (−32..31), in SIMD. Reads
// exactly the 12 bytes of the field.
inline __m128i unpack_scales_q3_K_simd(const uint8_t *scales) {
    const __m128i m4 = _mm_set1_epi8(0xF);
    const __m128i q07 = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(scales));
    uint32_t q811;
    std::memcpy(&q811, scales + 8, 4);
    // Low 4 bits: scales 0..7 the low nibbles of bytes 0..7, scales 8..15 their high nibbles.
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(q07, m4), _mm_and_si128(_mm_srli_epi16(q07, 4), m4));
    // High 2 bits of scale j: bits 2(j/4).. of byte 8 + j%4, i.e. bytes 8..11 shifted by 0, 2, 4, 6.
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(int(q811)), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}

// The 8 sums of 32 of a Q8_K block (pairs of its 16 bsums), as int16.
inline __m128i bsums_32(const block_q8_K &a) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i *>(a.bsums));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i *>(a.bsums + 8));
    return _mm_hadd_epi16(lo, hi);
}

inline __m256i load256(const void *p) { return _mm256_loadu_si256(static_cast<const __m256i *>(p)); }

// Q4_K/Q5_K packed scales and mins (kernels/k_scales.h) → 16 bytes [sc0..7, m0..7], in SIMD.
// Reads 16 bytes at `scales`: the 12 of the field and 4 of the field after it in the block.
inline __m128i unpack_scale_min_k4_simd(const uint8_t *scales) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(scales));
    // Low bits: sc0-3 = q0-3 & 63, sc4-7 = q8-11 & 15, m0-3 = q4-7 & 63, m4-7 = q8-11 >> 4.
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i lo = _mm_or_si128(
        _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
        _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
    // High 2 bits of sc4-7 / m4-7: bits 6-7 of q0-3 / q4-7 → bits 4-5.
    const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30)));
}

// 32 int8 (Signed) or uint8 values → 4 × 8 floats, in order.
template <bool Signed>
inline void cvt_x32_ps(__m256i q, __m256 v[4]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i)
        v[i] = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]));
}

// out[0..31] = dl · q (− ml when Sub), each operation rounded separately as gguf-py computes it
// (no FMA contraction: the kernels/ ISA files are compiled in ISO C++ mode, -ffp-contract=off).
template <bool Signed, bool Sub>
inline void dequant_x32(__m256i q, float dl, float ml, float *out) {
    __m256 v[4];
    cvt_x32_ps<Signed>(q, v);
    const __m256 vd = _mm256_set1_ps(dl), vm = _mm256_set1_ps(ml);
    for (int i = 0; i < 4; ++i) {
        __m256 r = _mm256_mul_ps(vd, v[i]);
        if constexpr (Sub) r = _mm256_sub_ps(r, vm);
        _mm256_storeu_ps(out + 8 * i, r);
    }
}

}  // namespace ktd::KTD_SIMD_NS
