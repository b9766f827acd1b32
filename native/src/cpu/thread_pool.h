// Persistent worker pool. API contract (the kernels and the forward are written against it):
//
//   ThreadPool pool(opts);              // workers are created once and live with the pool
//   pool.run([&](int tid, int nth) {    // fn runs once on each of nth workers (the calling
//       ...                             // thread takes part as tid 0); run() returns when all
//       pool.barrier(tid);              // workers have returned. barrier() may be called inside
//       ...                             // fn by every worker, the same number of times.
//   });
//   pool.parallel_for(n, [&](size_t begin, size_t end, int tid) {...});  // contiguous chunks
//
// run() is not reentrant (no nested run from inside fn) and is called from one thread at a time.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ktd {

struct ThreadPoolOptions {
    int n_threads = 0;          // 0 = one per chosen physical core
    std::vector<int> nodes;     // NUMA nodes to use; empty = all online nodes
    bool smt = false;           // also use SMT siblings
    bool pin = true;            // pin each worker to its CPU
    std::string sysfs_root = "/sys";
};

class ThreadPool {
public:
    explicit ThreadPool(const ThreadPoolOptions &opts = {});
    ~ThreadPool();
    ThreadPool(const ThreadPool &) = delete;
    ThreadPool &operator=(const ThreadPool &) = delete;

    int size() const;
    void run(const std::function<void(int tid, int nth)> &fn);
    void barrier(int tid);
    // Splits [0, n) into size() contiguous chunks (some may be empty) and runs fn on each.
    void parallel_for(size_t n, const std::function<void(size_t begin, size_t end, int tid)> &fn);

    int node_of(int tid) const;  // NUMA node of worker tid
    int cpu_of(int tid) const;   // CPU worker tid is pinned to (-1 if not pinned)

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace ktd
