// The matmul driver: quantize the activations (once, shared by all workers behind a barrier; for a
// few rows, by every worker into its own buffer, with no barrier), then the workers stream the
// weight rows (of one or several matrices: matmul_multi; two interleaved unit by unit with a hook on
// both after each range: matmul_pair) in contiguous ranges of row groups,
// claimed dynamically on one NUMA node. Each output element is computed by exactly one worker
// with a tile starting on a kRowBlock boundary, so results do not depend on the thread count or
// on which worker claimed which range.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

#include "cpu/thread_pool.h"
#include "kernels/kernels.h"
#include "kernels/tile.h"
#include "memory/arena.h"

namespace ktd {

namespace {
// Matrices one matmul_multi call takes (a layer's Q, K, V is the most the forward asks for).
constexpr int kMaxJobs = 8;
// Up to this many activation rows, every worker quantizes all of them into its own buffer: a
// decode row costs each worker well under a microsecond, less than waiting at a barrier for one
// worker to quantize it for all.
constexpr int64_t kPrivateActRows = 4;
// Smallest dynamically claimed piece of a work list, weight bytes: a few microseconds of streaming,
// so one claim (an atomic on a shared line) costs well under a percent of it.
constexpr size_t kMinChunkBytes = 64 * 1024;

void run_on(ThreadPool *pool, const std::function<void(int, int)> &fn) {
    if (pool && pool->size() > 1)
        pool->run(fn);
    else
        fn(0, 1);
}

void check_repack(const TypeKernels &tk) {
    if (tk.repack_rows <= 0 || !tk.repack || !tk.gemm_repacked || !tk.repacked_group_bytes)
        throw std::invalid_argument("type " + std::string(ggml_type_name(tk.type)) + " has no repacked layout");
}

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// One matrix of a matmul_multi call, with its place in the combined work list.
struct JobPlan {
    const PreparedWeights *pw;
    float *y;
    const float *bias;
    const MatmulRowHook *hook;
    size_t span_bytes;    // weight bytes of kRowBlock rows (the unit of work)
    int64_t groups;       // units: ceil(rows / kRowBlock)
    size_t first_byte;    // offset of the matrix in the combined work list
    int fmt;              // index of its activation format
};

// An activation format shared by the matrices whose kernels quantize the same way.
struct ActFormat {
    void (*quantize)(const float *, void *, int64_t);
    size_t row_bytes;   // one activation row
    size_t offset;      // of its n rows in a worker's (or the shared) activation buffer
};

// Rows [r0, r1) of one matrix (r0 a multiple of kRowBlock) on activations xq, then its bias and
// its hook.
void run_tile(const JobPlan &j, int64_t r0, int64_t r1, const uint8_t *xq, size_t arow, int64_t n, int tid) {
    const int64_t rows = j.pw->rows;
    matmul_tile(*j.pw, r0, r1, xq, arow, j.y + r0, size_t(rows), int(n), tid);
    if (j.bias)
        for (int64_t c = 0; c < n; ++c) {
            float *yc = j.y + c * rows;
            for (int64_t r = r0; r < r1; ++r) yc[r] += j.bias[r];
        }
    if (j.hook) j.hook->fn(j.hook->ctx, j.y, rows, r0, r1, n, tid);
}

// The first unit (span bytes each, `units` of them from first_byte on) that starts at or after byte
// b of the work list: a range [b0, b1) of it holds units [first_unit(b0), first_unit(b1)).
int64_t first_unit(size_t b, size_t first_byte, size_t span, int64_t units) {
    if (b <= first_byte) return 0;
    return std::min(units, int64_t((b - first_byte + span - 1) / span));
}

// What one matmul_multi / matmul_pair call computes: its matrices in the combined work list
// (weight bytes [0, total_bytes)) and the activation formats they read.
struct MatmulPlan {
    std::array<JobPlan, kMaxJobs> jobs;  // [n_jobs]
    std::array<ActFormat, kMaxJobs> fmts;  // [n_fmts]
    int n_jobs = 0, n_fmts = 0;
    int64_t k = 0;           // the width every matrix shares
    size_t total_bytes = 0;  // the work list
    size_t act_bytes = 0;    // one copy of the activations: n rows of every format, 64-byte aligned each
    size_t pair_span = 0;    // pair: one unit = both matrices' kRowBlock rows, so any byte range covers
                             // whole units of both
};

// The checked plan of `jobs` on n activation rows (pair: jobs[0] and jobs[1], the same rows).
MatmulPlan plan_matmul(const MatmulJob *jobs, int n_jobs, int64_t n, bool pair) {
    if (n_jobs < 1 || n_jobs > kMaxJobs)
        throw std::invalid_argument("matmul_multi: " + std::to_string(n_jobs) + " matrices, expected 1.." +
                                    std::to_string(kMaxJobs));
    if (n < 0) throw std::invalid_argument("matmul_multi: negative batch size");
    MatmulPlan p;
    p.n_jobs = n_jobs;
    p.k = jobs[0].pw->k;
    for (int j = 0; j < n_jobs; ++j) {
        const PreparedWeights &pw = *jobs[j].pw;
        const TypeKernels &tk = *pw.tk;
        if (pw.k != p.k)
            throw std::invalid_argument("matmul_multi: matrices of different widths (" + std::to_string(pw.k) +
                                        " and " + std::to_string(p.k) + ")");
        const size_t arow = act_row_size(tk, p.k);  // validates k for this type
        int f = 0;
        while (f < p.n_fmts && p.fmts[size_t(f)].quantize != tk.quantize_act_row) ++f;
        if (f == p.n_fmts) {
            p.fmts[size_t(f)] = {tk.quantize_act_row, arow, p.act_bytes};
            p.act_bytes += align_up(arow * size_t(n), 64);
            ++p.n_fmts;
        }
        const size_t span = pw.repacked ? tk.repacked_group_bytes(p.k) * size_t(kRowBlock / tk.repack_rows)
                                        : pw.row_bytes * size_t(kRowBlock);
        const int64_t groups = (pw.rows + kRowBlock - 1) / kRowBlock;
        p.jobs[size_t(j)] = {&pw, jobs[j].y, jobs[j].bias, jobs[j].hook, span, groups, p.total_bytes, f};
        p.total_bytes += span * size_t(groups);
    }
    if (pair && jobs[0].pw->rows != jobs[1].pw->rows)
        throw std::invalid_argument("matmul_pair: the two matrices must have the same rows (" +
                                    std::to_string(jobs[0].pw->rows) + " and " + std::to_string(jobs[1].pw->rows) +
                                    ")");
    p.pair_span = pair ? p.jobs[0].span_bytes + p.jobs[1].span_bytes : 0;
    return p;
}

// The activation buffer of a call: one shared by all workers, or (private_act) one per worker of
// nth, each starting on its own cache line.
void reserve_act(MatmulScratch &scratch, size_t act_bytes, int nth, bool private_act) {
    if (private_act) {
        if (scratch.act_private.size() < act_bytes * size_t(nth) + 64)
            scratch.act_private.resize(act_bytes * size_t(nth) + 64);
    } else if (scratch.act.size() < act_bytes) {
        scratch.act.resize(act_bytes);
    }
}

// The workers of one call (the pool runs operator()): each quantizes the activations (all of
// them into its own buffer, or its share of the shared one before a barrier), then computes the
// row groups of a fixed share of the work list, or of ranges it claims.
struct MatmulRun {
    const MatmulPlan &plan;
    const MatmulPairHook *pair;
    const float *x;  // [n][k]
    int64_t n;
    MatmulScratch &scratch;
    ThreadPool *pool;
    bool private_act;
    bool dynamic;  // ranges claimed from cursor (else each worker's fixed share)
    struct alignas(64) Cursor {
        std::atomic<size_t> next{0};
    } cursor;

