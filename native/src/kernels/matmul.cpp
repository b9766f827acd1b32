// The matmul driver: quantize the activations once (shared by all workers), then every worker
// streams its own contiguous range of weight rows. Each output element is computed by exactly
// one worker, so results do not depend on the thread count.
#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>

#include "cpu/thread_pool.h"
#include "kernels/kernels.h"
#include "memory/arena.h"

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

void run_on(ThreadPool *pool, const std::function<void(int, int)> &fn) {
    if (pool && pool->size() > 1)
        pool->run(fn);
    else
        fn(0, 1);
}

// Quantizes X [n][k] into scratch (columns split over the workers), then a barrier, then `tile`
// on this worker's rows.
template <typename Tile>
void run_matmul(ThreadPool *pool, const TypeKernels &tk, int64_t rows, int64_t k, const float *x, int64_t n,
                MatmulScratch &scratch, const Tile &tile) {
    const size_t arow = act_row_size(tk, k);
    if (scratch.act.size() < arow * size_t(n)) scratch.act.resize(arow * size_t(n));
    uint8_t *xq = scratch.act.data();
    auto body = [&](int tid, int nth) {
        for (int64_t c = tid; c < n; c += nth) tk.quantize_act_row(x + c * k, xq + size_t(c) * arow, k);
        if (nth > 1) pool->barrier(tid);
        int64_t r0, r1;
        row_range(rows, tid, nth, r0, r1);
        if (r0 < r1) tile(r0, r1, xq, arow, tid);
    };
    // std::ref: the std::function wraps a reference, so no allocation per call.
    run_on(pool, std::ref(body));
}

void check_repack(const TypeKernels &tk) {
    if (tk.repack_rows <= 0 || !tk.repack || !tk.gemm_repacked || !tk.repacked_group_bytes)
        throw std::invalid_argument("type " + std::string(ggml_type_name(tk.type)) + " has no repacked layout");
}
}  // namespace

void matmul(ThreadPool *pool, const TypeKernels &tk, const void *w, size_t w_row_bytes, int64_t rows,
            int64_t k, const float *x, int64_t n, float *y, MatmulScratch &scratch) {
    const char *wb = static_cast<const char *>(w);
    run_matmul(pool, tk, rows, k, x, n, scratch, [&](int64_t r0, int64_t r1, const uint8_t *xq, size_t arow, int) {
        tk.gemm(k, wb + r0 * w_row_bytes, w_row_bytes, xq, arow, y + r0, size_t(rows), int(r1 - r0), int(n));
    });
}

size_t repacked_size(const TypeKernels &tk, int64_t rows, int64_t k) {
    check_repack(tk);
    act_row_size(tk, k);  // validates k
    const int64_t groups = (rows + tk.repack_rows - 1) / tk.repack_rows;
    return size_t(groups) * tk.repacked_group_bytes(k);
}

void repack_weights(ThreadPool *pool, const TypeKernels &tk, const void *w, size_t w_row_bytes, int64_t rows,
                    int64_t k, void *out) {
    check_repack(tk);
    const int64_t groups = (rows + tk.repack_rows - 1) / tk.repack_rows;
    run_on(pool, [&](int tid, int nth) {
        const int64_t g0 = groups * tid / nth, g1 = groups * (tid + 1) / nth;
        if (g0 < g1) tk.repack(w, w_row_bytes, rows, k, g0, g1, out);
    });
}

void matmul_repacked(ThreadPool *pool, const TypeKernels &tk, const void *wp, int64_t rows, int64_t k,
                     const float *x, int64_t n, float *y, MatmulScratch &scratch) {
    check_repack(tk);
    const size_t group_bytes = tk.repacked_group_bytes(k);
    const char *wb = static_cast<const char *>(wp);
    run_matmul(pool, tk, rows, k, x, n, scratch, [&](int64_t r0, int64_t r1, const uint8_t *xq, size_t arow, int) {
        // kRowAlign is a multiple of repack_rows, so r0 starts a group.
        tk.gemm_repacked(k, wb + size_t(r0 / tk.repack_rows) * group_bytes, group_bytes, xq, arow, y + r0,
                         size_t(rows), int(r1 - r0), int(n));
    });
}

namespace {
bool will_repack(const TypeKernels &tk, bool allow_repack) {
    return allow_repack && tk.repack_rows > 0 && tk.repack && tk.gemm_repacked && tk.repacked_group_bytes;
}
}  // namespace

size_t prepared_bytes(const TypeKernels &tk, int64_t rows, int64_t k, bool allow_repack) {
    act_row_size(tk, k);  // validates k
    if (!will_repack(tk, allow_repack)) return 0;
    return (repacked_size(tk, rows, k) + kPreparedAlign - 1) / kPreparedAlign * kPreparedAlign;
}

PreparedWeights prepare_weights(ThreadPool *pool, const TypeKernels &tk, const void *w, size_t w_row_bytes,
                                int64_t rows, int64_t k, bool allow_repack, const std::shared_ptr<Arena> &arena) {
    act_row_size(tk, k);  // validates k
    PreparedWeights pw;
    pw.tk = &tk;
    pw.row_bytes = w_row_bytes;
    pw.rows = rows;
    pw.k = k;
    if (will_repack(tk, allow_repack)) {
        const size_t bytes = repacked_size(tk, rows, k);
        void *out;
        if (arena) {
            out = arena->alloc(bytes, kPreparedAlign);
            pw.storage = std::shared_ptr<const void>(arena, out);  // aliasing: owns the arena
        } else {
            // Not value-initialised: the pages are first touched by the repack workers.
            std::shared_ptr<uint8_t[]> buf(new uint8_t[bytes]);
            out = buf.get();
            pw.storage = std::shared_ptr<const void>(buf, out);
        }
        repack_weights(pool, tk, w, w_row_bytes, rows, k, out);
        pw.data = out;
        pw.repacked = true;
        pw.repacked_bytes = bytes;
    } else {
        pw.data = w;
    }
    return pw;
}

const PreparedWeights &PreparedWeights::for_worker(int tid) const {
    return node_copies ? node_copies->copies[size_t(node_copies->copy_of_tid[size_t(tid)])] : *this;
}

void matmul(ThreadPool *pool, const PreparedWeights &pw, const float *x, int64_t n, float *y, MatmulScratch &scratch) {
    if (pw.node_copies && pool && pool->size() > 1) {
        // Replicated weights: each worker streams its rows from its own node's copy.
        const TypeKernels &tk = *pw.tk;
        run_matmul(pool, tk, pw.rows, pw.k, x, n, scratch,
                   [&](int64_t r0, int64_t r1, const uint8_t *xq, size_t arow, int tid) {
                       const PreparedWeights &c = pw.for_worker(tid);
                       const char *wb = static_cast<const char *>(c.data);
                       if (c.repacked) {
                           const size_t group_bytes = tk.repacked_group_bytes(c.k);
                           tk.gemm_repacked(c.k, wb + size_t(r0 / tk.repack_rows) * group_bytes, group_bytes, xq,
                                            arow, y + r0, size_t(c.rows), int(r1 - r0), int(n));
                       } else {
                           tk.gemm(c.k, wb + size_t(r0) * c.row_bytes, c.row_bytes, xq, arow, y + r0,
                                   size_t(c.rows), int(r1 - r0), int(n));
                       }
                   });
        return;
    }
    if (pw.repacked)
        matmul_repacked(pool, *pw.tk, pw.data, pw.rows, pw.k, x, n, y, scratch);
    else
        matmul(pool, *pw.tk, pw.data, pw.row_bytes, pw.rows, pw.k, x, n, y, scratch);
}

}  // namespace ktd
