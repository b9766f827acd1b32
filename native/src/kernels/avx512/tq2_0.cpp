// TQ2_0 weights × Q8_K activations, AVX-512 (BW + VNNI). Layout and definition in
// kernels/ref/tq2_0.cpp. The 64 qs bytes are one vector; shift s gives elements 32s + (0..31) in
// the low half and 128 + 32s + (0..31) in the high half, and vshufi64x2 puts them in element
// order. The unsigned 2-bit values go straight into vpdpbusd (no scales); the −1 offset is
// Σ a, from Q8_K's bsums (the accumulator starts at −bsums).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 AVX-512 header false positives
#pragma GCC diagnostic ignored "-Wuninitialized"        // (GCC bug 105593, fixed in GCC 13)
#include <immintrin.h>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"
#include "kernels/avx512/ternary.h"
#include "kernels/kernels.h"

namespace ktd::avx512 {
namespace {

// The 4 vectors of 64 q (0..3) of a block in element order.
inline void unpack_tq2(const block_tq2_0 &x, __m512i v[4]) {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m512i z = _mm512_loadu_si512(x.qs);
    const __m512i q0 = _mm512_and_si512(z, m3), q1 = _mm512_and_si512(_mm512_srli_epi16(z, 2), m3);
    const __m512i q2 = _mm512_and_si512(_mm512_srli_epi16(z, 4), m3), q3 = _mm512_and_si512(_mm512_srli_epi16(z, 6), m3);
    v[0] = _mm512_shuffle_i64x2(q0, q1, 0x44);  // elements 0..63
    v[1] = _mm512_shuffle_i64x2(q2, q3, 0x44);  // 64..127
    v[2] = _mm512_shuffle_i64x2(q0, q1, 0xEE);  // 128..191
    v[3] = _mm512_shuffle_i64x2(q2, q3, 0xEE);  // 192..255
}

struct TQ2 {
    static void unpack(const block_tq2_0 &x, __m512i v[4]) { unpack_tq2(x, v); }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX512, TypeKernels{GGMLType::TQ2_0, GGMLType::Q8_K,
                                              dequantize_row_ternary<block_tq2_0, TQ2>, quantize_row_q8_K,
                                              gemm_tile<block_tq2_0, TernaryDot<block_tq2_0, TQ2>>});

}  // namespace ktd::avx512
