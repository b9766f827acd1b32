// The K-quants' 8-row repacks (kernels/repacked_k.h) with AVX2: the same bytes as the scalar
// reference (kernels/ref/q4_k.cpp, q6_k.cpp), which stays the definition and is what the tests
// compare these with, bitwise. The AVX2 and AVX-512 entries use these (the layout is shared).
//
// The nibble layouts are an 8 × 4 transpose of 32-bit words: 32 source bytes of row r give, after
// the per-byte nibble shuffles, four words per destination chunk, and destination register i of a
// chunk is word i of the 8 rows. Rows past the end of the matrix read as zero blocks, so every
// byte of a group block is written (no memset first) and a missing row has d = dmin = 0 and zero
// scales and values, as in the reference.
#include <immintrin.h>

#include <cstring>

#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/repacked_k.h"
#include "kernels/avx2/transpose.h"

namespace ktd::avx2 {
namespace {

inline __m128i load128(const uint8_t *p) { return _mm_loadu_si128(reinterpret_cast<const __m128i *>(p)); }
inline __m256i load256(const uint8_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }

// 32 source bytes (lo = bytes 0-15, hi = 16-31) → the "even" words (low nibbles of lo, high of
// hi's low nibbles) and the "odd" ones, as the reference's word-wise loop.
inline void split_nibbles(const uint8_t *src, __m128i &even, __m128i &odd) {
    const __m128i m4 = _mm_set1_epi8(0x0F), mf0 = _mm_set1_epi8(char(0xF0));
    const __m128i lo = load128(src), hi = load128(src + 16);
    even = _mm_or_si128(_mm_and_si128(lo, m4), _mm_and_si128(_mm_slli_epi16(hi, 4), mf0));
    odd = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, 4), m4), _mm_and_si128(hi, mf0));
}

// Source row r of group g (null past the end of the matrix).
inline const uint8_t *row_of(const void *w, size_t w_stride, int64_t rows, int64_t g, int r) {
    const int64_t row = g * kRepackRowsK + r;
    return row < rows ? static_cast<const uint8_t *>(w) + size_t(row) * w_stride : nullptr;
}

}  // namespace

void repack_q4_K_x8(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    const int64_t nb = k / QK_K;
    static const block_q4_K kZero{};
    auto *o = static_cast<block_q4_Kx8 *>(out);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t *row[kRepackRowsK];
        for (int r = 0; r < kRepackRowsK; ++r) row[r] = row_of(w, w_stride, rows, g, r);
        for (int64_t b = 0; b < nb; ++b) {
            block_q4_Kx8 &dst = o[g * nb + b];
            const block_q4_K *src[kRepackRowsK];
            alignas(32) uint8_t sc[64], mn[64];
            for (int r = 0; r < kRepackRowsK; ++r) {
                src[r] = row[r] ? reinterpret_cast<const block_q4_K *>(row[r]) + b : &kZero;
                dst.d[r] = src[r]->d;
                dst.dmin[r] = src[r]->dmin;
                uint8_t s8[8], m8[8];
                unpack_scale_min_k4(src[r]->scales, s8, m8);
                for (int j = 0; j < 8; ++j) {
                    sc[8 * j + r] = s8[j];
                    mn[8 * j + r] = m8[j];
                }
            }
            // scl/mnl: low nibbles of index x and x + 32; sh: their bits 4-5 (values are 6-bit).
            const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
            const __m256i s_lo = _mm256_load_si256(reinterpret_cast<const __m256i *>(sc));
            const __m256i s_hi = _mm256_load_si256(reinterpret_cast<const __m256i *>(sc + 32));
            const __m256i n_lo = _mm256_load_si256(reinterpret_cast<const __m256i *>(mn));
            const __m256i n_hi = _mm256_load_si256(reinterpret_cast<const __m256i *>(mn + 32));
            auto low_pair = [&](__m256i a, __m256i c) {
                return _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(_mm256_and_si256(c, m4), 4));
            };
            auto top2 = [&](__m256i a, int shift) {  // bits 4-5 of each byte at bit `shift`
                return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(a, 4), m3), shift);
            };
            store256(dst.scl, low_pair(s_lo, s_hi));
            store256(dst.mnl, low_pair(n_lo, n_hi));
            store256(dst.sh, _mm256_or_si256(_mm256_or_si256(top2(s_lo, 0), top2(s_hi, 2)),
                                             _mm256_or_si256(top2(n_lo, 4), top2(n_hi, 6))));
            // Source chunk c: low nibbles → sub-block 2c, high → 2c + 1.
            for (int c = 0; c < 4; ++c) {
                __m128i even[kRepackRowsK], odd[kRepackRowsK];
                for (int r = 0; r < kRepackRowsK; ++r) split_nibbles(src[r]->qs + 32 * c, even[r], odd[r]);
                __m256i t[4];
                transpose_8x4(even, t);
                for (int i = 0; i < 4; ++i) store256(dst.qs + 128 * (2 * c) + 32 * i, t[i]);
                transpose_8x4(odd, t);
                for (int i = 0; i < 4; ++i) store256(dst.qs + 128 * (2 * c + 1) + 32 * i, t[i]);
            }
        }
    }
}

