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
static_assert(sizeof(block_tq1_0) == 54);
static_assert(sizeof(block_tq2_0) == 66);

// The IQ4_NL / IQ4_XS code book.
inline constexpr int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                             1,    13,   25,  38,  53,  69,  89,  113};

}  // namespace ktd
