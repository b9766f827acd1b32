// The emulated CUDA backend (cuda/cuda_api.h: cuda_api_emulated): the ABI v3-v4 of ktd_cuda.h
// implemented on the host, a test double, not a fast path. "Device" memory is host memory that the
// context tracks (so a kernel handed a host pointer, or a range running past an allocation, is an
// error here as it would be a fault on a GPU), the budget is enforced as the real context enforces
// it, the stream is one host thread running the enqueued work in order (so the callers'
// synchronisation is exercised: a host buffer read before its copy's event was waited for reads
// stale data here too), and the kernels run the arithmetic the CUDA kernels run (cuda/block_math.h,
// cuda/ops_math.h) on the CPU, one thread.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/float16.h"
#include "common/ggml_types.h"
#include "common/sum_squares.h"
#include "cuda/block_math.h"
#include "cuda/cuda_api.h"
#include "cuda/ops_math.h"

namespace ktd {
namespace {

static_assert(sizeof(bm::ActQ8) == KTD_CUDA_ACT_BLOCK_BYTES, "KTD_CUDA_ACT_BLOCK_BYTES is one ActQ8");

struct EmuEvent {
    uint64_t mark = 0;  // the stream's submitted count when recorded
};

struct EmuCtx {
    uint64_t budget = 0, used = 0;
    std::map<uintptr_t, uint64_t> dev;  // allocation start → bytes
    std::set<void *> host, events;
    std::string err;
    // The stream.
    std::mutex mu;
    std::condition_variable cv, done_cv;
    std::deque<std::function<void()>> queue;
    uint64_t submitted = 0, completed = 0;
    bool stop = false;
    std::string fault;  // the first fault of a running "kernel" (where a GPU would fault), under mu
    std::thread worker;

