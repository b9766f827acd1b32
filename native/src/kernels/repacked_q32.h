// Row-interleaved ("repacked") layouts of the 32-element block types (Q8_0 activations).
//
// A group block holds block b (32 elements) of R consecutive rows, arranged so that 32-bit lane r
// of a SIMD register belongs to row r: register j (0..7) holds elements 4j..4j+3 of every row. One
// broadcast of 4 activation bytes then serves all R rows, the R row scales are one fp16 vector, and
// each row's sum stays in its own lane (no horizontal sums). A group block has exactly the bytes of
// the R row blocks it replaces; rows past the end of the matrix are zero (d = m = 0).
//
// Two families, each with its layout version (TypeKernels::repack_layout, which caches key on):
// - x8 (version 1, the AVX2 kernels; the reference's too): 8 rows, 256-bit registers.
// - x16 (version 2, the AVX-512 kernels of Q5_0 and Q8_0): 16 rows, 512-bit registers.
//
// The scalar repacks and element accessors in kernels/ref/ are the definition; the ISA entries use
// the same repacks. Only POD structs here (no inline code), so every ISA may include it.
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

}  // namespace ktd

namespace ktd::ref {
// The repacks (TypeKernels::repack contract) and group sizes of the layouts above, defined with
// the reference kernels (kernels/ref/repacked_q32.cpp) and used by every ISA's entry.
#define KTD_REPACK_Q32(name)                                                                              \
    size_t group_bytes_##name(int64_t k);                                                                 \
    void repack_##name(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, \
                       void *out)
KTD_REPACK_Q32(q4_0_x8);
KTD_REPACK_Q32(q4_1_x8);
KTD_REPACK_Q32(q5_0_x8);
KTD_REPACK_Q32(q5_1_x8);
KTD_REPACK_Q32(q8_0_x8);
KTD_REPACK_Q32(iq4_nl_x8);
KTD_REPACK_Q32(q5_0_x16);
KTD_REPACK_Q32(q8_0_x16);
#undef KTD_REPACK_Q32
// The reference entry of a 32-element type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): Q8_0
// activations, the given plain kernels, and the type's x8 layout with the scalar tile on it (the
// reference's plain tile, bitwise).
TypeKernels q32_type_kernels(GGMLType type, void (*dequantize_row)(const void *, float *, int64_t),
                             decltype(TypeKernels::gemm) gemm);
}  // namespace ktd::ref
