// Pinned, NUMA-grouped persistent pool (contract and placement rules: thread_pool.h).
//
// Synchronisation is three futex words, each on its own cache line:
//   start_seq  incremented by run() to release the workers (they wait for it to change),
//   remaining  workers still inside fn; the last one to finish wakes a sleeping caller,
//   bar_gen    incremented by the last worker to arrive at a barrier.
// Every waiter spins for spin_us first and only then registers as a sleeper and calls
// FUTEX_WAIT; a waker issues FUTEX_WAKE only when a sleeper is registered, so the common
// hot handoff makes no system call. The sleeper count and the word are both seq_cst, so a
// waker either sees the sleeper or the sleeper sees the new value before it sleeps.
#include "cpu/thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <latch>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "common/error.h"
#include "cpu/topology.h"

namespace ktd {

namespace {

constexpr size_t kCacheLine = 64;
constexpr int kMaxUnpinnedThreads = 4096;

void futex_wait(std::atomic<uint32_t> &word, uint32_t expected) {
    // Returns on wake, on EAGAIN (value already changed) or EINTR; callers re-check the word.
    syscall(SYS_futex, reinterpret_cast<uint32_t *>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr,
            nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t> &word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t *>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
            nullptr, 0);
}

// One spin-wait step: a hint to the core that this is a busy-wait loop (x86 PAUSE, arm64 YIELD).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// Spins until done() or until spin_us have passed; true if done.
template <class Done>
bool spin_until(Done done, int spin_us) {
    if (done()) return true;
    if (spin_us <= 0) return false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
    for (unsigned i = 1;; ++i) {
        cpu_relax();
        if (done()) return true;
        if ((i & 63) == 0 && std::chrono::steady_clock::now() >= deadline) return false;
    }
}

// Waits until word != old: bounded spin, then futex sleep registered in sleepers. True when the
// spin ran out (the waiter registered as a sleeper).
bool wait_change(std::atomic<uint32_t> &word, uint32_t old, std::atomic<int> &sleepers, int spin_us) {
    if (spin_until([&] { return word.load(std::memory_order_acquire) != old; }, spin_us)) return false;
    for (;;) {
        sleepers.fetch_add(1, std::memory_order_seq_cst);
        if (word.load(std::memory_order_seq_cst) == old) futex_wait(word, old);
        sleepers.fetch_sub(1, std::memory_order_seq_cst);
        if (word.load(std::memory_order_acquire) != old) return true;
    }
}

// Thrown out of barrier() on the other workers once one worker's fn has thrown, so they unwind
// instead of waiting for a worker that will never arrive. run() rethrows the original error.
struct BarrierAborted : std::runtime_error {
    BarrierAborted() : std::runtime_error("thread pool run aborted: another worker threw") {}
};

int pin_to(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return sched_setaffinity(0, sizeof set, &set) == 0 ? 0 : errno;
}

}  // namespace

// Per-worker state, one cache line each so that workers never share a line they write.
struct alignas(kCacheLine) WorkerState {
    CpuSlot slot;           // cpu = -1 when the pool does not pin
    int node_index = 0;     // index of slot.node in nodes()
    long thread_id = -1;    // gettid(); -1 for tid 0 (the caller)
    int pin_errno = 0;      // result of pinning at start-up
    uint64_t busy_ns = 0;   // PoolStats, written by this worker only (read between regions)
    uint64_t start_ns = 0;
    uint64_t sleeps = 0;    // regions this worker waited for past its spin, asleep
};

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

struct ThreadPool::Impl {
    int nth = 1;
    bool pin = true;
    std::atomic<int> spin_us{50};  // set_spin_us between regions; workers read it at each wait
    bool oversubscribed = false;   // more workers than usable CPUs: never spin
    std::vector<WorkerState> workers;
    std::vector<std::thread> threads;
    int caller_cpu = -1;  // set by pin_caller()
    WorkList items;       // for_each_item's list (run() is not reentrant, so one is enough)
    // PoolStats: written by the caller between regions, published to the workers with the job.
    bool stats_on = false;
    int64_t release_t = 0;  // when the current region was released (stats_on only)
    PoolStats stats;        // the caller's sums (busy_ns/start_ns live in WorkerState)

