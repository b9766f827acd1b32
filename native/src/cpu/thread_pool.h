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
//
// Placement: one worker per chosen CPU (choose_cpus in topology.h: one per physical core unless
// smt, grouped per NUMA node so tids of a node are contiguous). Workers 1..nth-1 are dedicated
// threads pinned to their CPU. tid 0 is the thread that calls run(): it is NOT pinned by the
// pool (pinning a Python thread behind its back would surprise the caller); a thread dedicated
// to the forward calls pin_caller() once to take CPU cpu_slot(0). Until then cpu_of(0) is -1.
//
// Waiting: workers and the caller spin (with pause) for spin_us microseconds, then sleep on a
// futex, so a dependent op handed over quickly costs microseconds and an idle pool uses no CPU.
// An exception thrown by fn on any worker is rethrown by run() (the first one); workers blocked
// in barrier() for that run are released.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ktd {

struct ThreadPoolOptions {
    int n_threads = 0;          // 0 = one per chosen physical core (all hardware threads if smt)
    std::vector<int> nodes;     // NUMA nodes to use; empty = all online nodes
    bool smt = false;           // also use SMT siblings
    bool pin = true;            // pin each worker to its CPU; false: any n_threads >= 1 is
                                // allowed (tests, oversubscription), nodes assigned round-robin
    std::string sysfs_root = "/sys";
    std::vector<int> affinity;  // the allowed CPUs; empty = the process's mask (tests present fake
                                // machines whose CPUs are not in it; use with pin=false)
    int spin_us = 50;           // bounded spin before sleeping on a futex, microseconds;
                                // 0 when unpinned workers outnumber the usable CPUs
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
    // Splits [0, n) over the workers of one NUMA node only (others return at once); tid is the
    // pool-wide worker id. Throws std::invalid_argument if the pool has no worker on node.
    void parallel_for_node(int node, size_t n,
                           const std::function<void(size_t begin, size_t end, int tid)> &fn);

    int node_of(int tid) const;  // NUMA node of worker tid
    int cpu_of(int tid) const;   // CPU worker tid is pinned to (-1 if not pinned)

    // Additions beyond the original contract.
    std::vector<int> nodes() const;               // nodes with workers, ascending
    std::vector<int> workers_of_node(int node) const;  // tids on node, ascending (contiguous)
    int cpu_slot(int tid) const;   // CPU chosen for tid even if not pinned (-1 when pin=false)
    long thread_id(int tid) const; // kernel thread id (gettid) of worker tid >= 1; -1 for tid 0
    // Pins the calling thread to cpu_slot(0) for good, so that tid 0 runs on its node too.
    // Throws SysError. No-op when pin=false.
    void pin_caller();

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace ktd
