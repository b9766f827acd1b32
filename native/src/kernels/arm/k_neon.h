// What the NEON and dotprod kernel files share for Q4_K and Q6_K weights with Q8_K activations
// (same inline/namespace rule as kernels/arm/q32_neon.h, which this includes).
//
// Each sub-block's integer sum is exact, the scale products are the reference's int32 sums and
// the float expression per super-block is the reference's, so these kernels equal the scalar
// reference (kernels/ref/q4_k.cpp, q6_k.cpp) bit for bit.
#pragma once
#include "kernels/arm/q32_neon.h"
#include "kernels/k_scales.h"

namespace ktd::KTD_ARM_NS {

// Σ of the 16 int8 products w·a (exact).
inline int32_t dot16(int8x16_t w, int8x16_t a) {
#if KTD_ARM_SDOT
    return vaddvq_s32(vdotq_s32(vdupq_n_s32(0), w, a));
#else
    const int32x4_t s = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(a)));
    return vaddvq_s32(vpadalq_s16(s, vmull_high_s8(w, a)));
#endif
}

// Q4_K: element e = 64c + 32h + l is nibble h of qs[32c + l], sub-block j = 2c + h.
inline float vec_dot_q4_K(int64_t k, const block_q4_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    const uint8x16_t low4 = vdupq_n_u8(0x0F);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(w[b].scales, sc, m);
        int32_t sumq = 0, summ = 0;
        for (int c = 0; c < 4; ++c) {
            const uint8x16_t q0 = vld1q_u8(w[b].qs + 32 * c), q1 = vld1q_u8(w[b].qs + 32 * c + 16);
            const int8_t *ac = a[b].qs + 64 * c;
            const int32x4_t lo = dot32(vdupq_n_s32(0), vreinterpretq_s8_u8(vandq_u8(q0, low4)),
                                       vreinterpretq_s8_u8(vandq_u8(q1, low4)), vld1q_s8(ac), vld1q_s8(ac + 16));
            const int32x4_t hi = dot32(vdupq_n_s32(0), vreinterpretq_s8_u8(vshrq_n_u8(q0, 4)),
                                       vreinterpretq_s8_u8(vshrq_n_u8(q1, 4)), vld1q_s8(ac + 32), vld1q_s8(ac + 48));
            sumq += sc[2 * c] * vaddvq_s32(lo) + sc[2 * c + 1] * vaddvq_s32(hi);
        }
        for (int j = 0; j < 8; ++j) summ += m[j] * (a[b].bsums[2 * j] + a[b].bsums[2 * j + 1]);
        sum += a[b].d * f16(w[b].d) * float(sumq) - a[b].d * f16(w[b].dmin) * float(summ);
    }
    return sum;
}

inline void dequantize_row_q4_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q4_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        const float d = f16(x[b].d), dmin = f16(x[b].dmin);
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(x[b].scales, sc, m);
        for (int j = 0; j < 8; ++j) {
            const float dl = d * float(sc[j]), ml = dmin * float(m[j]);
            const uint8_t *q = x[b].qs + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int l = 0; l < 32; ++l) y[32 * j + l] = dl * float((q[l] >> shift) & 0xF) - ml;
        }
    }
}

// Q6_K: in half t (128 elements), quarter s (32 elements, l < 32) has its low 4 bits in nibble
// s/2 of ql[64t + 32(s%2) + l] and its high 2 bits at bit 2s of qh[32t + l]; q − 32 is int8.
inline void q6_K_quarter(const block_q6_K &x, int t, int s, int8x16_t &v0, int8x16_t &v1) {
    const uint8_t *ql = x.ql + 64 * t + 32 * (s % 2), *qh = x.qh + 32 * t;
    const uint8x16_t l0 = vld1q_u8(ql), l1 = vld1q_u8(ql + 16);
    const uint8x16_t h0 = vld1q_u8(qh), h1 = vld1q_u8(qh + 16);
    const uint8x16_t low4 = vdupq_n_u8(0x0F), three = vdupq_n_u8(3);
    const uint8x16_t n0 = s / 2 ? vshrq_n_u8(l0, 4) : vandq_u8(l0, low4);
    const uint8x16_t n1 = s / 2 ? vshrq_n_u8(l1, 4) : vandq_u8(l1, low4);
    const int8x16_t sh = vdupq_n_s8(int8_t(-2 * s));  // right shift by 2s
    const uint8x16_t b0 = vandq_u8(vshlq_u8(h0, sh), three), b1 = vandq_u8(vshlq_u8(h1, sh), three);
    const int8x16_t off = vdupq_n_s8(32);
    v0 = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(n0, vshlq_n_u8(b0, 4))), off);
    v1 = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(n1, vshlq_n_u8(b1, 4))), off);
}

inline float vec_dot_q6_K(int64_t k, const block_q6_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sumq = 0;
        for (int t = 0; t < 2; ++t)
            for (int s = 0; s < 4; ++s) {
                int8x16_t v0, v1;
                q6_K_quarter(w[b], t, s, v0, v1);
                const int g = 8 * t + 2 * s;  // 16-element group of v0 (v1: g + 1)
                const int8_t *ag = a[b].qs + 16 * g;
                sumq += w[b].scales[g] * dot16(v0, vld1q_s8(ag)) + w[b].scales[g + 1] * dot16(v1, vld1q_s8(ag + 16));
            }
        sum += a[b].d * f16(w[b].d) * float(sumq);
    }
    return sum;
}

inline void dequantize_row_q6_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q6_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        const float d = f16(x[b].d);
        for (int t = 0; t < 2; ++t)
            for (int s = 0; s < 4; ++s) {
                int8x16_t v[2];
                q6_K_quarter(x[b], t, s, v[0], v[1]);
                for (int h = 0; h < 2; ++h) {
                    const int g = 8 * t + 2 * s + h;
                    const float dl = d * float(x[b].scales[g]);
                    int8_t q[16];
                    vst1q_s8(q, v[h]);
                    for (int l = 0; l < 16; ++l) y[16 * g + l] = dl * float(q[l]);
                }
            }
    }
}

template <typename WBlock, float (*Dot)(int64_t, const WBlock *, const block_q8_K *)>
void gemm_k(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y, size_t ldy,
            int nr, int nc) {
    for (int c = 0; c < nc; ++c) {
        const auto *a = reinterpret_cast<const block_q8_K *>(static_cast<const char *>(xq) + size_t(c) * x_stride);
        for (int r = 0; r < nr; ++r)
            y[size_t(c) * ldy + size_t(r)] =
                Dot(k, reinterpret_cast<const WBlock *>(static_cast<const char *>(w) + size_t(r) * w_stride), a);
    }
}

}  // namespace ktd::KTD_ARM_NS
