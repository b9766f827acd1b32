// NEON / dotprod kernels of the i-quant types with Q8_K activations: IQ1_S, IQ1_M, IQ2_XXS,
// IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (layouts: kernels/ref/iq1.cpp, iq2.cpp, iq3.cpp; code books:
// kernels/iq_grids.h). Same inline/namespace rule as kernels/arm/q32_neon.h; the tile is
// k_neon.h's gemm_k, the float stores k_more_neon.h's.
//
// The grid points are gathered from the code books (a table lookup per group of 8 or 4), the
// signs applied as a conditional negation (x ^ m) − m with m = 0xFF where the sign bit is set, and
// the products summed exactly in int32 per scale group; the scale sums and the float expression
// per super-block are the reference's, so these kernels equal it bit for bit.
#pragma once
#include "kernels/arm/k_more_neon.h"
#include "kernels/iq_grids.h"

namespace ktd::KTD_ARM_NS {

// The 8 signs of a 7-bit sign code (the 8th is the parity), bit j set ⇔ element j negative. The
// same function as iq_grids.h's iq_signs_from7, kept here so no inline function is shared with
// baseline objects.
inline uint8_t signs_from7(uint32_t s7) {
    s7 &= 0x7F;
    return uint8_t(s7 | (uint32_t(__builtin_parity(s7)) << 7));
}

// Sign masks: 0xFF in lane j (of 8) where bit j of `bits` is set.
inline uint8x8_t sign_mask8(uint8_t bits) {
    static const uint8_t kBit[8] = {1, 2, 4, 8, 16, 32, 64, 128};
    return vtst_u8(vdup_n_u8(bits), vld1_u8(kBit));
}
// v where the mask is clear, −v where it is set (|v| ≤ 127).
inline int8x16_t apply_signs(uint8x16_t v, uint8x16_t mask) {
    return vreinterpretq_s8_u8(vsubq_u8(veorq_u8(v, mask), mask));
}
// Two groups of 8 of an 8-dimensional grid, signed: lanes 0..7 = point p0 with signs s0, 8..15 = p1 with s1.
inline int8x16_t grid8_pair(uint64_t p0, uint64_t p1, uint8_t s0, uint8_t s1) {
    const uint8x16_t v = vcombine_u8(vcreate_u8(p0), vcreate_u8(p1));
    return apply_signs(v, vcombine_u8(sign_mask8(s0), sign_mask8(s1)));
}

// ---- IQ2_XXS / IQ2_XS / IQ2_S: w = (d·(0.5 + ls)·0.25)·grid·sign, groups of 8 -------------------
// Each decoder gives groups 2h, 2h + 1 (16 elements from 16h) signed, and the 4-bit scale of
// group g.
struct IQ2_XXS {
    using Block = block_iq2_xxs;
    static int8x16_t pair(const Block &x, int h) {
        const int ib = h / 2, l = 2 * (h % 2);
        const uint32_t a0 = uint32_t(x.qs[4 * ib]) | uint32_t(x.qs[4 * ib + 1]) << 16;
        const uint32_t a1 = uint32_t(x.qs[4 * ib + 2]) | uint32_t(x.qs[4 * ib + 3]) << 16;
        return grid8_pair(iq2xxs_grid[(a0 >> (8 * l)) & 0xFF], iq2xxs_grid[(a0 >> (8 * l + 8)) & 0xFF],
                          signs_from7(a1 >> (7 * l)), signs_from7(a1 >> (7 * l + 7)));
    }
    static int ls(const Block &x, int g) { return int((uint32_t(x.qs[4 * (g / 4) + 3]) << 16) >> 28); }
};
struct IQ2_XS {
    using Block = block_iq2_xs;
    static int8x16_t pair(const Block &x, int h) {
        const uint16_t q0 = x.qs[2 * h], q1 = x.qs[2 * h + 1];
        return grid8_pair(iq2xs_grid[q0 & 511], iq2xs_grid[q1 & 511], signs_from7(q0 >> 9), signs_from7(q1 >> 9));
    }
    static int ls(const Block &x, int g) { return (x.scales[g / 4] >> (4 * ((g / 2) % 2))) & 0xF; }
};
struct IQ2_S {
    using Block = block_iq2_s;
    static int8x16_t pair(const Block &x, int h) {
        const int g0 = 2 * h, g1 = 2 * h + 1;
        const int i0 = x.qs[g0] | ((x.qh[g0 / 4] >> (2 * (g0 % 4))) & 3) << 8;
        const int i1 = x.qs[g1] | ((x.qh[g1 / 4] >> (2 * (g1 % 4))) & 3) << 8;
        return grid8_pair(iq2s_grid[i0], iq2s_grid[i1], x.qs[32 + g0], x.qs[32 + g1]);
    }
    static int ls(const Block &x, int g) { return (x.scales[g / 4] >> (4 * ((g / 2) % 2))) & 0xF; }
};

template <class D>
inline float vec_dot_iq2(int64_t k, const typename D::Block *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sumi = 0;
        for (int h = 0; h < 16; ++h) {
            const int8x16_t v = D::pair(w[b], h);
            const int8x16_t q = vld1q_s8(a[b].qs + 16 * h);
            // Groups 2h and 2h + 1 share their scale (per 16 in IQ2_XS / IQ2_S, per 32 in
            // IQ2_XXS), so one exact 16-lane sum per pair.
            sumi += (2 * D::ls(w[b], 2 * h) + 1) * dot16(v, q);
        }
        sum += f16(w[b].d) * a[b].d * float(sumi) * 0.125f;
    }
    return sum;
}

