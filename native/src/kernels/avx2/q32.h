// The AVX2+FMA kernels of the 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): value
// unpacking, the plain-layout tile and the 8-row interleaved tile (the per-type dot products on
// them: q32_kernels.h). Included only by files under kernels/avx2/ (kernels/x86/common.h says why
// nothing here is shared with baseline code).
//
// The 32-element block types all dot against Q8_0 activations. A type supplies a traits struct
//   struct Traits {
//     using Block = block_xxx;
//     // Adds block `w`'s products with activation blocks a[c] (c < NC) to acc[c]
//     // (8 float lanes each; the lanes are summed once at the end of the row).
//     template <int NC> static void dot_block(const Block &w, const block_q8_0 *const *a, __m256 *acc);
//   };
// and gemm_q8_0_act<Traits> is its tile function: rows are processed in chunks of kRowChunk so
// the chunk's weights stay in L2 while up to kColTile activation rows (in L1) are dotted with
// them; each weight block is decoded once per kColTile columns.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/repacked_q32.h"
#include "kernels/x86/common.h"

namespace ktd::avx2 {

// 16 bytes of packed nibbles → 32 bytes: element j (< 16) = low nibble of byte j, element j + 16
// = high nibble of byte j (the qs order of Q4_0/Q4_1/Q5_x/IQ4_NL).
inline __m256i unpack_nibbles(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// The 32 bits of qh (bit j = element j) → 32 bytes, 0x10 where the bit is set (the fifth bit of
// the Q5 types in place).
inline __m256i expand_qh_bit4(const uint8_t *qh) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    // Byte j takes byte j/8 of bits, then is compared against its own bit (j % 8).
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuf);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    bytes = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_and_si256(bytes, _mm256_set1_epi8(0x10));
}

// Σ over pairs of u8·s8 products, as 8 int32 lanes (each lane the sum of 4 products).
// |u| ≤ 128, |s| ≤ 127 → each int16 pair sum ≤ 32512, no saturation.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Σ (u - off) · s for unsigned u ≤ 31 and a constant offset off ≤ 16: the offset's products are
// subtracted in int16 (|Σ| ≤ 2·31·127 + 2·16·127 < 32767).
inline __m256i dot_u8s8_offset(__m256i u, __m256i s, __m256i off) {
    const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(off, s));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// Σ s·w for signed w, s via the sign trick (|w| as unsigned, s with w's sign).
inline __m256i dot_s8s8(__m256i w, __m256i s) {
    return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w));
}

inline __m256i loadu_q8(const block_q8_0 &a) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs)); }

constexpr int kColTile = 4;
constexpr int kRowChunk = 16;

template <typename Traits, int NC>
inline void gemm_row(int64_t nb, const typename Traits::Block *w, const block_q8_0 *const *a, float *y, size_t ldy) {
    if constexpr (NC == 1) {
        // One column: two accumulators so consecutive blocks' FMAs do not wait on each other.
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        const block_q8_0 *a0 = a[0];
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            const block_q8_0 *p0 = a0 + b, *p1 = a0 + b + 1;
            Traits::template dot_block<1>(w[b], &p0, &acc[0]);
            Traits::template dot_block<1>(w[b + 1], &p1, &acc[1]);
        }
        if (b < nb) {
            const block_q8_0 *p0 = a0 + b;
            Traits::template dot_block<1>(w[b], &p0, &acc[0]);
        }
        y[0] = hsum(_mm256_add_ps(acc[0], acc[1]));
    } else {
        __m256 acc[NC];
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
        const block_q8_0 *p[NC];
        for (int64_t b = 0; b < nb; ++b) {
#pragma GCC unroll 8
            for (int c = 0; c < NC; ++c) p[c] = a[c] + b;
            Traits::template dot_block<NC>(w[b], p, acc);
        }
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) y[size_t(c) * ldy] = hsum(acc[c]);
    }
}

template <typename Traits>
void gemm_q8_0_act(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y,
                   size_t ldy, int nr, int nc) {
    const int64_t nb = k / QK8_0;
    const auto tile = [&]<int NC>(int r, int c0, const block_q8_0 *const *a) {
        const auto *wr =
            reinterpret_cast<const typename Traits::Block *>(static_cast<const char *>(w) + size_t(r) * w_stride);
        gemm_row<Traits, NC>(nb, wr, a, y + size_t(c0) * ldy + size_t(r), ldy);
    };
    for_each_tile<block_q8_0, kColTile>(nr, kRowChunk, xq, x_stride, nc, tile);
}

// ---- Row-interleaved (repacked) layouts, 8 rows per group (kernels/repacked_q32.h, x8) -------
//
// Traits for such a layout:
//   struct Traits {
//     using GroupBlock = ...;                 // block_xxx_x8
//     // The activation block sums the layout needs, scaled: asum_off[c] = kActSumScale·Σa (0: none).
//     // Unsigned q stored with an offset o use o (Σ(q - o)·a = Σq·a - o·Σa); a min term uses 1.
//     static constexpr int kActSumScale;
//     // acc[c] += the 8 rows' products with activation blocks a[c].
//     template <int NC> static void dot_group(const GroupBlock &g, const block_q8_0 *const *a,
//                                             const int32_t *asum_off, __m256 *acc);
//   };
constexpr int kRepackRows = kRepackRowsQ32x8;
// Distance of the software prefetch ahead of the repacked weight stream, bytes: one core is
// latency-bound below DRAM bandwidth with only the hardware prefetcher's misses in flight.
// Measured on the 0.5B decode shapes (Xeon, 1 thread): 1 KiB < 2 KiB < 4 KiB ≈ 8 KiB.
constexpr int kPrefetchBytes = 4096;

