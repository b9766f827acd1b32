#include "model/blocks.h"

#include <cmath>

#include "common/sum_squares.h"
#include "cpu/thread_pool.h"
#include "kernels/elementwise.h"

namespace ktd {

void rms_norm(const float *x, const float *w, float *y, int64_t n, float eps) {
    const double ss = sum_squares_f64(x, n);
    const float scale = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
    if (w) {
        for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
    } else {
        for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale;
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

}  // namespace ktd
