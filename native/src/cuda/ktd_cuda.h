// The C ABI of libktd_cuda.so (ktd_cuda.cu), as ktd._native loads it with dlopen/dlsym
// (bind_cuda.cpp). Bump KTD_CUDA_ABI_VERSION with any change here: a library of another version
// is refused with a reason instead of being called with the wrong arguments.
#pragma once
#include <cstddef>
#include <cstdint>

#define KTD_CUDA_ABI_VERSION 1

extern "C" {
// The ABI version the library was built with.
int ktd_cuda_abi_version(void);
// 0 when the CUDA runtime can talk to a driver; n_devices and a one-line description (or the
// runtime's reason, e.g. "CUDA driver version is insufficient for CUDA runtime version") in msg.
int ktd_cuda_probe(int *n_devices, char *msg, size_t msg_n);
// y [n][rows] = W [rows][k] · x [n][k] on device 0, W in GGML type `type` as stored in GGUF
// (w_bytes bytes); host pointers in and out (copies included: a test entry point).
int ktd_cuda_gemv_host(int type, const void *w, int64_t w_bytes, int64_t rows, int64_t k, const float *x, int64_t n,
                       float *y, char *msg, size_t msg_n);
}
