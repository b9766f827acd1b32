// libktd_cuda.so's ABI v3-v4 (ktd_cuda.h): a context on one device with its stream, allocations
// within a VRAM budget, pinned host buffers, events, and the kernels of cuda/kernels.cuh enqueued
// on device pointers. What model/cuda_device.h drives; cuda/emu_device.cpp is the same ABI
// emulated on the host, which is how the orchestration is tested without a GPU.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <map>
#include <set>
#include <string>

#include "common/ggml_types.h"
#include "cuda/kernels.cuh"
#include "cuda/ktd_cuda.h"

struct KtdCudaCtx {
    int device = 0;
    cudaStream_t stream = nullptr;
    uint64_t budget = 0, used = 0;
    std::map<void *, uint64_t> dev;
    std::set<void *> host;
    std::set<KtdCudaEvent *> events;
    std::string err;
};

struct KtdCudaEvent {
    cudaEvent_t e = nullptr;
};

namespace {

int fail(KtdCudaCtx *c, int code, const std::string &what) {
    c->err = what;
    return code;
}

int cuda_fail(KtdCudaCtx *c, const char *step, cudaError_t e) {
    return fail(c, int(e), std::string(step) + ": " + cudaGetErrorString(e) + " (" + cudaGetErrorName(e) + ")");
}

// After a launch: a configuration error is reported now, a fault by the next sync.
int launched(KtdCudaCtx *c, const char *what) {
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : cuda_fail(c, what, e);
}

// The context's device is current on the calling thread (the forward may run on any thread).
int use(KtdCudaCtx *c) {
    const cudaError_t e = cudaSetDevice(c->device);
    return e == cudaSuccess ? 0 : cuda_fail(c, "cudaSetDevice", e);
}

unsigned grid(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

}  // namespace

#define KTD_USE(c)                        \
    do {                                  \
        if (!(c)) return KTD_CUDA_E_ARG;  \
        if (int rc_ = use(c)) return rc_; \
    } while (0)

extern "C" int ktd_cuda_ctx_create(int device, uint64_t vram_budget, KtdCudaCtx **out, char *msg, size_t msg_n) {
    if (out) *out = nullptr;
    auto say = [&](const char *what, cudaError_t e) {
        if (msg && msg_n) std::snprintf(msg, msg_n, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
        return int(e);
    };
    if (!out) return KTD_CUDA_E_ARG;
    int count = 0;
    if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) return say("cudaGetDeviceCount", e);
    if (device < 0 || device >= count) {
        if (msg && msg_n) std::snprintf(msg, msg_n, "CUDA device %d does not exist (%d visible)", device, count);
        return KTD_CUDA_E_ARG;
    }
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return say("cudaSetDevice", e);
    auto *c = new KtdCudaCtx;
    c->device = device;
    c->budget = vram_budget;
    if (cudaError_t e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking); e != cudaSuccess) {
        delete c;
        return say("cudaStreamCreate", e);
    }
    *out = c;
    return 0;
}

extern "C" void ktd_cuda_ctx_destroy(KtdCudaCtx *c) {
    if (!c) return;
    cudaSetDevice(c->device);
    cudaStreamSynchronize(c->stream);
    for (auto &[p, n] : c->dev) cudaFree(p);
    for (void *p : c->host) cudaFreeHost(p);
    for (KtdCudaEvent *e : c->events) {
        cudaEventDestroy(e->e);
        delete e;
    }
    cudaStreamDestroy(c->stream);
    delete c;
}

extern "C" const char *ktd_cuda_ctx_error(const KtdCudaCtx *c) { return c ? c->err.c_str() : "no context"; }

extern "C" int ktd_cuda_mem_info(KtdCudaCtx *c, uint64_t *used, uint64_t *budget, uint64_t *dfree, uint64_t *dtotal) {
    KTD_USE(c);
    size_t f = 0, t = 0;
    if (cudaError_t e = cudaMemGetInfo(&f, &t); e != cudaSuccess) return cuda_fail(c, "cudaMemGetInfo", e);
    if (used) *used = c->used;
    if (budget) *budget = c->budget;
    if (dfree) *dfree = f;
    if (dtotal) *dtotal = t;
    return 0;
}

