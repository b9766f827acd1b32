// NEON / dotprod kernels of the other 256-element block types with Q8_K activations: Q2_K, Q3_K,
// Q5_K, IQ4_XS and the ternary TQ1_0, TQ2_0 (same inline/namespace rule as kernels/arm/q32_neon.h;
// the tile is k_neon.h's gemm_k).
//
// Every sub-block's integer sum is exact, the scale products are the reference's int32 sums and
// the float expression per super-block is the reference's, accumulated in block order, so these
// kernels equal the scalar reference (kernels/ref/q2_k.cpp, q3_k.cpp, q5_k.cpp, iq4_xs.cpp,
// tq1_0.cpp, tq2_0.cpp) bit for bit.
#pragma once
#include "kernels/arm/k_neon.h"

namespace ktd::KTD_ARM_NS {

// y[0..15] = dl·float(q) − ml (the reference's roundings: the product, then the difference;
// ml = 0 subtracts nothing, exactly).
inline void store16_scaled(float *y, float dl, float ml, int8x16_t q) {
    const float32x4_t vd = vdupq_n_f32(dl), vm = vdupq_n_f32(ml);
    const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
    const int32x4_t v[4] = {vmovl_s16(vget_low_s16(lo)), vmovl_high_s16(lo), vmovl_s16(vget_low_s16(hi)),
                            vmovl_high_s16(hi)};
    for (int i = 0; i < 4; ++i) vst1q_f32(y + 4 * i, vsubq_f32(vmulq_f32(vd, vcvtq_f32_s32(v[i])), vm));
}
// y[0..15] = dl·float(q) (one rounding).
inline void store16_mul(float *y, float dl, int8x16_t q) {
    const float32x4_t vd = vdupq_n_f32(dl);
    const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
    const int32x4_t v[4] = {vmovl_s16(vget_low_s16(lo)), vmovl_high_s16(lo), vmovl_s16(vget_low_s16(hi)),
                            vmovl_high_s16(hi)};
    for (int i = 0; i < 4; ++i) vst1q_f32(y + 4 * i, vmulq_f32(vd, vcvtq_f32_s32(v[i])));
}

// The 2-bit fields of Q2_K / Q3_K / TQ2_0: element 128t + 32s + l (l < 32) is bits 2s..2s+1 of
// qs[32t + l]; v0 = l < 16 (16-element group 8t + 2s), v1 = l ≥ 16 (group 8t + 2s + 1).
inline void two_bit_groups(const uint8_t *qs, int t, int s, uint8x16_t &v0, uint8x16_t &v1) {
    const int8x16_t sh = vdupq_n_s8(int8_t(-2 * s));  // right shift by 2s
    const uint8x16_t three = vdupq_n_u8(3);
    v0 = vandq_u8(vshlq_u8(vld1q_u8(qs + 32 * t), sh), three);
    v1 = vandq_u8(vshlq_u8(vld1q_u8(qs + 32 * t + 16), sh), three);
}

// ---- Q2_K: w = (d·(sc & 15))·q − dmin·(sc >> 4), q in 0..3, 16 groups of 16 -----------------
inline float vec_dot_q2_K(int64_t k, const block_q2_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sumq = 0, summ = 0;
        for (int t = 0; t < 2; ++t)
            for (int s = 0; s < 4; ++s) {
                uint8x16_t v0, v1;
                two_bit_groups(w[b].qs, t, s, v0, v1);
                const int g = 8 * t + 2 * s;
                const int8_t *ag = a[b].qs + 16 * g;
                sumq += (w[b].scales[g] & 0xF) * dot16(vreinterpretq_s8_u8(v0), vld1q_s8(ag)) +
                        (w[b].scales[g + 1] & 0xF) * dot16(vreinterpretq_s8_u8(v1), vld1q_s8(ag + 16));
            }
        for (int g = 0; g < 16; ++g) summ += (w[b].scales[g] >> 4) * a[b].bsums[g];
        sum += a[b].d * f16(w[b].d) * float(sumq) - a[b].d * f16(w[b].dmin) * float(summ);
    }
    return sum;
}

