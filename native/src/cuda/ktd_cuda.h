// The C ABI of libktd_cuda.so (ktd_cuda.cu), as ktd._native loads it with dlopen/dlsym
// (bind_cuda.cpp). Bump KTD_CUDA_ABI_VERSION with any change here: a library of another version
// is refused with a reason instead of being called with the wrong arguments.
#pragma once
#include <cstddef>
#include <cstdint>

#define KTD_CUDA_ABI_VERSION 2

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
// a [n] = act(a) · b, act: 0 silu (SwiGLU), 1 gelu_tanh (GeGLU).
int ktd_cuda_glu_host(int act, float *a, const float *b, int64_t n, char *msg, size_t msg_n);
// a [n] += b [n] (the residual add).
int ktd_cuda_add_host(float *a, const float *b, int64_t n, char *msg, size_t msg_n);
// Decode attention of one token over an F16 cache: q [n_head][hd], k/v [n_kv][n_head_kv][hd] (fp16 bits),
// out [n_head][hd] = softmax(scale · q·kᵀ) · v, head h reading kv head h / (n_head / n_head_kv).
int ktd_cuda_attn_decode_host(const float *q, const uint16_t *k, const uint16_t *v, float *out, int n_head,
                              int n_head_kv, int64_t hd, int64_t n_kv, float scale, char *msg, size_t msg_n);
}
