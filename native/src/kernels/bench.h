// Timing loops for the kernel benchmark (ktd.bench.kernels). Timed here, in C++, so the
// interpreter never sits inside a measured interval.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "kernels/kernels.h"

namespace ktd {

// Streams a freshly allocated buffer of `bytes` (touched first by the worker that reads it)
// with nth = pool size workers, each summing its own contiguous part; `reps` passes after one
// untimed pass, each pass timing a plain summing loop and the same loop with software prefetch
// 2, 4 and 8 KiB ahead (kReadBandwidthPrefetch), or only the loop with `prefetch` bytes ahead
// (0: none) when prefetch >= 0. Returns the best read bandwidth seen, in bytes/second.
//
// The best of every variant in a pass is also the best of 4 samples of the machine's noise; to
// compare single runs of something else with single passes, pick the loop first and then time
// that loop alone (ktd.bench.kernels' per-pass figure does).
inline constexpr size_t kReadBandwidthPrefetch[] = {0, 2048, 4096, 8192};
double bench_read_bandwidth(ThreadPool *pool, size_t bytes, int reps, int64_t prefetch = -1);

// A read-bandwidth buffer that stays between passes: allocated (2 MiB pages where THP allows) and
// written once, then read by one loop per pass(). ktd.bench.decode keeps one for a whole
// measurement: on a 2-vCPU KVM guest (Xeon, 480 MiB L3) the decode step that followed four passes
// over fresh 4.4 GB buffers (each allocated, faulted in, freed) took 1.5x as long as one that
// followed none (285-294 ms against 184-188, repeated in 5 processes of 6 rounds; a 3 s sleep
// after the passes did not help), so the decode figure had been measured against the passes'
// memory churn rather than against the machine.
class ReadBuffer {
public:
    ReadBuffer(ThreadPool *pool, size_t bytes);  // bytes >= 4096, rounded down to 4 KiB
    // Bytes/s of one pass of the loop prefetching `prefetch` bytes ahead (0: none), split over the
    // pool's workers as bench_read_bandwidth does.
    double pass(ThreadPool *pool, size_t prefetch);
    size_t bytes() const { return bytes_; }

private:
    struct FreeDeleter {
        void operator()(uint8_t *p) const { std::free(p); }
    };
    std::unique_ptr<uint8_t, FreeDeleter> buf_;
    size_t bytes_ = 0;
};

// Best wall time in seconds of one matmul(W[rows,k] · X[n,k]^T) over `reps` calls after one
// untimed call; X is synthetic (values in [-1, 1)), the scratch and output are reused.
double bench_matmul(ThreadPool *pool, const TypeKernels &tk, const void *w, size_t w_row_bytes, int64_t rows,
                    int64_t k, int64_t n, int reps);
// The same on weights produced by repack_weights.
double bench_matmul_repacked(ThreadPool *pool, const TypeKernels &tk, const void *wp, int64_t rows, int64_t k,
                             int64_t n, int reps);

}  // namespace ktd