    EmuCtx() : worker([this] { loop(); }) {}
    ~EmuCtx() {
        {
            std::lock_guard<std::mutex> l(mu);
            stop = true;
        }
        cv.notify_all();
        worker.join();
        for (auto &[p, n] : dev) std::free(reinterpret_cast<void *>(p));
        for (void *p : host) std::free(p);
        for (void *e : events) delete static_cast<EmuEvent *>(e);
    }
    void loop() {
        std::unique_lock<std::mutex> l(mu);
        for (;;) {
            cv.wait(l, [&] { return stop || !queue.empty(); });
            if (queue.empty()) return;
            std::function<void()> fn = std::move(queue.front());
            queue.pop_front();
            l.unlock();
            fn();
            l.lock();
            ++completed;
            done_cv.notify_all();
        }
    }
    int enqueue(std::function<void()> fn) {
        {
            std::lock_guard<std::mutex> l(mu);
            queue.push_back(std::move(fn));
            ++submitted;
        }
        cv.notify_all();
        return 0;
    }
    // Waits until the stream has run up to mark; a fault of a kernel meanwhile is the error.
    int wait_for(uint64_t mark) {
        std::unique_lock<std::mutex> l(mu);
        done_cv.wait(l, [&] { return completed >= mark; });
        if (fault.empty()) return 0;
        err = fault;
        return KTD_CUDA_E_ARG;
    }
    // From a running kernel: an access outside its allocation (the kernel stops there).
    void kernel_fault(const std::string &what) {
        std::lock_guard<std::mutex> l(mu);
        if (fault.empty()) fault = "a kernel faulted (reported at the next sync): " + what;
    }
    uint64_t mark() {
        std::lock_guard<std::mutex> l(mu);
        return submitted;
    }
    int fail(int code, const std::string &what) {
        err = what;
        return code;
    }
    // The end of the device allocation p lies in (p checked with is_dev first).
    uintptr_t alloc_end(const void *p) const {
        auto it = --dev.upper_bound(reinterpret_cast<uintptr_t>(p));
        return it->first + it->second;
    }
    // Whether [p, p + bytes) lies inside one device allocation of this context.
    bool is_dev(const void *p, uint64_t bytes) const {
        const uintptr_t a = reinterpret_cast<uintptr_t>(p);
        auto it = dev.upper_bound(a);
        if (it == dev.begin()) return false;
        --it;
        return a >= it->first && a + bytes <= it->first + it->second;
    }
};

EmuCtx *C(KtdCudaCtx *c) { return reinterpret_cast<EmuCtx *>(c); }

std::string hex(const void *p) {
    char b[32];
    std::snprintf(b, sizeof b, "%p", p);
    return b;
}

// Every pointer of a kernel is a device range of this context.
#define EMU_DEV(ptr, bytes, what)                                                                              \
    do {                                                                                                       \
        if (!c->is_dev((ptr), uint64_t(bytes)))                                                                \
            return c->fail(KTD_CUDA_E_ARG, std::string(what) + ": " + hex(ptr) + " + " +                       \
                                               std::to_string(uint64_t(bytes)) +                              \
                                               " bytes is not inside a device allocation of this context");   \
    } while (0)
#define EMU_CTX(ctx)                                   \
    EmuCtx *c = C(ctx);                                \
    if (!c) return KTD_CUDA_E_ARG;

int ctx_create(int device, uint64_t budget, KtdCudaCtx **out, char *msg, size_t msg_n) {
    if (out) *out = nullptr;
    if (!out || device != 0) {
        if (msg && msg_n) std::snprintf(msg, msg_n, "emulated CUDA: only device 0 exists (asked for %d)", device);
        return KTD_CUDA_E_ARG;
    }
    auto *c = new EmuCtx;
    c->budget = budget;
    *out = reinterpret_cast<KtdCudaCtx *>(c);
    return 0;
}

void ctx_destroy(KtdCudaCtx *ctx) { delete C(ctx); }

const char *ctx_error(const KtdCudaCtx *ctx) {
    return ctx ? reinterpret_cast<const EmuCtx *>(ctx)->err.c_str() : "no context";
}

int mem_info(KtdCudaCtx *ctx, uint64_t *used, uint64_t *budget, uint64_t *dfree, uint64_t *dtotal) {
    EMU_CTX(ctx);
    if (used) *used = c->used;
    if (budget) *budget = c->budget;
    if (dfree) *dfree = 0;
    if (dtotal) *dtotal = 0;
    return 0;
}

int alloc(KtdCudaCtx *ctx, void **p, uint64_t bytes) {
    EMU_CTX(ctx);
    if (!p) return c->fail(KTD_CUDA_E_ARG, "alloc: null out pointer");
    *p = nullptr;
    if (c->budget && c->used + bytes > c->budget)
        return c->fail(KTD_CUDA_E_BUDGET, "alloc of " + std::to_string(bytes) + " bytes exceeds the VRAM budget: " +
                                              std::to_string(c->used) + " of " + std::to_string(c->budget) +
                                              " bytes in use");
    void *m = std::malloc(std::max<uint64_t>(bytes, 1));
    if (!m) return c->fail(KTD_CUDA_E_BUDGET, "alloc of " + std::to_string(bytes) + " bytes: out of host memory");
    c->dev[reinterpret_cast<uintptr_t>(m)] = bytes;
    c->used += bytes;
    *p = m;
    return 0;
}

int dfree(KtdCudaCtx *ctx, void *p) {
    EMU_CTX(ctx);
    if (!p) return 0;
    auto it = c->dev.find(reinterpret_cast<uintptr_t>(p));
    if (it == c->dev.end()) return c->fail(KTD_CUDA_E_ARG, "free: " + hex(p) + " is not a device allocation");
    c->wait_for(c->mark());  // cudaFree synchronizes too
    c->used -= it->second;
    c->dev.erase(it);
    std::free(p);
    return 0;
}

int host_alloc(KtdCudaCtx *ctx, void **p, uint64_t bytes) {
    EMU_CTX(ctx);
    if (!p) return c->fail(KTD_CUDA_E_ARG, "host_alloc: null out pointer");
    *p = std::malloc(std::max<uint64_t>(bytes, 1));
    if (!*p) return c->fail(KTD_CUDA_E_BUDGET, "host_alloc: out of memory");
    c->host.insert(*p);
    return 0;
}

int host_free(KtdCudaCtx *ctx, void *p) {
    EMU_CTX(ctx);
    if (!p) return 0;
    if (!c->host.erase(p)) return c->fail(KTD_CUDA_E_ARG, "host_free: " + hex(p) + " is not a pinned allocation");
    c->wait_for(c->mark());
    std::free(p);
    return 0;
}

// A copy's ends for its kind: the device side(s) inside an allocation ([p, p + span)), the host
// side not device memory. 0, or the error (`what`: "copy", "copy2d").
int check_copy(EmuCtx *c, const void *dst, uint64_t dspan, const void *src, uint64_t sspan, int kind,
               const std::string &what) {
    switch (kind) {
        case KTD_CUDA_H2D:
            EMU_DEV(dst, dspan, what + " to device (dst)");
            if (c->is_dev(src, 1)) return c->fail(KTD_CUDA_E_ARG, what + " to device: src is device memory");
            return 0;
        case KTD_CUDA_D2H:
            EMU_DEV(src, sspan, what + " to host (src)");
            if (c->is_dev(dst, 1)) return c->fail(KTD_CUDA_E_ARG, what + " to host: dst is device memory");
            return 0;
        case KTD_CUDA_D2D:
            EMU_DEV(src, sspan, what + " on device (src)");
            EMU_DEV(dst, dspan, what + " on device (dst)");
            return 0;
        default: return c->fail(KTD_CUDA_E_ARG, what + ": unknown kind " + std::to_string(kind));
    }
}

int copy(KtdCudaCtx *ctx, void *dst, const void *src, uint64_t bytes, int kind) {
    EMU_CTX(ctx);
    if (bytes == 0) return 0;
    if (const int rc = check_copy(c, dst, bytes, src, bytes, kind, "copy")) return rc;
    return c->enqueue([=] { std::memmove(dst, src, size_t(bytes)); });
}

int copy2d(KtdCudaCtx *ctx, void *dst, uint64_t dpitch, const void *src, uint64_t spitch, uint64_t width,
           uint64_t rows, int kind) {
    EMU_CTX(ctx);
    if (width == 0 || rows == 0) return 0;
    if (dpitch < width || spitch < width) return c->fail(KTD_CUDA_E_ARG, "copy2d: pitches must be >= the row width");
    // Each side from the first byte of the first row to the last byte of the last row.
    const uint64_t dspan = dpitch * (rows - 1) + width, sspan = spitch * (rows - 1) + width;
    if (const int rc = check_copy(c, dst, dspan, src, sspan, kind, "copy2d")) return rc;
    return c->enqueue([=] {
        for (uint64_t r = 0; r < rows; ++r)
            std::memmove(static_cast<char *>(dst) + r * dpitch, static_cast<const char *>(src) + r * spitch,
                         size_t(width));
    });
}

int memset0(KtdCudaCtx *ctx, void *p, uint64_t bytes) {
    EMU_CTX(ctx);
    if (bytes == 0) return 0;
    EMU_DEV(p, bytes, "memset");
    return c->enqueue([=] { std::memset(p, 0, size_t(bytes)); });
}

int sync(KtdCudaCtx *ctx) {
    EMU_CTX(ctx);
    return c->wait_for(c->mark());
}

int event_create(KtdCudaCtx *ctx, KtdCudaEvent **ev) {
    EMU_CTX(ctx);
    if (!ev) return c->fail(KTD_CUDA_E_ARG, "event_create: null out pointer");
    auto *e = new EmuEvent;
    c->events.insert(e);
    *ev = reinterpret_cast<KtdCudaEvent *>(e);
    return 0;
}

int event_destroy(KtdCudaCtx *ctx, KtdCudaEvent *ev) {
    EMU_CTX(ctx);
    if (!c->events.erase(ev)) return c->fail(KTD_CUDA_E_ARG, "event_destroy: not an event of this context");
    delete reinterpret_cast<EmuEvent *>(ev);
    return 0;
}

int event_record(KtdCudaCtx *ctx, KtdCudaEvent *ev) {
    EMU_CTX(ctx);
    if (!c->events.count(ev)) return c->fail(KTD_CUDA_E_ARG, "event_record: not an event of this context");
    reinterpret_cast<EmuEvent *>(ev)->mark = c->mark();
    return 0;
}

int event_wait(KtdCudaCtx *ctx, KtdCudaEvent *ev) {
    EMU_CTX(ctx);
    if (!c->events.count(ev)) return c->fail(KTD_CUDA_E_ARG, "event_wait: not an event of this context");
    return c->wait_for(reinterpret_cast<EmuEvent *>(ev)->mark);
}

// --- kernels ------------------------------------------------------------------------------------

template <class Block>
void gemv_q(const void *w, int64_t rows, int64_t k, const bm::ActQ8 *act, int64_t n, float *y) {
    const int64_t n_sub = k / 32;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t r = 0; r < rows; ++r) {
            const Block *row = static_cast<const Block *>(w) + r * (n_sub / bm::SubsPerBlock<Block>::value);
            float acc = 0.0f;
            for (int64_t t = 0; t < n_sub; ++t) {
                bm::Sub32 s;
                bm::unpack_row_sub(row, t, s);
                acc += bm::dot(s, act[i * n_sub + t]);
            }
            y[i * rows + r] = acc;
        }
}

template <int Type>
void gemv_f(const void *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t r = 0; r < rows; ++r) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; ++j) {
                const int64_t idx = r * k + j;
                float wv;
                if constexpr (Type == 0) wv = static_cast<const float *>(w)[idx];
                else if constexpr (Type == 1) wv = bm::half_to_float(static_cast<const uint16_t *>(w)[idx]);
                else wv = bm::bf16_to_float(static_cast<const uint16_t *>(w)[idx]);
                acc += wv * x[i * k + j];
            }
            y[i * rows + r] = acc;
        }
}

