// Sub-block scale unpacking of the K-quants (ISA-neutral; shared by every ISA's kernels so the
// bit layouts are written down once). Layouts as in ggml's ggml-quants.c and gguf-py.
// The functions are `static`: this header is compiled into the reference, AVX2 and AVX-512
// translation units with different ISA flags, and an `inline` function would be merged by the
// linker into one copy, possibly the AVX-512 one, called from the reference kernels too.
#pragma once
#include <cstdint>

namespace ktd {

// Q4_K / Q5_K: 8 sub-blocks of 32 with a 6-bit scale and a 6-bit min packed in 12 bytes:
//   bytes 0-3: scale j (low 6 bits) | bits 4-5 of scale j+4 (top 2 bits), j < 4
//   bytes 4-7: min j (low 6 bits)   | bits 4-5 of min j+4 (top 2 bits)
//   bytes 8-11: low 4 bits of scale j+4 | low 4 bits of min j+4 << 4
// → sc[8], m[8] (each 0..63).
static inline void unpack_scale_min_k4(const uint8_t *q, uint8_t *sc, uint8_t *m) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = q[j] & 63;
        m[j] = q[j + 4] & 63;
        sc[j + 4] = uint8_t((q[j + 8] & 0xF) | ((q[j] >> 6) << 4));
        m[j + 4] = uint8_t((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
    }
}

// Q3_K: 16 6-bit scales (stored + 32) packed in 12 bytes: low 4 bits of scale j in byte j (j < 8)
// or the high nibble of byte j-8 (j >= 8); high 2 bits in byte 8 + j%4 at bit 2*(j/4).
// → sc[16] in -32..31.
static inline void unpack_scales_q3_K(const uint8_t *q, int8_t *sc) {
    for (int j = 0; j < 16; ++j) {
        const int lo = j < 8 ? (q[j] & 0xF) : (q[j - 8] >> 4);
        const int hi = (q[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = int8_t((lo | (hi << 4)) - 32);
    }
}

// IQ4_XS: 8 6-bit scales (stored + 32): low 4 bits in scales_l nibbles, high 2 bits in scales_h.
static inline int iq4_xs_scale(const uint8_t *scales_l, uint16_t scales_h, int j) {
    const int lo = (scales_l[j / 2] >> (4 * (j % 2))) & 0xF;
    const int hi = (scales_h >> (2 * j)) & 3;
    return (lo | (hi << 4)) - 32;
}

}  // namespace ktd
