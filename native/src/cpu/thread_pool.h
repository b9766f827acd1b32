// Persistent worker pool. API contract (the kernels and the forward are written against it):
//
//   ThreadPool pool(opts);              // workers are created once and live with the pool
//   pool.run([&](int tid, int nth) {    // fn runs once on each of nth workers (the calling
//       ...                             // thread takes part as tid 0); run() returns when all
//       pool.barrier(tid);              // workers have returned. barrier() may be called inside
//       ...                             // fn by every worker, the same number of times.
//   });
//   pool.parallel_for(n, [&](size_t begin, size_t end, int tid) {...});  // contiguous chunks
//   pool.for_each_item(n, [&](size_t item, int tid) {...});  // items claimed one at a time
//
// run() is not reentrant (no nested run from inside fn) and is called from one thread at a time.
//
// Work lists (kt-kernel's do_work_stealing_job): items of uneven cost (experts with different
// token counts, causal attention blocks) are claimed one at a time from a shared counter, so no
// worker idles while another holds a long fixed share. for_each_item is the one-region form; a
// WorkList is the same list for use inside a run() between barriers, where one region has several
// phases:
//   WorkList &list = ...;                     // outlives the region (scratch), one per phase
//   list.reset(n);                            // before run(), or by one worker before a barrier
//   pool.run([&](int tid, int) {
//       list.drain(0, [&](size_t item) {...}); // every item [0, n) runs on exactly one worker
//   });
// With several NUMA nodes the items are cut per node (reset(first, n_slice)): slice s (the node's
// index in nodes(), node_index(tid)) owns items [first[s], first[s + 1]) and only its workers claim
// them, so a worker touches only the weights its node holds. No stealing across nodes: a node's
// items wait for its own workers. Which worker runs an item varies from run to run; a caller that
// needs thread-count independent results makes each item's output depend on the item only.
// kt-kernel's init and finalize steps are the code before and after drain() in the region.
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

// Where a pool's time goes (set_stats(true); off by default, then nothing is timed): per region
// (run() call) the caller's hand-over and its wait for the slowest worker, per worker the time it
// spent inside fn and the delay from the release of a region to its start there. Wall-clock
// nanoseconds of steady_clock; tid 0 is the caller. For reports (ktd.bench.decode --breakdown);
// results never depend on it.
struct PoolStats {
    uint64_t runs = 0;             // run() calls (every region: parallel_for, for_each_item, ...)
    uint64_t barriers = 0;         // barrier() calls by tid 0 (every worker makes as many)
    uint64_t run_ns = 0;           // caller's time inside run(), release to return
    uint64_t join_wait_ns = 0;     // of which: after its own fn returned, waiting for the workers
    uint64_t join_sleeps = 0;      // joins that outlasted the spin and slept on the futex
    uint64_t barrier_wait_ns = 0;  // caller's time inside barrier() (waiting for the others)
    std::vector<uint64_t> busy_ns;   // [tid]: time inside fn (barrier waits included)
    std::vector<uint64_t> start_ns;  // [tid >= 1]: release of a region to fn starting there
    uint64_t worker_sleeps = 0;    // region starts a worker (tid >= 1) waited for past its spin, asleep
                                   // on the futex
};

// A list of work items claimed dynamically by the workers of a running region (contract above).
// reset() is not thread safe: call it while nobody claims, and publish it to the claimers through
// run() or a barrier. claim() is safe from any number of workers at once (one relaxed atomic add
// on the slice's own cache line). No allocation once it has seen its largest slice count.
class WorkList {
public:
    WorkList();
    ~WorkList();
    WorkList(const WorkList &) = delete;
    WorkList &operator=(const WorkList &) = delete;

    // One slice: items [0, n) for every worker.
    void reset(size_t n);
    // n_slice >= 1 slices: slice s holds items [first[s], first[s + 1]); first [n_slice + 1],
    // ascending. Throws std::invalid_argument otherwise.
    void reset(const size_t *first, int n_slice);
    int n_slices() const { return n_slice_; }
    // The next unclaimed item of slice `slice` (0 <= slice < n_slices(), unchecked) into `item`;
    // false when the slice has none left (then it stays false until the next reset).
    bool claim(int slice, size_t &item);
    // fn(item) for every item of `slice` that this worker claims, until the slice is exhausted.
    template <class Fn>
    void drain(int slice, Fn &&fn) {
        for (size_t item; claim(slice, item);) fn(item);
    }

private:
    struct Cursor;
    std::unique_ptr<Cursor[]> cursors_;  // [capacity_], one cache line each
    int capacity_ = 0, n_slice_ = 0;
};