extern "C" int ktd_cuda_alloc(KtdCudaCtx *c, void **p, uint64_t bytes) {
    KTD_USE(c);
    if (!p) return fail(c, KTD_CUDA_E_ARG, "alloc: null out pointer");
    *p = nullptr;
    if (c->budget && c->used + bytes > c->budget)
        return fail(c, KTD_CUDA_E_BUDGET, "alloc of " + std::to_string(bytes) + " bytes exceeds the VRAM budget: " +
                                              std::to_string(c->used) + " of " + std::to_string(c->budget) +
                                              " bytes in use");
    if (cudaError_t e = cudaMalloc(p, bytes ? bytes : 1); e != cudaSuccess)
        return cuda_fail(c, ("cudaMalloc(" + std::to_string(bytes) + ")").c_str(), e);
    c->dev[*p] = bytes;
    c->used += bytes;
    return 0;
}

extern "C" int ktd_cuda_free(KtdCudaCtx *c, void *p) {
    KTD_USE(c);
    if (!p) return 0;
    auto it = c->dev.find(p);
    if (it == c->dev.end()) return fail(c, KTD_CUDA_E_ARG, "free: not a device allocation of this context");
    c->used -= it->second;
    c->dev.erase(it);
    if (cudaError_t e = cudaFree(p); e != cudaSuccess) return cuda_fail(c, "cudaFree", e);
    return 0;
}

extern "C" int ktd_cuda_host_alloc(KtdCudaCtx *c, void **p, uint64_t bytes) {
    KTD_USE(c);
    if (!p) return fail(c, KTD_CUDA_E_ARG, "host_alloc: null out pointer");
    if (cudaError_t e = cudaMallocHost(p, bytes ? bytes : 1); e != cudaSuccess) return cuda_fail(c, "cudaMallocHost", e);
    c->host.insert(*p);
    return 0;
}

extern "C" int ktd_cuda_host_free(KtdCudaCtx *c, void *p) {
    KTD_USE(c);
    if (!p) return 0;
    if (!c->host.erase(p)) return fail(c, KTD_CUDA_E_ARG, "host_free: not a pinned allocation of this context");
    if (cudaError_t e = cudaFreeHost(p); e != cudaSuccess) return cuda_fail(c, "cudaFreeHost", e);
    return 0;
}

// KTD_CUDA_H2D/D2H/D2D as the runtime's kind; cudaMemcpyDefault for anything else.
static cudaMemcpyKind memcpy_kind(int kind) {
    return kind == KTD_CUDA_H2D   ? cudaMemcpyHostToDevice
           : kind == KTD_CUDA_D2H ? cudaMemcpyDeviceToHost
           : kind == KTD_CUDA_D2D ? cudaMemcpyDeviceToDevice
                                  : cudaMemcpyDefault;
}

extern "C" int ktd_cuda_copy(KtdCudaCtx *c, void *dst, const void *src, uint64_t bytes, int kind) {
    KTD_USE(c);
    if (bytes == 0) return 0;
    const cudaMemcpyKind k = memcpy_kind(kind);
    if (k == cudaMemcpyDefault) return fail(c, KTD_CUDA_E_ARG, "copy: unknown kind " + std::to_string(kind));
    if (cudaError_t e = cudaMemcpyAsync(dst, src, bytes, k, c->stream); e != cudaSuccess)
        return cuda_fail(c, "cudaMemcpyAsync", e);
    return 0;
}

extern "C" int ktd_cuda_copy2d(KtdCudaCtx *c, void *dst, uint64_t dpitch, const void *src, uint64_t spitch,
                               uint64_t width, uint64_t rows, int kind) {
    KTD_USE(c);
    if (width == 0 || rows == 0) return 0;
    if (dpitch < width || spitch < width) return fail(c, KTD_CUDA_E_ARG, "copy2d: pitches must be >= the row width");
    const cudaMemcpyKind k = memcpy_kind(kind);
    if (k == cudaMemcpyDefault) return fail(c, KTD_CUDA_E_ARG, "copy2d: unknown kind " + std::to_string(kind));
    if (cudaError_t e = cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, k, c->stream); e != cudaSuccess)
        return cuda_fail(c, "cudaMemcpy2DAsync", e);
    return 0;
}

extern "C" int ktd_cuda_memset0(KtdCudaCtx *c, void *p, uint64_t bytes) {
    KTD_USE(c);
    if (cudaError_t e = cudaMemsetAsync(p, 0, bytes, c->stream); e != cudaSuccess)
        return cuda_fail(c, "cudaMemsetAsync", e);
    return 0;
}