    void operator()(int tid, int nth_run) {
        const uint8_t *xq = quantize(tid, nth_run);
        if (!dynamic) {
            // This worker's fixed share of the work list.
            run_bytes(xq, tid, plan.total_bytes * size_t(tid) / size_t(nth_run),
                      plan.total_bytes * size_t(tid + 1) / size_t(nth_run));
            return;
        }
        claim_and_run(xq, tid, nth_run);
    }

    // The quantized activations worker tid reads: every format's n rows.
    const uint8_t *quantize(int tid, int nth_run) {
        const int64_t k = plan.k;
        uint8_t *xq;
        if (private_act) {
            // Each worker's slice starts on its own cache line.
            const uintptr_t base = reinterpret_cast<uintptr_t>(scratch.act_private.data());
            xq = reinterpret_cast<uint8_t *>(align_up(base, 64)) + size_t(tid) * plan.act_bytes;
            for (int f = 0; f < plan.n_fmts; ++f) {
                const ActFormat &fm = plan.fmts[size_t(f)];
                for (int64_t c = 0; c < n; ++c) fm.quantize(x + c * k, xq + fm.offset + size_t(c) * fm.row_bytes, k);
            }
        } else {
            // Rows split over the workers, then a barrier: every worker reads all of them.
            xq = scratch.act.data();
            for (int f = 0; f < plan.n_fmts; ++f) {
                const ActFormat &fm = plan.fmts[size_t(f)];
                for (int64_t c = tid; c < n; c += nth_run)
                    fm.quantize(x + c * k, xq + fm.offset + size_t(c) * fm.row_bytes, k);
            }
            if (nth_run > 1) pool->barrier(tid);
        }
        return xq;
    }

