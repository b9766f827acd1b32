// The sampler's vector passes with NEON (kernels/sampling.h), 4 floats at a time; bit-identical to
// the reference, as the AVX2 twin (kernels/avx2/sampling.cpp): the same e^x steps
// (neon/vec_math.h), the draw's float64 sums in the same 16 lanes and reduction order.
// dotprod and i8mm use these (isa_fallback).
#include <arm_neon.h>

#include <cstring>
#include <limits>

#include "kernels/neon/vec_math.h"
#include "kernels/sampling.h"

namespace ktd::neon {

namespace {

// Lanes [0, m) set (m clamped to 0..4).
uint32x4_t head_mask(int64_t m) {
    const int32_t k = int32_t(m < 0 ? 0 : m > 4 ? 4 : m);
    const int32_t lanes[4] = {0, 1, 2, 3};
    return vcgtq_s32(vdupq_n_s32(k), vld1q_s32(lanes));
}

// maxNum: a NaN lane never wins (as the reference's x > m ? x : m); NaNs are reported in *nan.
float max(const float *x, int64_t n, bool *nan) {
    const float32x4_t ninf = vdupq_n_f32(-std::numeric_limits<float>::infinity());
    float32x4_t m[4] = {ninf, ninf, ninf, ninf};
    uint32x4_t ordered = vdupq_n_u32(~0u);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 4; ++j) {
            const float32x4_t a = vld1q_f32(x + i + 4 * j);
            m[j] = vmaxnmq_f32(m[j], a);
            ordered = vandq_u32(ordered, vceqq_f32(a, a));
        }
    for (; i < n; i += 4) {
        const int64_t r = n - i < 4 ? n - i : 4;
        const float32x4_t a = vbslq_f32(head_mask(r), load_head(x + i, r), ninf);
        m[0] = vmaxnmq_f32(m[0], a);
        ordered = vandq_u32(ordered, vceqq_f32(a, a));
    }
    *nan = vminvq_u32(ordered) == 0;
    return vmaxnmvq_f32(vmaxnmq_f32(vmaxnmq_f32(m[0], m[1]), vmaxnmq_f32(m[2], m[3])));
}

// d = (x · scale) − shift rounded twice as the reference (-ffp-contract=off: no fused multiply-sub).
float32x4_t exp_floor(float32x4_t x, float32x4_t scale, float32x4_t shift) {
    const float32x4_t d = vsubq_f32(vmulq_f32(x, scale), shift);
    const uint32x4_t below = vcltq_f32(d, vdupq_n_f32(kSampleExpFloor));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(exp_ps(d)), below));
}

void exp_scaled(const float *x, int64_t n, float scale, float shift, float *w) {
    const float32x4_t sc = vdupq_n_f32(scale), sh = vdupq_n_f32(shift);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(w + i, exp_floor(vld1q_f32(x + i), sc, sh));
    if (i < n) store_head(w + i, exp_floor(load_head(x + i, n - i), sc, sh), n - i);
}

int64_t select_ge(const float *x, int64_t n, float t, int32_t *out) {
    const float32x4_t tv = vdupq_n_f32(t);
    int64_t c = 0, i = 0;
    for (; i + 16 <= n; i += 16) {
        const uint32x4_t any = vorrq_u32(vorrq_u32(vcgeq_f32(vld1q_f32(x + i), tv), vcgeq_f32(vld1q_f32(x + i + 4), tv)),
                                         vorrq_u32(vcgeq_f32(vld1q_f32(x + i + 8), tv), vcgeq_f32(vld1q_f32(x + i + 12), tv)));
        if (vmaxvq_u32(any) == 0) continue;  // usually: the threshold is met by a few percent of the entries
        for (int64_t j = i; j < i + 16; ++j)
            if (x[j] >= t) out[c++] = int32_t(j);
    }
    for (; i < n; ++i)
        if (x[i] >= t) out[c++] = int32_t(i);
    return c;
}

// The kept w of 4 elements at i (lanes past b1 are 0): w > v, or w == v and i + lane < tie_end.
float32x4_t kept4(const float *w, int64_t i, int64_t b1, float32x4_t v, int64_t tie_end) {
    const int64_t r = b1 - i;
    const float32x4_t x = r >= 4 ? vld1q_f32(w + i) : load_head(w + i, r < 0 ? 0 : r);
    const uint32x4_t keep = vorrq_u32(vcgtq_f32(x, v), vandq_u32(vceqq_f32(x, v), head_mask(tie_end - i)));
    return vreinterpretq_f32_u32(vandq_u32(vandq_u32(keep, head_mask(r)), vreinterpretq_u32_f32(x)));
}

