// The tiles of the NEON, dotprod and i8mm kernel files on the arm x4 layouts of Q4_K and Q6_K
// (kernels/repacked_k.h: 4 rows, 8-byte interleave; same inline/namespace rule as
// kernels/arm/q32_neon.h).
//
// Per super-block and row, each sub-block's integer sum is exact (SDOT, SMULL + SADALP, or SMMLA
// on pairs of tokens for i8mm), the scale products are the reference's int32 sums, and each
// (row, token) lane does the reference's float expression per super-block in super-block order,
// so every tile equals the scalar reference (kernels/ref/q4_k.cpp, q6_k.cpp) bit for bit.
#pragma once
#include "kernels/arm/k_neon.h"
#include "kernels/arm/q32_neon.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_k.h"

namespace ktd::KTD_ARM_NS {

// Exact int8 dot products of one register holding 8 bytes of rows A (low half) and B (high half)
// with 8 activation bytes, accumulated: partial() has row A's sum in lanes 0-1 and B's in 2-3.
struct RowPairAcc {
#if KTD_ARM_SDOT
    int32x4_t v = vdupq_n_s32(0);
    void add(int8x16_t w, int8x8_t a) { v = vdotq_s32(v, w, vcombine_s8(a, a)); }
    int32x4_t partial() const { return v; }
#else
    int32x4_t ra = vdupq_n_s32(0), rb = vdupq_n_s32(0);
    void add(int8x16_t w, int8x8_t a) {
        ra = vpadalq_s16(ra, vmull_s8(vget_low_s8(w), a));
        rb = vpadalq_s16(rb, vmull_s8(vget_high_s8(w), a));
    }
    int32x4_t partial() const { return vpaddq_s32(ra, rb); }
#endif
};
// [row 0, row 1, row 2, row 3] from the accumulators of the pairs (0, 1) and (2, 3).
inline int32x4_t rows4(const RowPairAcc &p0, const RowPairAcc &p1) { return vpaddq_s32(p0.partial(), p1.partial()); }

inline int32x4_t i32x4(int32_t a, int32_t b, int32_t c, int32_t d) {
    const int32_t t[4] = {a, b, c, d};
    return vld1q_s32(t);
}
inline float32x4_t f32x4(float a, float b, float c, float d) {
    const float t[4] = {a, b, c, d};
    return vld1q_f32(t);
}

// Piece i of an interleaved array, rows 2p and 2p + 1.
inline uint8x16_t piece(const uint8_t *x, int i, int p) { return vld1q_u8(x + 32 * i + 16 * p); }

// ---- Q4_K ----------------------------------------------------------------------------------
// Row r's qs byte 32c + 8h + t (piece 4c + h): low nibble = element 64c + 8h + t (sub-block 2c),
// high nibble = element 64c + 32 + 8h + t (sub-block 2c + 1).
struct Q4_Kx4Scales {
    uint8_t sc[4][8], m[4][8];
    explicit Q4_Kx4Scales(const block_q4_Kx4 &g) {
        for (int r = 0; r < 4; ++r) unpack_scale_min_k4(g.scales[r], sc[r], m[r]);
    }
    // Σ_j m[r][j]·(bsums[2j] + bsums[2j + 1]), the reference's int32 sum.
    int32_t summ(int r, const block_q8_K &a) const {
        int32_t s = 0;
        for (int j = 0; j < 8; ++j) s += m[r][j] * (a.bsums[2 * j] + a.bsums[2 * j + 1]);
        return s;
    }
};

inline float32x4_t group_dot_q4_K_x4(int64_t nb, const block_q4_Kx4 *wg, const block_q8_K *a) {
    float32x4_t sum = vdupq_n_f32(0.0f);
    const uint8x16_t low4 = vdupq_n_u8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        const Q4_Kx4Scales s(wg[b]);
        int32x4_t sumq = vdupq_n_s32(0);
        for (int c = 0; c < 4; ++c) {
            RowPairAcc lo[2], hi[2];
            for (int h = 0; h < 4; ++h) {
                const int8x8_t alo = vld1_s8(a[b].qs + 64 * c + 8 * h), ahi = vld1_s8(a[b].qs + 64 * c + 32 + 8 * h);
                for (int p = 0; p < 2; ++p) {
                    const uint8x16_t q = piece(wg[b].qs, 4 * c + h, p);
                    lo[p].add(vreinterpretq_s8_u8(vandq_u8(q, low4)), alo);
                    hi[p].add(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), ahi);
                }
            }
            const int j = 2 * c;
            sumq = vmlaq_s32(sumq, rows4(lo[0], lo[1]), i32x4(s.sc[0][j], s.sc[1][j], s.sc[2][j], s.sc[3][j]));
            sumq = vmlaq_s32(sumq, rows4(hi[0], hi[1]),
                             i32x4(s.sc[0][j + 1], s.sc[1][j + 1], s.sc[2][j + 1], s.sc[3][j + 1]));
        }
        const int32x4_t summ = i32x4(s.summ(0, a[b]), s.summ(1, a[b]), s.summ(2, a[b]), s.summ(3, a[b]));
        const float32x4_t dw = f32x4(f16(wg[b].d[0]), f16(wg[b].d[1]), f16(wg[b].d[2]), f16(wg[b].d[3]));
        const float32x4_t dm = f32x4(f16(wg[b].dmin[0]), f16(wg[b].dmin[1]), f16(wg[b].dmin[2]), f16(wg[b].dmin[3]));
        const float32x4_t t1 = vmulq_f32(vmulq_n_f32(dw, a[b].d), vcvtq_f32_s32(sumq));
        const float32x4_t t2 = vmulq_f32(vmulq_n_f32(dm, a[b].d), vcvtq_f32_s32(summ));
        sum = vaddq_f32(sum, vsubq_f32(t1, t2));
    }
    return sum;
}

