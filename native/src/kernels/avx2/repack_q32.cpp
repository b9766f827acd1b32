// The x16 repacks of Q8_0 and Q5_0 (kernels/repacked_q32.h; the AVX-512 entries' layouts) with
// AVX2 instructions: the same bytes as the scalar reference (kernels/ref/repacked_q32.cpp), which
// stays the definition and is what the tests compare these with, bitwise. Every byte of a group
// block is written (no memset first); a row past the end of the matrix is all zero bytes, as in
// the reference (for Q8_0 that is not the 0x80 a zero value is stored as: the reference leaves
// such rows as they were zeroed).
#include <immintrin.h>

#include <cstring>

#include "kernels/blocks.h"
#include "kernels/repacked_q32.h"
#include "kernels/avx2/transpose.h"

namespace ktd::avx2 {
namespace {

constexpr int R16 = kRepackRowsQ32x16;

// r[8] (8 words each) → out[j] = word j of rows 0..7.
inline void transpose_8x8(const __m256i r[8], __m256i out[8]) {
    __m256i t[8], u[8];
    for (int p = 0; p < 4; ++p) {
        t[2 * p] = _mm256_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm256_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // rows 4h..4h+3
        u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int j = 0; j < 4; ++j) {
        out[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        out[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

template <typename Block>
inline const Block *row_block(const void *w, size_t w_stride, int64_t rows, int64_t g, int r, int64_t b) {
    const int64_t row = g * R16 + r;
    return row < rows ? reinterpret_cast<const Block *>(static_cast<const uint8_t *>(w) + size_t(row) * w_stride) + b
                      : nullptr;
}

}  // namespace

void repack_q8_0_x16(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    const int64_t nb = k / 32;
    const __m256i flip = _mm256_set1_epi8(char(0x80));
    auto *o = static_cast<block_q8_0x16 *>(out);
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            block_q8_0x16 &dst = o[g * nb + b];
            for (int h = 0; h < 2; ++h) {  // rows 8h..8h+7: bytes 32h..32h+31 of each 64-byte register row
                __m256i r[8], t[8];
                for (int i = 0; i < 8; ++i) {
                    const block_q8_0 *src = row_block<block_q8_0>(w, w_stride, rows, g, 8 * h + i, b);
                    dst.d[8 * h + i] = src ? src->d : 0;
                    r[i] = src ? _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(src->qs)), flip)
                               : _mm256_setzero_si256();
                }
                transpose_8x8(r, t);
                for (int j = 0; j < 8; ++j) store256(dst.qs + 64 * j + 32 * h, t[j]);
            }
        }
}

void repack_q5_0_x16(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    const int64_t nb = k / 32;
    auto *o = static_cast<block_q5_0x16 *>(out);
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            block_q5_0x16 &dst = o[g * nb + b];
            uint64_t qh[8] = {};
            for (int h = 0; h < 2; ++h) {
                __m128i q[8];
                for (int i = 0; i < 8; ++i) {
                    const int r = 8 * h + i;
                    const block_q5_0 *src = row_block<block_q5_0>(w, w_stride, rows, g, r, b);
                    dst.d[r] = src ? src->d : 0;
                    q[i] = src ? _mm_loadu_si128(reinterpret_cast<const __m128i *>(src->qs)) : _mm_setzero_si128();
                    if (!src) continue;
                    uint32_t bits;
                    std::memcpy(&bits, src->qh, 4);
                    // Bit 4 of element 4j + t → bit 4r + t of qh[j]: nibble j of the row's bits.
                    for (int j = 0; j < 8; ++j) qh[j] |= uint64_t((bits >> (4 * j)) & 0xFu) << (4 * r);
                }
                __m256i t[4];
                transpose_8x4(q, t);
                for (int i = 0; i < 4; ++i) store256(dst.qs + 64 * i + 32 * h, t[i]);
            }
            std::memcpy(dst.qh, qh, sizeof qh);
        }
}

}  // namespace ktd::avx2