int gemv_batched(KtdCudaCtx *ctx, int type, const void *w, uint64_t w_stride, int64_t n_mat, int64_t rows, int64_t k,
                 const float *x, int64_t x_mat, int64_t x_pitch, int64_t n, float *y, int64_t y_mat, int64_t y_pitch,
                 void *act) {
    EMU_CTX(ctx);
    const GGMLType t = GGMLType(type);
    const auto row = ggml_row_size(t, uint64_t(k));
    const bool is_float = t == GGMLType::F32 || t == GGMLType::F16 || t == GGMLType::BF16;
    if (n_mat <= 0 || n_mat > 65535 || rows <= 0 || n <= 0 || k <= 0 || (!is_float && k % 32 != 0) || !row ||
        x_pitch < k || y_pitch < rows || x_mat < 0 || y_mat < 0)
        return c->fail(KTD_CUDA_E_ARG, "gemv_batched: 0 < n_mat <= 65535, k positive (a multiple of 32 for block "
                                       "types), rows and n positive, pitches at least a row");
    // Every matrix, activation row and output row inside one allocation (the first byte of the
    // first to the last byte of the last).
    EMU_DEV(w, w_stride * uint64_t(n_mat - 1) + *row * uint64_t(rows), "gemv_batched (w)");
    EMU_DEV(x, uint64_t(x_mat * (n_mat - 1) + x_pitch * (n - 1) + k) * 4, "gemv_batched (x)");
    EMU_DEV(y, uint64_t(y_mat * (n_mat - 1) + y_pitch * (n - 1) + rows) * 4, "gemv_batched (y)");
    auto mat = [=](int64_t m) { return static_cast<const char *>(w) + uint64_t(m) * w_stride; };
    switch (t) {
        case GGMLType::F32: case GGMLType::F16: case GGMLType::BF16:
            return c->enqueue([=] {
                for (int64_t m = 0; m < n_mat; ++m)
                    for (int64_t i = 0; i < n; ++i) {
                        const float *xi = x + m * x_mat + i * x_pitch;
                        float *yi = y + m * y_mat + i * y_pitch;
                        if (t == GGMLType::F32) gemv_f<0>(mat(m), rows, k, xi, 1, yi);
                        else if (t == GGMLType::F16) gemv_f<1>(mat(m), rows, k, xi, 1, yi);
                        else gemv_f<2>(mat(m), rows, k, xi, 1, yi);
                    }
            });
        default: break;
    }
    void (*f)(const void *, int64_t, int64_t, const bm::ActQ8 *, int64_t, float *) = nullptr;
    int64_t block_k = 0;
    if (!bm::visit_block_type(t, [&](auto b) {
            f = gemv_q<decltype(b)>;
            block_k = 32 * bm::SubsPerBlock<decltype(b)>::value;
        }))
        return c->fail(KTD_CUDA_E_UNSUPPORTED,
                       std::string("gemv_batched: no kernel for GGML type ") + std::string(ggml_type_name(t)));
    if (k % block_k) return c->fail(KTD_CUDA_E_ARG, "gemv_batched: k is not a whole number of blocks");
    const int64_t n_sub = k / 32;
    EMU_DEV(act, uint64_t(n_mat * n * n_sub) * KTD_CUDA_ACT_BLOCK_BYTES, "gemv_batched (act_scratch)");
    auto *a = static_cast<bm::ActQ8 *>(act);
    return c->enqueue([=] {
        // act [m][i][k/32], as the kernel lays it out
        for (int64_t m = 0; m < n_mat; ++m)
            for (int64_t i = 0; i < n; ++i)
                for (int64_t s = 0; s < n_sub; ++s)
                    bm::quantize_act(x + m * x_mat + i * x_pitch + 32 * s, a[(m * n + i) * n_sub + s]);
        for (int64_t m = 0; m < n_mat; ++m)
            for (int64_t i = 0; i < n; ++i) f(mat(m), rows, k, a + (m * n + i) * n_sub, 1, y + m * y_mat + i * y_pitch);
    });
}

