// Shared building blocks of the forward pass: norms, activations (rotary embeddings:
// kernels/rope.h; attention: kernels/attention.h).
// All activations are F32, row-major, one row per batch token: x [n][n_embd] etc.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>

#include "kernels/rope.h"  // the forward's blocks come with the rotary embedding

namespace ktd {

class ThreadPool;

// fn(i) for every batch row i < n: split across the pool when there are at least min_rows rows
// (prefill), on the calling thread otherwise (decode: a hand-over would cost more than the row).
// Rows are independent, so the split never changes a result.
void for_each_row(ThreadPool &pool, int64_t n, int64_t min_rows, const std::function<void(int64_t)> &fn);

// y[i] = x[i] / sqrt(mean(x²) + eps) · w[i] for one row of n (w null: no weight). y may alias x.
void rms_norm(const float *x, const float *w, float *y, int64_t n, float eps);

// In place, the active ISA's kernels (definitions: kernels/elementwise.h):
//   a[i] = silu(a[i]) · b[i]       (SwiGLU)
//   a[i] = gelu_tanh(a[i]) · b[i]  (GeGLU)
//   a[i] = relu(a[i])² · b[i]      (BitNet b1.58)
void swiglu(float *a, const float *b, int64_t n);
void geglu(float *a, const float *b, int64_t n);
void relu2glu(float *a, const float *b, int64_t n);

}  // namespace ktd
