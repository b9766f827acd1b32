// Row-interleaved ("repacked") layouts of the 32-element block types (Q8_0 activations).
//
// A group block holds block b (32 elements) of R consecutive rows, arranged so that 32-bit lane r
// of a SIMD register belongs to row r: register j (0..7) holds elements 4j..4j+3 of every row. One
// broadcast of 4 activation bytes then serves all R rows, the R row scales are one fp16 vector, and
// each row's sum stays in its own lane (no horizontal sums). A group block has exactly the bytes of
// the R row blocks it replaces; rows past the end of the matrix are zero (d = m = 0).
//
// Three families, each with its layout version (TypeKernels::repack_layout, which caches key on):
// - x8 (version 1, the AVX2 kernels; the reference's too): 8 rows, 256-bit registers.
// - x16 (version 2, the AVX-512 kernels of Q5_0 and Q8_0): 16 rows, 512-bit registers.
// - arm x4 (version 3, the aarch64 kernels): 4 rows in 8-byte groups, SMMLA's operand (below).
//
// The scalar repacks and element accessors in kernels/ref/repacked_q32.cpp are the definition;
// the ISA entries use the same repacks. Only POD structs here (no inline code), so every ISA may include it.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/blocks.h"
#include "kernels/kernels.h"

namespace ktd {

constexpr int kRepackRowsQ32x8 = 8;
constexpr uint32_t kRepackLayoutQ32x8 = 1;
constexpr int kRepackRowsQ32x16 = 16;
constexpr uint32_t kRepackLayoutQ32x16 = 2;

// ---- x8 ------------------------------------------------------------------------------------
// Nibble layout (qs, 128 bytes): byte 32i + 4r + t (i < 4, t < 4) holds row r's element 4i + t in
// its low nibble and element 16 + 4i + t in its high nibble (the pairing of the row block's qs, so
// each 4-byte word of it is copied as is): the low nibbles of bytes 32i.. are register i, the high
// ones register i + 4.
// Fifth bits (qh, 32 bytes): bit j of byte 4r + t = bit 4 of row r's element 4j + t.

// w = d·(q − 8), q (0..15) in the nibble layout.
struct block_q4_0x8 {
    uint16_t d[kRepackRowsQ32x8];
    uint8_t qs[128];
};
// w = d·q + m, q (0..15) in the nibble layout.
struct block_q4_1x8 {
    uint16_t d[kRepackRowsQ32x8];
    uint16_t m[kRepackRowsQ32x8];
    uint8_t qs[128];
};
// w = d·(q − 16), q (0..31): low four bits in the nibble layout, fifth bits in qh.
struct block_q5_0x8 {
    uint16_t d[kRepackRowsQ32x8];
    uint8_t qh[32];
    uint8_t qs[128];
};
// w = d·q + m, q (0..31) as in block_q5_0x8.
struct block_q5_1x8 {
    uint16_t d[kRepackRowsQ32x8];
    uint16_t m[kRepackRowsQ32x8];
    uint8_t qh[32];
    uint8_t qs[128];
};
// w = d·q, qs[32j + 4r + t] = row r's element 4j + t.
struct block_q8_0x8 {
    uint16_t d[kRepackRowsQ32x8];
    int8_t qs[kRepackRowsQ32x8 * QK8_0];
};
// w = d·kvalues_iq4nl[q], the code book indices q in the nibble layout.
struct block_iq4_nlx8 {
    uint16_t d[kRepackRowsQ32x8];
    uint8_t qs[128];
};
static_assert(sizeof(block_q4_0x8) == kRepackRowsQ32x8 * sizeof(block_q4_0));
static_assert(sizeof(block_q4_1x8) == kRepackRowsQ32x8 * sizeof(block_q4_1));
static_assert(sizeof(block_q5_0x8) == kRepackRowsQ32x8 * sizeof(block_q5_0));
static_assert(sizeof(block_q5_1x8) == kRepackRowsQ32x8 * sizeof(block_q5_1));
static_assert(sizeof(block_q8_0x8) == kRepackRowsQ32x8 * sizeof(block_q8_0));
static_assert(sizeof(block_iq4_nlx8) == kRepackRowsQ32x8 * sizeof(block_iq4_nl));

// ---- x16 -----------------------------------------------------------------------------------
// w = d·(q − 16), q (0..31):
//   qs[64i + 4r + t] (i < 4): low nibble = bits 0-3 of row r's element 4i + t, high nibble = of
//                             element 16 + 4i + t
//   qh[j] (little-endian u64) bit 4r + t = bit 4 of row r's element 4j + t
// so register j is the low nibbles of qs row i = j (j < 4) or the high ones of i = j − 4, and
// qh[j] is its byte mask for the fifth bit.
struct block_q5_0x16 {
    uint16_t d[kRepackRowsQ32x16];
    uint64_t qh[8];
    uint8_t qs[16 * kRepackRowsQ32x16];
};
// w = d·(u − 128): qs[64j + 4r + t] = row r's element 4j + t as the unsigned u = q + 128 (q XOR
// 0x80), so vpdpbusd takes the weights as its unsigned operand and the activations as they are.
struct block_q8_0x16 {
    uint16_t d[kRepackRowsQ32x16];
    uint8_t qs[kRepackRowsQ32x16 * QK8_0];
};
static_assert(sizeof(block_q5_0x16) == kRepackRowsQ32x16 * sizeof(block_q5_0));
static_assert(sizeof(block_q8_0x16) == kRepackRowsQ32x16 * sizeof(block_q8_0));


// ---- arm x4 (version 3, the aarch64 NEON / dotprod / i8mm kernels of all six types) ---------
// 4 rows, interleaved in 8-byte groups: one 128-bit register holds 8 consecutive elements of two
// rows (row 2p in its low half, row 2p + 1 in its high half), which is both SMMLA's 2x8 operand
// and, split in 32-bit lanes, SDOT's (lanes 0-1 row 2p, lanes 2-3 row 2p + 1). "Chunk c" (c < 4)
// of a block is its elements 8c..8c+7; the kernels hold chunk c of rows 2p, 2p + 1 in register
// w[c][p]. (Version 3 is each of these types' first arm layout: no type's x8 or x16 layout uses 3.)
constexpr int kRepackRowsQ32x4 = 4;
constexpr uint32_t kRepackLayoutQ32ArmX4 = 3;

// The 4-bit types' qs (64 bytes): qs[32h + 8r + t] (h < 2, t < 8) = row r's qs byte 8h + t, i.e.
// the low nibble is element 8h + t (chunk h) and the high nibble element 16 + 8h + t (chunk 2 + h):
// each row's 8-byte halves copied as is, so one 16-byte load at 32h + 16p is chunks h and 2 + h of
// rows 2p, 2p + 1.
// The 5-bit types' fifth bits (qh, 16 bytes): bit 2c + p of byte 8s + t (s < 2, t < 8) = bit 4 of
// row 2p + s's element 8c + t, so testing bit 2c + p of all 16 bytes gives register w[c][p]'s
// fifth bits lane for lane.

// w = d·q, qs[32c + 8r + t] (c < 4, t < 8) = row r's element 8c + t.
struct block_q8_0x4 {
    uint16_t d[kRepackRowsQ32x4];
    int8_t qs[kRepackRowsQ32x4 * QK8_0];
};
// w = d·(q − 8), q (0..15) in the 4-bit qs layout.
struct block_q4_0x4 {
    uint16_t d[kRepackRowsQ32x4];
    uint8_t qs[kRepackRowsQ32x4 * QK4_0 / 2];
};
// w = d·q + m, q (0..15) in the 4-bit qs layout.
struct block_q4_1x4 {
    uint16_t d[kRepackRowsQ32x4];
    uint16_t m[kRepackRowsQ32x4];
    uint8_t qs[kRepackRowsQ32x4 * QK4_1 / 2];
};
// w = d·(q − 16), q (0..31): bits 0-3 in the 4-bit qs layout, bit 4 in the qh layout.
struct block_q5_0x4 {
    uint16_t d[kRepackRowsQ32x4];
    uint8_t qh[16];
    uint8_t qs[kRepackRowsQ32x4 * QK5_0 / 2];
};
// w = d·q + m, q (0..31) as in block_q5_0x4.
struct block_q5_1x4 {
    uint16_t d[kRepackRowsQ32x4];
    uint16_t m[kRepackRowsQ32x4];
    uint8_t qh[16];
    uint8_t qs[kRepackRowsQ32x4 * QK5_1 / 2];
};
// w = d·kvalues_iq4nl[q], the code book indices q in the 4-bit qs layout.
struct block_iq4_nlx4 {
    uint16_t d[kRepackRowsQ32x4];
    uint8_t qs[kRepackRowsQ32x4 * QK4_NL / 2];
};
static_assert(sizeof(block_q8_0x4) == kRepackRowsQ32x4 * sizeof(block_q8_0));
static_assert(sizeof(block_q4_0x4) == kRepackRowsQ32x4 * sizeof(block_q4_0));
static_assert(sizeof(block_q4_1x4) == kRepackRowsQ32x4 * sizeof(block_q4_1));
static_assert(sizeof(block_q5_0x4) == kRepackRowsQ32x4 * sizeof(block_q5_0));
static_assert(sizeof(block_q5_1x4) == kRepackRowsQ32x4 * sizeof(block_q5_1));
static_assert(sizeof(block_iq4_nlx4) == kRepackRowsQ32x4 * sizeof(block_iq4_nl));

}  // namespace ktd