    const std::function<void(int, int)> *job = nullptr;
    std::atomic<bool> stop{false};
    std::atomic<bool> failed{false};
    std::mutex error_mu;
    std::exception_ptr error;

    alignas(kCacheLine) std::atomic<uint32_t> start_seq{0};
    std::atomic<int> start_sleepers{0};
    alignas(kCacheLine) std::atomic<uint32_t> remaining{0};
    std::atomic<int> caller_sleeping{0};
    alignas(kCacheLine) std::atomic<uint32_t> bar_count{0};
    alignas(kCacheLine) std::atomic<uint32_t> bar_gen{0};
    std::atomic<int> bar_sleepers{0};

    void call(int tid) {
        try {
            (*job)(tid, nth);
        } catch (const BarrierAborted &) {
            // Consequence of another worker's error, which is the one reported.
        } catch (...) {
            {
                std::lock_guard<std::mutex> lk(error_mu);
                if (!error) error = std::current_exception();
            }
            failed.store(true, std::memory_order_seq_cst);
            bar_gen.fetch_add(1, std::memory_order_seq_cst);
            futex_wake_all(bar_gen);
        }
    }

    void worker_main(int tid, std::latch &started) {
        WorkerState &w = workers[tid];
        w.thread_id = long(syscall(SYS_gettid));
        if (pin) w.pin_errno = pin_to(w.slot.cpu);
        started.count_down();
        uint32_t seen = 0;
        for (;;) {
            const bool slept = wait_change(start_seq, seen, start_sleepers, spin_us.load(std::memory_order_relaxed));
            seen = start_seq.load(std::memory_order_acquire);
            if (stop.load(std::memory_order_acquire)) return;
            if (stats_on) {
                w.sleeps += slept;
                const int64_t t0 = now_ns();
                w.start_ns += uint64_t(std::max<int64_t>(0, t0 - release_t));
                call(tid);
                w.busy_ns += uint64_t(now_ns() - t0);
            } else {
                call(tid);
            }
            if (remaining.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
                caller_sleeping.load(std::memory_order_seq_cst))
                futex_wake_all(remaining);
        }
    }

