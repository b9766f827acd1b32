// What the NEON and dotprod kernel files share for the 32-element block types with Q8_0
// activations (Q8_0, Q4_0): the fp16 conversion, the per-block integer dot products and the tile.
//
// Everything here is inline, so it lives in the namespace of the including file's ISA (ktd::neon,
// ktd::dotprod or ktd::i8mm, from the KTD_ISA_* macro CMake defines per ISA target): the same inline
// function compiled with different -march flags in two translation units must not be merged by
// the linker (a dotprod copy could otherwise run on a CPU without SDOT). For the same reason this
// header includes no header with inline code shared with baseline translation units.
//
// The integer sum of each block is exact and the float accumulation is the reference's (per
// block, in block order: sum += d_w · d_a · isum), so these kernels equal the scalar reference
// bit for bit.
#pragma once
#include <arm_neon.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/blocks.h"

// KTD_ARM_SDOT: the ISA has SDOT (dotprod, and i8mm, which CMake builds as armv8.2-a+dotprod+i8mm).
#if defined(KTD_ISA_I8MM)
#define KTD_ARM_NS i8mm
#define KTD_ARM_SDOT 1
#elif defined(KTD_ISA_DOTPROD)
#define KTD_ARM_NS dotprod
#define KTD_ARM_SDOT 1
#elif defined(KTD_ISA_NEON)
#define KTD_ARM_NS neon
#define KTD_ARM_SDOT 0
#else
#error "kernels/arm/ headers are only for the NEON, dotprod and i8mm kernel files"
#endif

namespace ktd::KTD_ARM_NS {

// IEEE half bits → float (exact; FCVT is part of Armv8-A).
inline float f16(uint16_t h) {
    __fp16 v;
    std::memcpy(&v, &h, sizeof v);
    return float(v);
}

// Σ w[i]·a[i] over 32 int8 pairs given as two halves each, in int32 lanes (sum the lanes for the
// total). Exact: |product| ≤ 2^14, so the int16 products and their pairwise int32 sums cannot
// overflow.
inline int32x4_t dot32(int32x4_t acc, int8x16_t w0, int8x16_t w1, int8x16_t a0, int8x16_t a1) {
#if KTD_ARM_SDOT
    return vdotq_s32(vdotq_s32(acc, w0, a0), w1, a1);
#else
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(w0), vget_low_s8(a0)));
    acc = vpadalq_s16(acc, vmull_high_s8(w0, a0));
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(w1), vget_low_s8(a1)));
    acc = vpadalq_s16(acc, vmull_high_s8(w1, a1));
    return acc;
#endif
}

// The 32 weights of a block as int8 in activation order (element j in lane j of w0 / j - 16 of w1).
struct Q8_0Unpack {
    using Block = block_q8_0;
    static void load(const block_q8_0 &x, int8x16_t &w0, int8x16_t &w1) {
        w0 = vld1q_s8(x.qs);
        w1 = vld1q_s8(x.qs + 16);
    }
};
struct Q4_0Unpack {
    using Block = block_q4_0;
    // q - 8: the low nibbles are elements 0..15, the high nibbles 16..31.
    static void load(const block_q4_0 &x, int8x16_t &w0, int8x16_t &w1) {
        const uint8x16_t q = vld1q_u8(x.qs);
        const int8x16_t eight = vdupq_n_s8(8);
        w0 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F))), eight);
        w1 = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), eight);
    }
};

template <class U>
inline float vec_dot_q8(int64_t k, const typename U::Block *w, const block_q8_0 *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK8_0; ++b) {
        int8x16_t w0, w1;
        U::load(w[b], w0, w1);
        const int32x4_t acc = dot32(vdupq_n_s32(0), w0, w1, vld1q_s8(a[b].qs), vld1q_s8(a[b].qs + 16));
        sum += f16(w[b].d) * f16(a[b].d) * float(vaddvq_s32(acc));
    }
    return sum;
}

// The tile (TypeKernels::gemm contract): y[c·ldy + r] = dot(W row r, activation row c).
template <class U>
void gemm_q8(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y, size_t ldy,
             int nr, int nc) {
    for (int c = 0; c < nc; ++c) {
        const auto *a = reinterpret_cast<const block_q8_0 *>(static_cast<const char *>(xq) + size_t(c) * x_stride);
        for (int r = 0; r < nr; ++r)
            y[size_t(c) * ldy + size_t(r)] = vec_dot_q8<U>(
                k, reinterpret_cast<const typename U::Block *>(static_cast<const char *>(w) + size_t(r) * w_stride), a);
    }
}

// d · q for one block's 32 int8 values (exact int → float, one rounding in the product, as the
// reference).
inline void store_scaled(float *y, float d, int8x16_t q0, int8x16_t q1) {
    const float32x4_t vd = vdupq_n_f32(d);
    const int8x16_t q[2] = {q0, q1};
    for (int h = 0; h < 2; ++h) {
        const int16x8_t lo = vmovl_s8(vget_low_s8(q[h])), hi = vmovl_high_s8(q[h]);
        vst1q_f32(y + 16 * h + 0, vmulq_f32(vd, vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)))));
        vst1q_f32(y + 16 * h + 4, vmulq_f32(vd, vcvtq_f32_s32(vmovl_high_s16(lo))));
        vst1q_f32(y + 16 * h + 8, vmulq_f32(vd, vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)))));
        vst1q_f32(y + 16 * h + 12, vmulq_f32(vd, vcvtq_f32_s32(vmovl_high_s16(hi))));
    }
}

template <class U>
void dequantize_row_q8(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const typename U::Block *>(vx);
    for (int64_t b = 0; b < k / QK8_0; ++b, y += QK8_0) {
        int8x16_t w0, w1;
        U::load(x[b], w0, w1);
        store_scaled(y, f16(x[b].d), w0, w1);
    }
}

}  // namespace ktd::KTD_ARM_NS