inline void dequantize_row_q2_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q2_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        const float d = f16(x[b].d), dmin = f16(x[b].dmin);
        for (int t = 0; t < 2; ++t)
            for (int s = 0; s < 4; ++s) {
                uint8x16_t v[2];
                two_bit_groups(x[b].qs, t, s, v[0], v[1]);
                for (int h = 0; h < 2; ++h) {
                    const int g = 8 * t + 2 * s + h;
                    store16_scaled(y + 16 * g, d * float(x[b].scales[g] & 0xF), dmin * float(x[b].scales[g] >> 4),
                                   vreinterpretq_s8_u8(v[h]));
                }
            }
    }
}

// ---- Q3_K: q = low 2 bits − (high bit clear ? 4 : 0); high bit of element 32u + l: bit u of
// hmask[l]; w = (d·sc[g])·q with 6-bit signed scales --------------------------------------------
inline void q3_K_groups(const block_q3_K &x, int t, int s, int8x16_t &v0, int8x16_t &v1) {
    uint8x16_t lo0, lo1;
    two_bit_groups(x.qs, t, s, lo0, lo1);
    const uint8x16_t bit = vdupq_n_u8(uint8_t(1u << (4 * t + s))), four = vdupq_n_u8(4);
    const uint8x16_t sub0 = vbicq_u8(four, vtstq_u8(vld1q_u8(x.hmask), bit));
    const uint8x16_t sub1 = vbicq_u8(four, vtstq_u8(vld1q_u8(x.hmask + 16), bit));
    v0 = vsubq_s8(vreinterpretq_s8_u8(lo0), vreinterpretq_s8_u8(sub0));
    v1 = vsubq_s8(vreinterpretq_s8_u8(lo1), vreinterpretq_s8_u8(sub1));
}

inline float vec_dot_q3_K(int64_t k, const block_q3_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int8_t sc[16];
        unpack_scales_q3_K(w[b].scales, sc);
        int32_t sumq = 0;
        for (int t = 0; t < 2; ++t)
            for (int s = 0; s < 4; ++s) {
                int8x16_t v0, v1;
                q3_K_groups(w[b], t, s, v0, v1);
                const int g = 8 * t + 2 * s;
                const int8_t *ag = a[b].qs + 16 * g;
                sumq += sc[g] * dot16(v0, vld1q_s8(ag)) + sc[g + 1] * dot16(v1, vld1q_s8(ag + 16));
            }
        sum += a[b].d * f16(w[b].d) * float(sumq);
    }
    return sum;
}

inline void dequantize_row_q3_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q3_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        const float d = f16(x[b].d);
        int8_t sc[16];
        unpack_scales_q3_K(x[b].scales, sc);
        for (int t = 0; t < 2; ++t)
            for (int s = 0; s < 4; ++s) {
                int8x16_t v[2];
                q3_K_groups(x[b], t, s, v[0], v[1]);
                for (int h = 0; h < 2; ++h) {
                    const int g = 8 * t + 2 * s + h;
                    store16_mul(y + 16 * g, d * float(sc[g]), v[h]);
                }
            }
    }
}

// ---- Q5_K: Q4_K plus bit 4 of element e = 64c + 32h + l at bit e/32 of qh[l] ----------------
// The 32 values of sub-block j = 2c + h (0..31 as int8).
inline void q5_K_sub(const block_q5_K &x, int j, int8x16_t &v0, int8x16_t &v1) {
    const int c = j / 2;
    const uint8x16_t q0 = vld1q_u8(x.qs + 32 * c), q1 = vld1q_u8(x.qs + 32 * c + 16);
    const uint8x16_t n0 = j % 2 ? vshrq_n_u8(q0, 4) : vandq_u8(q0, vdupq_n_u8(0x0F));
    const uint8x16_t n1 = j % 2 ? vshrq_n_u8(q1, 4) : vandq_u8(q1, vdupq_n_u8(0x0F));
    const uint8x16_t bit = vdupq_n_u8(uint8_t(1u << j)), sixteen = vdupq_n_u8(0x10);
    v0 = vreinterpretq_s8_u8(vorrq_u8(n0, vandq_u8(vtstq_u8(vld1q_u8(x.qh), bit), sixteen)));
    v1 = vreinterpretq_s8_u8(vorrq_u8(n1, vandq_u8(vtstq_u8(vld1q_u8(x.qh + 16), bit), sixteen)));
}