    void release_workers() {
        start_seq.fetch_add(1, std::memory_order_seq_cst);
        if (start_sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(start_seq);
    }

    void shutdown() {
        stop.store(true, std::memory_order_release);
        release_workers();
        for (auto &t : threads)
            if (t.joinable()) t.join();
        threads.clear();
    }
};

ThreadPool::ThreadPool(const ThreadPoolOptions &opts) : impl_(std::make_unique<Impl>()) {
    Impl &s = *impl_;
    s.pin = opts.pin;
    s.spin_us.store(std::max(0, opts.spin_us));
    Topology topo = opts.affinity.empty() ? read_topology(opts.sysfs_root)
                                          : read_topology(opts.sysfs_root, opts.affinity);
    std::vector<CpuSlot> slots;
    if (opts.pin) {
        slots = choose_cpus(topo, opts.n_threads, opts.nodes, opts.smt);
    } else {
        if (opts.n_threads < 0 || opts.n_threads > kMaxUnpinnedThreads)
            throw std::invalid_argument("n_threads must be in [0, " + std::to_string(kMaxUnpinnedThreads) +
                                        "], got " + std::to_string(opts.n_threads));
        std::vector<CpuSlot> base = choose_cpus(topo, 0, opts.nodes, opts.smt);
        size_t n = opts.n_threads > 0 ? size_t(opts.n_threads) : base.size();
        for (size_t i = 0; i < n; ++i) slots.push_back(CpuSlot{-1, base[i % base.size()].node});
        // Keep the tids of one node contiguous, as in the pinned case.
        std::stable_sort(slots.begin(), slots.end(),
                         [](const CpuSlot &a, const CpuSlot &b) { return a.node < b.node; });
    }
    s.nth = int(slots.size());
    // More workers than usable CPUs: a spinning waiter would burn the time slice of the very
    // worker it waits for, so go straight to the futex.
    s.oversubscribed = size_t(s.nth) > topo.cpus.size();
    if (s.oversubscribed) s.spin_us.store(0);
    s.workers.resize(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) {
        s.workers[i].slot = slots[i];
        s.workers[i].node_index = i == 0 ? 0 : s.workers[i - 1].node_index + (slots[i].node != slots[i - 1].node);
    }

    std::latch started(s.nth - 1);
    try {
        for (int t = 1; t < s.nth; ++t) s.threads.emplace_back([&s, t, &started] { s.worker_main(t, started); });
    } catch (const std::system_error &e) {
        for (size_t k = s.threads.size() + 1; k < size_t(s.nth); ++k) started.count_down();
        started.wait();
        s.shutdown();
        throw SysError("pthread_create", e.code().value());
    }
    started.wait();
    for (int t = 1; t < s.nth; ++t)
        if (s.workers[t].pin_errno) {
            int e = s.workers[t].pin_errno, cpu = s.workers[t].slot.cpu;
            s.shutdown();
            throw SysError("sched_setaffinity(cpu " + std::to_string(cpu) + ")", e);
        }
}

ThreadPool::~ThreadPool() { impl_->shutdown(); }

int ThreadPool::size() const { return impl_->nth; }

void ThreadPool::run(const std::function<void(int, int)> &fn) {
    Impl &s = *impl_;
    s.job = &fn;
    s.error = nullptr;
    s.failed.store(false, std::memory_order_relaxed);
    s.bar_count.store(0, std::memory_order_relaxed);  // an aborted run may leave arrivals behind
    s.remaining.store(uint32_t(s.nth - 1), std::memory_order_relaxed);
    const bool st = s.stats_on;
    const int64_t t_release = st ? now_ns() : 0;
    s.release_t = t_release;
    if (s.nth > 1) s.release_workers();  // seq_cst: publishes job and the resets above
    s.call(0);
    const int64_t t_own = st ? now_ns() : 0;
    auto done = [&] { return s.remaining.load(std::memory_order_acquire) == 0; };
    if (!spin_until(done, s.spin_us.load(std::memory_order_relaxed))) {
        if (st) ++s.stats.join_sleeps;
        for (;;) {
            s.caller_sleeping.store(1, std::memory_order_seq_cst);
            uint32_t r = s.remaining.load(std::memory_order_seq_cst);
            if (r == 0) break;
            futex_wait(s.remaining, r);
        }
        s.caller_sleeping.store(0, std::memory_order_relaxed);
    }
    if (st) {
        const int64_t t_end = now_ns();
        ++s.stats.runs;
        s.stats.run_ns += uint64_t(t_end - t_release);
        s.stats.join_wait_ns += uint64_t(t_end - t_own);
        s.workers[0].busy_ns += uint64_t(t_own - t_release);
    }
    s.job = nullptr;
    if (s.error) {
        std::exception_ptr e = std::move(s.error);
        s.error = nullptr;
        std::rethrow_exception(e);
    }
}

void ThreadPool::barrier(int tid) {
    Impl &s = *impl_;
    if (tid == 0 && s.stats_on) {
        // The caller's wait (stats_on does not change inside a region).
        ++s.stats.barriers;
        const int64_t t0 = now_ns();
        struct AddOnExit {
            Impl &s;
            int64_t t0;
            ~AddOnExit() { s.stats.barrier_wait_ns += uint64_t(now_ns() - t0); }
        } add{s, t0};
        barrier_wait(tid);
        return;
    }
    barrier_wait(tid);
}

void ThreadPool::barrier_wait(int tid) {
    Impl &s = *impl_;
    if (s.nth == 1) return;
    if (s.failed.load(std::memory_order_acquire)) throw BarrierAborted();
    const uint32_t gen = s.bar_gen.load(std::memory_order_acquire);
    if (s.bar_count.fetch_add(1, std::memory_order_acq_rel) + 1 == uint32_t(s.nth)) {
        s.bar_count.store(0, std::memory_order_relaxed);
        s.bar_gen.fetch_add(1, std::memory_order_seq_cst);
        if (s.bar_sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(s.bar_gen);
        return;
    }
    wait_change(s.bar_gen, gen, s.bar_sleepers, s.spin_us.load(std::memory_order_relaxed));
    if (s.failed.load(std::memory_order_acquire)) throw BarrierAborted();
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t, int)> &fn) {
    run([&](int tid, int nth) {
        size_t chunk = (n + size_t(nth) - 1) / size_t(nth);
        size_t b = std::min(n, chunk * size_t(tid)), e = std::min(n, b + chunk);
        if (b < e) fn(b, e, tid);
    });
}

void ThreadPool::parallel_for_node(int node, size_t n,
                                   const std::function<void(size_t, size_t, int)> &fn) {
    const std::vector<int> tids = workers_of_node(node);
    if (tids.empty())
        throw std::invalid_argument("thread pool has no worker on NUMA node " + std::to_string(node));
    const int first = tids.front(), count = int(tids.size());
    run([&](int tid, int) {
        if (tid < first || tid >= first + count) return;
        size_t chunk = (n + size_t(count) - 1) / size_t(count);
        size_t b = std::min(n, chunk * size_t(tid - first)), e = std::min(n, b + chunk);
        if (b < e) fn(b, e, tid);
    });
}

WorkList &ThreadPool::item_list(size_t n) {
    impl_->items.reset(n);
    return impl_->items;
}

WorkList &ThreadPool::item_list_node(const std::vector<size_t> &first) {
    const size_t n_node = nodes().size();
    if (first.size() != n_node + 1)
        throw std::invalid_argument("for_each_item_node: " + std::to_string(first.size()) +
                                    " range bounds for a pool on " + std::to_string(n_node) + " NUMA node(s), expected " +
                                    std::to_string(n_node + 1));
    impl_->items.reset(first.data(), int(n_node));
    return impl_->items;
}

// Each slice's cursor and end on a cache line of its own: workers of different nodes never
// write the same line.
struct alignas(kCacheLine) WorkList::Cursor {
    std::atomic<size_t> next{0};
    size_t end = 0;
};

WorkList::WorkList() = default;
WorkList::~WorkList() = default;

void WorkList::reset(size_t n) {
    const size_t first[2] = {0, n};
    reset(first, 1);
}

void WorkList::reset(const size_t *first, int n_slice) {
    if (n_slice < 1) throw std::invalid_argument("WorkList: " + std::to_string(n_slice) + " slices, expected >= 1");
    for (int i = 0; i < n_slice; ++i)
        if (first[i] > first[i + 1])
            throw std::invalid_argument("WorkList: slice " + std::to_string(i) + " ends before it starts (" +
                                        std::to_string(first[i]) + " > " + std::to_string(first[i + 1]) + ")");
    if (n_slice > capacity_) {
        cursors_ = std::make_unique<Cursor[]>(size_t(n_slice));
        capacity_ = n_slice;
    }
    for (int i = 0; i < n_slice; ++i) {
        cursors_[size_t(i)].next.store(first[i], std::memory_order_relaxed);
        cursors_[size_t(i)].end = first[i + 1];
    }
    n_slice_ = n_slice;
}

bool WorkList::claim(int slice, size_t &item) {
    Cursor &c = cursors_[size_t(slice)];
    // Past the end the counter keeps growing; harmless, it is reset before the next use.
    item = c.next.fetch_add(1, std::memory_order_relaxed);
    return item < c.end;
}

// A range [lo, hi) packed as lo | hi << 32 in one word, so that the owner (lo + 1) and a thief
// (hi - 1) race on one compare-and-swap and never both take the last item.
struct alignas(kCacheLine) RangeList::Range {
    std::atomic<uint64_t> lo_hi{0};
};

RangeList::RangeList() = default;
RangeList::~RangeList() = default;

void RangeList::reset(size_t n, int n_owner) {
    if (n_owner < 1) throw std::invalid_argument("RangeList: " + std::to_string(n_owner) + " owners, expected >= 1");
    if (n >= (size_t(1) << 32)) throw std::invalid_argument("RangeList: " + std::to_string(n) + " items, expected < 2^32");
    if (n_owner > capacity_) {
        ranges_ = std::make_unique<Range[]>(size_t(n_owner));
        capacity_ = n_owner;
    }
    for (int t = 0; t < n_owner; ++t) {
        const uint64_t lo = n * size_t(t) / size_t(n_owner), hi = n * size_t(t + 1) / size_t(n_owner);
        ranges_[size_t(t)].lo_hi.store(lo | (hi << 32), std::memory_order_relaxed);
    }
    n_owner_ = n_owner;
}

// Takes the front (lo) or the back (hi - 1) item of a packed range; false when it is empty.
// Relaxed is enough, as in WorkList::claim: the items' inputs were published by the reset's run()
// or barrier, and their outputs are synchronized by the caller's own counters or barrier.
static bool take_item(std::atomic<uint64_t> &lo_hi, bool front, size_t &item) {
    constexpr uint64_t kLow = 0xffffffffu;
    const uint64_t step = front ? 1 : uint64_t(1) << 32;
    for (uint64_t v = lo_hi.load(std::memory_order_relaxed); (v & kLow) < (v >> 32);)
        if (lo_hi.compare_exchange_weak(v, front ? v + step : v - step, std::memory_order_relaxed)) {
            item = size_t(front ? v & kLow : (v >> 32) - 1);
            return true;
        }
    return false;
}

bool RangeList::claim(int tid, size_t &item) {
    if (take_item(ranges_[size_t(tid)].lo_hi, true, item)) return true;
    for (int k = 1; k < n_owner_; ++k)
        if (take_item(ranges_[size_t((tid + k) % n_owner_)].lo_hi, false, item)) return true;
    return false;
}

static void check_tid(const ThreadPool::Impl &s, int tid) {
    if (tid < 0 || tid >= s.nth)
        throw std::out_of_range("worker id " + std::to_string(tid) + " out of range [0, " +
                                std::to_string(s.nth) + ")");
}

int ThreadPool::node_of(int tid) const {
    check_tid(*impl_, tid);
    return impl_->workers[tid].slot.node;
}

int ThreadPool::cpu_of(int tid) const {
    check_tid(*impl_, tid);
    if (tid == 0) return impl_->caller_cpu;
    return impl_->pin ? impl_->workers[tid].slot.cpu : -1;
}

int ThreadPool::cpu_slot(int tid) const {
    check_tid(*impl_, tid);
    return impl_->workers[tid].slot.cpu;
}

long ThreadPool::thread_id(int tid) const {
    check_tid(*impl_, tid);
    return impl_->workers[tid].thread_id;
}

std::vector<int> ThreadPool::nodes() const {
    std::vector<int> out;
    for (const auto &w : impl_->workers)
        if (out.empty() || out.back() != w.slot.node) out.push_back(w.slot.node);
    return out;
}

std::vector<int> ThreadPool::workers_of_node(int node) const {
    std::vector<int> out;
    for (int t = 0; t < impl_->nth; ++t)
        if (impl_->workers[t].slot.node == node) out.push_back(t);
    return out;
}

int ThreadPool::node_index(int tid) const {
    check_tid(*impl_, tid);
    return impl_->workers[size_t(tid)].node_index;
}

void ThreadPool::pin_caller() {
    Impl &s = *impl_;
    if (!s.pin) return;
    int cpu = s.workers[0].slot.cpu;
    if (int e = pin_to(cpu)) throw SysError("sched_setaffinity(cpu " + std::to_string(cpu) + ")", e);
    s.caller_cpu = cpu;
}

}  // namespace ktd

namespace ktd {

void ThreadPool::set_stats(bool on) {
    impl_->stats_on = on;
    if (on) reset_stats();
}

bool ThreadPool::stats_enabled() const { return impl_->stats_on; }

PoolStats ThreadPool::stats() const {
    const Impl &s = *impl_;
    PoolStats out = s.stats;
    for (const WorkerState &w : s.workers) {
        out.busy_ns.push_back(w.busy_ns);
        out.start_ns.push_back(w.start_ns);
        out.worker_sleeps += w.sleeps;
    }
    return out;
}

void ThreadPool::reset_stats() {
    Impl &s = *impl_;
    s.stats = PoolStats{};
    for (WorkerState &w : s.workers) w.busy_ns = w.start_ns = w.sleeps = 0;
}

void ThreadPool::set_spin_us(int us) {
    if (us < 0) throw std::invalid_argument("spin_us must be >= 0, got " + std::to_string(us));
    if (!impl_->oversubscribed) impl_->spin_us.store(us, std::memory_order_relaxed);
}

int ThreadPool::spin_us() const { return impl_->spin_us.load(std::memory_order_relaxed); }

}  // namespace ktd
