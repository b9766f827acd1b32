#include "model/blocks.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/float16.h"
#include "cpu/thread_pool.h"
#include "kernels/attention.h"
#include "kernels/elementwise.h"

namespace ktd {

void rms_norm(const float *x, const float *w, float *y, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
    const float scale = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
    if (w) {
        for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
    } else {
        for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale;
    }
}

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

void for_each_row(ThreadPool &pool, int64_t n, int64_t min_rows, const std::function<void(int64_t)> &fn) {
    if (n < min_rows || pool.size() == 1) {
        for (int64_t i = 0; i < n; ++i) fn(i);
        return;
    }
    pool.parallel_for(size_t(n), [&](size_t begin, size_t end, int) {
        for (size_t i = begin; i < end; ++i) fn(int64_t(i));
    });
}

void swiglu(float *a, const float *b, int64_t n) { swiglu_kernel()(a, b, n); }

void geglu(float *a, const float *b, int64_t n) { glu_kernel(Glu::GeGLU)(a, b, n); }

void relu2glu(float *a, const float *b, int64_t n) { glu_kernel(Glu::ReLU2)(a, b, n); }

const float *fp16_table() {
    static const std::vector<float> table = [] {
        std::vector<float> t(65536);
        for (uint32_t h = 0; h < 65536; ++h) t[h] = fp16_to_fp32(uint16_t(h));
        return t;
    }();
    return table.data();
}

namespace {

// Eight partial sums: the compiler turns them into SIMD lanes (a single running sum is a serial
// dependency it may not reorder).
float dot8(const float *a, const float *b, int64_t n) {
    float acc[8] = {};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        for (int u = 0; u < 8; ++u) acc[u] += a[d + u] * b[d + u];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < n; ++d) s += a[d] * b[d];
    return s;
}

bool values_in_keys(const uint16_t *k, size_t k_stride, const uint16_t *v, size_t v_stride, int64_t hd_k, int64_t hd_v) {
    return v == k && v_stride == k_stride && hd_v <= hd_k;
}

}  // namespace

size_t attend_group_tmp_floats(int n_q, int64_t head_dim_k, int64_t head_dim_v) {
    // key tile, value tile (unless the values are read from the key tile), scores
    return size_t(kAttnTile) * size_t(head_dim_k + head_dim_v) + size_t(n_q) * kAttnTile;
}

void attend_group(const float *q, size_t q_stride, int n_q, const uint16_t *k, size_t k_stride, const uint16_t *v,
                  size_t v_stride, int64_t k0, int64_t k1, int64_t head_dim_k, int64_t head_dim_v, float *m, float *l,
                  float *o, size_t o_stride, float *tmp) {
    const float *h2f = fp16_table();
    const bool v_in_k = values_in_keys(k, k_stride, v, v_stride, head_dim_k, head_dim_v);
    float *kt = tmp;                                          // [kAttnTile][head_dim_k]
    float *vt = v_in_k ? kt : kt + kAttnTile * head_dim_k;    // [kAttnTile][vt_stride]
    const int64_t vt_stride = v_in_k ? head_dim_k : head_dim_v;
    float *scores = tmp + size_t(kAttnTile) * size_t(head_dim_k + head_dim_v);  // [n_q][kAttnTile]
    for (int g = 0; g < n_q; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        std::fill(o + size_t(g) * o_stride, o + size_t(g) * o_stride + head_dim_v, 0.0f);
    }
    for (int64_t t0 = k0; t0 < k1; t0 += kAttnTile) {
        const int64_t nt = std::min<int64_t>(kAttnTile, k1 - t0);
        for (int64_t j = 0; j < nt; ++j) {
            const uint16_t *kj = k + size_t(t0 + j) * k_stride;
            for (int64_t d = 0; d < head_dim_k; ++d) kt[j * head_dim_k + d] = h2f[kj[d]];
            if (v_in_k) continue;
            const uint16_t *vj = v + size_t(t0 + j) * v_stride;
            for (int64_t d = 0; d < head_dim_v; ++d) vt[j * head_dim_v + d] = h2f[vj[d]];
        }
        for (int g = 0; g < n_q; ++g) {
            const float *qg = q + size_t(g) * q_stride;
            float *sg = scores + size_t(g) * kAttnTile, *og = o + size_t(g) * o_stride;
            float tile_max = -INFINITY;
            for (int64_t j = 0; j < nt; ++j) {
                sg[j] = dot8(qg, kt + j * head_dim_k, head_dim_k);
                tile_max = std::max(tile_max, sg[j]);
            }
            const float m_new = std::max(m[g], tile_max);
            const float correction = std::exp(m[g] - m_new);  // 0 on the first tile (m = -inf)
            l[g] *= correction;
            for (int64_t d = 0; d < head_dim_v; ++d) og[d] *= correction;
            for (int64_t j = 0; j < nt; ++j) {
                const float p = std::exp(sg[j] - m_new);
                l[g] += p;
                const float *vj = vt + j * vt_stride;
                for (int64_t d = 0; d < head_dim_v; ++d) og[d] += p * vj[d];
            }
            m[g] = m_new;
        }
    }
}

void attend_merge(int n, const float *m, const float *l, const float *o, size_t stride, int64_t head_dim_v, float *out) {
    float m_max = -INFINITY;
    for (int c = 0; c < n; ++c) m_max = std::max(m_max, m[size_t(c) * stride]);
    std::fill(out, out + head_dim_v, 0.0f);
    float sum = 0.0f;
    for (int c = 0; c < n; ++c) {
        const float lc = l[size_t(c) * stride];
        if (lc == 0.0f) continue;  // an empty range
        const float w = std::exp(m[size_t(c) * stride] - m_max);
        sum += w * lc;
        const float *oc = o + size_t(c) * stride;
        for (int64_t d = 0; d < head_dim_v; ++d) out[d] += w * oc[d];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t d = 0; d < head_dim_v; ++d) out[d] *= inv;
}

}  // namespace ktd