// The plain GEMV: one matrix of the batched one.
int gemv(KtdCudaCtx *ctx, int type, const void *w, int64_t rows, int64_t k, const float *x, int64_t n, float *y,
         void *act) {
    return gemv_batched(ctx, type, w, 0, 1, rows, k, x, 0, k, n, y, 0, rows, act);
}

int rmsnorm(KtdCudaCtx *ctx, const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps) {
    EMU_CTX(ctx);
    if (rows <= 0 || n <= 0) return c->fail(KTD_CUDA_E_ARG, "rmsnorm: rows and n must be positive");
    EMU_DEV(x, uint64_t(rows * n) * 4, "rmsnorm (x)");
    EMU_DEV(y, uint64_t(rows * n) * 4, "rmsnorm (y)");
    if (w) EMU_DEV(w, uint64_t(n) * 4, "rmsnorm (w)");
    return c->enqueue([=] {
        for (int64_t r = 0; r < rows; ++r) {
            const float *xr = x + r * n;
            float *yr = y + r * n;
            const double ss = sum_squares_f64(xr, n);
            const float scale = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
            for (int64_t i = 0; i < n; ++i) yr[i] = w ? xr[i] * scale * w[i] : xr[i] * scale;
        }
    });
}

int rope(KtdCudaCtx *ctx, const KtdRope *rp, const float *ff, const int32_t *pos, float *x, int64_t n_tok,
         int n_heads, int64_t hd) {
    EMU_CTX(ctx);
    if (!rp || rp->n_rot <= 0 || rp->n_rot % 2 || rp->n_rot > hd || rp->n_rot > 512 || n_tok <= 0 || n_heads <= 0)
        return c->fail(KTD_CUDA_E_ARG, "rope: n_rot must be even, in (0, min(head_dim, 512)]; n_tok, n_heads positive");
    if (ff) EMU_DEV(ff, uint64_t(rp->n_rot / 2) * 4, "rope (freq_factors)");
    EMU_DEV(pos, uint64_t(n_tok) * 4, "rope (pos)");
    EMU_DEV(x, uint64_t(n_tok * n_heads * hd) * 4, "rope (x)");
    const KtdRope r = *rp;
    return c->enqueue([=] {
        float cs[512];
        for (int64_t t = 0; t < n_tok; ++t) {
            om::rope_cos_sin(r, ff, pos[t], cs);
            for (int h = 0; h < n_heads; ++h)
                for (int i = 0; i < r.n_rot / 2; ++i) om::rope_pair(r, cs, x + (t * n_heads + h) * hd, i);
        }
    });
}

