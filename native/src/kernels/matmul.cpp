// The matmul driver: quantize the activations once (shared by all workers), then every worker
// streams its own contiguous range of weight rows.
#include <algorithm>

#include "cpu/thread_pool.h"
#include "kernels/kernels.h"

namespace ktd {

namespace {
// Row ranges are multiples of this so interleaved (repacked) row groups never straddle workers.
constexpr int64_t kRowAlign = 16;

void row_range(int64_t rows, int tid, int nth, int64_t &r0, int64_t &r1) {
    int64_t groups = (rows + kRowAlign - 1) / kRowAlign;
    int64_t g0 = groups * tid / nth, g1 = groups * (tid + 1) / nth;
    r0 = std::min(rows, g0 * kRowAlign);
    r1 = std::min(rows, g1 * kRowAlign);
}
}  // namespace

void matmul(ThreadPool *pool, const TypeKernels &tk, const void *w, size_t w_row_bytes, int64_t rows,
            int64_t k, const float *x, int64_t n, float *y, MatmulScratch &scratch) {
    const size_t arow = act_row_size(tk, k);
    if (scratch.act.size() < arow * size_t(n)) scratch.act.resize(arow * size_t(n));
    uint8_t *xq = scratch.act.data();
    const char *wb = static_cast<const char *>(w);

    auto body = [&](int tid, int nth) {
        for (int64_t c = tid; c < n; c += nth) tk.quantize_act_row(x + c * k, xq + c * arow, k);
        if (nth > 1) pool->barrier(tid);
        int64_t r0, r1;
        row_range(rows, tid, nth, r0, r1);
        if (r0 < r1)
            tk.gemm(k, wb + r0 * w_row_bytes, w_row_bytes, xq, arow, y + r0, size_t(rows), int(r1 - r0), int(n));
    };
    if (pool && pool->size() > 1)
        pool->run(body);
    else
        body(0, 1);
}

}  // namespace ktd