template <class D>
inline void dequantize_row_iq2(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const typename D::Block *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        const float d = f16(x[b].d);
        for (int h = 0; h < 16; ++h) {
            const float db = d * (0.5f + float(D::ls(x[b], 2 * h))) * 0.25f;
            store16_mul(y + 16 * h, db, D::pair(x[b], h));
        }
    }
}

// ---- IQ3_XXS / IQ3_S: groups of 4, scale per 32 -------------------------------------------------
// 16 elements from 32ib + 16h of sub-block ib, signed.
inline int8x16_t grid4_quad(const uint32_t *grid, int i0, int i1, int i2, int i3, uint8_t s0, uint8_t s1) {
    const uint32_t pts[4] = {grid[i0], grid[i1], grid[i2], grid[i3]};
    return apply_signs(vreinterpretq_u8_u32(vld1q_u32(pts)), vcombine_u8(sign_mask8(s0), sign_mask8(s1)));
}
inline uint32_t le32(const uint8_t *p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}
struct IQ3_XXS {
    using Block = block_iq3_xxs;
    static int8x16_t half(const Block &x, int ib, int h) {
        const uint32_t a = le32(x.qs + 64 + 4 * ib);
        const uint8_t *q = x.qs + 8 * ib + 4 * h;
        return grid4_quad(iq3xxs_grid, q[0], q[1], q[2], q[3], signs_from7(a >> (14 * h)),
                          signs_from7(a >> (14 * h + 7)));
    }
    static int ls(const Block &x, int ib) { return int(le32(x.qs + 64 + 4 * ib) >> 28); }
};
struct IQ3_S {
    using Block = block_iq3_s;
    static int8x16_t half(const Block &x, int ib, int h) {
        int idx[4];
        for (int i = 0; i < 4; ++i) {
            const int q = 8 * ib + 4 * h + i;
            idx[i] = x.qs[q] | ((x.qh[q / 8] >> (q % 8)) & 1) << 8;
        }
        const uint8_t *s = x.signs + 4 * ib + 2 * h;
        return grid4_quad(iq3s_grid, idx[0], idx[1], idx[2], idx[3], s[0], s[1]);
    }
    static int ls(const Block &x, int ib) { return (x.scales[ib / 2] >> (4 * (ib % 2))) & 0xF; }
};

template <class D>
inline int32_t iq3_block_sum(const typename D::Block &w, const block_q8_K &a) {
    int32_t sumi = 0;
    for (int ib = 0; ib < 8; ++ib) {
        const int8_t *q = a.qs + 32 * ib;
        const int32_t t = vaddvq_s32(dot32(vdupq_n_s32(0), D::half(w, ib, 0), D::half(w, ib, 1), vld1q_s8(q),
                                           vld1q_s8(q + 16)));
        sumi += (2 * D::ls(w, ib) + 1) * t;
    }
    return sumi;
}

inline float vec_dot_iq3_xxs(int64_t k, const block_iq3_xxs *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b)
        sum += f16(w[b].d) * a[b].d * float(iq3_block_sum<IQ3_XXS>(w[b], a[b])) * 0.25f;
    return sum;
}
inline float vec_dot_iq3_s(int64_t k, const block_iq3_s *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) sum += f16(w[b].d) * a[b].d * float(iq3_block_sum<IQ3_S>(w[b], a[b]));
    return sum;
}

