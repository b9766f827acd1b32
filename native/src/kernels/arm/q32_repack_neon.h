// The tiles of the NEON, dotprod and i8mm kernel files on the arm x4 layouts of the 32-element
// types, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL (kernels/repacked_q32.h: 4 rows, 8-byte
// interleave; same inline/namespace rule as kernels/arm/q32_neon.h, which this includes).
//
//   one activation row (decode, and the odd last token of a batch): per group block, the four
//     rows' exact integer sums by SDOT (dotprod, i8mm) or SMULL + SADALP (NEON);
//   pairs of activation rows (i8mm only): SMMLA multiplies a register holding 8 elements of rows
//     2p, 2p + 1 by one holding the same 8 elements of tokens c, c + 1, accumulating the 2x2
//     block of exact integer sums [row 2p·c, row 2p·c+1, row 2p+1·c, row 2p+1·c+1].
//
// Each block's integer sum is exact, then every (row, token) lane does the reference's float
// operations in its order per block in block order (vector multiplies and adds, no fused
// multiply-add):
//   sum += (d_w · d_a) · float(isum)                                  Q8_0, Q4_0, Q5_0, IQ4_NL
//   sum += (d_w · d_a) · float(isum) + (m_w · d_a) · float(Σ a)       Q4_1, Q5_1 (L::kMin)
// so every tile equals the scalar reference (kernels/ref/<type>.cpp) bit for bit.
#pragma once
#include "kernels/arm/q32_neon.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_q32.h"

namespace ktd::KTD_ARM_NS {

// Per layout: load(g, w) puts the 32 int8 weight values v of the group block's 4 rows (w = d·v,
// or d·v + m where kMin) into w[c][p] (c < 4: elements 8c..8c+7; p < 2: rows 2p in the low half,
// 2p + 1 in the high half).
struct Q8_0x4Layout {
    using Group = block_q8_0x4;
    static constexpr bool kMin = false;
    static void load(const Group &g, int8x16_t w[4][2]) {
        for (int c = 0; c < 4; ++c) {
            w[c][0] = vld1q_s8(g.qs + 32 * c);
            w[c][1] = vld1q_s8(g.qs + 32 * c + 16);
        }
    }
};

// The 4-bit qs layout as q (0..15) in w[c][p]: byte 32h + 8r + t holds element 8h + t (chunk h) in
// its low nibble and 16 + 8h + t (chunk 2 + h) in its high one.
inline void load_nibbles_x4(const uint8_t *qs, uint8x16_t q[4][2]) {
    const uint8x16_t low4 = vdupq_n_u8(0x0F);
    for (int h = 0; h < 2; ++h)
        for (int p = 0; p < 2; ++p) {
            const uint8x16_t b = vld1q_u8(qs + 32 * h + 16 * p);
            q[h][p] = vandq_u8(b, low4);
            q[2 + h][p] = vshrq_n_u8(b, 4);
        }
}
// Adds the qh layout's fifth bits: register [c][p] gets 0x10 where bit 2c + p of its lane's byte is set.
inline void add_bit4_x4(const uint8_t *qh, uint8x16_t q[4][2]) {
    const uint8x16_t h = vld1q_u8(qh), sixteen = vdupq_n_u8(0x10);
    for (int c = 0; c < 4; ++c)
        for (int p = 0; p < 2; ++p)
            q[c][p] = vorrq_u8(q[c][p], vandq_u8(vtstq_u8(h, vdupq_n_u8(uint8_t(1u << (2 * c + p)))), sixteen));
}
// w = q − off (q − off fits int8: off 8 for 4-bit q, 16 for 5-bit, 0 for Q4_1 / Q5_1's 0..31).
inline void to_s8(const uint8x16_t q[4][2], uint8_t off, int8x16_t w[4][2]) {
    const uint8x16_t o = vdupq_n_u8(off);
    for (int c = 0; c < 4; ++c)
        for (int p = 0; p < 2; ++p) w[c][p] = vreinterpretq_s8_u8(vsubq_u8(q[c][p], o));
}

struct Q4_0x4Layout {  // q − 8
    using Group = block_q4_0x4;
    static constexpr bool kMin = false;
    static void load(const Group &g, int8x16_t w[4][2]) {
        uint8x16_t q[4][2];
        load_nibbles_x4(g.qs, q);
        to_s8(q, 8, w);
    }
};
struct Q4_1x4Layout {  // q in 0..15
    using Group = block_q4_1x4;
    static constexpr bool kMin = true;
    static void load(const Group &g, int8x16_t w[4][2]) {
        uint8x16_t q[4][2];
        load_nibbles_x4(g.qs, q);
        to_s8(q, 0, w);
    }
};
struct Q5_0x4Layout {  // q − 16
    using Group = block_q5_0x4;
    static constexpr bool kMin = false;
    static void load(const Group &g, int8x16_t w[4][2]) {
        uint8x16_t q[4][2];
        load_nibbles_x4(g.qs, q);
        add_bit4_x4(g.qh, q);
        to_s8(q, 16, w);
    }
};
struct Q5_1x4Layout {  // q in 0..31
    using Group = block_q5_1x4;
    static constexpr bool kMin = true;
    static void load(const Group &g, int8x16_t w[4][2]) {
        uint8x16_t q[4][2];
        load_nibbles_x4(g.qs, q);
        add_bit4_x4(g.qh, q);
        to_s8(q, 0, w);
    }
};
struct IQ4_NLx4Layout {  // kvalues_iq4nl[q]
    using Group = block_iq4_nlx4;
    static constexpr bool kMin = false;
    static void load(const Group &g, int8x16_t w[4][2]) {
        const int8x16_t table = vld1q_s8(kvalues_iq4nl);
        uint8x16_t q[4][2];
        load_nibbles_x4(g.qs, q);
        for (int c = 0; c < 4; ++c)
            for (int p = 0; p < 2; ++p) w[c][p] = vqtbl1q_s8(table, q[c][p]);
    }
};

// The 4 rows' fp16 scales as floats (exact).
inline float32x4_t row_scales_x4(const uint16_t *d) {
    float32x4_t v;
    float tmp[4];
    for (int r = 0; r < 4; ++r) tmp[r] = f16(d[r]);
    v = vld1q_f32(tmp);
    return v;
}

// [Σ row r · a over the block] for r = 0..3, exact.
inline int32x4_t isums_x4(const int8x16_t w[4][2], const int8_t *a) {
#if KTD_ARM_SDOT
    int32x4_t acc0 = vdupq_n_s32(0), acc1 = vdupq_n_s32(0);
    for (int c = 0; c < 4; ++c) {
        const int8x8_t a8 = vld1_s8(a + 8 * c);
        const int8x16_t av = vcombine_s8(a8, a8);
        acc0 = vdotq_s32(acc0, w[c][0], av);
        acc1 = vdotq_s32(acc1, w[c][1], av);
    }
    return vpaddq_s32(acc0, acc1);  // lanes 0-1 of acc0 are row 0, 2-3 row 1; likewise acc1
#else
    int32x4_t acc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int c = 0; c < 4; ++c) {
        const int8x8_t a8 = vld1_s8(a + 8 * c);
        for (int p = 0; p < 2; ++p) {
            acc[2 * p] = vpadalq_s16(acc[2 * p], vmull_s8(vget_low_s8(w[c][p]), a8));
            acc[2 * p + 1] = vpadalq_s16(acc[2 * p + 1], vmull_s8(vget_high_s8(w[c][p]), a8));
        }
    }
    return vpaddq_s32(vpaddq_s32(acc[0], acc[1]), vpaddq_s32(acc[2], acc[3]));
#endif
}