extern "C" int ktd_cuda_sync(KtdCudaCtx *c) {
    KTD_USE(c);
    if (cudaError_t e = cudaStreamSynchronize(c->stream); e != cudaSuccess) return cuda_fail(c, "the stream", e);
    return 0;
}

extern "C" int ktd_cuda_event_create(KtdCudaCtx *c, KtdCudaEvent **ev) {
    KTD_USE(c);
    if (!ev) return fail(c, KTD_CUDA_E_ARG, "event_create: null out pointer");
    auto *e = new KtdCudaEvent;
    if (cudaError_t r = cudaEventCreateWithFlags(&e->e, cudaEventDisableTiming); r != cudaSuccess) {
        delete e;
        return cuda_fail(c, "cudaEventCreate", r);
    }
    c->events.insert(e);
    *ev = e;
    return 0;
}

extern "C" int ktd_cuda_event_destroy(KtdCudaCtx *c, KtdCudaEvent *ev) {
    KTD_USE(c);
    if (!c->events.erase(ev)) return fail(c, KTD_CUDA_E_ARG, "event_destroy: not an event of this context");
    cudaEventDestroy(ev->e);
    delete ev;
    return 0;
}

extern "C" int ktd_cuda_event_record(KtdCudaCtx *c, KtdCudaEvent *ev) {
    KTD_USE(c);
    if (!c->events.count(ev)) return fail(c, KTD_CUDA_E_ARG, "event_record: not an event of this context");
    if (cudaError_t e = cudaEventRecord(ev->e, c->stream); e != cudaSuccess) return cuda_fail(c, "cudaEventRecord", e);
    return 0;
}

extern "C" int ktd_cuda_event_wait(KtdCudaCtx *c, KtdCudaEvent *ev) {
    KTD_USE(c);
    if (!c->events.count(ev)) return fail(c, KTD_CUDA_E_ARG, "event_wait: not an event of this context");
    if (cudaError_t e = cudaEventSynchronize(ev->e); e != cudaSuccess) return cuda_fail(c, "the stream (event)", e);
    return 0;
}

extern "C" int ktd_cuda_gemv_batched(KtdCudaCtx *c, int type, const void *w, uint64_t w_stride, int64_t n_mat,
                                     int64_t rows, int64_t k, const float *x, int64_t x_mat, int64_t x_pitch, int64_t n,
                                     float *y, int64_t y_mat, int64_t y_pitch, void *act_scratch) {
    KTD_USE(c);
    const bool is_float = type == int(GGMLType::F32) || type == int(GGMLType::F16) || type == int(GGMLType::BF16);
    if (n_mat <= 0 || n_mat > 65535 || rows <= 0 || n <= 0 || k <= 0 || (!is_float && k % 32 != 0) ||
        x_pitch < k || y_pitch < rows)
        return fail(c, KTD_CUDA_E_ARG, "gemv_batched: 0 < n_mat <= 65535, k positive (a multiple of 32 for block "
                                       "types), rows and n positive, pitches at least a row");
    const dim3 g(blocks_for(rows * n * 32), unsigned(n_mat));
    cudaStream_t st = c->stream;
    switch (GGMLType(type)) {
        case GGMLType::F32:
            gemv_f_batched_kernel<0><<<g, kThreads, 0, st>>>(w, w_stride, rows, k, x, x_mat, x_pitch, n, y, y_mat, y_pitch);
            return launched(c, "gemv_batched");
        case GGMLType::F16:
            gemv_f_batched_kernel<1><<<g, kThreads, 0, st>>>(w, w_stride, rows, k, x, x_mat, x_pitch, n, y, y_mat, y_pitch);
            return launched(c, "gemv_batched");
        case GGMLType::BF16:
            gemv_f_batched_kernel<2><<<g, kThreads, 0, st>>>(w, w_stride, rows, k, x, x_mat, x_pitch, n, y, y_mat, y_pitch);
            return launched(c, "gemv_batched");
        default: break;
    }
    int64_t block_k = 0;
    if (!bm::visit_block_type(GGMLType(type), [&](auto b) { block_k = 32 * bm::SubsPerBlock<decltype(b)>::value; }))
        return fail(c, KTD_CUDA_E_UNSUPPORTED, "gemv_batched: no kernel for GGML type " + std::to_string(type) +
                                                   " (F32, F16, BF16, " + bm::kBlockTypeNames + ")");
    if (k % block_k) return fail(c, KTD_CUDA_E_ARG, "gemv_batched: k is not a whole number of blocks");
    if (!act_scratch) return fail(c, KTD_CUDA_E_ARG, "gemv_batched: a block type needs act_scratch");
    auto *act = static_cast<ActQ8 *>(act_scratch);
    quantize_act_batched_kernel<<<blocks_for(n_mat * n * (k / 32)), kThreads, 0, st>>>(x, x_mat, x_pitch, k, n, n_mat,
                                                                                     act);
    bm::visit_block_type(GGMLType(type), [&](auto b) {
        launch_q_batched<decltype(b)>(w, w_stride, n_mat, rows, k, act, n, y, y_mat, y_pitch, st);
    });
    return launched(c, "gemv_batched");
}