    // Runs the row groups of the work list that start in bytes [b0, b1): any partition of
    // [0, total_bytes) into ranges computes every group exactly once.
    void run_bytes(const uint8_t *xq, int tid, size_t b0, size_t b1) const {
        if (pair) {
            const int64_t g0 = first_unit(b0, 0, plan.pair_span, plan.jobs[0].groups);
            const int64_t g1 = first_unit(b1, 0, plan.pair_span, plan.jobs[0].groups);
            if (g0 >= g1) return;
            const int64_t r0 = g0 * kRowBlock, r1 = std::min(plan.jobs[0].pw->rows, g1 * kRowBlock);
            for (int j = 0; j < 2; ++j) {
                const ActFormat &fm = plan.fmts[size_t(plan.jobs[size_t(j)].fmt)];
                run_tile(plan.jobs[size_t(j)], r0, r1, xq + fm.offset, fm.row_bytes, n, tid);
            }
            pair->fn(pair->ctx, plan.jobs[0].y, plan.jobs[1].y, plan.jobs[0].pw->rows, r0, r1, n, tid);
            return;
        }
        for (int j = 0; j < plan.n_jobs; ++j) {
            const JobPlan &p = plan.jobs[size_t(j)];
            const int64_t g0 = first_unit(b0, p.first_byte, p.span_bytes, p.groups);
            const int64_t g1 = first_unit(b1, p.first_byte, p.span_bytes, p.groups);
            if (g0 >= g1) continue;
            const ActFormat &fm = plan.fmts[size_t(p.fmt)];
            run_tile(p, g0 * kRowBlock, std::min(p.pw->rows, g1 * kRowBlock), xq + fm.offset, fm.row_bytes, n, tid);
        }
    }

