// The C ABI of libktd_cuda.so (ktd_cuda.cu), as ktd._native loads it with dlopen/dlsym
// (bind_cuda.cpp). Bump KTD_CUDA_ABI_VERSION with any change here: a library of another version
// is refused with a reason instead of being called with the wrong arguments.
#pragma once
#include <cstddef>
#include <cstdint>

#define KTD_CUDA_ABI_VERSION 6

extern "C" {
// Rotary embedding parameters (model/hparams.h RopeParams as plain C).
struct KtdRope {
    int n_rot;            // rotated dims per head
    int neox;             // 1: pairs (i, i + n_rot/2); 0: (2i, 2i+1)
    int yarn;             // 1: YaRN scaling (with ext_factor != 0)
    int n_ctx_orig;
    float freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow;
};

// The ABI version the library was built with.
int ktd_cuda_abi_version(void);
// 0 when the CUDA runtime can talk to a driver; n_devices and a one-line description (or the
// runtime's reason, e.g. "CUDA driver version is insufficient for CUDA runtime version") in msg.
int ktd_cuda_probe(int *n_devices, char *msg, size_t msg_n);
// y [n][rows] = W [rows][k] · x [n][k] on device 0, W in GGML type `type` as stored in GGUF
// (w_bytes bytes); host pointers in and out (copies included: a test entry point).
int ktd_cuda_gemv_host(int type, const void *w, int64_t w_bytes, int64_t rows, int64_t k, const float *x, int64_t n,
                       float *y, char *msg, size_t msg_n);
// Test entry points of the non-matrix kernels, host pointers in and out (copies included):
// y [rows][n] = rms_norm(x) · w (w may be null).
int ktd_cuda_rmsnorm_host(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps, char *msg,
                          size_t msg_n);
// x [n_tok][n_heads][head_dim] rotated in place at positions pos [n_tok] (freq_factors [n_rot/2] or null).
int ktd_cuda_rope_host(const struct KtdRope *rp, const float *freq_factors, const int32_t *pos, float *x,
                       int64_t n_tok, int n_heads, int64_t head_dim, char *msg, size_t msg_n);
// a [n] = act(a) · b, act: 0 silu (SwiGLU), 1 gelu_tanh (GeGLU), 2 relu2 (squared ReLU, ABI v5).
int ktd_cuda_glu_host(int act, float *a, const float *b, int64_t n, char *msg, size_t msg_n);
// a [n] += b [n] (the residual add).
int ktd_cuda_add_host(float *a, const float *b, int64_t n, char *msg, size_t msg_n);
// Decode attention of one token over an F16 cache: q [n_head][hd], k/v [n_kv][n_head_kv][hd] (fp16 bits),
// out [n_head][hd] = softmax(scale · q·kᵀ) · v, head h reading kv head h / (n_head / n_head_kv).
int ktd_cuda_attn_decode_host(const float *q, const uint16_t *k, const uint16_t *v, float *out, int n_head,
                              int n_head_kv, int64_t hd, int64_t n_kv, float scale, char *msg, size_t msg_n);

// --- ABI v3: the device backend (model/cuda_device.h) ------------------------------------------
// A context owns one device, one stream and every allocation made through it, within a VRAM
// budget. Pointers marked "dev" are the context's device allocations; kernels and copies are
// enqueued on the context's stream in call order and run asynchronously: host memory handed to
// ktd_cuda_copy must stay valid until an event recorded after it was waited for (or a sync).
// Every call returns 0 or an error code (KTD_CUDA_E_* below, or a cudaError_t value, > 0) and
// leaves a one-line message in ktd_cuda_ctx_error(). An error found asynchronously (a kernel
// fault) is reported by the next sync or event wait.
typedef struct KtdCudaCtx KtdCudaCtx;
typedef struct KtdCudaEvent KtdCudaEvent;

#define KTD_CUDA_E_ARG (-1)          // bad argument (the message says which)
#define KTD_CUDA_E_BUDGET (-2)       // the allocation would exceed the context's VRAM budget
#define KTD_CUDA_E_UNSUPPORTED (-3)  // no kernel for this GGML type / shape
#define KTD_CUDA_H2D 0
#define KTD_CUDA_D2H 1
#define KTD_CUDA_D2D 2
// Bytes of quantized activations per 32 floats (one block: f32 scale, i32 sum, 32 int8), the
// act_scratch of ktd_cuda_gemv holds n·k/32 of them.
#define KTD_CUDA_ACT_BLOCK_BYTES 40

// A context on device `device` that may allocate at most vram_budget bytes (0: no limit beyond
// the device's). On failure *out is null and msg says why (no driver, no such device, ...).
int ktd_cuda_ctx_create(int device, uint64_t vram_budget, KtdCudaCtx **out, char *msg, size_t msg_n);
// Waits for the stream, frees every allocation and event of the context, and the context.
void ktd_cuda_ctx_destroy(KtdCudaCtx *c);
const char *ktd_cuda_ctx_error(const KtdCudaCtx *c);
// used: bytes allocated through the context; budget: its limit (0: none); device_free/total:
// what the driver reports (the emulation: 0, 0).
int ktd_cuda_mem_info(KtdCudaCtx *c, uint64_t *used, uint64_t *budget, uint64_t *device_free, uint64_t *device_total);
int ktd_cuda_alloc(KtdCudaCtx *c, void **dev, uint64_t bytes);
int ktd_cuda_free(KtdCudaCtx *c, void *dev);
// Page-locked host memory (the hybrid copies' buffers); not counted in the budget.
int ktd_cuda_host_alloc(KtdCudaCtx *c, void **host, uint64_t bytes);
int ktd_cuda_host_free(KtdCudaCtx *c, void *host);
// Enqueued copy of `bytes`; kind: KTD_CUDA_H2D, KTD_CUDA_D2H, KTD_CUDA_D2D.
int ktd_cuda_copy(KtdCudaCtx *c, void *dst, const void *src, uint64_t bytes, int kind);
int ktd_cuda_memset0(KtdCudaCtx *c, void *dev, uint64_t bytes);
// Waits until everything enqueued has run.
int ktd_cuda_sync(KtdCudaCtx *c);
int ktd_cuda_event_create(KtdCudaCtx *c, KtdCudaEvent **ev);
int ktd_cuda_event_destroy(KtdCudaCtx *c, KtdCudaEvent *ev);
// Marks the stream's current end; event_wait blocks the host until the stream has run up to it.
int ktd_cuda_event_record(KtdCudaCtx *c, KtdCudaEvent *ev);
int ktd_cuda_event_wait(KtdCudaCtx *c, KtdCudaEvent *ev);

// Kernels, dev pointers only.
// y [n][rows] = W [rows][k] · x [n][k], W in GGML type `type` as stored in GGUF. Block types
// quantize x into act_scratch first (n·k/32 · KTD_CUDA_ACT_BLOCK_BYTES bytes; unused for F32,
// F16, BF16, may then be null).
int ktd_cuda_gemv(KtdCudaCtx *c, int type, const void *w, int64_t rows, int64_t k, const float *x, int64_t n,
                  float *y, void *act_scratch);
// y [rows][n] = rms_norm(x) · w (w may be null; y may be x).
int ktd_cuda_rmsnorm(KtdCudaCtx *c, const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps);
// x [n_tok][n_heads][head_dim] rotated in place at positions pos [n_tok] (freq_factors [n_rot/2] or null).
int ktd_cuda_rope(KtdCudaCtx *c, const struct KtdRope *rp, const float *freq_factors, const int32_t *pos, float *x,
                  int64_t n_tok, int n_heads, int64_t head_dim);
// a [n] = act(a) · b, act: 0 silu, 1 gelu_tanh, 2 relu2 (ABI v5).
int ktd_cuda_glu(KtdCudaCtx *c, int act, float *a, const float *b, int64_t n);
// a [n] += b [n].
int ktd_cuda_add(KtdCudaCtx *c, float *a, const float *b, int64_t n);
// y [n][width] += b [width] on every row (a bias).
int ktd_cuda_add_rows(KtdCudaCtx *c, float *y, const float *b, int64_t n, int64_t width);
// y [n][width] row i *= sigmoid(g [i]) (qwen2moe's shared-expert gate).
int ktd_cuda_gate_rows(KtdCudaCtx *c, float *y, const float *g, int64_t n, int64_t width);
// cache row rows[i] (of `width` fp16) = src [i][width] rounded to F16, i < n_tok.
int ktd_cuda_kv_write(KtdCudaCtx *c, const float *src, int64_t n_tok, int64_t width, uint16_t *cache,
                      const int64_t *rows);
// Attention of n_tok query rows over an F16 cache (one query row per token, causal by position):
// q [n_tok][n_head][hd], k/v rows of [n_head_kv][hd]; row i attends cache rows
// [kv_first[i], kv_first[i] + n_kv[i]); out [n_tok][n_head][hd] = softmax(scale · q·kᵀ) · v,
// head h reading kv head h / (n_head / n_head_kv). hd <= 256.
int ktd_cuda_attention(KtdCudaCtx *c, const float *q, const uint16_t *k, const uint16_t *v, float *out, int64_t n_tok,
                       int n_head, int n_head_kv, int64_t hd, const int64_t *kv_first, const int32_t *n_kv,
                       float scale);

// --- ABI v4: multi-head latent attention (deepseek2) ------------------------------------------
// Enqueued strided copy: `rows` rows of width_bytes, the rows dpitch bytes apart at dst and spitch
// bytes apart at src (pitches >= width_bytes); kind as ktd_cuda_copy.
int ktd_cuda_copy2d(KtdCudaCtx *c, void *dst, uint64_t dpitch, const void *src, uint64_t spitch, uint64_t width_bytes,
                    uint64_t rows, int kind);
// n_mat matrices of one shape in one call (MLA's per-head attn_k_b, attn_v_b): for m < n_mat,
// y_m [n][rows] = W_m [rows][k] · x_m [n][k], W_m at w + m·w_stride bytes, row i of x_m at x +
// m·x_mat + i·x_pitch and row i of y_m at y + m·y_mat + i·y_pitch (floats). act_scratch as
// ktd_cuda_gemv's for n_mat·n rows.
int ktd_cuda_gemv_batched(KtdCudaCtx *c, int type, const void *w, uint64_t w_stride, int64_t n_mat, int64_t rows,
                          int64_t k, const float *x, int64_t x_mat, int64_t x_pitch, int64_t n, float *y, int64_t y_mat,
                          int64_t y_pitch, void *act_scratch);
// Multi-query attention over one F16 cache whose rows are both the keys and the values (MLA's
// latent cache): q [n_tok][n_head][hd_k], cache rows of hd_k; row i attends cache rows
// [kv_first[i], kv_first[i] + n_kv[i]); out [n_tok][n_head][hd_v] = softmax(scale · q·kᵀ) · (the
// first hd_v entries of each row). 0 < hd_v <= hd_k <= 1024.
int ktd_cuda_attention_mla(KtdCudaCtx *c, const float *q, const uint16_t *kv, float *out, int64_t n_tok, int n_head,
                           int64_t hd_k, int64_t hd_v, const int64_t *kv_first, const int32_t *n_kv, float scale);

// --- ABI v5: bitnet ---------------------------------------------------------------------------
// The block types TQ1_0 and TQ2_0 in ktd_cuda_gemv / ktd_cuda_gemv_batched, act 2 (relu2) in
// ktd_cuda_glu, and: x [n] *= s (a tensor's scale).
int ktd_cuda_scale(KtdCudaCtx *c, float *x, int64_t n, float s);

// --- ABI v6: routed experts grouped by expert (gpu.experts over a chunk) ------------------------
// dst [n][width] row i = src row idx[i] (idx [n] on the device).
int ktd_cuda_gather_rows(KtdCudaCtx *c, float *dst, const float *src, const int32_t *idx, int64_t n, int64_t width);
// y row idx[i] += w[i] · src row i, i < n (idx, w [n] on the device). The idx[i] must be distinct
// within a call (one expert's tokens): rows are updated without atomics.
int ktd_cuda_scatter_add_rows(KtdCudaCtx *c, float *y, const float *src, const int32_t *idx, const float *w,
                              int64_t n, int64_t width);
}