int glu(KtdCudaCtx *ctx, int act, float *a, const float *b, int64_t n) {
    EMU_CTX(ctx);
    if (act < 0 || act >= om::kGluActs || n <= 0)
        return c->fail(KTD_CUDA_E_ARG, "glu: act 0 (silu), 1 (gelu_tanh) or 2 (relu2), n > 0");
    EMU_DEV(a, uint64_t(n) * 4, "glu (a)");
    EMU_DEV(b, uint64_t(n) * 4, "glu (b)");
    return c->enqueue([=] {
        for (int64_t i = 0; i < n; ++i) a[i] = om::glu_act(act, a[i]) * b[i];
    });
}

int scale(KtdCudaCtx *ctx, float *x, int64_t n, float s) {
    EMU_CTX(ctx);
    if (n <= 0) return c->fail(KTD_CUDA_E_ARG, "scale: n must be positive");
    EMU_DEV(x, uint64_t(n) * 4, "scale (x)");
    return c->enqueue([=] {
        for (int64_t i = 0; i < n; ++i) x[i] *= s;
    });
}

int add(KtdCudaCtx *ctx, float *a, const float *b, int64_t n) {
    EMU_CTX(ctx);
    if (n <= 0) return c->fail(KTD_CUDA_E_ARG, "add: n must be positive");
    EMU_DEV(a, uint64_t(n) * 4, "add (a)");
    EMU_DEV(b, uint64_t(n) * 4, "add (b)");
    return c->enqueue([=] {
        for (int64_t i = 0; i < n; ++i) a[i] += b[i];
    });
}

