// Shared building blocks of the forward pass: norms, rotary embeddings, activations (attention:
// kernels/attention.h).
// All activations are F32, row-major, one row per batch token: x [n][n_embd] etc.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>

#include "model/hparams.h"

namespace ktd {

class ThreadPool;

// fn(i) for every batch row i < n: split across the pool when there are at least min_rows rows
// (prefill), on the calling thread otherwise (decode: a hand-over would cost more than the row).
// Rows are independent, so the split never changes a result.
void for_each_row(ThreadPool &pool, int64_t n, int64_t min_rows, const std::function<void(int64_t)> &fn);

// y[i] = x[i] / sqrt(mean(x²) + eps) · w[i] for one row of n (w null: no weight). y may alias x.
void rms_norm(const float *x, const float *w, float *y, int64_t n, float eps);

// Rotary angles for one position: cs[2i] = cos θ_i, cs[2i+1] = sin θ_i for i < n_rot/2
// (θ_i = pos · freq_base^(-2i/n_rot) / freq_factors[i], with linear/YaRN scaling applied).
// freq_factors: [n_rot/2] or null.
void rope_cos_sin(const RopeParams &rp, const float *freq_factors, int64_t pos, float *cs);
// Rotates the first n_rot dims of each of n_heads head vectors (head_dim apart) in place.
void rope_apply(const RopeParams &rp, const float *cs, float *x, int n_heads, int64_t head_dim);

// In place, the active ISA's kernels (definitions: kernels/elementwise.h):
//   a[i] = silu(a[i]) · b[i]       (SwiGLU)
//   a[i] = gelu_tanh(a[i]) · b[i]  (GeGLU)
//   a[i] = relu(a[i])² · b[i]      (BitNet b1.58)
void swiglu(float *a, const float *b, int64_t n);
void geglu(float *a, const float *b, int64_t n);
void relu2glu(float *a, const float *b, int64_t n);

// Exact F16 → F32 through a 64 Ki-entry table (the core is compiled for baseline x86-64: no F16C).
const float *fp16_table();

// n_q query heads that share one cached K/V sequence (a GQA group; MLA: all heads and the latent)
// over keys [k0, k1), in tiles of kAttnTile (kernels/attention.h): each tile of keys is converted from F16 once and used by every head. Leaves
// the unnormalized softmax state per head so that the states of several key ranges merge
// (attend_merge): m[g] the max score, l[g] = Σ exp(s - m), o_g [head_dim_v] = Σ exp(s - m)·v
// (all heads: m = -inf, l = 0, o = 0 for an empty range).
//   q_g = q + g·q_stride [head_dim_k] (already scaled), key j at k + j·k_stride, value j at v + j·v_stride, F16 (v == k with the same
//   stride: the values are the first head_dim_v entries of each key row), o_g = o + g·o_stride,
//   tmp: attend_group_tmp_floats(...) floats of scratch.
size_t attend_group_tmp_floats(int n_q, int64_t head_dim_k, int64_t head_dim_v);
void attend_group(const float *q, size_t q_stride, int n_q, const uint16_t *k, size_t k_stride, const uint16_t *v,
                  size_t v_stride, int64_t k0, int64_t k1, int64_t head_dim_k, int64_t head_dim_v, float *m, float *l,
                  float *o, size_t o_stride, float *tmp);
// Softmax-weighted output of one head from its states of n key ranges, range c at m[c·stride],
// l[c·stride], o + c·stride: out [head_dim_v] = Σ_c exp(m_c - M)·o_c / Σ_c exp(m_c - M)·l_c, M = max m_c.
void attend_merge(int n, const float *m, const float *l, const float *o, size_t stride, int64_t head_dim_v, float *out);

}  // namespace ktd