// The plain GEMV: one matrix of the batched one, y [n][rows] = W · x [n][k].
extern "C" int ktd_cuda_gemv(KtdCudaCtx *c, int type, const void *w, int64_t rows, int64_t k, const float *x,
                             int64_t n, float *y, void *act_scratch) {
    return ktd_cuda_gemv_batched(c, type, w, 0, 1, rows, k, x, 0, k, n, y, 0, rows, act_scratch);
}

extern "C" int ktd_cuda_rmsnorm(KtdCudaCtx *c, const float *x, const float *w, float *y, int64_t rows, int64_t n,
                                float eps) {
    KTD_USE(c);
    if (rows <= 0 || n <= 0) return fail(c, KTD_CUDA_E_ARG, "rmsnorm: rows and n must be positive");
    rmsnorm_kernel<<<unsigned(rows), 256, 0, c->stream>>>(x, w, y, n, eps);
    return launched(c, "rmsnorm");
}

extern "C" int ktd_cuda_rope(KtdCudaCtx *c, const KtdRope *rp, const float *ff, const int32_t *pos, float *x,
                             int64_t n_tok, int n_heads, int64_t hd) {
    KTD_USE(c);
    if (!rp || rp->n_rot <= 0 || rp->n_rot % 2 || rp->n_rot > hd || rp->n_rot > 512 || n_tok <= 0 || n_heads <= 0)
        return fail(c, KTD_CUDA_E_ARG, "rope: n_rot must be even, in (0, min(head_dim, 512)]; n_tok, n_heads positive");
    rope_kernel<<<unsigned(n_tok), 128, size_t(rp->n_rot) * sizeof(float), c->stream>>>(*rp, ff, pos, x, n_heads, hd);
    return launched(c, "rope");
}

extern "C" int ktd_cuda_glu(KtdCudaCtx *c, int act, float *a, const float *b, int64_t n) {
    KTD_USE(c);
    if (act < 0 || act >= kGluActs || n <= 0)
        return fail(c, KTD_CUDA_E_ARG, "glu: act 0 (silu), 1 (gelu_tanh) or 2 (relu2), n > 0");
    glu_kernel<<<grid(n, 256), 256, 0, c->stream>>>(act, a, b, n);
    return launched(c, "glu");
}

extern "C" int ktd_cuda_scale(KtdCudaCtx *c, float *x, int64_t n, float s) {
    KTD_USE(c);
    if (n <= 0) return fail(c, KTD_CUDA_E_ARG, "scale: n must be positive");
    scale_kernel<<<grid(n, 256), 256, 0, c->stream>>>(x, n, s);
    return launched(c, "scale");
}

extern "C" int ktd_cuda_gather_rows(KtdCudaCtx *c, float *dst, const float *src, const int32_t *idx, int64_t n,
                                    int64_t width) {
    KTD_USE(c);
    if (n <= 0 || width <= 0 || !idx) return fail(c, KTD_CUDA_E_ARG, "gather_rows: n and width positive, idx given");
    gather_rows_kernel<<<grid(n * width, 256), 256, 0, c->stream>>>(dst, src, idx, n, width);
    return launched(c, "gather_rows");
}

extern "C" int ktd_cuda_scatter_add_rows(KtdCudaCtx *c, float *y, const float *src, const int32_t *idx, const float *w,
                                         int64_t n, int64_t width) {
    KTD_USE(c);
    if (n <= 0 || width <= 0 || !idx || !w)
        return fail(c, KTD_CUDA_E_ARG, "scatter_add_rows: n and width positive, idx and w given");
    scatter_add_rows_kernel<<<grid(n * width, 256), 256, 0, c->stream>>>(y, src, idx, w, n, width);
    return launched(c, "scatter_add_rows");
}