// ---- Q6_K ----------------------------------------------------------------------------------
// Half t, quarter s, 8-element piece h (elements 128t + 32s + 8h + i): low 4 bits = nibble s/2 of
// ql piece 8t + 4(s%2) + h, high 2 bits = bits 2s of qh piece 4t + h; sub-block 8t + 2s + h/2.
inline int8x16_t q6_K_x4_weights(const block_q6_Kx4 &g, int t, int s, int h, int p) {
    const uint8x16_t l = piece(g.ql, 8 * t + 4 * (s % 2) + h, p), qh = piece(g.qh, 4 * t + h, p);
    const uint8x16_t n = s / 2 ? vshrq_n_u8(l, 4) : vandq_u8(l, vdupq_n_u8(0x0F));
    const uint8x16_t hb = vandq_u8(vshlq_u8(qh, vdupq_n_s8(int8_t(-2 * s))), vdupq_n_u8(3));
    return vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(n, vshlq_n_u8(hb, 4))), vdupq_n_s8(32));
}

inline float32x4_t group_dot_q6_K_x4(int64_t nb, const block_q6_Kx4 *wg, const block_q8_K *a) {
    float32x4_t sum = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; ++b) {
        const block_q6_Kx4 &g = wg[b];
        int32x4_t sumq = vdupq_n_s32(0);
        for (int t = 0; t < 2; ++t)
            for (int s = 0; s < 4; ++s) {
                RowPairAcc acc[2][2];  // [sub-block of the quarter][row pair]
                for (int h = 0; h < 4; ++h) {
                    const int8x8_t av = vld1_s8(a[b].qs + 128 * t + 32 * s + 8 * h);
                    for (int p = 0; p < 2; ++p) acc[h / 2][p].add(q6_K_x4_weights(g, t, s, h, p), av);
                }
                for (int u = 0; u < 2; ++u) {
                    const int sb = 8 * t + 2 * s + u;
                    sumq = vmlaq_s32(sumq, rows4(acc[u][0], acc[u][1]),
                                     i32x4(g.scales[0][sb], g.scales[1][sb], g.scales[2][sb], g.scales[3][sb]));
                }
            }
        const float32x4_t dw = f32x4(f16(g.d[0]), f16(g.d[1]), f16(g.d[2]), f16(g.d[3]));
        sum = vaddq_f32(sum, vmulq_f32(vmulq_n_f32(dw, a[b].d), vcvtq_f32_s32(sumq)));
    }
    return sum;
}