// Broadcast of activation bytes 4j..4j+3.
inline __m256i act_quad(const block_q8_0 &a, int j) { return bcast4(a.qs + 4 * j); }

// Adds the fifth bits (qh of the 5-bit x8 groups: bit j of byte 4r + t = bit 4 of row r's element
// 4j + t) to the nibble registers of load_nibbles.
inline void add_bit4(const uint8_t *qh, __m256i v[8]) {
    const __m256i b4 = _mm256_set1_epi8(0x10);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qh));
    // Bit j of each byte → bit 4 (16-bit shifts: the 0x10 mask drops what crosses bytes).
    v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), b4));
    v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), b4));
    v[2] = _mm256_or_si256(v[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), b4));
    v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), b4));
    v[4] = _mm256_or_si256(v[4], _mm256_and_si256(h, b4));
    v[5] = _mm256_or_si256(v[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), b4));
    v[6] = _mm256_or_si256(v[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), b4));
    v[7] = _mm256_or_si256(v[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), b4));
}
// Σ_j v[j]·(activation bytes 4j..4j+3) per lane for unsigned v ≤ 31: int16 partial sums of four
// registers stay below 4·2·31·127 = 31496.
inline __m256i dot_group_u5(const __m256i v[8], const block_q8_0 &a) {
    __m256i s0 = _mm256_maddubs_epi16(v[0], act_quad(a, 0));
    __m256i s1 = _mm256_maddubs_epi16(v[4], act_quad(a, 4));
#pragma GCC unroll 4
    for (int j = 1; j < 4; ++j) {
        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(v[j], act_quad(a, j)));
        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(v[j + 4], act_quad(a, j + 4)));
    }
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
}
// The same for v ≤ 15: all eight registers in one int16 sum (8·2·15·127 = 30480).
inline __m256i dot_group_u4(const __m256i v[8], const block_q8_0 &a) {
    __m256i s = _mm256_maddubs_epi16(v[0], act_quad(a, 0));
#pragma GCC unroll 8
    for (int j = 1; j < 8; ++j) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v[j], act_quad(a, j)));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}
// PF: the prefetch mode (kernels.h; prefill always l1, decode k_decode_prefetch()).
template <typename Traits, int NC, int PF = kPrefetchL1>
inline void gemm_group(int64_t nb, const typename Traits::GroupBlock *g, const block_q8_0 *const *a,
                       const int32_t *asum_off, float *y, size_t ldy, int rows_valid) {
    __m256 acc[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    const block_q8_0 *p[NC];
    int32_t off[NC] = {};
    for (int64_t b = 0; b < nb; ++b) {
        prefetch_lines<PF>(reinterpret_cast<const char *>(g + b) + prefetch_ahead<PF>(kPrefetchBytes),
                           sizeof(typename Traits::GroupBlock));
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
            p[c] = a[c] + b;
            if constexpr (Traits::kActSumScale != 0) off[c] = asum_off[size_t(c) * size_t(nb) + size_t(b)];
        }
        Traits::template dot_group<NC>(g[b], p, off, acc);
    }
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) store_rows8(acc[c], y + size_t(c) * ldy, rows_valid);
}

// gemm_repacked for an 8-row interleaved layout (TypeKernels::gemm_repacked contract). The
// software prefetch runs in prefill, and in decode (nc = 1) where k_decode_prefetch() says so.
template <typename Traits>
void gemm_repacked_r8(int64_t k, const void *wp, size_t group_stride, const void *xq, size_t x_stride, float *y,
                      size_t ldy, int nr, int nc) {
    const int64_t nb = k / QK8_0;
    // kActSumScale·Σa per (column, block), computed once per call.
    thread_local GrowBuffer<int32_t> sums;
    int32_t *asum_off = nullptr;
    if constexpr (Traits::kActSumScale != 0) {
        asum_off = sums.get(size_t(nc) * size_t(nb));
        for (int c = 0; c < nc; ++c) {
            const auto *a = reinterpret_cast<const block_q8_0 *>(static_cast<const char *>(xq) + size_t(c) * x_stride);
            for (int64_t b = 0; b < nb; ++b)
                asum_off[size_t(c) * size_t(nb) + size_t(b)] = Traits::kActSumScale * act_sum(a[b]);
        }
    }
    const int decode_pf = k_decode_prefetch();
    const auto tile = [&]<int NC>(int gi, int c0, const block_q8_0 *const *a) {
        const auto *g = reinterpret_cast<const typename Traits::GroupBlock *>(static_cast<const char *>(wp) +
                                                                              size_t(gi) * group_stride);
        const int32_t *off = asum_off ? asum_off + size_t(c0) * size_t(nb) : nullptr;
        const int valid = std::min(kRepackRows, nr - gi * kRepackRows);
        float *yg = y + size_t(c0) * ldy + size_t(gi) * kRepackRows;
        if constexpr (NC == 1)
            if (nc == 1) {  // decode: its prefetch mode
                if (decode_pf == kPrefetchOff) return gemm_group<Traits, 1, kPrefetchOff>(nb, g, a, off, yg, ldy, valid);
                if (decode_pf == kPrefetchL2) return gemm_group<Traits, 1, kPrefetchL2>(nb, g, a, off, yg, ldy, valid);
            }
        gemm_group<Traits, NC>(nb, g, a, off, yg, ldy, valid);
    };
    const int n_groups = (nr + kRepackRows - 1) / kRepackRows;
    for_each_tile<block_q8_0, kColTile>(n_groups, kRowChunk / kRepackRows, xq, x_stride, nc, tile);
}

}  // namespace ktd::avx2