inline void dequantize_row_iq3_xxs(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_iq3_xxs *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        const float d = f16(x[b].d);
        for (int ib = 0; ib < 8; ++ib) {
            const float db = d * (0.5f + float(IQ3_XXS::ls(x[b], ib))) * 0.5f;
            for (int h = 0; h < 2; ++h) store16_mul(y + 32 * ib + 16 * h, db, IQ3_XXS::half(x[b], ib, h));
        }
    }
}
inline void dequantize_row_iq3_s(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_iq3_s *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        const float d = f16(x[b].d);
        for (int ib = 0; ib < 8; ++ib) {
            const float db = d * float(1 + 2 * IQ3_S::ls(x[b], ib));
            for (int h = 0; h < 2; ++h) store16_mul(y + 32 * ib + 16 * h, db, IQ3_S::half(x[b], ib, h));
        }
    }
}

// ---- IQ1_S / IQ1_M: w = dl·(grid + δ), grid in {−1, 0, 1}, δ = ±1/8, dl = d·(2s + 1) ------------
// Group g of 8: its 11-bit grid index, the sign of δ (+1 / −1) and its 3-bit scale.
struct IQ1_S {
    using Block = block_iq1_s;
    static int idx(const Block &x, int g) { return x.qs[g] | ((x.qh[g / 4] >> (3 * (g % 4))) & 7) << 8; }
    static int delta_sign(const Block &x, int g) { return (x.qh[g / 4] & 0x8000) ? -1 : 1; }
    static int s(const Block &x, int g) { return (x.qh[g / 4] >> 12) & 7; }
    static float d(const Block &x) { return f16(x.d); }
};
struct IQ1_M {
    using Block = block_iq1_m;
    static int nib(const Block &x, int g) { return (x.qh[g / 2] >> (4 * (g % 2))) & 0xF; }
    static uint16_t sc(const Block &x, int i) { return uint16_t(x.scales[2 * i] | x.scales[2 * i + 1] << 8); }
    static int idx(const Block &x, int g) { return x.qs[g] | (nib(x, g) & 7) << 8; }
    static int delta_sign(const Block &x, int g) { return (nib(x, g) & 8) ? -1 : 1; }
    static int s(const Block &x, int g) {
        const int h = g / 2;
        return (sc(x, h / 4) >> (3 * (h % 4))) & 7;
    }
    static float d(const Block &x) {
        return f16(uint16_t((sc(x, 0) >> 12) | ((sc(x, 1) >> 8) & 0x00F0) | ((sc(x, 2) >> 4) & 0x0F00) |
                            (sc(x, 3) & 0xF000)));
    }
};

template <class D>
inline float vec_dot_iq1(int64_t k, const typename D::Block *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sum_grid = 0, sum_delta = 0;
        for (int g = 0; g < 32; g += 2) {
            const int8x16_t v = vreinterpretq_s8_u64(
                vcombine_u64(vcreate_u64(iq1s_grid[D::idx(w[b], g)]), vcreate_u64(iq1s_grid[D::idx(w[b], g + 1)])));
            const int8x16_t q = vld1q_s8(a[b].qs + 8 * g);
            // Per group of 8: Σ grid·q8 and Σ q8 (the halves of the 16 lanes).
            const int16x8_t prod = vpaddq_s16(vmull_s8(vget_low_s8(v), vget_low_s8(q)), vmull_high_s8(v, q));
            const int32_t s0 = vaddlv_s16(vget_low_s16(prod)), s1 = vaddlv_s16(vget_high_s16(prod));
            const int32_t q0 = vaddlv_s8(vget_low_s8(q)), q1 = vaddlv_s8(vget_high_s8(q));
            const int l0 = 2 * D::s(w[b], g) + 1, l1 = 2 * D::s(w[b], g + 1) + 1;
            sum_grid += l0 * s0 + l1 * s1;
            sum_delta += l0 * D::delta_sign(w[b], g) * q0 + l1 * D::delta_sign(w[b], g + 1) * q1;
        }
        sum += D::d(w[b]) * a[b].d * (float(sum_grid) + kIQ1Delta * float(sum_delta));
    }
    return sum;
}

template <class D>
inline void dequantize_row_iq1(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const typename D::Block *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b, y += QK_K) {
        const float d = D::d(x[b]);
        for (int g = 0; g < 32; ++g) {
            const float dl = d * float(2 * D::s(x[b], g) + 1);
            const float32x4_t vd = vdupq_n_f32(dl), delta = vdupq_n_f32(float(D::delta_sign(x[b], g)) * kIQ1Delta);
            const int16x8_t v = vmovl_s8(vreinterpret_s8_u64(vcreate_u64(iq1s_grid[D::idx(x[b], g)])));
            vst1q_f32(y + 8 * g, vmulq_f32(vd, vaddq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(v))), delta)));
            vst1q_f32(y + 8 * g + 4, vmulq_f32(vd, vaddq_f32(vcvtq_f32_s32(vmovl_high_s16(v)), delta)));
        }
    }
}

}  // namespace ktd::KTD_ARM_NS