// Items [0, n) cut into n_owner contiguous ranges, one per worker (as parallel_for cuts them):
// worker tid claims its own range front to back, and once it is empty takes items from the back
// of the others' (the next worker's first). For weights streamed item by item, where a WorkList
// would hand each worker every nth item: here a worker's consecutive items are consecutive in
// memory, so the hardware prefetcher's stream runs on from one item into the next instead of
// starting cold at each, and a thief takes the far end of a range, away from its owner's stream.
// The MoE decode's ~100-400 KiB items streamed 4-18% faster this way at 2 threads on a Zen 4, in
// 16 of 18 phase measurements (one even, one 6% slower; moe_decode.cpp). Same contract as
// WorkList otherwise: reset() while nobody claims, published through run() or a barrier; claim()
// from any number of workers at once (a compare-and-swap on the range's own cache line). No
// allocation once it has seen its largest owner count.
class RangeList {
public:
    RangeList();
    ~RangeList();
    RangeList(const RangeList &) = delete;
    RangeList &operator=(const RangeList &) = delete;

    // n < 2^32 items over n_owner >= 1 ranges; std::invalid_argument otherwise.
    void reset(size_t n, int n_owner);
    int n_owners() const { return n_owner_; }
    // The next item for worker tid (0 <= tid < n_owners(), unchecked): the front of its own range,
    // else the back of another's; false when every range is empty.
    bool claim(int tid, size_t &item);
    // fn(item) for every item this worker claims, until all ranges are empty.
    template <class Fn>
    void drain(int tid, Fn &&fn) {
        for (size_t item; claim(tid, item);) fn(item);
    }

private:
    struct Range;
    std::unique_ptr<Range[]> ranges_;  // [capacity_], one cache line each
    int capacity_ = 0, n_owner_ = 0;
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
    // fn(item, tid) once for every item in [0, n), claimed dynamically by all workers in one run()
    // (a WorkList owned by the pool). n = 0: returns without waking the workers. An exception from
    // fn is rethrown as by run(); items not yet claimed when it was thrown may or may not run.
    // A template, so that an item costs no indirect call and a capturing fn no allocation.
    template <class Fn>
    void for_each_item(size_t n, Fn &&fn) {
        if (n == 0) return;
        WorkList &list = item_list(n);
        run([&](int tid, int) { list.drain(0, [&](size_t item) { fn(item, tid); }); });
    }
    // The same per NUMA node: items [first[i], first[i + 1]) run only on workers of node nodes()[i];
    // first [nodes().size() + 1], ascending (std::invalid_argument otherwise).
    template <class Fn>
    void for_each_item_node(const std::vector<size_t> &first, Fn &&fn) {
        WorkList &list = item_list_node(first);
        if (first.back() == first.front()) return;
        run([&](int tid, int) { list.drain(node_index(tid), [&](size_t item) { fn(item, tid); }); });
    }

    int node_of(int tid) const;  // NUMA node of worker tid
    int cpu_of(int tid) const;   // CPU worker tid is pinned to (-1 if not pinned)

    // Additions beyond the original contract.
    std::vector<int> nodes() const;               // nodes with workers, ascending
    std::vector<int> workers_of_node(int node) const;  // tids on node, ascending (contiguous)
    int node_index(int tid) const;  // index of node_of(tid) in nodes(): the WorkList slice of tid
    int cpu_slot(int tid) const;   // CPU chosen for tid even if not pinned (-1 when pin=false)
    long thread_id(int tid) const; // kernel thread id (gettid) of worker tid >= 1; -1 for tid 0
    // Pins the calling thread to cpu_slot(0) for good, so that tid 0 runs on its node too.
    // Throws SysError. No-op when pin=false.
    void pin_caller();
    // Region timing (PoolStats above). set_stats(true) also clears the sums; call it, stats() and
    // reset_stats() from the thread that calls run(), between regions.
    void set_stats(bool on);
    bool stats_enabled() const;
    // The bounded spin of every wait (ThreadPoolOptions::spin_us), changed for the following waits
    // (a waiter already asleep stays so until woken): the hybrid forward raises it so the workers
    // still spin when the next MoE layer comes after the device's dense part. Call it between
    // regions. Ignored (stays 0) when the pool has more workers than usable CPUs;
    // std::invalid_argument below 0.
    void set_spin_us(int us);
    int spin_us() const;
    PoolStats stats() const;
    void reset_stats();

    struct Impl;

private:
    void barrier_wait(int tid);                                 // barrier() without the stats
    WorkList &item_list(size_t n);                              // the pool's list, reset to [0, n)
    WorkList &item_list_node(const std::vector<size_t> &first);  // checked, reset to the node ranges
    std::unique_ptr<Impl> impl_;
};

}  // namespace ktd