extern "C" int ktd_cuda_add(KtdCudaCtx *c, float *a, const float *b, int64_t n) {
    KTD_USE(c);
    if (n <= 0) return fail(c, KTD_CUDA_E_ARG, "add: n must be positive");
    add_kernel<<<grid(n, 256), 256, 0, c->stream>>>(a, b, n);
    return launched(c, "add");
}

extern "C" int ktd_cuda_add_rows(KtdCudaCtx *c, float *y, const float *b, int64_t n, int64_t width) {
    KTD_USE(c);
    if (n <= 0 || width <= 0) return fail(c, KTD_CUDA_E_ARG, "add_rows: n and width must be positive");
    add_rows_kernel<<<grid(n * width, 256), 256, 0, c->stream>>>(y, b, n, width);
    return launched(c, "add_rows");
}

extern "C" int ktd_cuda_gate_rows(KtdCudaCtx *c, float *y, const float *g, int64_t n, int64_t width) {
    KTD_USE(c);
    if (n <= 0 || width <= 0) return fail(c, KTD_CUDA_E_ARG, "gate_rows: n and width must be positive");
    gate_rows_kernel<<<grid(n * width, 256), 256, 0, c->stream>>>(y, g, n, width);
    return launched(c, "gate_rows");
}

extern "C" int ktd_cuda_kv_write(KtdCudaCtx *c, const float *src, int64_t n_tok, int64_t width, uint16_t *cache,
                                 const int64_t *rows) {
    KTD_USE(c);
    if (n_tok <= 0 || width <= 0) return fail(c, KTD_CUDA_E_ARG, "kv_write: n_tok and width must be positive");
    kv_write_kernel<<<grid(n_tok * width, 256), 256, 0, c->stream>>>(src, n_tok, width,
                                                                      reinterpret_cast<__half *>(cache), rows);
    return launched(c, "kv_write");
}

extern "C" int ktd_cuda_attention(KtdCudaCtx *c, const float *q, const uint16_t *k, const uint16_t *v, float *out,
                                  int64_t n_tok, int n_head, int n_head_kv, int64_t hd, const int64_t *kv_first,
                                  const int32_t *n_kv, float scale) {
    KTD_USE(c);
    if (n_tok <= 0 || n_head <= 0 || n_head > 65535 || n_head_kv <= 0 || n_head % n_head_kv || hd <= 0 ||
        hd > kMaxHd || !kv_first || !n_kv)
        return fail(c, KTD_CUDA_E_ARG,
                    "attention: 0 < n_head <= 65535 a multiple of n_head_kv, 0 < hd <= 256, n_tok > 0, kv ranges given");
    const int64_t row = int64_t(n_head_kv) * hd;
    attn_kernel<kMaxHd><<<dim3(unsigned(n_tok), unsigned(n_head)), 32, 0, c->stream>>>(
        q, reinterpret_cast<const __half *>(k), row, reinterpret_cast<const __half *>(v), row, out, n_head, n_head_kv,
        hd, hd, kv_first, n_kv, 0, scale);
    return launched(c, "attention");
}

extern "C" int ktd_cuda_attention_mla(KtdCudaCtx *c, const float *q, const uint16_t *kv, float *out, int64_t n_tok,
                                      int n_head, int64_t hd_k, int64_t hd_v, const int64_t *kv_first,
                                      const int32_t *n_kv, float scale) {
    KTD_USE(c);
    if (n_tok <= 0 || n_head <= 0 || n_head > 65535 || hd_v <= 0 || hd_v > hd_k || hd_k > kMaxHdMla || !kv_first ||
        !n_kv)
        return fail(c, KTD_CUDA_E_ARG,
                    "attention_mla: 0 < n_head <= 65535, 0 < hd_v <= hd_k <= 1024, n_tok > 0, kv ranges given");
    const auto *rows = reinterpret_cast<const __half *>(kv);
    attn_kernel<kMaxHdMla><<<dim3(unsigned(n_tok), unsigned(n_head)), 32, 0, c->stream>>>(
        q, rows, hd_k, rows, hd_k, out, n_head, 1, hd_k, hd_v, kv_first, n_kv, 0, scale);
    return launched(c, "attention_mla");
}
