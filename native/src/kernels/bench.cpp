#include "kernels/bench.h"

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <vector>

#include "cpu/thread_pool.h"

namespace ktd {

namespace {
using Clock = std::chrono::steady_clock;

void run_on(ThreadPool *pool, const std::function<void(int, int)> &fn) {
    if (pool && pool->size() > 1)
        pool->run(fn);
    else
        fn(0, 1);
}

// Sums [p, p + n) 64 bytes at a time with four independent accumulators (baseline SSE2 is
// enough: one core's DRAM stream is far below its load bandwidth). prefetch > 0 also issues a
// software prefetch that many bytes ahead: one core's stream is latency-bound, and the weight
// kernels prefetch ahead, so a loop relying on the hardware prefetcher alone would understate
// the ceiling they are measured against.
#if defined(__aarch64__)
// The same on aarch64 with baseline Advanced SIMD (every Armv8-A CPU): 4 × 16-byte loads per
// 64 bytes, 64-bit lane adds, PRFM PLDL1KEEP (__builtin_prefetch) as the prefetch.
uint64_t sum_stream(const uint8_t *p, size_t n, size_t prefetch) {
    uint64x2_t a0 = vdupq_n_u64(0), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 64 <= n; i += 64) {
        if (prefetch && i + prefetch < n) __builtin_prefetch(p + i + prefetch, 0, 3);
        a0 = vaddq_u64(a0, vreinterpretq_u64_u8(vld1q_u8(p + i)));
        a1 = vaddq_u64(a1, vreinterpretq_u64_u8(vld1q_u8(p + i + 16)));
        a2 = vaddq_u64(a2, vreinterpretq_u64_u8(vld1q_u8(p + i + 32)));
        a3 = vaddq_u64(a3, vreinterpretq_u64_u8(vld1q_u8(p + i + 48)));
    }
    return vaddvq_u64(vaddq_u64(vaddq_u64(a0, a1), vaddq_u64(a2, a3)));
}
#else
uint64_t sum_stream(const uint8_t *p, size_t n, size_t prefetch) {
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 64 <= n; i += 64) {
        if (prefetch && i + prefetch < n) _mm_prefetch(reinterpret_cast<const char *>(p + i + prefetch), _MM_HINT_T0);
        a0 = _mm_add_epi64(a0, _mm_load_si128(reinterpret_cast<const __m128i *>(p + i)));
        a1 = _mm_add_epi64(a1, _mm_load_si128(reinterpret_cast<const __m128i *>(p + i + 16)));
        a2 = _mm_add_epi64(a2, _mm_load_si128(reinterpret_cast<const __m128i *>(p + i + 32)));
        a3 = _mm_add_epi64(a3, _mm_load_si128(reinterpret_cast<const __m128i *>(p + i + 48)));
    }
    const __m128i s = _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3));
    alignas(16) uint64_t out[2];
    _mm_store_si128(reinterpret_cast<__m128i *>(out), s);
    return out[0] + out[1];
}
#endif

// Worker tid's part of n bytes split over nth workers: a multiple of 64 bytes each, the last
// takes the remainder.
void part_of(size_t n, int nth, int tid, size_t &b, size_t &e) {
    const size_t chunk = (n / size_t(nth)) & ~size_t(63);
    b = chunk * size_t(tid);
    e = tid == nth - 1 ? n : b + chunk;
}
}  // namespace

ReadBuffer::ReadBuffer(ThreadPool *pool, size_t bytes) {
    if (bytes < 4096) throw std::invalid_argument("ReadBuffer: bytes >= 4096 required");
    bytes_ = bytes & ~size_t(4095);
    // On 2 MiB pages where the kernel gives them (transparent huge pages in "madvise" mode need
    // the hint), as the weights arena is: streaming 4 KiB pages was measured ~5-8% slower on one
    // core here, which would understate the ceiling the weight kernels are compared against.
    constexpr size_t kHugePage = size_t(2) << 20;
    const size_t alloc_bytes = (bytes_ + kHugePage - 1) / kHugePage * kHugePage;
    buf_.reset(static_cast<uint8_t *>(std::aligned_alloc(kHugePage, alloc_bytes)));
    if (!buf_) throw std::bad_alloc();
    madvise(buf_.get(), alloc_bytes, MADV_HUGEPAGE);  // a hint: without THP the pages stay 4 KiB
    // Each worker writes the part it reads (first touch), with a value of its own.
    const int nth = pool ? pool->size() : 1;
    run_on(pool, [&](int tid, int) {
        size_t b, e;
        part_of(bytes_, nth, tid, b, e);
        std::fill(buf_.get() + b, buf_.get() + e, uint8_t(tid + 1));
    });
}