// Σ a over one activation block (exact).
inline int32_t block_asum(const int8_t *a) {
    return int32_t(vaddlvq_s8(vld1q_s8(a))) + int32_t(vaddlvq_s8(vld1q_s8(a + 16)));
}

inline const block_q8_0 *act_row(const void *xq, size_t x_stride, int c) {
    return reinterpret_cast<const block_q8_0 *>(static_cast<const char *>(xq) + size_t(c) * x_stride);
}

// Stores lanes r < nr of v to y[r·step].
inline void store_rows(float *y, size_t step, float32x4_t v, int nr) {
    float tmp[4];
    vst1q_f32(tmp, v);
    for (int r = 0; r < nr && r < 4; ++r) y[size_t(r) * step] = tmp[r];
}

// One group (4 rows) · one activation row: the 4 dot products.
template <class L>
inline float32x4_t group_dot_x4(int64_t nb, const typename L::Group *wg, const block_q8_0 *a) {
    float32x4_t sum = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; ++b) {
        int8x16_t w[4][2];
        L::load(wg[b], w);
        const int32x4_t isum = isums_x4(w, a[b].qs);
        const float da = f16(a[b].d);
        const float32x4_t dot = vmulq_f32(vmulq_n_f32(row_scales_x4(wg[b].d), da), vcvtq_f32_s32(isum));
        if constexpr (L::kMin) {
            const float32x4_t mins = vmulq_n_f32(vmulq_n_f32(row_scales_x4(wg[b].m), da), float(block_asum(a[b].qs)));
            sum = vaddq_f32(sum, vaddq_f32(dot, mins));
        } else {
            sum = vaddq_f32(sum, dot);
        }
    }
    return sum;
}

