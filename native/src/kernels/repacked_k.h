// Row-interleaved ("repacked") layouts of the K-quants, 8 rows per group (Q4_K layout version 1,
// Q6_K version 5).
//
// A group block holds super-block b (256 elements) of 8 consecutive rows, arranged so that
// 32-bit lane r of a 256-bit register belongs to row r: a register holds 4 consecutive elements
// (bytes 4r..4r+3) of each of the 8 rows. One broadcast of 4 activation bytes then serves all 8
// rows, the 8 row scales are one fp16 vector, and each row's sum stays in its own lane (no
// horizontal sums). The group block has exactly the bytes of the 8 row blocks it replaces, so
// repacking does not change the number of bytes streamed per token.
//
// Element registers: "register i of a 32-element chunk" (i < 8) holds elements 4i..4i+3 of the
// chunk. The 4-bit values of a chunk are 128 bytes: byte 32i + 4r + t (i < 4, t < 4) holds row r's
// element 4i + t in its low nibble and element 16 + 4i + t in its high nibble, so the low
// nibbles of those 32 bytes are register i and the high nibbles register i + 4.
//
// The reference repack (kernels/ref/) is the definition; the x86 entries use an AVX2 twin of it
// that writes the same bytes (tested bitwise), the others the reference itself (the layout is
// shared, only the tile kernels differ). Only POD structs here: no inline code, so the header
// is safe to include from translation units compiled with different ISA flags.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/blocks.h"

namespace ktd {

constexpr int kRepackRowsK = 8;
constexpr uint32_t kRepackLayoutQ4_K = 1;
// Version numbers are not reused across a type's layouts (Q6_K: 1 the first x8 layout, 3 the arm
// x4 layout, 4 the x8 layout with separate ql and qh, 5 the x8 layout below).
constexpr uint32_t kRepackLayoutQ6_K = 5;

// Q4_K, 8 rows. Sub-block j (32 elements) of row r has the 6-bit scale sc and min m of the
// original block; their "index" is i = 8j + r (0..63).
//   scl[x]: low nibble = bits 0-3 of sc at index x, high nibble = bits 0-3 of sc at index x + 32 (x < 32)
//   mnl[x]: the same for m
//   sh[x]:  bits 0-1 = bits 4-5 of sc[x], bits 2-3 = of sc[x + 32], bits 4-5 = of m[x], bits 6-7 = of m[x + 32]
//   qs:     sub-block j at 128j, the chunk nibble layout above
// w = d[r]·sc·q − dmin[r]·m as in block_q4_K.
struct block_q4_Kx8 {
    uint16_t d[kRepackRowsK];
    uint16_t dmin[kRepackRowsK];
    uint8_t scl[32];
    uint8_t mnl[32];
    uint8_t sh[32];
    uint8_t qs[kRepackRowsK * QK_K / 2];
};
static_assert(sizeof(block_q4_Kx8) == kRepackRowsK * sizeof(block_q4_K));

// Q6_K, 8 rows (layout version 5). q = the unsigned 6-bit value (0..63) of an element,
// w = d[r]·sc·(q − 32). After d, the block is 8 chunks of 208 bytes, chunk s holding everything
// the kernels read for elements 32s..32s+31 in the order they read it, so that a group streams
// as one ascending run of addresses (version 1 kept scales, ql and qh as three separate arrays,
// which the tile read in three interleaved runs; the hardware prefetchers did not follow them and
// the n = 1 GEMV streamed slower than the plain rows):
//   scales[2r + h] = the int8 scale of sub-block 2s + h (16 elements) of row r
//   q[96h + 32j + 4r + t] (h < 2, j < 3, t < 4): bits 0-5 = q of row r's element 32s + 16h + 4j + t,
//       bits 6-7 = bits 2j..2j+1 of q of its element 32s + 16h + 12 + t
// So half h of the chunk (sub-block 2s + h) is three registers: masked with 0x3F they are element
// registers 0-2 of the sub-block, and their top two bits assemble register 3. Version 4 stored the
// low nibbles and the high 2 bits apart (the Q4_K nibble layout plus a 2-bit plane), which took
// 15-19 vector operations per sub-block to put the 6-bit values together; this takes 11.
struct block_q6_Kx8_chunk {
    int8_t scales[2 * kRepackRowsK];
    uint8_t q[kRepackRowsK * 32 * 6 / 8];
};
struct block_q6_Kx8 {
    uint16_t d[kRepackRowsK];
    block_q6_Kx8_chunk c[QK_K / 32];
};
static_assert(sizeof(block_q6_Kx8) == kRepackRowsK * sizeof(block_q6_K));

// ---- arm x4 (version 3, the aarch64 NEON / dotprod / i8mm kernels) -------------------------
// 4 rows interleaved in 8-byte groups, as the 32-element types' arm x4 layout (repacked_q32.h):
// a per-row byte array of n bytes becomes n/8 pieces of 32 bytes, piece i = bytes 8i..8i+7 of
// rows 0, 1, 2, 3 (x[32i + 8r + t] = row r's byte 8i + t), so one 128-bit load holds the same 8
// bytes of rows 2p and 2p + 1: SMMLA's 2x8 operand, and SDOT's in 32-bit lanes. The small fields
// (d, dmin, the packed scales) are kept per row as in the original block.
constexpr int kRepackRowsKx4 = 4;
constexpr uint32_t kRepackLayoutKArmX4 = 3;

// Q4_K: d, dmin and the 12 packed scale bytes of each row; qs interleaved (row r's qs[32c + l]:
// low nibble = element 64c + l, high nibble = element 64c + 32 + l, as in block_q4_K).
struct block_q4_Kx4 {
    uint16_t d[kRepackRowsKx4];
    uint16_t dmin[kRepackRowsKx4];
    uint8_t scales[kRepackRowsKx4][12];
    uint8_t qs[kRepackRowsKx4 * QK_K / 2];
};
static_assert(sizeof(block_q4_Kx4) == kRepackRowsKx4 * sizeof(block_q4_K));

// Q6_K: d and the 16 int8 scales of each row; ql and qh interleaved (byte meanings as in block_q6_K).
struct block_q6_Kx4 {
    uint16_t d[kRepackRowsKx4];
    int8_t scales[kRepackRowsKx4][QK_K / 16];
    uint8_t ql[kRepackRowsKx4 * QK_K / 2];
    uint8_t qh[kRepackRowsKx4 * QK_K / 4];
};
static_assert(sizeof(block_q6_Kx4) == kRepackRowsKx4 * sizeof(block_q6_K));

}  // namespace ktd

namespace ktd::ref {
// The repacks (TypeKernels::repack contract) and group sizes of the layouts above, defined with
// the reference kernels and shared by every ISA's entry.
size_t group_bytes_q4_K_x8(int64_t k);
void repack_q4_K_x8(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out);
size_t group_bytes_q6_K_x8(int64_t k);
void repack_q6_K_x8(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out);
size_t group_bytes_q4_K_x4(int64_t k);
void repack_q4_K_x4(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out);
size_t group_bytes_q6_K_x4(int64_t k);
void repack_q6_K_x4(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out);
}  // namespace ktd::ref

namespace ktd::avx2 {
// The same repacks with AVX2 (kernels/avx2/repack_k.cpp): bitwise the reference's bytes; the
// AVX2 and AVX-512 entries register these.
void repack_q4_K_x8(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out);
void repack_q6_K_x8(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out);
}  // namespace ktd::avx2
