// The sampler's vector passes, scalar (kernels/sampling.h): the specification every ISA matches bit
// for bit. e^x follows avx2::exp_ps step by step (std::fma is the fused multiply-add of the SIMD
// code, std::nearbyint its round-to-nearest-even); the draw's block sums run in the
// SIMD code's 16 lanes.
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/sampling.h"

namespace ktd::ref {

namespace {

// Cephes expf, as avx2::exp_ps (arguments here are <= 0: no overflow).
float exp_cephes(float x) {
    x = std::fmax(x, -87.33654f);
    x = std::fmin(x, 88.37626f);
    const float n = std::nearbyint(x * 1.44269504088896341f);
    float r = std::fma(-n, 0.693359375f, x);
    r = std::fma(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
    const float y = std::fma(p * r, r, r) + 1.0f;
    return y * std::ldexp(1.0f, int(n));
}

float max(const float *x, int64_t n, bool *nan) {
    float m = -std::numeric_limits<float>::infinity();
    bool any_nan = false;
    for (int64_t i = 0; i < n; ++i) {
        any_nan |= std::isnan(x[i]);
        m = x[i] > m ? x[i] : m;
    }
    *nan = any_nan;
    return m;
}

void exp_scaled(const float *x, int64_t n, float scale, float shift, float *w) {
    for (int64_t i = 0; i < n; ++i) {
        const float y = x[i] * scale;  // no FMA in this translation unit: two roundings
        const float d = y - shift;
        w[i] = d < kSampleExpFloor ? 0.0f : exp_cephes(d);
    }
}

int64_t select_ge(const float *x, int64_t n, float t, int32_t *out) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; ++i)
        if (x[i] >= t) out[c++] = int32_t(i);
    return c;
}

void kept_block_sums(const float *w, int64_t n, float v, int64_t tie_end, int64_t block, double *sums) {
    for (int64_t b0 = 0, b = 0; b0 < n; b0 += block, ++b) {
        const int64_t b1 = b0 + block < n ? b0 + block : n;
        double lane[16] = {};
        for (int64_t i = b0; i < b1; ++i)
            if (w[i] > v || (w[i] == v && i < tie_end)) lane[(i - b0) % 16] += double(w[i]);
        double t[8], u[4];
        for (int l = 0; l < 8; ++l) t[l] = lane[l] + lane[l + 8];
        for (int l = 0; l < 4; ++l) u[l] = t[l] + t[l + 4];
        sums[b] = (u[0] + u[2]) + (u[1] + u[3]);
    }
}

void split_pass(const float *w, int64_t n, uint32_t lo, uint32_t hi, double mass[3], uint32_t *out_mid,
                int64_t *n_mid, uint32_t *out_hi, int64_t *n_hi) {
    double s[3] = {};
    int64_t cm = 0, ch = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &w[i], sizeof bits);
        const int r = bits >= hi ? 2 : bits >= lo ? 1 : 0;
        s[r] += double(w[i]);
        if (r == 1) out_mid[cm++] = bits;
        if (r == 2 && out_hi) out_hi[ch++] = bits;
    }
    for (int r = 0; r < 3; ++r) mass[r] = s[r];
    *n_mid = cm;
    if (out_hi) *n_hi = ch;
}

constexpr SamplingKernels kKernels{max, exp_scaled, select_ge, kept_block_sums, split_pass};

}  // namespace

KTD_REGISTER_SAMPLING(Isa::Ref, kKernels);

}  // namespace ktd::ref