inline float vec_dot_q5_K(int64_t k, const block_q5_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(w[b].scales, sc, m);
        int32_t sumq = 0, summ = 0;
        for (int j = 0; j < 8; ++j) {
            int8x16_t v0, v1;
            q5_K_sub(w[b], j, v0, v1);
            const int8_t *aj = a[b].qs + 32 * j;
            sumq += sc[j] * vaddvq_s32(dot32(vdupq_n_s32(0), v0, v1, vld1q_s8(aj), vld1q_s8(aj + 16)));
            summ += m[j] * (a[b].bsums[2 * j] + a[b].bsums[2 * j + 1]);
        }
        sum += a[b].d * f16(w[b].d) * float(sumq) - a[b].d * f16(w[b].dmin) * float(summ);
    }
    return sum;
}

inline void dequantize_row_q5_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q5_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        const float d = f16(x[b].d), dmin = f16(x[b].dmin);
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(x[b].scales, sc, m);
        for (int j = 0; j < 8; ++j) {
            int8x16_t v0, v1;
            q5_K_sub(x[b], j, v0, v1);
            const float dl = d * float(sc[j]), ml = dmin * float(m[j]);
            store16_scaled(y + 32 * j, dl, ml, v0);
            store16_scaled(y + 32 * j + 16, dl, ml, v1);
        }
    }
}

// ---- IQ4_XS: element 32j + 16h + l is nibble h of qs[16j + l], a kvalues_iq4nl index; 6-bit
// signed scale per 32 --------------------------------------------------------------------------
inline void iq4_xs_sub(const block_iq4_xs &x, int j, int8x16_t &v0, int8x16_t &v1) {
    const int8x16_t table = vld1q_s8(kvalues_iq4nl);
    const uint8x16_t q = vld1q_u8(x.qs + 16 * j);
    v0 = vqtbl1q_s8(table, vandq_u8(q, vdupq_n_u8(0x0F)));
    v1 = vqtbl1q_s8(table, vshrq_n_u8(q, 4));
}

inline float vec_dot_iq4_xs(int64_t k, const block_iq4_xs *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sumq = 0;
        for (int j = 0; j < 8; ++j) {
            int8x16_t v0, v1;
            iq4_xs_sub(w[b], j, v0, v1);
            const int8_t *aj = a[b].qs + 32 * j;
            sumq += iq4_xs_scale(w[b].scales_l, w[b].scales_h, j) *
                    vaddvq_s32(dot32(vdupq_n_s32(0), v0, v1, vld1q_s8(aj), vld1q_s8(aj + 16)));
        }
        sum += a[b].d * f16(w[b].d) * float(sumq);
    }
    return sum;
}

inline void dequantize_row_iq4_xs(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_iq4_xs *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        const float d = f16(x[b].d);
        for (int j = 0; j < 8; ++j) {
            int8x16_t v0, v1;
            iq4_xs_sub(x[b], j, v0, v1);
            const float dl = d * float(iq4_xs_scale(x[b].scales_l, x[b].scales_h, j));
            store16_mul(y + 32 * j, dl, v0);
            store16_mul(y + 32 * j + 16, dl, v1);
        }
    }
}

// ---- Ternary: w = d·(q − 1), q in {0, 1, 2}; Σ (q − 1)·a = Σ q·a − Σ a (bsums) ----------------
inline float ternary_block(float d, const block_q8_K &a, int32_t s) {
    int32_t asum = 0;
    for (int g = 0; g < 16; ++g) asum += a.bsums[g];
    return a.d * d * float(s - asum);
}