void repack_q6_K_x8(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    const int64_t nb = k / QK_K;
    static const block_q6_K kZero{};
    auto *o = static_cast<block_q6_Kx8 *>(out);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t *row[kRepackRowsK];
        for (int r = 0; r < kRepackRowsK; ++r) row[r] = row_of(w, w_stride, rows, g, r);
        for (int64_t b = 0; b < nb; ++b) {
            block_q6_Kx8 &dst = o[g * nb + b];
            const block_q6_K *src[kRepackRowsK];
            for (int r = 0; r < kRepackRowsK; ++r) {
                src[r] = row[r] ? reinterpret_cast<const block_q6_K *>(row[r]) + b : &kZero;
                dst.d[r] = src[r]->d;
                // Chunk p's scales[2r + h] = scale of sub-block 2p + h: 16-bit units.
                for (int p = 0; p < 8; ++p) std::memcpy(dst.c[p].scales + 2 * r, src[r]->scales + 2 * p, 2);
            }
            // Each row's 256 six-bit values as bytes, in element order (positions as in the
            // reference's q6_K_value: element 128n + 32f + l has its low 4 bits in nibble f / 2 of
            // ql[64n + 32(f % 2) + l] and its high 2 bits at bit 2f of qh[32n + l]).
            alignas(32) uint8_t qv[kRepackRowsK][QK_K];
            const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
            for (int r = 0; r < kRepackRowsK; ++r)
                for (int n = 0; n < 2; ++n) {
                    const __m256i ql0 = load256(src[r]->ql + 64 * n), ql1 = load256(src[r]->ql + 64 * n + 32);
                    const __m256i qh = load256(src[r]->qh + 32 * n);
                    uint8_t *e = qv[r] + 128 * n;
                    store256(e, _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)));
                    store256(e + 32, _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)));
                    store256(e + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30)));
                    store256(e + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                                     _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30)));
                }
            // Half h of chunk s: the 16 bytes at 32s + 16h of each row, transposed into element
            // registers 0-3 (lane r = row r); register 3's bits 2j..2j+1 go to bits 6-7 of register j.
            const __m256i mc0 = _mm256_set1_epi8(char(0xC0));
            for (int s = 0; s < 8; ++s)
                for (int h = 0; h < 2; ++h) {
                    __m128i rw[kRepackRowsK];
                    for (int r = 0; r < kRepackRowsK; ++r) rw[r] = load128(qv[r] + 32 * s + 16 * h);
                    __m256i t[4];
                    transpose_8x4(rw, t);
                    uint8_t *q = dst.c[s].q + 96 * h;
                    store256(q, _mm256_or_si256(t[0], _mm256_and_si256(_mm256_slli_epi16(t[3], 6), mc0)));
                    store256(q + 32, _mm256_or_si256(t[1], _mm256_and_si256(_mm256_slli_epi16(t[3], 4), mc0)));
                    store256(q + 64, _mm256_or_si256(t[2], _mm256_and_si256(_mm256_slli_epi16(t[3], 2), mc0)));
                }
        }
    }
}

}  // namespace ktd::avx2