    // Guided self-scheduling: claim half of this worker's fair share of what is left (at least
    // kMinChunkBytes), so the claims shrink towards the end and a worker that was slowed down
    // (by the OS, or by a slower share of the memory bus) leaves a short tail.
    void claim_and_run(const uint8_t *xq, int tid, int nth_run) {
        const size_t total_bytes = plan.total_bytes;
        size_t start = cursor.next.load(std::memory_order_relaxed);
        while (start < total_bytes) {
            const size_t size = std::max(kMinChunkBytes, (total_bytes - start) / (2 * size_t(nth_run)));
            const size_t end = std::min(total_bytes, start + size);
            if (cursor.next.compare_exchange_weak(start, end, std::memory_order_relaxed)) {
                run_bytes(xq, tid, start, end);
                start = cursor.next.load(std::memory_order_relaxed);
            }
        }
    }
};

// matmul_multi and matmul_pair. pair: the two jobs' row groups interleaved in the work list (a
// unit is a kRowBlock span of jobs[0] and the same rows of jobs[1]) and pair->fn after both.
void run_matmul(ThreadPool *pool, const MatmulJob *jobs, int n_jobs, const float *x, int64_t n,
                MatmulScratch &scratch, const MatmulPairHook *pair) {
    const MatmulPlan plan = plan_matmul(jobs, n_jobs, n, pair != nullptr);
    const int nth = pool ? pool->size() : 1;
    const bool private_act = nth > 1 && n <= kPrivateActRows;
    reserve_act(scratch, plan.act_bytes, nth, private_act);
    // Byte ranges are claimed dynamically when all workers share one NUMA node (tids of a node are
    // contiguous, so the first and last tell); across nodes each worker keeps its fixed share, the
    // rows whose pages it first touched when the weights were repacked.
    const bool dynamic = nth > 1 && pool->node_of(0) == pool->node_of(nth - 1);
    MatmulRun run{plan, pair, x, n, scratch, pool, private_act, dynamic, {}};
    // std::ref: the std::function wraps a reference, so no allocation per call.
    run_on(pool, std::ref(run));
}

}  // namespace

void matmul_multi(ThreadPool *pool, const MatmulJob *jobs, int n_jobs, const float *x, int64_t n,
                  MatmulScratch &scratch) {
    run_matmul(pool, jobs, n_jobs, x, n, scratch, nullptr);
}

void matmul_pair(ThreadPool *pool, const MatmulJob &a, const MatmulJob &b, const MatmulPairHook &hook, const float *x,
                 int64_t n, MatmulScratch &scratch) {
    if (!hook.fn) throw std::invalid_argument("matmul_pair: no hook");
    const MatmulJob jobs[2] = {a, b};
    run_matmul(pool, jobs, 2, x, n, scratch, &hook);
}

void matmul(ThreadPool *pool, const TypeKernels &tk, const void *w, size_t w_row_bytes, int64_t rows,
            int64_t k, const float *x, int64_t n, float *y, MatmulScratch &scratch) {
    PreparedWeights pw;
    pw.tk = &tk;
    pw.data = w;
    pw.row_bytes = w_row_bytes;
    pw.rows = rows;
    pw.k = k;
    const MatmulJob job{&pw, y, nullptr};
    matmul_multi(pool, &job, 1, x, n, scratch);
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
    PreparedWeights pw;
    pw.tk = &tk;
    pw.data = wp;
    pw.rows = rows;
    pw.k = k;
    pw.repacked = true;
    const MatmulJob job{&pw, y, nullptr};
    matmul_multi(pool, &job, 1, x, n, scratch);
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
                                int64_t rows, int64_t k, bool allow_repack, const std::shared_ptr<Arena> &arena,
                                bool fill) {
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
        if (fill || !arena) repack_weights(pool, tk, w, w_row_bytes, rows, k, out);
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

void matmul_tile(const PreparedWeights &w, int64_t r0, int64_t r1, const uint8_t *xq, size_t x_stride, float *y,
                 size_t ldy, int nc, int tid) {
    const PreparedWeights &pw = w.for_worker(tid);
    const TypeKernels &tk = *pw.tk;
    const char *wb = static_cast<const char *>(pw.data);
    if (pw.repacked) {
        // r0 is a multiple of kRowBlock, hence of repack_rows: it starts a group.
        const size_t group_bytes = tk.repacked_group_bytes(pw.k);
        tk.gemm_repacked(pw.k, wb + size_t(r0 / tk.repack_rows) * group_bytes, group_bytes, xq, x_stride, y, ldy,
                         int(r1 - r0), nc);
    } else {
        tk.gemm(pw.k, wb + size_t(r0) * pw.row_bytes, pw.row_bytes, xq, x_stride, y, ldy, int(r1 - r0), nc);
    }
}

void matmul(ThreadPool *pool, const PreparedWeights &pw, const float *x, int64_t n, float *y, MatmulScratch &scratch) {
    const MatmulJob job{&pw, y, nullptr};
    matmul_multi(pool, &job, 1, x, n, scratch);
}

}  // namespace ktd
