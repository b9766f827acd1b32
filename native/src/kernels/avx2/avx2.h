// Shared pieces of the AVX2+FMA kernels (included only by files under kernels/avx2/).
//
// These files do not include common/float16.h or other headers with inline code shared with
// baseline translation units, and use no out-of-line std templates (std::vector...): an inline
// function or template instance compiled here with AVX2 flags could be the copy the linker keeps
// for the baseline code too (check: `nm -C` on these objects lists weak symbols of ktd::avx2
// only). Conversions use F16C intrinsics.
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

namespace ktd::avx2 {

// The Q8_0 activation quantizer, bitwise identical to ref::quantize_row_q8_0 (round half away
// from zero, as lround).
void quantize_row_q8_0(const float *x, void *y, int64_t k);

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float f16(uint16_t h) { return _cvtsh_ss(h); }

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
    using Block = typename Traits::Block;
    const int64_t nb = k / QK8_0;
    const char *wb = static_cast<const char *>(w);
    const char *xb = static_cast<const char *>(xq);
    for (int r0 = 0; r0 < nr; r0 += kRowChunk) {
        const int r1 = std::min(nr, r0 + kRowChunk);
        for (int c0 = 0; c0 < nc; c0 += kColTile) {
            const int ncc = std::min(kColTile, nc - c0);
            const block_q8_0 *a[kColTile];
            for (int c = 0; c < ncc; ++c)
                a[c] = reinterpret_cast<const block_q8_0 *>(xb + size_t(c0 + c) * x_stride);
            for (int r = r0; r < r1; ++r) {
                const Block *wr = reinterpret_cast<const Block *>(wb + size_t(r) * w_stride);
                float *yr = y + size_t(c0) * ldy + size_t(r);
                switch (ncc) {
                    case 1: gemm_row<Traits, 1>(nb, wr, a, yr, ldy); break;
                    case 2: gemm_row<Traits, 2>(nb, wr, a, yr, ldy); break;
                    case 3: gemm_row<Traits, 3>(nb, wr, a, yr, ldy); break;
                    default: gemm_row<Traits, 4>(nb, wr, a, yr, ldy); break;
                }
            }
        }
    }
}

// ---- Row-interleaved (repacked) layouts, 8 rows per group ------------------------------------
//
// A group block holds block b of 8 consecutive rows, arranged so that 32-bit lane r of a 256-bit
// register belongs to row r: register j (0..7) holds elements 4j..4j+3 of every row. One
// broadcast of 4 activation bytes then serves all 8 rows, the 8 row scales are one fp16 vector,
// and each row's sum stays in its own lane (no horizontal sums). Traits for such a layout:
//   struct Traits {
//     using GroupBlock = ...;                 // the 8-row block, sizeof = 8 * sizeof(row block)
//     // The activation block sums the layout needs, scaled: asum_off[c] = kActSumScale·Σa (0: none).
//     // Unsigned q stored with an offset o use o (Σ(q - o)·a = Σq·a - o·Σa); a min term uses 1.
//     static constexpr int kActSumScale;
//     // acc[c] += the 8 rows' products with activation blocks a[c].
//     template <int NC> static void dot_group(const GroupBlock &g, const block_q8_0 *const *a,
//                                             const int32_t *asum_off, __m256 *acc);
//   };
constexpr int kRepackRows = 8;
// Distance of the software prefetch ahead of the repacked weight stream, bytes: one core is
// latency-bound below DRAM bandwidth with only the hardware prefetcher's misses in flight.
// Measured on the 0.5B decode shapes (Xeon, 1 thread): 1 KiB < 2 KiB < 4 KiB ≈ 8 KiB.
constexpr int kPrefetchBytes = 4096;

// Broadcast of activation bytes 4j..4j+3.
inline __m256i act_quad(const block_q8_0 &a, int j) {
    int32_t v;
    std::memcpy(&v, a.qs + 4 * j, 4);
    return _mm256_set1_epi32(v);
}

inline int32_t act_sum(const block_q8_0 &a) {
    const __m256i s = dot_u8s8(_mm256_set1_epi8(1), loadu_q8(a));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 1));
    return _mm_cvtsi128_si32(t);
}

// The nibble layout shared by the 4- and 5-bit 8-row groups (128 bytes of qs): qs[32i + 4r + t]
// holds row r's element 4i + t in its low nibble and element 16 + 4i + t in its high nibble, so
// register i's low nibbles are lane-per-row register j = i and its high nibbles j = i + 4.
// Row r's block in the Q4_0 qs encoding (byte j: element j low nibble, element j + 16 high)
// into the group's qs: the layout keeps that pairing, so each 4-byte word is copied as is.
inline void put_nibbles(uint8_t *qs, int r, const uint8_t *src_qs) {
    for (int i = 0; i < 4; ++i) std::memcpy(qs + 32 * i + 4 * r, src_qs + 4 * i, 4);
}
inline void load_nibbles(const uint8_t *qs, __m256i v[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * i));
        v[i] = _mm256_and_si256(q, m4);
        v[i + 4] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    }
}
// Fifth bits of the 5-bit groups (32 bytes of qh): qh[4r + t] bit j = bit 4 of row r's element 4j + t.
// From row r's qh in the Q5 encoding (bit e of the little-endian u32 = element e's fifth bit):
// byte t gathers bits t, t + 4, ..., t + 28 (pext).
inline void put_bit4(uint8_t *qh, int r, const uint8_t *src_qh) {
    uint32_t bits;
    std::memcpy(&bits, src_qh, 4);
    for (int t = 0; t < 4; ++t) qh[4 * r + t] = uint8_t(_pext_u32(bits, 0x11111111u << t));
}
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
inline __m256 load_d8(const uint16_t *d) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(d)));
}