// The row indices are device data (read when the kernel runs): checked then against src's / y's
// allocation; scatter_add_rows also faults on a repeated index (the kernel's rows would race).
int gather_rows(KtdCudaCtx *ctx, float *dst, const float *src, const int32_t *idx, int64_t n, int64_t width) {
    EMU_CTX(ctx);
    if (n <= 0 || width <= 0 || !idx) return c->fail(KTD_CUDA_E_ARG, "gather_rows: n and width positive, idx given");
    EMU_DEV(dst, uint64_t(n * width) * 4, "gather_rows (dst)");
    EMU_DEV(src, uint64_t(width) * 4, "gather_rows (src)");
    EMU_DEV(idx, uint64_t(n) * 4, "gather_rows (idx)");
    const uintptr_t limit = c->alloc_end(src);
    return c->enqueue([=] {
        for (int64_t i = 0; i < n; ++i) {
            const float *row = src + int64_t(idx[i]) * width;
            if (idx[i] < 0 || reinterpret_cast<uintptr_t>(row + width) > limit)
                return c->kernel_fault("gather_rows: row " + std::to_string(idx[i]) + " is outside src");
            std::copy(row, row + width, dst + i * width);
        }
    });
}

int scatter_add_rows(KtdCudaCtx *ctx, float *y, const float *src, const int32_t *idx, const float *w, int64_t n,
                     int64_t width) {
    EMU_CTX(ctx);
    if (n <= 0 || width <= 0 || !idx || !w)
        return c->fail(KTD_CUDA_E_ARG, "scatter_add_rows: n and width positive, idx and w given");
    EMU_DEV(y, uint64_t(width) * 4, "scatter_add_rows (y)");
    EMU_DEV(src, uint64_t(n * width) * 4, "scatter_add_rows (src)");
    EMU_DEV(idx, uint64_t(n) * 4, "scatter_add_rows (idx)");
    EMU_DEV(w, uint64_t(n) * 4, "scatter_add_rows (w)");
    const uintptr_t limit = c->alloc_end(y);
    return c->enqueue([=] {
        std::vector<int32_t> seen(idx, idx + n);
        std::sort(seen.begin(), seen.end());
        if (std::adjacent_find(seen.begin(), seen.end()) != seen.end())
            return c->kernel_fault("scatter_add_rows: row " + std::to_string(*std::adjacent_find(seen.begin(), seen.end())) +
                                   " appears twice");
        for (int64_t i = 0; i < n; ++i) {
            float *row = y + int64_t(idx[i]) * width;
            if (idx[i] < 0 || reinterpret_cast<uintptr_t>(row + width) > limit)
                return c->kernel_fault("scatter_add_rows: row " + std::to_string(idx[i]) + " is outside y");
            for (int64_t d = 0; d < width; ++d) row[d] += w[i] * src[i * width + d];
        }
    });
}

int add_rows(KtdCudaCtx *ctx, float *y, const float *b, int64_t n, int64_t width) {
    EMU_CTX(ctx);
    if (n <= 0 || width <= 0) return c->fail(KTD_CUDA_E_ARG, "add_rows: n and width must be positive");
    EMU_DEV(y, uint64_t(n * width) * 4, "add_rows (y)");
    EMU_DEV(b, uint64_t(width) * 4, "add_rows (b)");
    return c->enqueue([=] {
        for (int64_t i = 0; i < n * width; ++i) y[i] += b[i % width];
    });
}

int gate_rows(KtdCudaCtx *ctx, float *y, const float *g, int64_t n, int64_t width) {
    EMU_CTX(ctx);
    if (n <= 0 || width <= 0) return c->fail(KTD_CUDA_E_ARG, "gate_rows: n and width must be positive");
    EMU_DEV(y, uint64_t(n * width) * 4, "gate_rows (y)");
    EMU_DEV(g, uint64_t(n) * 4, "gate_rows (g)");
    return c->enqueue([=] {
        for (int64_t i = 0; i < n; ++i) {
            const float s = 1.0f / (1.0f + std::exp(-g[i]));
            for (int64_t d = 0; d < width; ++d) y[i * width + d] *= s;
        }
    });
}