#if defined(KTD_ISA_I8MM)
// Pairs of tokens (i8mm): s01 = [r0c0, r0c1, r1c0, r1c1], s23 likewise for rows 2, 3.
inline void group_dot_q4_K_x4_pair(int64_t nb, const block_q4_Kx4 *wg, const block_q8_K *a0, const block_q8_K *a1,
                                   float32x4_t &s01, float32x4_t &s23) {
    s01 = s23 = vdupq_n_f32(0.0f);
    const uint8x16_t low4 = vdupq_n_u8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        const Q4_Kx4Scales s(wg[b]);
        int32x4_t sumq[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int c = 0; c < 4; ++c) {
            int32x4_t lo[2] = {vdupq_n_s32(0), vdupq_n_s32(0)}, hi[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
            for (int h = 0; h < 4; ++h) {
                const int o = 64 * c + 8 * h;
                const int8x16_t alo = vcombine_s8(vld1_s8(a0[b].qs + o), vld1_s8(a1[b].qs + o));
                const int8x16_t ahi = vcombine_s8(vld1_s8(a0[b].qs + o + 32), vld1_s8(a1[b].qs + o + 32));
                for (int p = 0; p < 2; ++p) {
                    const uint8x16_t q = piece(wg[b].qs, 4 * c + h, p);
                    lo[p] = vmmlaq_s32(lo[p], vreinterpretq_s8_u8(vandq_u8(q, low4)), alo);
                    hi[p] = vmmlaq_s32(hi[p], vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), ahi);
                }
            }
            for (int p = 0; p < 2; ++p) {
                const int ra = 2 * p, rb = 2 * p + 1, j = 2 * c;
                sumq[p] = vmlaq_s32(sumq[p], lo[p], i32x4(s.sc[ra][j], s.sc[ra][j], s.sc[rb][j], s.sc[rb][j]));
                sumq[p] = vmlaq_s32(sumq[p], hi[p],
                                    i32x4(s.sc[ra][j + 1], s.sc[ra][j + 1], s.sc[rb][j + 1], s.sc[rb][j + 1]));
            }
        }
        const float32x4_t da = f32x4(a0[b].d, a1[b].d, a0[b].d, a1[b].d);
        float32x4_t *out[2] = {&s01, &s23};
        for (int p = 0; p < 2; ++p) {
            const int ra = 2 * p, rb = 2 * p + 1;
            const int32x4_t summ = i32x4(s.summ(ra, a0[b]), s.summ(ra, a1[b]), s.summ(rb, a0[b]), s.summ(rb, a1[b]));
            const float32x4_t dw = f32x4(f16(wg[b].d[ra]), f16(wg[b].d[ra]), f16(wg[b].d[rb]), f16(wg[b].d[rb]));
            const float32x4_t dm =
                f32x4(f16(wg[b].dmin[ra]), f16(wg[b].dmin[ra]), f16(wg[b].dmin[rb]), f16(wg[b].dmin[rb]));
            const float32x4_t t1 = vmulq_f32(vmulq_f32(da, dw), vcvtq_f32_s32(sumq[p]));
            const float32x4_t t2 = vmulq_f32(vmulq_f32(da, dm), vcvtq_f32_s32(summ));
            *out[p] = vaddq_f32(*out[p], vsubq_f32(t1, t2));
        }
    }
}

inline void group_dot_q6_K_x4_pair(int64_t nb, const block_q6_Kx4 *wg, const block_q8_K *a0, const block_q8_K *a1,
                                   float32x4_t &s01, float32x4_t &s23) {
    s01 = s23 = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; ++b) {
        const block_q6_Kx4 &g = wg[b];
        int32x4_t sumq[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int t = 0; t < 2; ++t)
            for (int s = 0; s < 4; ++s) {
                int32x4_t acc[2][2] = {{vdupq_n_s32(0), vdupq_n_s32(0)}, {vdupq_n_s32(0), vdupq_n_s32(0)}};
                for (int h = 0; h < 4; ++h) {
                    const int o = 128 * t + 32 * s + 8 * h;
                    const int8x16_t av = vcombine_s8(vld1_s8(a0[b].qs + o), vld1_s8(a1[b].qs + o));
                    for (int p = 0; p < 2; ++p) acc[h / 2][p] = vmmlaq_s32(acc[h / 2][p], q6_K_x4_weights(g, t, s, h, p), av);
                }
                for (int u = 0; u < 2; ++u) {
                    const int sb = 8 * t + 2 * s + u;
                    for (int p = 0; p < 2; ++p) {
                        const int ra = 2 * p, rb = 2 * p + 1;
                        sumq[p] = vmlaq_s32(sumq[p], acc[u][p],
                                            i32x4(g.scales[ra][sb], g.scales[ra][sb], g.scales[rb][sb], g.scales[rb][sb]));
                    }
                }
            }
        const float32x4_t da = f32x4(a0[b].d, a1[b].d, a0[b].d, a1[b].d);
        float32x4_t *out[2] = {&s01, &s23};
        for (int p = 0; p < 2; ++p) {
            const float32x4_t dw = f32x4(f16(g.d[2 * p]), f16(g.d[2 * p]), f16(g.d[2 * p + 1]), f16(g.d[2 * p + 1]));
            *out[p] = vaddq_f32(*out[p], vmulq_f32(vmulq_f32(da, dw), vcvtq_f32_s32(sumq[p])));
        }
    }
}
#endif

