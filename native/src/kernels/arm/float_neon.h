// NEON kernels of the float weight types F32, F16, BF16 with F32 activations (why F32: see
// kernels/ref/float.cpp), the ARM counterpart of kernels/avx2/float.cpp. Same inline/namespace
// rule as kernels/arm/q32_neon.h (both ARM ISAs use these: SDOT has nothing for floats).
//
// F16 is widened by FCVTL, BF16 by a 16-bit shift: both exact, so dequantize_row is bitwise the
// reference's. The dot products use FMA into several float32x4 accumulators, a different
// summation order (and fewer roundings) than the reference's sequential sum, so, like the AVX2
// kernels, they agree with it within the float32 summation bound of tests/kernels/test_kernels_q32.py
// (order_bound), not bit for bit. The decode path (one activation row) uses four accumulators of
// four lanes per output; the prefill tile one accumulator per output, whatever the tiling, so a
// given output does not depend on how the rows and columns are split between threads.
#pragma once
#include "kernels/arm/q32_neon.h"

namespace ktd::KTD_ARM_NS {

struct F32Load {
    using T = float;
    static float32x4_t load4(const float *w) { return vld1q_f32(w); }
    static float load1(const float *w) { return *w; }
};
struct F16Load {
    using T = uint16_t;
    static float32x4_t load4(const uint16_t *w) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(w))); }
    static float load1(const uint16_t *w) { return f16(*w); }
};
struct BF16Load {
    using T = uint16_t;
    static float32x4_t load4(const uint16_t *w) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(w), 16)); }
    static float load1(const uint16_t *w) {
        const uint32_t u = uint32_t(*w) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
};

template <typename L>
void dequantize_row_float(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const typename L::T *>(vx);
    int64_t i = 0;
    for (; i + 4 <= k; i += 4) vst1q_f32(y + i, L::load4(x + i));
    for (; i < k; ++i) y[i] = L::load1(x + i);
}

// One weight row against one activation row: four accumulators, then the scalar tail.
template <typename L>
float dot_row_float(int64_t k, const typename L::T *w, const float *a) {
    float32x4_t acc[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    int64_t i = 0;
    for (; i + 16 <= k; i += 16)
        for (int u = 0; u < 4; ++u) acc[u] = vfmaq_f32(acc[u], L::load4(w + i + 4 * u), vld1q_f32(a + i + 4 * u));
    for (; i + 4 <= k; i += 4) acc[0] = vfmaq_f32(acc[0], L::load4(w + i), vld1q_f32(a + i));
    float sum = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
    for (; i < k; ++i) sum += L::load1(w + i) * a[i];
    return sum;
}

// RM weight rows × RN activation rows, one accumulator per output (each widened weight vector
// used RN times, each activation vector RM times).
template <typename L, int RM, int RN>
void dot_tile_float(int64_t k, const typename L::T *const *w, const float *const *a, float *y, size_t ldy) {
    float32x4_t acc[RM][RN];
    for (int r = 0; r < RM; ++r)
        for (int c = 0; c < RN; ++c) acc[r][c] = vdupq_n_f32(0.0f);
    int64_t i = 0;
    for (; i + 4 <= k; i += 4) {
        float32x4_t wv[RM];
        for (int r = 0; r < RM; ++r) wv[r] = L::load4(w[r] + i);
        for (int c = 0; c < RN; ++c) {
            const float32x4_t av = vld1q_f32(a[c] + i);
            for (int r = 0; r < RM; ++r) acc[r][c] = vfmaq_f32(acc[r][c], wv[r], av);
        }
    }
    for (int r = 0; r < RM; ++r)
        for (int c = 0; c < RN; ++c) {
            float sum = vaddvq_f32(acc[r][c]);
            for (int64_t t = i; t < k; ++t) sum += L::load1(w[r] + t) * a[c][t];
            y[size_t(c) * ldy + size_t(r)] = sum;
        }
}

template <typename L>
void gemm_float(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y, size_t ldy,
                int nr, int nc) {
    using T = typename L::T;
    const auto row = [&](int r) { return reinterpret_cast<const T *>(static_cast<const char *>(w) + size_t(r) * w_stride); };
    const auto act = [&](int c) {
        return reinterpret_cast<const float *>(static_cast<const char *>(xq) + size_t(c) * x_stride);
    };
    if (nc == 1) {
        for (int r = 0; r < nr; ++r) y[r] = dot_row_float<L>(k, row(r), act(0));
        return;
    }
    constexpr int kRM = 4, kRN = 4;
    for (int c0 = 0; c0 < nc; c0 += kRN) {
        const int rn = nc - c0 < kRN ? nc - c0 : kRN;
        for (int r0 = 0; r0 < nr; r0 += kRM) {
            const int rm = nr - r0 < kRM ? nr - r0 : kRM;
            if (rm == kRM && rn == kRN) {
                const T *wr[kRM] = {row(r0), row(r0 + 1), row(r0 + 2), row(r0 + 3)};
                const float *ac[kRN] = {act(c0), act(c0 + 1), act(c0 + 2), act(c0 + 3)};
                dot_tile_float<L, kRM, kRN>(k, wr, ac, y + size_t(c0) * ldy + size_t(r0), ldy);
                continue;
            }
            // Edge tile: output by output, the same single accumulator per output.
            for (int c = c0; c < c0 + rn; ++c)
                for (int r = r0; r < r0 + rm; ++r) {
                    const T *wr[1] = {row(r)};
                    const float *ac[1] = {act(c)};
                    dot_tile_float<L, 1, 1>(k, wr, ac, y + size_t(c) * ldy + size_t(r), ldy);
                }
        }
    }
}

}  // namespace ktd::KTD_ARM_NS
