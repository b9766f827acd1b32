// Placeholder implementation of the ThreadPool contract (thread_pool.h): correct, unpinned,
// condition-variable based. The Foundation issue replaces it with pinned, NUMA-grouped workers
// that spin before sleeping; the contract stays.
#include "cpu/thread_pool.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

namespace ktd {

struct ThreadPool::Impl {
    int nth = 1;
    std::vector<std::thread> threads;
    std::mutex mu;
    std::condition_variable cv_start, cv_done, cv_bar;
    const std::function<void(int, int)> *job = nullptr;
    uint64_t generation = 0;
    int running = 0;
    bool stop = false;
    std::exception_ptr error;
    // barrier
    int bar_count = 0;
    uint64_t bar_gen = 0;

    void call(int tid) {
        try {
            (*job)(tid, nth);
        } catch (...) {
            std::lock_guard<std::mutex> lk(mu);
            if (!error) error = std::current_exception();
        }
    }
    void worker(int tid) {
        uint64_t seen = 0;
        for (;;) {
            {
                std::unique_lock<std::mutex> lk(mu);
                cv_start.wait(lk, [&] { return stop || generation != seen; });
                if (stop) return;
                seen = generation;
            }
            call(tid);
            std::lock_guard<std::mutex> lk(mu);
            if (--running == 0) cv_done.notify_all();
        }
    }
};

ThreadPool::ThreadPool(const ThreadPoolOptions &opts) : impl_(std::make_unique<Impl>()) {
    int n = opts.n_threads > 0 ? opts.n_threads : (int)std::max(1u, std::thread::hardware_concurrency());
    impl_->nth = n;
    for (int t = 1; t < n; ++t) impl_->threads.emplace_back([this, t] { impl_->worker(t); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lk(impl_->mu);
        impl_->stop = true;
    }
    impl_->cv_start.notify_all();
    for (auto &t : impl_->threads) t.join();
}

int ThreadPool::size() const { return impl_->nth; }

void ThreadPool::run(const std::function<void(int, int)> &fn) {
    Impl &s = *impl_;
    {
        std::lock_guard<std::mutex> lk(s.mu);
        s.job = &fn;
        s.error = nullptr;
        s.running = s.nth - 1;
        ++s.generation;
    }
    s.cv_start.notify_all();
    s.call(0);
    std::unique_lock<std::mutex> lk(s.mu);
    s.cv_done.wait(lk, [&] { return s.running == 0; });
    s.job = nullptr;
    if (s.error) std::rethrow_exception(s.error);
}

void ThreadPool::barrier(int) {
    Impl &s = *impl_;
    std::unique_lock<std::mutex> lk(s.mu);
    uint64_t gen = s.bar_gen;
    if (++s.bar_count == s.nth) {
        s.bar_count = 0;
        ++s.bar_gen;
        s.cv_bar.notify_all();
    } else {
        s.cv_bar.wait(lk, [&] { return s.bar_gen != gen; });
    }
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t, int)> &fn) {
    run([&](int tid, int nth) {
        size_t chunk = (n + nth - 1) / nth;
        size_t b = std::min(n, chunk * tid), e = std::min(n, b + chunk);
        if (b < e) fn(b, e, tid);
    });
}

int ThreadPool::node_of(int) const { return 0; }
int ThreadPool::cpu_of(int) const { return -1; }

}  // namespace ktd
