// The C ABI of ktd_cuda.h as a table of function pointers: filled from libktd_cuda.so with dlsym
// (cuda_api_library) or from the emulation compiled into ktd._native (cuda_api_emulated, a test
// double: "device" memory is host memory, the stream one host thread running the enqueued work in
// order, the kernels the same cuda/block_math.h and cuda/ops_math.h arithmetic on the CPU). The
// device backend (model/cuda_device.h) calls only this table, so its orchestration runs and is
// tested on any machine.
#pragma once
#include <string>

#include "cuda/ktd_cuda.h"

namespace ktd {

struct CudaApi {
    std::string name;  // "library <path>" or "emulated"
    decltype(&ktd_cuda_abi_version) abi_version = nullptr;
    decltype(&ktd_cuda_probe) probe = nullptr;
    // ABI v2 test entry points (host pointers, copies included); the emulation has none.
    decltype(&ktd_cuda_gemv_host) gemv_host = nullptr;
    decltype(&ktd_cuda_rmsnorm_host) rmsnorm_host = nullptr;
    decltype(&ktd_cuda_rope_host) rope_host = nullptr;
    decltype(&ktd_cuda_glu_host) glu_host = nullptr;
    decltype(&ktd_cuda_add_host) add_host = nullptr;
    decltype(&ktd_cuda_attn_decode_host) attn_host = nullptr;
    // ABI v3: the device backend.
    decltype(&ktd_cuda_ctx_create) ctx_create = nullptr;
    decltype(&ktd_cuda_ctx_destroy) ctx_destroy = nullptr;
    decltype(&ktd_cuda_ctx_error) ctx_error = nullptr;
    decltype(&ktd_cuda_mem_info) mem_info = nullptr;
    decltype(&ktd_cuda_alloc) alloc = nullptr;
    decltype(&ktd_cuda_free) free = nullptr;
    decltype(&ktd_cuda_host_alloc) host_alloc = nullptr;
    decltype(&ktd_cuda_host_free) host_free = nullptr;
    decltype(&ktd_cuda_copy) copy = nullptr;
    decltype(&ktd_cuda_memset0) memset0 = nullptr;
    decltype(&ktd_cuda_sync) sync = nullptr;
    decltype(&ktd_cuda_event_create) event_create = nullptr;
    decltype(&ktd_cuda_event_destroy) event_destroy = nullptr;
    decltype(&ktd_cuda_event_record) event_record = nullptr;
    decltype(&ktd_cuda_event_wait) event_wait = nullptr;
    decltype(&ktd_cuda_gemv) gemv = nullptr;
    decltype(&ktd_cuda_rmsnorm) rmsnorm = nullptr;
    decltype(&ktd_cuda_rope) rope = nullptr;
    decltype(&ktd_cuda_glu) glu = nullptr;
    decltype(&ktd_cuda_add) add = nullptr;
    decltype(&ktd_cuda_add_rows) add_rows = nullptr;
    decltype(&ktd_cuda_gate_rows) gate_rows = nullptr;
    decltype(&ktd_cuda_kv_write) kv_write = nullptr;
    decltype(&ktd_cuda_attention) attention = nullptr;
    // ABI v4: MLA.
    decltype(&ktd_cuda_copy2d) copy2d = nullptr;
    decltype(&ktd_cuda_gemv_batched) gemv_batched = nullptr;
    decltype(&ktd_cuda_attention_mla) attention_mla = nullptr;
    // ABI v5: bitnet.
    decltype(&ktd_cuda_scale) scale = nullptr;
    // ABI v6: experts grouped by expert.
    decltype(&ktd_cuda_gather_rows) gather_rows = nullptr;
    decltype(&ktd_cuda_scatter_add_rows) scatter_add_rows = nullptr;
};

// libktd_cuda.so ($KTD_CUDA_LIBRARY, else beside ktd._native), loaded once: the table when it
// loaded, has ABI KTD_CUDA_ABI_VERSION and every entry point; null otherwise, with the reason in
// *reason (always set: the library's path). probe() may still say no device can be used.
const CudaApi *cuda_api_library(std::string *reason, std::string *path = nullptr);
// The emulation (cuda/emu_device.cpp).
const CudaApi &cuda_api_emulated();

}  // namespace ktd