void kept_block_sums(const float *w, int64_t n, float v, int64_t tie_end, int64_t block, double *sums) {
    const float32x4_t vv = vdupq_n_f32(v);
    for (int64_t b0 = 0, b = 0; b0 < n; b0 += block, ++b) {
        const int64_t b1 = b0 + block < n ? b0 + block : n;
        float64x2_t l[8];  // l[j] = lanes 2j, 2j + 1 of the 16-lane pattern
        for (auto &x : l) x = vdupq_n_f64(0.0);
        for (int64_t i = b0; i < b1; i += 16)
            for (int q = 0; q < 4; ++q) {
                const float32x4_t a = kept4(w, i + 4 * q, b1, vv, tie_end);
                l[2 * q] = vaddq_f64(l[2 * q], vcvt_f64_f32(vget_low_f32(a)));
                l[2 * q + 1] = vaddq_f64(l[2 * q + 1], vcvt_high_f64_f32(a));
            }
        // t_l = lane l + lane l+8; u_l = t_l + t_l+4; sum = (u0 + u2) + (u1 + u3)
        float64x2_t t[4];
        for (int j = 0; j < 4; ++j) t[j] = vaddq_f64(l[j], l[j + 4]);
        const float64x2_t u01 = vaddq_f64(t[0], t[2]), u23 = vaddq_f64(t[1], t[3]);
        const float64x2_t h = vaddq_f64(u01, u23);  // (u0 + u2, u1 + u3)
        sums[b] = vgetq_lane_f64(h, 0) + vgetq_lane_f64(h, 1);
    }
}

// The weights are >= 0, so their bits compare as unsigned integers like their values.
void split_pass(const float *w, int64_t n, uint32_t lo, uint32_t hi, double mass[3], uint32_t *out_mid,
                int64_t *n_mid, uint32_t *out_hi, int64_t *n_hi) {
    const uint32x4_t vlo = vdupq_n_u32(lo), vhi = vdupq_n_u32(hi);
    float64x2_t acc[3][2];
    for (auto &r : acc) r[0] = r[1] = vdupq_n_f64(0.0);
    int64_t cm = 0, ch = 0;
    for (int64_t i = 0; i < n; i += 4) {
        const int64_t r = n - i < 4 ? n - i : 4;
        const uint32x4_t in_range = head_mask(r);
        const uint32x4_t bits =
            vandq_u32(in_range, r == 4 ? vld1q_u32(reinterpret_cast<const uint32_t *>(w + i))
                                       : vreinterpretq_u32_f32(load_head(w + i, r)));
        const uint32x4_t ge_hi = vandq_u32(vcgeq_u32(bits, vhi), in_range);
        const uint32x4_t ge_lo = vandq_u32(vcgeq_u32(bits, vlo), in_range);
        const uint32x4_t band = vbicq_u32(ge_lo, ge_hi);
        const uint32x4_t sel[3] = {vbicq_u32(in_range, ge_lo), band, ge_hi};
        for (int k = 0; k < 3; ++k) {
            const float32x4_t x = vreinterpretq_f32_u32(vandq_u32(sel[k], bits));
            acc[k][0] = vaddq_f64(acc[k][0], vcvt_f64_f32(vget_low_f32(x)));
            acc[k][1] = vaddq_f64(acc[k][1], vcvt_high_f64_f32(x));
        }
        if (vmaxvq_u32(vorrq_u32(band, ge_hi)) == 0) continue;
        uint32_t b[4], mb[4], mh[4];
        vst1q_u32(b, bits);
        vst1q_u32(mb, band);
        vst1q_u32(mh, ge_hi);
        for (int j = 0; j < r; ++j) {
            if (mb[j]) out_mid[cm++] = b[j];
            if (mh[j] && out_hi) out_hi[ch++] = b[j];
        }
    }
    for (int k = 0; k < 3; ++k) {
        const float64x2_t s = vaddq_f64(acc[k][0], acc[k][1]);
        mass[k] = vgetq_lane_f64(s, 0) + vgetq_lane_f64(s, 1);
    }
    *n_mid = cm;
    if (out_hi) *n_hi = ch;
}

constexpr SamplingKernels kKernels{max, exp_scaled, select_ge, kept_block_sums, split_pass};

}  // namespace

KTD_REGISTER_SAMPLING(Isa::NEON, kKernels);

}  // namespace ktd::neon