#if defined(KTD_ISA_I8MM)
// One group (4 rows) · activation rows c0, c0 + 1: y for rows 0-1 in s01 = [r0c0, r0c1, r1c0,
// r1c1] and rows 2-3 in s23 likewise.
template <class L>
inline void group_dot_x4_pair(int64_t nb, const typename L::Group *wg, const block_q8_0 *a0, const block_q8_0 *a1,
                              float32x4_t &s01, float32x4_t &s23) {
    s01 = vdupq_n_f32(0.0f);
    s23 = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; ++b) {
        int8x16_t w[4][2];
        L::load(wg[b], w);
        int32x4_t p01 = vdupq_n_s32(0), p23 = vdupq_n_s32(0);
        for (int c = 0; c < 4; ++c) {
            const int8x16_t av = vcombine_s8(vld1_s8(a0[b].qs + 8 * c), vld1_s8(a1[b].qs + 8 * c));
            p01 = vmmlaq_s32(p01, w[c][0], av);
            p23 = vmmlaq_s32(p23, w[c][1], av);
        }
        const float32x4_t dw = row_scales_x4(wg[b].d);
        const float da_[4] = {f16(a0[b].d), f16(a1[b].d), f16(a0[b].d), f16(a1[b].d)};
        const float32x4_t da = vld1q_f32(da_);
        // Lane (row, token): d_w[row] · d_a[token], the reference's product.
        const float32x4_t sc01 = vmulq_f32(vzip1q_f32(dw, dw), da), sc23 = vmulq_f32(vzip2q_f32(dw, dw), da);
        float32x4_t d01 = vmulq_f32(sc01, vcvtq_f32_s32(p01)), d23 = vmulq_f32(sc23, vcvtq_f32_s32(p23));
        if constexpr (L::kMin) {
            // + (m_w[row] · d_a[token]) · Σ a[token]
            const float32x4_t mw = row_scales_x4(wg[b].m);
            const float as0 = float(block_asum(a0[b].qs)), as1 = float(block_asum(a1[b].qs));
            const float as_[4] = {as0, as1, as0, as1};
            const float32x4_t as = vld1q_f32(as_);
            d01 = vaddq_f32(d01, vmulq_f32(vmulq_f32(vzip1q_f32(mw, mw), da), as));
            d23 = vaddq_f32(d23, vmulq_f32(vmulq_f32(vzip2q_f32(mw, mw), da), as));
        }
        s01 = vaddq_f32(s01, d01);
        s23 = vaddq_f32(s23, d23);
    }
}
#endif

// The tile on the layout (TypeKernels::gemm_repacked contract). i8mm: tokens in pairs by SMMLA,
// an odd last one by SDOT; dotprod / NEON: one token at a time.
template <class L>
void gemm_repacked_x4(int64_t k, const void *wp, size_t group_stride, const void *xq, size_t x_stride, float *y,
                      size_t ldy, int nr, int nc) {
    const int64_t nb = k / QK8_0;
    const int groups = (nr + 3) / 4;
    for (int g = 0; g < groups; ++g) {
        const auto *wg = reinterpret_cast<const typename L::Group *>(static_cast<const char *>(wp) + size_t(g) * group_stride);
        const int rows = nr - 4 * g;
        float *yg = y + size_t(4 * g);
        int c = 0;
#if defined(KTD_ISA_I8MM)
        for (; c + 1 < nc; c += 2) {
            float32x4_t s01, s23;
            group_dot_x4_pair<L>(nb, wg, act_row(xq, x_stride, c), act_row(xq, x_stride, c + 1), s01, s23);
            float t[8];
            vst1q_f32(t, s01);
            vst1q_f32(t + 4, s23);
            for (int r = 0; r < rows && r < 4; ++r) {
                // t[4(r/2) + 2(r%2) + token]
                const int base = 4 * (r / 2) + 2 * (r % 2);
                yg[size_t(c) * ldy + size_t(r)] = t[base];
                yg[size_t(c + 1) * ldy + size_t(r)] = t[base + 1];
            }
        }
#endif
        for (; c < nc; ++c) store_rows(yg + size_t(c) * ldy, 1, group_dot_x4<L>(nb, wg, act_row(xq, x_stride, c)), rows);
    }
}

// `tk` (an entry of a 32-element type) with the arm x4 layout and this ISA's tile on it; other
// types as they are.
inline TypeKernels with_arm_x4_layout(TypeKernels tk) {
    switch (tk.type) {
        case GGMLType::Q8_0: tk.gemm_repacked = gemm_repacked_x4<Q8_0x4Layout>; break;
        case GGMLType::Q4_0: tk.gemm_repacked = gemm_repacked_x4<Q4_0x4Layout>; break;
        case GGMLType::Q4_1: tk.gemm_repacked = gemm_repacked_x4<Q4_1x4Layout>; break;
        case GGMLType::Q5_0: tk.gemm_repacked = gemm_repacked_x4<Q5_0x4Layout>; break;
        case GGMLType::Q5_1: tk.gemm_repacked = gemm_repacked_x4<Q5_1x4Layout>; break;
        case GGMLType::IQ4_NL: tk.gemm_repacked = gemm_repacked_x4<IQ4_NLx4Layout>; break;
        default: return tk;
    }
    return ref::with_arm_x4_layout(tk);
}

}  // namespace ktd::KTD_ARM_NS