// The tile on the layout (TypeKernels::gemm_repacked contract); i8mm: tokens in pairs by SMMLA,
// an odd last one by SDOT; dotprod / NEON: one token at a time.
template <typename Group, float32x4_t (*Dot1)(int64_t, const Group *, const block_q8_K *),
          void (*Dot2)(int64_t, const Group *, const block_q8_K *, const block_q8_K *, float32x4_t &, float32x4_t &)>
void gemm_repacked_k_x4(int64_t k, const void *wp, size_t group_stride, const void *xq, size_t x_stride, float *y,
                        size_t ldy, int nr, int nc) {
    const int64_t nb = k / QK_K;
    auto act = [&](int c) {
        return reinterpret_cast<const block_q8_K *>(static_cast<const char *>(xq) + size_t(c) * x_stride);
    };
    for (int g = 0; g < (nr + 3) / 4; ++g) {
        const auto *wg = reinterpret_cast<const Group *>(static_cast<const char *>(wp) + size_t(g) * group_stride);
        const int rows = nr - 4 * g < 4 ? nr - 4 * g : 4;
        float *yg = y + size_t(4 * g);
        int c = 0;
        if constexpr (Dot2 != nullptr) {
            for (; c + 1 < nc; c += 2) {
                float32x4_t s01, s23;
                Dot2(nb, wg, act(c), act(c + 1), s01, s23);
                float t[8];
                vst1q_f32(t, s01);
                vst1q_f32(t + 4, s23);
                for (int r = 0; r < rows; ++r) {
                    const int base = 4 * (r / 2) + 2 * (r % 2);
                    yg[size_t(c) * ldy + size_t(r)] = t[base];
                    yg[size_t(c + 1) * ldy + size_t(r)] = t[base + 1];
                }
            }
        }
        for (; c < nc; ++c) {
            float t[4];
            vst1q_f32(t, Dot1(nb, wg, act(c)));
            for (int r = 0; r < rows; ++r) yg[size_t(c) * ldy + size_t(r)] = t[r];
        }
    }
}

// `tk` (a Q4_K or Q6_K entry) with the arm x4 layout and this ISA's tile on it; other types as they are.
inline TypeKernels with_arm_k_x4_layout(TypeKernels tk) {
    if (tk.type != GGMLType::Q4_K && tk.type != GGMLType::Q6_K) return tk;
    tk.repack_rows = kRepackRowsKx4;
    tk.repack_layout = kRepackLayoutKArmX4;
    if (tk.type == GGMLType::Q4_K) {
        tk.repacked_group_bytes = ref::group_bytes_q4_K_x4;
        tk.repack = ref::repack_q4_K_x4;
#if defined(KTD_ISA_I8MM)
        tk.gemm_repacked = gemm_repacked_k_x4<block_q4_Kx4, group_dot_q4_K_x4, group_dot_q4_K_x4_pair>;
#else
        tk.gemm_repacked = gemm_repacked_k_x4<block_q4_Kx4, group_dot_q4_K_x4, nullptr>;
#endif
    } else {
        tk.repacked_group_bytes = ref::group_bytes_q6_K_x4;
        tk.repack = ref::repack_q6_K_x4;
#if defined(KTD_ISA_I8MM)
        tk.gemm_repacked = gemm_repacked_k_x4<block_q6_Kx4, group_dot_q6_K_x4, group_dot_q6_K_x4_pair>;
#else
        tk.gemm_repacked = gemm_repacked_k_x4<block_q6_Kx4, group_dot_q6_K_x4, nullptr>;
#endif
    }
    return tk;
}

}  // namespace ktd::KTD_ARM_NS
