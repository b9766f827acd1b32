#include "kernels/rope.h"

#include <algorithm>
#include <cmath>

namespace ktd {

namespace {

// llama.cpp's YaRN helpers (ggml_rope_yarn_corr_dims, rope_yarn_ramp): the dims below corr[0]
// are extrapolated, above corr[1] interpolated, a linear ramp in between.
float yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return float(n_dims) * std::log(float(n_ctx_orig) / (n_rot * 2.0f * float(M_PI))) / (2.0f * std::log(base));
}

float yarn_ramp(float low, float high, int64_t i0) {
    const float y = (float(i0 / 2) - low) / std::max(0.001f, high - low);
    return 1.0f - std::min(1.0f, std::max(0.0f, y));
}

}  // namespace

void rope_cos_sin(const RopeParams &rp, const float *freq_factors, int64_t pos, float *cs) {
    const int half = rp.n_rot / 2;
    const float theta_scale = std::pow(rp.freq_base, -2.0f / float(rp.n_rot));
    float corr0 = 0.0f, corr1 = 0.0f;
    float mscale = rp.attn_factor;
    if (rp.scaling == RopeScaling::Yarn && rp.ext_factor != 0.0f) {
        corr0 = std::max(0.0f, std::floor(yarn_corr_dim(rp.n_rot, rp.n_ctx_orig, rp.beta_fast, rp.freq_base)));
        corr1 = std::min(float(rp.n_rot - 1),
                         std::ceil(yarn_corr_dim(rp.n_rot, rp.n_ctx_orig, rp.beta_slow, rp.freq_base)));
        mscale *= 1.0f + 0.1f * std::log(1.0f / rp.freq_scale);
    }
    float theta_base = float(pos);
    for (int i = 0; i < half; ++i) {
        const float theta_extrap = theta_base / (freq_factors ? freq_factors[i] : 1.0f);
        const float theta_interp = rp.freq_scale * theta_extrap;
        float theta = theta_interp;
        if (rp.scaling == RopeScaling::Yarn && rp.ext_factor != 0.0f) {
            const float mix = yarn_ramp(corr0, corr1, 2 * i) * rp.ext_factor;
            theta = theta_interp * (1.0f - mix) + theta_extrap * mix;
        }
        cs[2 * i] = std::cos(theta) * mscale;
        cs[2 * i + 1] = std::sin(theta) * mscale;
        theta_base *= theta_scale;
    }
}

void rope_apply(const RopeParams &rp, const float *cs, float *x, int n_heads, int64_t head_dim) {
    const int half = rp.n_rot / 2;
    for (int h = 0; h < n_heads; ++h) {
        float *xh = x + int64_t(h) * head_dim;
        for (int i = 0; i < half; ++i) {
            const float c = cs[2 * i], s = cs[2 * i + 1];
            // Norm: rotate adjacent pairs; Neox: rotate dim i with dim i + n_rot/2.
            float *a = rp.type == RopeType::Norm ? xh + 2 * i : xh + i;
            float *b = rp.type == RopeType::Norm ? xh + 2 * i + 1 : xh + i + half;
            const float x0 = *a, x1 = *b;
            *a = x0 * c - x1 * s;
            *b = x0 * s + x1 * c;
        }
    }
}

}  // namespace ktd