namespace ktd::ref {
// The x8 layouts (kernels/ref/repacked_q32.cpp): tk with the repack fields of its type's layout
// (repack_rows, repack_layout, repacked_group_bytes, repack; the caller sets gemm_repacked). Every
// ISA's entry of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL takes them from here.
TypeKernels with_x8_layout(TypeKernels tk);
// The reference entry of one of those types: Q8_0 activations, the given plain kernels, the x8
// layout and the scalar tile on it (bitwise the plain tile).
TypeKernels q32_type_kernels(GGMLType type, void (*dequantize_row)(const void *, float *, int64_t),
                             decltype(TypeKernels::gemm) gemm);

// The x16 layouts' repacks and group sizes (TypeKernels::repack contract), for the AVX-512 entries.
size_t group_bytes_q5_0_x16(int64_t k);
void repack_q5_0_x16(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out);
size_t group_bytes_q8_0_x16(int64_t k);
void repack_q8_0_x16(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out);
}  // namespace ktd::ref

namespace ktd::avx2 {
// The x16 repacks with AVX2 instructions (kernels/avx2/repack_q32.cpp): bitwise the reference's
// bytes; the AVX-512 entries of Q5_0 and Q8_0 register these.
void repack_q5_0_x16(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out);
void repack_q8_0_x16(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out);
}  // namespace ktd::avx2
namespace ktd::ref {
// The arm x4 layouts (kernels/ref/repacked_q32.cpp): tk, an entry of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
// or IQ4_NL, with its layout's repack fields (repack_rows, repack_layout, repacked_group_bytes,
// repack: scalar, shared by the aarch64 entries; the caller sets gemm_repacked).
TypeKernels with_arm_x4_layout(TypeKernels tk);
}  // namespace ktd::ref