double ReadBuffer::pass(ThreadPool *pool, size_t prefetch) {
    const int nth = pool ? pool->size() : 1;
    std::vector<uint64_t> sink(size_t(nth) * 8);  // one cache line per worker
    const auto t0 = Clock::now();
    run_on(pool, [&](int tid, int) {
        size_t b, e;
        part_of(bytes_, nth, tid, b, e);
        sink[size_t(tid) * 8] = sum_stream(buf_.get() + b, e - b, prefetch);
    });
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    // The sums are data-dependent; checking them keeps the loads from being optimised away.
    uint64_t total = 0;
    for (int t = 0; t < nth; ++t) total += sink[size_t(t) * 8];
    if (total == 0) throw std::logic_error("ReadBuffer: the buffer read back as zero");
    return double(bytes_) / dt;
}

double bench_read_bandwidth(ThreadPool *pool, size_t bytes, int reps, int64_t prefetch) {
    if (bytes < 4096 || reps < 1) throw std::invalid_argument("bench_read_bandwidth: bytes >= 4096 and reps >= 1 required");
    if (prefetch < -1) throw std::invalid_argument("bench_read_bandwidth: prefetch must be -1 (every variant) or >= 0 bytes");
    ReadBuffer buf(pool, bytes);
    // Every pass runs each loop variant in turn (kReadBandwidthPrefetch): the ceiling is the best
    // any of them reaches. Or only the one asked for.
    const std::vector<size_t> variants = prefetch < 0 ? std::vector<size_t>(std::begin(kReadBandwidthPrefetch),
                                                                          std::end(kReadBandwidthPrefetch))
                                                      : std::vector<size_t>{size_t(prefetch)};
    double best = 0;
    for (int rep = 0; rep <= reps; ++rep)
        for (const size_t pf : variants) {
            const double bw = buf.pass(pool, pf);
            if (rep > 0) best = std::max(best, bw);
        }
    return best;
}

namespace {
// Best seconds of `call(x, y, scratch)` over reps calls after one untimed call.
template <typename Call>
double time_matmul(int64_t rows, int64_t k, int64_t n, int reps, const Call &call) {
    if (rows < 1 || k < 1 || n < 1 || reps < 1) throw std::invalid_argument("bench_matmul: rows, k, n, reps >= 1 required");
    std::vector<float> x(size_t(n * k)), y(size_t(n * rows));
    uint32_t s = 12345;
    for (float &v : x) {
        s = s * 1664525u + 1013904223u;
        v = float(int32_t(s >> 8) - (1 << 23)) / float(1 << 23);
    }
    MatmulScratch scratch;
    double best = std::numeric_limits<double>::infinity();
    for (int rep = 0; rep <= reps; ++rep) {
        const auto t0 = Clock::now();
        call(x.data(), y.data(), scratch);
        const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
        if (rep > 0) best = std::min(best, dt);
    }
    return best;
}
}  // namespace

double bench_matmul(ThreadPool *pool, const TypeKernels &tk, const void *w, size_t w_row_bytes, int64_t rows,
                    int64_t k, int64_t n, int reps) {
    return time_matmul(rows, k, n, reps, [&](const float *x, float *y, MatmulScratch &scratch) {
        matmul(pool, tk, w, w_row_bytes, rows, k, x, n, y, scratch);
    });
}

double bench_matmul_repacked(ThreadPool *pool, const TypeKernels &tk, const void *wp, int64_t rows, int64_t k,
                             int64_t n, int reps) {
    return time_matmul(rows, k, n, reps, [&](const float *x, float *y, MatmulScratch &scratch) {
        matmul_repacked(pool, tk, wp, rows, k, x, n, y, scratch);
    });
}

}  // namespace ktd