// Visits block b of every row of group g (rows past `rows` are skipped: the group stays zero).
template <typename Block, typename Fn>
inline void for_group_rows(const void *w, size_t w_stride, int64_t rows, int64_t g, int64_t b, const Fn &fn) {
    for (int r = 0; r < kRepackRows && g * kRepackRows + r < rows; ++r)
        fn(r, reinterpret_cast<const Block *>(static_cast<const char *>(w) + size_t(g * kRepackRows + r) * w_stride)[b]);
}

template <typename Traits, int NC>
inline void gemm_group(int64_t nb, const typename Traits::GroupBlock *g, const block_q8_0 *const *a,
                       const int32_t *asum_off, float *y, size_t ldy, int rows_valid) {
    __m256 acc[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    const block_q8_0 *p[NC];
    int32_t off[NC] = {};
    for (int64_t b = 0; b < nb; ++b) {
        for (size_t o = 0; o < sizeof(typename Traits::GroupBlock); o += 64)
            _mm_prefetch(reinterpret_cast<const char *>(g + b) + kPrefetchBytes + o, _MM_HINT_T0);
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
            p[c] = a[c] + b;
            if constexpr (Traits::kActSumScale != 0) off[c] = asum_off[size_t(c) * size_t(nb) + size_t(b)];
        }
        Traits::template dot_group<NC>(g[b], p, off, acc);
    }
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
        if (rows_valid == kRepackRows) {
            _mm256_storeu_ps(y + size_t(c) * ldy, acc[c]);
        } else {
            alignas(32) float tmp[kRepackRows];
            _mm256_store_ps(tmp, acc[c]);
            std::memcpy(y + size_t(c) * ldy, tmp, size_t(rows_valid) * sizeof(float));
        }
    }
}

// Per-thread buffer of activation block sums; grows only (no allocation once warm).
struct ActSums {
    int32_t *p = nullptr;
    size_t cap = 0;
    ActSums() = default;
    ActSums(const ActSums &) = delete;
    ActSums &operator=(const ActSums &) = delete;
    ~ActSums() { delete[] p; }
    int32_t *get(size_t n) {
        if (n > cap) {
            delete[] p;
            p = new int32_t[n];
            cap = n;
        }
        return p;
    }
};

// gemm_repacked for an 8-row interleaved layout (TypeKernels::gemm_repacked contract).
template <typename Traits>
void gemm_repacked_r8(int64_t k, const void *wp, size_t group_stride, const void *xq, size_t x_stride, float *y,
                      size_t ldy, int nr, int nc) {
    using GroupBlock = typename Traits::GroupBlock;
    const int64_t nb = k / QK8_0;
    const char *wb = static_cast<const char *>(wp);
    const char *xb = static_cast<const char *>(xq);
    // kActSumScale·Σa per (column, block), computed once per call.
    thread_local ActSums sums;
    int32_t *asum_off = nullptr;
    if constexpr (Traits::kActSumScale != 0) {
        asum_off = sums.get(size_t(nc) * size_t(nb));
        for (int c = 0; c < nc; ++c) {
            const auto *a = reinterpret_cast<const block_q8_0 *>(xb + size_t(c) * x_stride);
            for (int64_t b = 0; b < nb; ++b)
                asum_off[size_t(c) * size_t(nb) + size_t(b)] = Traits::kActSumScale * act_sum(a[b]);
        }
    }
    const int n_groups = (nr + kRepackRows - 1) / kRepackRows;
    constexpr int kGroupChunk = kRowChunk / kRepackRows;
    for (int g0 = 0; g0 < n_groups; g0 += kGroupChunk) {
        const int g1 = std::min(n_groups, g0 + kGroupChunk);
        for (int c0 = 0; c0 < nc; c0 += kColTile) {
            const int ncc = std::min(kColTile, nc - c0);
            const block_q8_0 *a[kColTile];
            for (int c = 0; c < ncc; ++c) a[c] = reinterpret_cast<const block_q8_0 *>(xb + size_t(c0 + c) * x_stride);
            const int32_t *off = asum_off ? asum_off + size_t(c0) * size_t(nb) : nullptr;
            for (int gi = g0; gi < g1; ++gi) {
                const auto *g = reinterpret_cast<const GroupBlock *>(wb + size_t(gi) * group_stride);
                const int valid = std::min(kRepackRows, nr - gi * kRepackRows);
                float *yg = y + size_t(c0) * ldy + size_t(gi) * kRepackRows;
                switch (ncc) {
                    case 1: gemm_group<Traits, 1>(nb, g, a, off, yg, ldy, valid); break;
                    case 2: gemm_group<Traits, 2>(nb, g, a, off, yg, ldy, valid); break;
                    case 3: gemm_group<Traits, 3>(nb, g, a, off, yg, ldy, valid); break;
                    default: gemm_group<Traits, 4>(nb, g, a, off, yg, ldy, valid); break;
                }
            }
        }
    }
}

}  // namespace ktd::avx2
