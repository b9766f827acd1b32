// libktd_cuda.so's non-matrix kernels: RMSNorm, rotary embedding (linear/YaRN), SwiGLU/GeGLU,
// residual add, and decode attention over an F16 KV cache (GQA). Their per-element arithmetic is
// cuda/ops_math.h, which the CPU build compiles and tests; the host entry points below (copies
// included) are what the gpu-marked tests call against numpy and the CPU forward's blocks.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "cuda/kernels.cuh"
#include "cuda/ktd_cuda.h"
#include "cuda/ops_math.h"

namespace {

unsigned blocks(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// Device copies of host arrays for the test entry points; the first CUDA error is kept with the
// step that failed.
struct Session {
    std::vector<void *> bufs;
    cudaError_t e = cudaSuccess;
    const char *step = "";
    ~Session() {
        for (void *b : bufs) cudaFree(b);
    }
    template <class T>
    T *up(const T *host, int64_t count) {
        if (e != cudaSuccess || !host) return nullptr;
        void *d = nullptr;
        step = "cudaMalloc";
        if ((e = cudaMalloc(&d, size_t(count) * sizeof(T))) != cudaSuccess) return nullptr;
        bufs.push_back(d);
        step = "cudaMemcpy (to device)";
        e = cudaMemcpy(d, host, size_t(count) * sizeof(T), cudaMemcpyHostToDevice);
        return static_cast<T *>(d);
    }
    template <class T>
    T *alloc(int64_t count) {
        if (e != cudaSuccess) return nullptr;
        void *d = nullptr;
        step = "cudaMalloc";
        if ((e = cudaMalloc(&d, size_t(count) * sizeof(T))) != cudaSuccess) return nullptr;
        bufs.push_back(d);
        return static_cast<T *>(d);
    }
    void launched() {
        if (e == cudaSuccess) {
            step = "kernel";
            if ((e = cudaGetLastError()) == cudaSuccess) e = cudaDeviceSynchronize();
        }
    }
    template <class T>
    void down(T *host, const T *dev, int64_t count) {
        if (e != cudaSuccess) return;
        step = "cudaMemcpy (to host)";
        e = cudaMemcpy(host, dev, size_t(count) * sizeof(T), cudaMemcpyDeviceToHost);
    }
    int finish(char *msg, size_t n) const {
        if (e != cudaSuccess && msg && n)
            std::snprintf(msg, n, "%s: %s (%s)", step, cudaGetErrorString(e), cudaGetErrorName(e));
        return int(e);
    }
};

int bad(char *msg, size_t n, const char *what) {
    if (msg && n) std::snprintf(msg, n, "%s", what);
    return -1;
}

}  // namespace

extern "C" int ktd_cuda_rmsnorm_host(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps,
                                     char *msg, size_t msg_n) {
    if (rows <= 0 || n <= 0) return bad(msg, msg_n, "rmsnorm: rows and n must be positive");
    Session s;
    const float *dx = s.up(x, rows * n), *dw = s.up(w, n);
    float *dy = s.alloc<float>(rows * n);
    if (s.e == cudaSuccess) rmsnorm_kernel<<<unsigned(rows), 256>>>(dx, dw, dy, n, eps);
    s.launched();
    s.down(y, dy, rows * n);
    return s.finish(msg, msg_n);
}

extern "C" int ktd_cuda_rope_host(const KtdRope *rp, const float *freq_factors, const int32_t *pos, float *x,
                                  int64_t n_tok, int n_heads, int64_t head_dim, char *msg, size_t msg_n) {
    if (!rp || rp->n_rot <= 0 || rp->n_rot % 2 || rp->n_rot > head_dim || n_tok <= 0 || n_heads <= 0)
        return bad(msg, msg_n, "rope: n_rot must be even, positive and <= head_dim; n_tok, n_heads positive");
    Session s;
    const float *dff = s.up(freq_factors, rp->n_rot / 2);
    const int32_t *dpos = s.up(pos, n_tok);
    float *dx = s.up(x, n_tok * n_heads * head_dim);
    if (s.e == cudaSuccess)
        rope_kernel<<<unsigned(n_tok), 128, size_t(rp->n_rot) * sizeof(float)>>>(*rp, dff, dpos, dx, n_heads, head_dim);
    s.launched();
    s.down(x, dx, n_tok * n_heads * head_dim);
    return s.finish(msg, msg_n);
}

extern "C" int ktd_cuda_glu_host(int act, float *a, const float *b, int64_t n, char *msg, size_t msg_n) {
    if (act < 0 || act >= kGluActs || n <= 0)
        return bad(msg, msg_n, "glu: act must be 0 (silu), 1 (gelu_tanh) or 2 (relu2), n > 0");
    Session s;
    float *da = s.up(a, n);
    const float *db = s.up(b, n);
    if (s.e == cudaSuccess) glu_kernel<<<blocks(n, 256), 256>>>(act, da, db, n);
    s.launched();
    s.down(a, da, n);
    return s.finish(msg, msg_n);
}

extern "C" int ktd_cuda_add_host(float *a, const float *b, int64_t n, char *msg, size_t msg_n) {
    if (n <= 0) return bad(msg, msg_n, "add: n must be positive");
    Session s;
    float *da = s.up(a, n);
    const float *db = s.up(b, n);
    if (s.e == cudaSuccess) add_kernel<<<blocks(n, 256), 256>>>(da, db, n);
    s.launched();
    s.down(a, da, n);
    return s.finish(msg, msg_n);
}

extern "C" int ktd_cuda_attn_decode_host(const float *q, const uint16_t *k, const uint16_t *v, float *out, int n_head,
                                         int n_head_kv, int64_t hd, int64_t n_kv, float scale, char *msg,
                                         size_t msg_n) {
    if (n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv || hd <= 0 || hd > kMaxHd || n_kv <= 0)
        return bad(msg, msg_n, "attention: n_head a multiple of n_head_kv, 0 < hd <= 256, n_kv > 0");
    Session s;
    const float *dq = s.up(q, int64_t(n_head) * hd);
    const uint16_t *dk = s.up(k, n_kv * n_head_kv * hd), *dv = s.up(v, n_kv * n_head_kv * hd);
    float *dout = s.alloc<float>(int64_t(n_head) * hd);
    if (s.e == cudaSuccess)
        attn_kernel<kMaxHd><<<dim3(1, unsigned(n_head)), 32>>>(
            dq, reinterpret_cast<const __half *>(dk), int64_t(n_head_kv) * hd, reinterpret_cast<const __half *>(dv),
            int64_t(n_head_kv) * hd, dout, n_head, n_head_kv, hd, hd, nullptr, nullptr, n_kv, scale);
    s.launched();
    s.down(out, dout, int64_t(n_head) * hd);
    return s.finish(msg, msg_n);
}
