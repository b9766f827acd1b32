// Loading libktd_cuda.so into a CudaApi table (cuda/cuda_api.h): dlopen at run time, never linked.
#include "cuda/cuda_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

namespace ktd {
namespace {

// Where libktd_cuda.so is looked for: $KTD_CUDA_LIBRARY, else beside this module's file.
std::string library_path() {
    if (const char *env = std::getenv("KTD_CUDA_LIBRARY"); env && *env) return env;
    Dl_info info{};
    if (dladdr(reinterpret_cast<void *>(&library_path), &info) && info.dli_fname) {
        std::string self = info.dli_fname;
        const size_t slash = self.rfind('/');
        return (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/libktd_cuda.so";
    }
    return "libktd_cuda.so";
}

template <class F>
bool sym(void *h, const char *name, F &f) {
    f = reinterpret_cast<F>(dlsym(h, name));
    return f != nullptr;
}

struct Loaded {
    CudaApi api;
    bool ok = false;
    std::string path, reason;
};

const Loaded &loaded() {
    static Loaded l;
    static std::once_flag once;
    std::call_once(once, [] {
        l.path = library_path();
        void *h = dlopen(l.path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char *e = dlerror();
            l.reason = std::string("the CUDA backend is not installed or cannot be loaded: ") + (e ? e : l.path);
            return;
        }
        CudaApi &a = l.api;
        a.name = "library " + l.path;
        if (!sym(h, "ktd_cuda_abi_version", a.abi_version)) {
            l.reason = l.path + ": not a ktd CUDA backend (no ktd_cuda_abi_version)";
            return;
        }
        if (const int v = a.abi_version(); v != KTD_CUDA_ABI_VERSION) {
            l.reason = l.path + ": built for CUDA backend ABI " + std::to_string(v) + ", this ktd needs " +
                       std::to_string(KTD_CUDA_ABI_VERSION);
            return;
        }
        std::string missing;
        auto need = [&](const char *name, auto &f) {
            if (!sym(h, name, f)) missing += std::string(missing.empty() ? "" : ", ") + name;
        };
        need("ktd_cuda_probe", a.probe);
        need("ktd_cuda_gemv_host", a.gemv_host);
        need("ktd_cuda_rmsnorm_host", a.rmsnorm_host);
        need("ktd_cuda_rope_host", a.rope_host);
        need("ktd_cuda_glu_host", a.glu_host);
        need("ktd_cuda_add_host", a.add_host);
        need("ktd_cuda_attn_decode_host", a.attn_host);
        need("ktd_cuda_ctx_create", a.ctx_create);
        need("ktd_cuda_ctx_destroy", a.ctx_destroy);
        need("ktd_cuda_ctx_error", a.ctx_error);
        need("ktd_cuda_mem_info", a.mem_info);
        need("ktd_cuda_alloc", a.alloc);
        need("ktd_cuda_free", a.free);
        need("ktd_cuda_host_alloc", a.host_alloc);
        need("ktd_cuda_host_free", a.host_free);
        need("ktd_cuda_copy", a.copy);
        need("ktd_cuda_memset0", a.memset0);
        need("ktd_cuda_sync", a.sync);
        need("ktd_cuda_event_create", a.event_create);
        need("ktd_cuda_event_destroy", a.event_destroy);
        need("ktd_cuda_event_record", a.event_record);
        need("ktd_cuda_event_wait", a.event_wait);
        need("ktd_cuda_gemv", a.gemv);
        need("ktd_cuda_rmsnorm", a.rmsnorm);
        need("ktd_cuda_rope", a.rope);
        need("ktd_cuda_glu", a.glu);
        need("ktd_cuda_add", a.add);
        need("ktd_cuda_add_rows", a.add_rows);
        need("ktd_cuda_gate_rows", a.gate_rows);
        need("ktd_cuda_kv_write", a.kv_write);
        need("ktd_cuda_attention", a.attention);
        need("ktd_cuda_copy2d", a.copy2d);
        need("ktd_cuda_gemv_batched", a.gemv_batched);
        need("ktd_cuda_attention_mla", a.attention_mla);
        need("ktd_cuda_scale", a.scale);
        need("ktd_cuda_gather_rows", a.gather_rows);
        need("ktd_cuda_scatter_add_rows", a.scatter_add_rows);
        if (!missing.empty()) {
            l.reason = l.path + ": not a ktd CUDA backend (entry points missing: " + missing + ")";
            return;
        }
        l.ok = true;
    });
    return l;
}

}  // namespace

const CudaApi *cuda_api_library(std::string *reason, std::string *path) {
    const Loaded &l = loaded();
    if (reason) *reason = l.reason;
    if (path) *path = l.path;
    return l.ok ? &l.api : nullptr;
}

}  // namespace ktd