int kv_write(KtdCudaCtx *ctx, const float *src, int64_t n_tok, int64_t width, uint16_t *cache, const int64_t *rows) {
    EMU_CTX(ctx);
    if (n_tok <= 0 || width <= 0) return c->fail(KTD_CUDA_E_ARG, "kv_write: n_tok and width must be positive");
    EMU_DEV(src, uint64_t(n_tok * width) * 4, "kv_write (src)");
    EMU_DEV(rows, uint64_t(n_tok) * 8, "kv_write (rows)");
    EMU_DEV(cache, uint64_t(width) * 2, "kv_write (cache)");
    // The rows are device data (read when the kernel runs): each row's range is checked then.
    const uintptr_t limit = c->alloc_end(cache);
    return c->enqueue([=] {
        for (int64_t i = 0; i < n_tok; ++i) {
            uint16_t *dst = cache + rows[i] * width;
            if (rows[i] < 0 || reinterpret_cast<uintptr_t>(dst + width) > limit)
                return c->kernel_fault("kv_write: cache row " + std::to_string(rows[i]) + " is outside the cache");
            for (int64_t d = 0; d < width; ++d) dst[d] = fp32_to_fp16(src[i * width + d]);
        }
    });
}

// The attention kernel's arithmetic (cuda/kernels.cuh attn_kernel): cache row t holds KV head j's
// key at k + t·k_row + j·hd_k and its value at v + t·v_row + j·hd_v; token i attends rows
// [kv_first[i], kv_first[i] + n_kv[i]).
void attend(const float *q, const uint16_t *k, int64_t k_row, const uint16_t *v, int64_t v_row, float *out,
            int64_t n_tok, int n_head, int n_head_kv, int64_t hd_k, int64_t hd_v, const int64_t *kv_first,
            const int32_t *n_kv, float scale) {
    std::vector<float> acc(static_cast<size_t>(hd_v));
    for (int64_t i = 0; i < n_tok; ++i)
        for (int h = 0; h < n_head; ++h) {
            const int kvh = h / (n_head / n_head_kv);
            const float *qh = q + (i * n_head + h) * hd_k;
            std::fill(acc.begin(), acc.end(), 0.0f);
            float m = -INFINITY, l = 0.0f;
            for (int64_t t = 0; t < n_kv[i]; ++t) {
                const uint16_t *kt = k + (kv_first[i] + t) * k_row + kvh * hd_k;
                const uint16_t *vt = v + (kv_first[i] + t) * v_row + kvh * hd_v;
                float s = 0.0f;
                for (int64_t d = 0; d < hd_k; ++d) s += qh[d] * fp16_to_fp32(kt[d]);
                s *= scale;
                const float m2 = std::max(m, s), corr = std::exp(m - m2), p = std::exp(s - m2);
                l = l * corr + p;
                for (int64_t d = 0; d < hd_v; ++d) acc[size_t(d)] = acc[size_t(d)] * corr + p * fp16_to_fp32(vt[d]);
                m = m2;
            }
            float *o = out + (i * n_head + h) * hd_v;
            for (int64_t d = 0; d < hd_v; ++d) o[d] = l > 0.0f ? acc[size_t(d)] / l : 0.0f;
        }
}

int attention(KtdCudaCtx *ctx, const float *q, const uint16_t *k, const uint16_t *v, float *out, int64_t n_tok,
              int n_head, int n_head_kv, int64_t hd, const int64_t *kv_first, const int32_t *n_kv, float scale) {
    EMU_CTX(ctx);
    if (n_tok <= 0 || n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv || hd <= 0 || hd > 256)
        return c->fail(KTD_CUDA_E_ARG, "attention: n_head a multiple of n_head_kv, 0 < hd <= 256, n_tok > 0");
    EMU_DEV(q, uint64_t(n_tok * n_head * hd) * 4, "attention (q)");
    EMU_DEV(out, uint64_t(n_tok * n_head * hd) * 4, "attention (out)");
    EMU_DEV(k, uint64_t(n_head_kv * hd) * 2, "attention (k)");
    EMU_DEV(v, uint64_t(n_head_kv * hd) * 2, "attention (v)");
    EMU_DEV(kv_first, uint64_t(n_tok) * 8, "attention (kv_first)");
    EMU_DEV(n_kv, uint64_t(n_tok) * 4, "attention (n_kv)");
    const uintptr_t k_end = c->alloc_end(k), v_end = c->alloc_end(v);
    return c->enqueue([=] {
        const int64_t row = int64_t(n_head_kv) * hd;
        for (int64_t i = 0; i < n_tok; ++i)
            if (kv_first[i] < 0 || n_kv[i] < 0 ||
                reinterpret_cast<uintptr_t>(k + (kv_first[i] + n_kv[i]) * row) > k_end ||
                reinterpret_cast<uintptr_t>(v + (kv_first[i] + n_kv[i]) * row) > v_end)
                return c->kernel_fault("attention: token " + std::to_string(i) + "'s key range [" +
                                       std::to_string(kv_first[i]) + ", +" + std::to_string(n_kv[i]) +
                                       ") is outside the cache");
        attend(q, k, row, v, row, out, n_tok, n_head, n_head_kv, hd, hd, kv_first, n_kv, scale);
    });
}