// TQ2_0: the 2-bit fields of Q2_K.
inline float vec_dot_tq2_0(int64_t k, const block_tq2_0 *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32x4_t acc = vdupq_n_s32(0);
        for (int t = 0; t < 2; ++t)
            for (int s = 0; s < 4; ++s) {
                uint8x16_t v0, v1;
                two_bit_groups(w[b].qs, t, s, v0, v1);
                const int8_t *ag = a[b].qs + 16 * (8 * t + 2 * s);
                acc = dot32(acc, vreinterpretq_s8_u8(v0), vreinterpretq_s8_u8(v1), vld1q_s8(ag), vld1q_s8(ag + 16));
            }
        sum += ternary_block(f16(w[b].d), a[b], vaddvq_s32(acc));
    }
    return sum;
}

inline void dequantize_row_tq2_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_tq2_0 *>(vx);
    const int8x16_t one = vdupq_n_s8(1);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        const float d = f16(x[b].d);
        for (int t = 0; t < 2; ++t)
            for (int s = 0; s < 4; ++s) {
                uint8x16_t v0, v1;
                two_bit_groups(x[b].qs, t, s, v0, v1);
                const int g = 8 * t + 2 * s;
                store16_mul(y + 16 * g, d, vsubq_s8(vreinterpretq_s8_u8(v0), one));
                store16_mul(y + 16 * g + 16, d, vsubq_s8(vreinterpretq_s8_u8(v1), one));
            }
    }
}

// TQ1_0: trit i of a byte u is (u8(u·3^i)·3) >> 8. The 256 elements in 16 vectors of 16:
// e < 160: byte qs[e % 32], trit e / 32 (vectors 0..9); 160 ≤ e < 240: byte qs[32 + (e − 160) % 16],
// trit (e − 160) / 16 (vectors 10..14); e ≥ 240: byte qh[(e − 240) % 4], trit (e − 240) / 4 (15).
inline uint8x16_t top_trit(uint8x16_t u) {
    const uint8x8_t three = vdup_n_u8(3);
    return vcombine_u8(vshrn_n_u16(vmull_u8(vget_low_u8(u), three), 8), vshrn_n_u16(vmull_high_u8(u, vdupq_n_u8(3)), 8));
}
inline void tq1_0_values(const block_tq1_0 &x, uint8x16_t v[16]) {
    static const uint8_t kPow3[5] = {1, 3, 9, 27, 81};
    const uint8x16_t q0 = vld1q_u8(x.qs), q1 = vld1q_u8(x.qs + 16), q2 = vld1q_u8(x.qs + 32);
    for (int i = 0; i < 5; ++i) {
        const uint8x16_t p = vdupq_n_u8(kPow3[i]);
        v[2 * i] = top_trit(vmulq_u8(q0, p));
        v[2 * i + 1] = top_trit(vmulq_u8(q1, p));
        v[10 + i] = top_trit(vmulq_u8(q2, p));
    }
    uint32_t h;
    std::memcpy(&h, x.qh, 4);
    static const uint8_t kPowH[16] = {1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27};
    v[15] = top_trit(vmulq_u8(vreinterpretq_u8_u32(vdupq_n_u32(h)), vld1q_u8(kPowH)));
}

inline float vec_dot_tq1_0(int64_t k, const block_tq1_0 *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        uint8x16_t v[16];
        tq1_0_values(w[b], v);
        int32x4_t acc = vdupq_n_s32(0);
        for (int i = 0; i < 16; i += 2)
            acc = dot32(acc, vreinterpretq_s8_u8(v[i]), vreinterpretq_s8_u8(v[i + 1]), vld1q_s8(a[b].qs + 16 * i),
                        vld1q_s8(a[b].qs + 16 * i + 16));
        sum += ternary_block(f16(w[b].d), a[b], vaddvq_s32(acc));
    }
    return sum;
}

inline void dequantize_row_tq1_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_tq1_0 *>(vx);
    const int8x16_t one = vdupq_n_s8(1);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        uint8x16_t v[16];
        tq1_0_values(x[b], v);
        const float d = f16(x[b].d);
        for (int i = 0; i < 16; ++i) store16_mul(y + 16 * i, d, vsubq_s8(vreinterpretq_s8_u8(v[i]), one));
    }
}

}  // namespace ktd::KTD_ARM_NS
