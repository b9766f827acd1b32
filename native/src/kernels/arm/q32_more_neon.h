// NEON / dotprod kernels of the other 32-element block types with Q8_0 activations: Q5_0 and
// IQ4_NL (w = d·v, as Q4_0: the unpackers below plug into q32_neon.h's vec_dot_q8 / gemm_q8) and
// Q4_1, Q5_1 (w = d·q + m: the dot product also needs Σ a per block). Same inline/namespace rule
// as kernels/arm/q32_neon.h.
//
// Each block's integer sums are exact and the float expression per block is the reference's
// (kernels/ref/q4_1.cpp, q5_0.cpp, q5_1.cpp, iq4_nl.cpp), accumulated in block order, so these
// kernels equal the scalar reference bit for bit.
#pragma once
#include "kernels/arm/q32_neon.h"

namespace ktd::KTD_ARM_NS {

// Bit 4 of the 32 elements of a Q5 block (bit j of the little-endian uint32 qh) as 0x10 / 0 bytes,
// element j in lane j of h0 / j − 16 of h1.
inline void q5_high_bits(const uint8_t *qh, uint8x16_t &h0, uint8x16_t &h1) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    const uint8x16_t bytes = vreinterpretq_u8_u32(vdupq_n_u32(bits));
    static const uint8_t kIdx0[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
    static const uint8_t kIdx1[16] = {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    static const uint8_t kBit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t bit = vld1q_u8(kBit), sixteen = vdupq_n_u8(0x10);
    h0 = vandq_u8(vtstq_u8(vqtbl1q_u8(bytes, vld1q_u8(kIdx0)), bit), sixteen);
    h1 = vandq_u8(vtstq_u8(vqtbl1q_u8(bytes, vld1q_u8(kIdx1)), bit), sixteen);
}

// The unpackers: the 32 values of a block as int8 in activation order (low nibbles = elements
// 0..15, high nibbles = 16..31).
struct Q5_0Unpack {  // q − 16
    using Block = block_q5_0;
    static void load(const block_q5_0 &x, int8x16_t &w0, int8x16_t &w1) {
        uint8x16_t h0, h1;
        q5_high_bits(x.qh, h0, h1);
        const uint8x16_t q = vld1q_u8(x.qs);
        const int8x16_t off = vdupq_n_s8(16);
        w0 = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q, vdupq_n_u8(0x0F)), h0)), off);
        w1 = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(q, 4), h1)), off);
    }
};
struct IQ4_NLUnpack {  // kvalues_iq4nl[q]
    using Block = block_iq4_nl;
    static void load(const block_iq4_nl &x, int8x16_t &w0, int8x16_t &w1) {
        const int8x16_t table = vld1q_s8(kvalues_iq4nl);
        const uint8x16_t q = vld1q_u8(x.qs);
        w0 = vqtbl1q_s8(table, vandq_u8(q, vdupq_n_u8(0x0F)));
        w1 = vqtbl1q_s8(table, vshrq_n_u8(q, 4));
    }
};
struct Q4_1Unpack {  // q in 0..15
    using Block = block_q4_1;
    static void load(const block_q4_1 &x, int8x16_t &w0, int8x16_t &w1) {
        const uint8x16_t q = vld1q_u8(x.qs);
        w0 = vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F)));
        w1 = vreinterpretq_s8_u8(vshrq_n_u8(q, 4));
    }
};
struct Q5_1Unpack {  // q in 0..31
    using Block = block_q5_1;
    static void load(const block_q5_1 &x, int8x16_t &w0, int8x16_t &w1) {
        uint8x16_t h0, h1;
        q5_high_bits(x.qh, h0, h1);
        const uint8x16_t q = vld1q_u8(x.qs);
        w0 = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q, vdupq_n_u8(0x0F)), h0));
        w1 = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(q, 4), h1));
    }
};

// Q4_1 / Q5_1: Σ_j (d q_j + m)·da a_j = d·da·Σ q_j a_j + m·da·Σ a_j, the reference's expression.
template <class U>
inline float vec_dot_q8_min(int64_t k, const typename U::Block *w, const block_q8_0 *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK8_0; ++b) {
        int8x16_t w0, w1;
        U::load(w[b], w0, w1);
        const int8x16_t a0 = vld1q_s8(a[b].qs), a1 = vld1q_s8(a[b].qs + 16);
        const int32_t isum = vaddvq_s32(dot32(vdupq_n_s32(0), w0, w1, a0, a1));
        const int32_t asum = int32_t(vaddlvq_s8(a0)) + int32_t(vaddlvq_s8(a1));
        const float da = f16(a[b].d);
        sum += f16(w[b].d) * da * float(isum) + f16(w[b].m) * da * float(asum);
    }
    return sum;
}

template <class U>
void gemm_q8_min(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y, size_t ldy,
                 int nr, int nc) {
    for (int c = 0; c < nc; ++c) {
        const auto *a = reinterpret_cast<const block_q8_0 *>(static_cast<const char *>(xq) + size_t(c) * x_stride);
        for (int r = 0; r < nr; ++r)
            y[size_t(c) * ldy + size_t(r)] = vec_dot_q8_min<U>(
                k, reinterpret_cast<const typename U::Block *>(static_cast<const char *>(w) + size_t(r) * w_stride), a);
    }
}

// d·q + m for one block's 32 values (the reference's two roundings: the product, then the sum).
template <class U>
void dequantize_row_q8_min(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const typename U::Block *>(vx);
    for (int64_t b = 0; b < k / QK8_0; ++b, y += QK8_0) {
        int8x16_t w0, w1;
        U::load(x[b], w0, w1);
        store_scaled(y, f16(x[b].d), w0, w1);
        const float32x4_t m = vdupq_n_f32(f16(x[b].m));
        for (int i = 0; i < QK8_0; i += 4) vst1q_f32(y + i, vaddq_f32(vld1q_f32(y + i), m));
    }
}

}  // namespace ktd::KTD_ARM_NS
