// libktd_cuda.so: ktd's optional CUDA backend. Built only where nvcc is found (CMakeLists.txt);
// ktd._native never links it: it dlopens this library at run time (cuda/bind_cuda.cpp) and asks
// ktd_cuda_probe() whether a device can be used, so a CPU-only host gets a reason, not a crash.
//
// The kernels read the GGUF block formats as they are stored (no re-quantization), through the
// __host__ __device__ functions of cuda/block_math.h, which the CPU build compiles and tests
// against gguf-py: the arithmetic here is the arithmetic tested on every CI run.
//
// C ABI only (extern "C"), every entry point returns 0 or a CUDA error code and writes a message.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "cuda/block_math.h"
#include "cuda/kernels.cuh"
#include "cuda/ktd_cuda.h"

namespace {

void set_error(char *msg, size_t n, const char *what, cudaError_t e) {
    if (msg && n) std::snprintf(msg, n, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

}  // namespace

extern "C" int ktd_cuda_abi_version(void) { return KTD_CUDA_ABI_VERSION; }

extern "C" int ktd_cuda_probe(int *n_devices, char *msg, size_t msg_n) {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (n_devices) *n_devices = e == cudaSuccess ? count : 0;
    if (e != cudaSuccess) {
        set_error(msg, msg_n, "cudaGetDeviceCount", e);
        return int(e);
    }
    if (msg && msg_n) {
        cudaDeviceProp p{};
        if (count > 0 && cudaGetDeviceProperties(&p, 0) == cudaSuccess)
            std::snprintf(msg, msg_n, "%d device(s); device 0: %s, compute capability %d.%d, %.1f GiB", count, p.name,
                          p.major, p.minor, double(p.totalGlobalMem) / double(1ull << 30));
        else
            std::snprintf(msg, msg_n, "%d device(s)", count);
    }
    return 0;
}

extern "C" int ktd_cuda_gemv_host(int type, const void *w, int64_t w_bytes, int64_t rows, int64_t k, const float *x,
                                  int64_t n, float *y, char *msg, size_t msg_n) {
    if (k % 32 != 0 || rows <= 0 || n <= 0) {
        if (msg && msg_n) std::snprintf(msg, msg_n, "gemv: k must be a multiple of 32, rows and n positive");
        return -1;
    }
    void *dw = nullptr;
    float *dx = nullptr, *dy = nullptr;
    ActQ8 *dact = nullptr;
    const int64_t n_sub = n * k / 32;
    cudaError_t e = cudaSuccess;
    const char *step = "cudaMalloc";
    do {
        if ((e = cudaMalloc(&dw, size_t(w_bytes))) != cudaSuccess) break;
        if ((e = cudaMalloc(&dx, size_t(n * k) * sizeof(float))) != cudaSuccess) break;
        if ((e = cudaMalloc(&dy, size_t(n * rows) * sizeof(float))) != cudaSuccess) break;
        if ((e = cudaMalloc(&dact, size_t(n_sub) * sizeof(ActQ8))) != cudaSuccess) break;
        step = "cudaMemcpy (to device)";
        if ((e = cudaMemcpy(dw, w, size_t(w_bytes), cudaMemcpyHostToDevice)) != cudaSuccess) break;
        if ((e = cudaMemcpy(dx, x, size_t(n * k) * sizeof(float), cudaMemcpyHostToDevice)) != cudaSuccess) break;
        step = "kernel launch";
        switch (GGMLType(type)) {
        case GGMLType::F32: launch_f<0>(dw, rows, k, dx, n, dy, nullptr); break;
        case GGMLType::F16: launch_f<1>(dw, rows, k, dx, n, dy, nullptr); break;
        case GGMLType::BF16: launch_f<2>(dw, rows, k, dx, n, dy, nullptr); break;
        default:
            quantize_act_kernel<<<blocks_for(n_sub), kThreads>>>(dx, dact, n_sub);
            if (!bm::visit_block_type(GGMLType(type),
                                      [&](auto b) { launch_q<decltype(b)>(dw, rows, k, dact, n, dy, nullptr); })) {
                if (msg && msg_n) std::snprintf(msg, msg_n, "gemv: no CUDA kernel for GGML type %d", type);
                cudaFree(dw), cudaFree(dx), cudaFree(dy), cudaFree(dact);
                return -1;
            }
        }
        if ((e = cudaGetLastError()) != cudaSuccess) break;
        step = "cudaMemcpy (to host)";
        if ((e = cudaMemcpy(y, dy, size_t(n * rows) * sizeof(float), cudaMemcpyDeviceToHost)) != cudaSuccess) break;
    } while (false);
    if (e != cudaSuccess) set_error(msg, msg_n, step, e);
    cudaFree(dw), cudaFree(dx), cudaFree(dy), cudaFree(dact);
    return int(e);
}