int attention_mla(KtdCudaCtx *ctx, const float *q, const uint16_t *kv, float *out, int64_t n_tok, int n_head,
                  int64_t hd_k, int64_t hd_v, const int64_t *kv_first, const int32_t *n_kv, float scale) {
    EMU_CTX(ctx);
    if (n_tok <= 0 || n_head <= 0 || hd_v <= 0 || hd_v > hd_k || hd_k > 1024)
        return c->fail(KTD_CUDA_E_ARG, "attention_mla: 0 < hd_v <= hd_k <= 1024, n_tok and n_head positive");
    EMU_DEV(q, uint64_t(n_tok * n_head * hd_k) * 4, "attention_mla (q)");
    EMU_DEV(out, uint64_t(n_tok * n_head * hd_v) * 4, "attention_mla (out)");
    EMU_DEV(kv, uint64_t(hd_k) * 2, "attention_mla (kv)");
    EMU_DEV(kv_first, uint64_t(n_tok) * 8, "attention_mla (kv_first)");
    EMU_DEV(n_kv, uint64_t(n_tok) * 4, "attention_mla (n_kv)");
    const uintptr_t kv_end = c->alloc_end(kv);
    return c->enqueue([=] {
        for (int64_t i = 0; i < n_tok; ++i)
            if (kv_first[i] < 0 || n_kv[i] < 0 || reinterpret_cast<uintptr_t>(kv + (kv_first[i] + n_kv[i]) * hd_k) > kv_end)
                return c->kernel_fault("attention_mla: token " + std::to_string(i) + "'s key range [" +
                                       std::to_string(kv_first[i]) + ", +" + std::to_string(n_kv[i]) +
                                       ") is outside the cache");
        attend(q, kv, hd_k, kv, hd_k, out, n_tok, n_head, 1, hd_k, hd_v, kv_first, n_kv, scale);
    });
}

int probe(int *n, char *msg, size_t msg_n) {
    if (n) *n = 1;
    if (msg && msg_n) std::snprintf(msg, msg_n, "1 device(s); device 0: emulated on the host (a test double)");
    return 0;
}

int abi_version() { return KTD_CUDA_ABI_VERSION; }

}  // namespace

const CudaApi &cuda_api_emulated() {
    static const CudaApi api = [] {
        CudaApi a;
        a.name = "emulated";
        a.abi_version = abi_version;
        a.probe = probe;
        a.ctx_create = ctx_create;
        a.ctx_destroy = ctx_destroy;
        a.ctx_error = ctx_error;
        a.mem_info = mem_info;
        a.alloc = alloc;
        a.free = dfree;
        a.host_alloc = host_alloc;
        a.host_free = host_free;
        a.copy = copy;
        a.memset0 = memset0;
        a.sync = sync;
        a.event_create = event_create;
        a.event_destroy = event_destroy;
        a.event_record = event_record;
        a.event_wait = event_wait;
        a.gemv = gemv;
        a.rmsnorm = rmsnorm;
        a.rope = rope;
        a.glu = glu;
        a.add = add;
        a.add_rows = add_rows;
        a.gate_rows = gate_rows;
        a.scale = scale;
        a.gather_rows = gather_rows;
        a.scatter_add_rows = scatter_add_rows;
        a.kv_write = kv_write;
        a.attention = attention;
        a.copy2d = copy2d;
        a.gemv_batched = gemv_batched;
        a.attention_mla = attention_mla;
        return a;
    }();
    return api;
}

}  // namespace ktd
