// The per-element arithmetic of the CUDA backend's non-matrix kernels (RMSNorm, rotary angles with
// linear/YaRN scaling, the GLU activations), written once as `__host__ __device__` functions: the
// CPU build compiles this very code (ktd._native.cuda_math) and tests it against numpy's
// transcription of llama.cpp's formulas and against the CPU forward's own blocks (model/blocks.cpp,
// kernels/rope.cpp) on every CI run; the kernels in ktd_cuda.cu call it on the device.
#pragma once
#include <cmath>
#include <cstdint>

#include "cuda/ktd_cuda.h"

#if defined(__CUDACC__)
#define KTD_OPS_HD __host__ __device__ __forceinline__
#else
#define KTD_OPS_HD inline
#endif

namespace ktd::om {

KTD_OPS_HD float fmin_(float a, float b) { return a < b ? a : b; }
KTD_OPS_HD float fmax_(float a, float b) { return a > b ? a : b; }

// llama.cpp's YaRN correction dimension and ramp (as kernels/rope.cpp computes them).
KTD_OPS_HD float yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return float(n_dims) * logf(float(n_ctx_orig) / (n_rot * 2.0f * 3.14159265358979323846f)) / (2.0f * logf(base));
}

KTD_OPS_HD float yarn_ramp(float low, float high, int64_t i0) {
    const float y = (float(i0 / 2) - low) / fmax_(0.001f, high - low);
    return 1.0f - fmin_(1.0f, fmax_(0.0f, y));
}

// cs[2i] = cos θ_i, cs[2i+1] = sin θ_i for i < n_rot/2 at position pos (freq_factors: [n_rot/2]
// divisors or null): the operations and their order of kernels/rope.cpp's rope_cos_sin, so the
// host build gives the CPU forward's angles bit for bit.
KTD_OPS_HD void rope_cos_sin(const KtdRope &rp, const float *freq_factors, int64_t pos, float *cs) {
    const int half = rp.n_rot / 2;
    const float theta_scale = powf(rp.freq_base, -2.0f / float(rp.n_rot));
    const bool yarn = rp.yarn != 0 && rp.ext_factor != 0.0f;
    float corr0 = 0.0f, corr1 = 0.0f;
    float mscale = rp.attn_factor;
    if (yarn) {
        corr0 = fmax_(0.0f, floorf(yarn_corr_dim(rp.n_rot, rp.n_ctx_orig, rp.beta_fast, rp.freq_base)));
        corr1 = fmin_(float(rp.n_rot - 1), ceilf(yarn_corr_dim(rp.n_rot, rp.n_ctx_orig, rp.beta_slow, rp.freq_base)));
        mscale *= 1.0f + 0.1f * logf(1.0f / rp.freq_scale);
    }
    float theta_base = float(pos);
    for (int i = 0; i < half; ++i) {
        const float theta_extrap = theta_base / (freq_factors ? freq_factors[i] : 1.0f);
        const float theta_interp = rp.freq_scale * theta_extrap;
        float theta = theta_interp;
        if (yarn) {
            const float mix = yarn_ramp(corr0, corr1, 2 * i) * rp.ext_factor;
            theta = theta_interp * (1.0f - mix) + theta_extrap * mix;
        }
        cs[2 * i] = cosf(theta) * mscale;
        cs[2 * i + 1] = sinf(theta) * mscale;
        theta_base *= theta_scale;
    }
}

// One rotated pair of a head vector xh: Norm rotates (2i, 2i+1), Neox (i, i + n_rot/2).
KTD_OPS_HD void rope_pair(const KtdRope &rp, const float *cs, float *xh, int i) {
    const int half = rp.n_rot / 2;
    float *a = rp.neox ? xh + i : xh + 2 * i;
    float *b = rp.neox ? xh + i + half : xh + 2 * i + 1;
    const float c = cs[2 * i], s = cs[2 * i + 1];
    const float x0 = *a, x1 = *b;
    *a = x0 * c - x1 * s;
    *b = x0 * s + x1 * c;
}

KTD_OPS_HD float silu(float x) { return x / (1.0f + expf(-x)); }

// GELU, tanh approximation (GeGLU of gemma).
KTD_OPS_HD float gelu_tanh(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// Squared ReLU (BitNet b1.58 2B4T's FFN).
KTD_OPS_HD float relu2(float x) { return x > 0.0f ? x * x : 0.0f; }

// The GLU activations by the ABI's code (ktd_cuda_glu): 0 silu, 1 gelu_tanh, 2 relu2.
constexpr int kGluActs = 3;
KTD_OPS_HD float glu_act(int act, float x) { return act == 0 ? silu(x) : act == 1 ? gelu_tanh(x) : relu2(x); }

}  // namespace ktd::om
