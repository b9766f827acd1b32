// Block layouts of the GGUF quantized types (the file format; identical to ggml's
// ggml-common.h). fp16 fields are raw IEEE half bits (see common/float16.h). Each struct's size
// is checked against the GGML type table.
#pragma once
#include <cstdint>

#include "common/ggml_types.h"

namespace ktd {

constexpr int QK4_0 = 32, QK4_1 = 32, QK5_0 = 32, QK5_1 = 32, QK8_0 = 32, QK4_NL = 32;
constexpr int QK_K = 256;           // super-block of the K-quants, IQ4_XS and the ternary types
constexpr int K_SCALE_SIZE = 12;    // packed 6-bit scales+mins of Q4_K/Q5_K

// 32 weights: w = d * (q - 8), q 4-bit; qs[j] low nibble = element j, high nibble = j + 16.
struct block_q4_0 { uint16_t d; uint8_t qs[QK4_0 / 2]; };
// w = d * q + m, q 4-bit, nibble order as q4_0.
struct block_q4_1 { uint16_t d; uint16_t m; uint8_t qs[QK4_1 / 2]; };
// w = d * (q - 16), q 5-bit: low 4 bits as q4_0, bit 4 of element j in bit j of qh (little endian u32).
struct block_q5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK5_0 / 2]; };
// w = d * q + m, q 5-bit, bits as q5_0.
struct block_q5_1 { uint16_t d; uint16_t m; uint8_t qh[4]; uint8_t qs[QK5_1 / 2]; };
// w = d * q, q int8. Also the activation format of the 32-element block types.
struct block_q8_0 { uint16_t d; int8_t qs[QK8_0]; };
// Non-linear 4-bit: w = d * kvalues_iq4nl[q], nibble order as q4_0.
struct block_iq4_nl { uint16_t d; uint8_t qs[QK4_NL / 2]; };

// 2-bit K-quant: 16 sub-blocks of 16; scales[i] = scale (low 4 bits) | min (high 4 bits);
// w = d * sc * q - dmin * m.
struct block_q2_K { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; uint16_t d; uint16_t dmin; };
// 3-bit K-quant: low 2 bits in qs, high bit in hmask, 16 6-bit scales packed in 12 bytes.
struct block_q3_K { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; uint16_t d; };
// 4-bit K-quant: 8 sub-blocks of 32 with 6-bit scales and mins packed in scales[12];
// w = d * sc * q - dmin * m.
struct block_q4_K { uint16_t d; uint16_t dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; };
// 5-bit K-quant: as q4_K plus the fifth bits in qh.
struct block_q5_K { uint16_t d; uint16_t dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
// 6-bit K-quant: 16 sub-blocks of 16 with int8 scales; w = d * sc * (q - 32).
struct block_q6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; };
// Activation format of the 256-element block types: float scale, int8 values, and the sums of
// each group of 16 values (used to apply the K-quants' mins without touching qs again).
struct block_q8_K { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; };
// Non-linear 4-bit with 8 sub-blocks of 32 and 6-bit scales (low 4 bits in scales_l, high 2 in scales_h).
struct block_iq4_xs { uint16_t d; uint16_t scales_h; uint8_t scales_l[QK_K / 64]; uint8_t qs[QK_K / 2]; };
// The i-quants (element orders in kernels/ref/iq1.cpp, iq2.cpp, iq3.cpp; code books in
// kernels/iq_grids.h). 256 weights each, grouped in 8 sub-blocks of 32.
// IQ2_XXS, 2.06 bits/weight: per sub-block two uint32 (qs[4ib..4ib+3]): 4 grid indices (bytes),
// then 4 × 7-bit sign codes and a 4-bit scale.
struct block_iq2_xxs { uint16_t d; uint16_t qs[QK_K / 8]; };
// IQ2_XS, 2.31 bits/weight: per 8 weights a uint16 = 9-bit grid index | 7-bit sign code << 9;
// 4-bit scales per 16 weights.
struct block_iq2_xs { uint16_t d; uint16_t qs[QK_K / 8]; uint8_t scales[QK_K / 32]; };
// IQ2_S, 2.56 bits/weight: qs[0..31] low 8 bits of a 10-bit grid index per 8 weights (high 2
// bits in qh), qs[32..63] their sign bytes; 4-bit scales per 16 weights.
struct block_iq2_s { uint16_t d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t scales[QK_K / 32]; };
// IQ3_XXS, 3.06 bits/weight: qs[0..63] one grid index per 4 weights; qs[64..95] per sub-block a
// uint32 of 4 × 7-bit sign codes and a 4-bit scale.
struct block_iq3_xxs { uint16_t d; uint8_t qs[3 * QK_K / 8]; };
// IQ3_S, 3.44 bits/weight: 9-bit grid index per 4 weights (low 8 in qs, bit 8 in qh), explicit
// sign bits, 4-bit scales per sub-block.
struct block_iq3_s { uint16_t d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t signs[QK_K / 8]; uint8_t scales[QK_K / 64]; };
// IQ1_S, 1.56 bits/weight: 11-bit index into the ternary grid per 8 weights (low 8 in qs, high 3
// in qh); per sub-block a 3-bit scale and the sign of the ±1/8 shift in qh.
struct block_iq1_s { uint16_t d; uint8_t qs[QK_K / 8]; uint16_t qh[QK_K / 32]; };
// IQ1_M, 1.75 bits/weight: as IQ1_S with the high index bits and shift sign per 8 weights in qh
// nibbles, 3-bit scales per 16 weights, and the fp16 block scale split over the top nibbles of
// the 4 uint16 of `scales`.
struct block_iq1_m { uint8_t qs[QK_K / 8]; uint8_t qh[QK_K / 16]; uint8_t scales[QK_K / 32]; };
// Ternary (BitNet b1.58), 1.6875 bits/weight: 5 trits per byte in qs (240 weights), 4 per byte in qh (16).
struct block_tq1_0 { uint8_t qs[(QK_K - 4 * QK_K / 64) / 5]; uint8_t qh[QK_K / 64]; uint16_t d; };
// Ternary, 2 bits/weight: w = d * (q - 1), q in {0, 1, 2}.
struct block_tq2_0 { uint8_t qs[QK_K / 4]; uint16_t d; };

static_assert(sizeof(block_q4_0) == 18);
static_assert(sizeof(block_q4_1) == 20);
static_assert(sizeof(block_q5_0) == 22);
static_assert(sizeof(block_q5_1) == 24);
static_assert(sizeof(block_q8_0) == 34);
static_assert(sizeof(block_iq4_nl) == 18);
static_assert(sizeof(block_q2_K) == 84);
static_assert(sizeof(block_q3_K) == 110);
static_assert(sizeof(block_q4_K) == 144);
static_assert(sizeof(block_q5_K) == 176);
static_assert(sizeof(block_q6_K) == 210);
static_assert(sizeof(block_q8_K) == 292);
static_assert(sizeof(block_iq4_xs) == 136);
static_assert(sizeof(block_iq2_xxs) == 66);
static_assert(sizeof(block_iq2_xs) == 74);
static_assert(sizeof(block_iq2_s) == 82);
static_assert(sizeof(block_iq3_xxs) == 98);
static_assert(sizeof(block_iq3_s) == 110);
static_assert(sizeof(block_iq1_s) == 50);
static_assert(sizeof(block_iq1_m) == 56);
static_assert(sizeof(block_tq1_0) == 54);
static_assert(sizeof(block_tq2_0) == 66);

// The IQ4_NL / IQ4_XS code book.
inline constexpr int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                             1,    13,   25,  38,  53,  69,  89,  113};

}  // namespace ktd
