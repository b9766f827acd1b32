// The CUDA side as ktd._native sees it: cuda_status() loads libktd_cuda.so at run time (never
// linked: a CPU-only build and host are unchanged) and says whether a device can be used or
// exactly why not; cuda_math exposes the host/device block arithmetic of cuda/block_math.h as
// the CPU compiles it, so tests check the GPU kernels' math against gguf-py without a GPU.
#include <dlfcn.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdlib>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>

#include "bindings.h"
#include "common/ggml_types.h"
#include "cuda/block_math.h"
#include "cuda/ktd_cuda.h"

namespace py = pybind11;

namespace ktd {
namespace {

struct CudaLib {
    void *handle = nullptr;
    std::string path, reason;
    decltype(&ktd_cuda_probe) probe = nullptr;
    decltype(&ktd_cuda_gemv_host) gemv_host = nullptr;
};

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

const CudaLib &cuda_lib() {
    static CudaLib lib;
    static std::once_flag once;
    std::call_once(once, [] {
        lib.path = library_path();
        lib.handle = dlopen(lib.path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (!lib.handle) {
            const char *e = dlerror();
            lib.reason = std::string("the CUDA backend is not installed or cannot be loaded: ") + (e ? e : lib.path);
            return;
        }
        auto version = reinterpret_cast<decltype(&ktd_cuda_abi_version)>(dlsym(lib.handle, "ktd_cuda_abi_version"));
        lib.probe = reinterpret_cast<decltype(&ktd_cuda_probe)>(dlsym(lib.handle, "ktd_cuda_probe"));
        lib.gemv_host = reinterpret_cast<decltype(&ktd_cuda_gemv_host)>(dlsym(lib.handle, "ktd_cuda_gemv_host"));
        if (!version || !lib.probe || !lib.gemv_host) {
            lib.reason = lib.path + ": not a ktd CUDA backend (entry points missing)";
            lib.probe = nullptr;
        } else if (version() != KTD_CUDA_ABI_VERSION) {
            lib.reason = lib.path + ": built for CUDA backend ABI " + std::to_string(version()) + ", this ktd needs " +
                         std::to_string(KTD_CUDA_ABI_VERSION);
            lib.probe = nullptr;
        }
    });
    return lib;
}

GGMLType type_named(const std::string &name) {
    for (GGMLType t : {GGMLType::Q4_0, GGMLType::Q5_0, GGMLType::Q8_0, GGMLType::Q4_K, GGMLType::Q5_K, GGMLType::Q6_K,
                       GGMLType::F32, GGMLType::F16, GGMLType::BF16})
        if (ggml_type_name(t) == name) return t;
    throw std::invalid_argument("cuda_math: no CUDA kernel for type '" + name +
                                "' (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, F32, F16, BF16)");
}

template <class Block>
void for_each_sub(const uint8_t *row, int64_t k, const std::function<void(int64_t, const bm::Sub32 &)> &f) {
    bm::Sub32 s;
    for (int64_t t = 0; t < k / 32; ++t) {
        bm::unpack_row_sub(reinterpret_cast<const Block *>(row), t, s);
        f(t, s);
    }
}

void visit_subs(GGMLType type, const uint8_t *row, int64_t k, const std::function<void(int64_t, const bm::Sub32 &)> &f) {
    switch (type) {
    case GGMLType::Q4_0: return for_each_sub<block_q4_0>(row, k, f);
    case GGMLType::Q5_0: return for_each_sub<block_q5_0>(row, k, f);
    case GGMLType::Q8_0: return for_each_sub<block_q8_0>(row, k, f);
    case GGMLType::Q4_K: return for_each_sub<block_q4_K>(row, k, f);
    case GGMLType::Q5_K: return for_each_sub<block_q5_K>(row, k, f);
    case GGMLType::Q6_K: return for_each_sub<block_q6_K>(row, k, f);
    default: throw std::invalid_argument("cuda_math: " + std::string(ggml_type_name(type)) + " is not a block format");
    }
}

// The bytes of one row of k elements, checked against the type's block size.
const uint8_t *row_bytes(GGMLType type, const py::array_t<uint8_t, py::array::c_style> &data, int64_t k) {
    const auto size = ggml_row_size(type, uint64_t(k));
    if (k <= 0 || k % 32 != 0 || !size)
        throw std::invalid_argument("cuda_math: k = " + std::to_string(k) + " is not a whole number of " +
                                    std::string(ggml_type_name(type)) + " blocks");
    if (uint64_t(data.size()) != *size)
        throw std::invalid_argument("cuda_math: a " + std::string(ggml_type_name(type)) + " row of " + std::to_string(k) +
                                    " elements is " + std::to_string(*size) + " bytes, got " +
                                    std::to_string(data.size()));
    return data.data();
}

}  // namespace

void bind_cuda(py::module_ &m) {
    m.def(
        "cuda_status",
        [] {
            const CudaLib &lib = cuda_lib();
            py::dict out;
            out["library"] = lib.path;
            if (!lib.probe) {
                out["available"] = false;
                out["devices"] = 0;
                out["reason"] = lib.reason;
                return out;
            }
            int n = 0;
            char msg[512] = {0};
            const int rc = lib.probe(&n, msg, sizeof msg);
            out["available"] = rc == 0 && n > 0;
            out["devices"] = n;
            out["reason"] = rc == 0 && n == 0 ? std::string("no CUDA device is visible") : std::string(msg);
            return out;
        },
        "{available, devices, reason, library}: whether the optional CUDA backend (libktd_cuda.so) can run here, "
        "and why not");

    auto cm = m.def_submodule("cuda_math", "the CUDA kernels' block arithmetic (cuda/block_math.h) compiled for the CPU");
    cm.def(
        "dequantize",
        [](const std::string &type, py::array_t<uint8_t, py::array::c_style> data, int64_t k) {
            const GGMLType t = type_named(type);
            const uint8_t *row = row_bytes(t, data, k);
            py::array_t<float> out(k);
            float *y = out.mutable_data();
            visit_subs(t, row, k, [&](int64_t i, const bm::Sub32 &s) { bm::dequantize(s, y + 32 * i); });
            return out;
        },
        py::arg("type"), py::arg("data"), py::arg("k"), "one row of k weights as the GPU kernels unpack them");
    cm.def(
        "quantize_act",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> x) {
            const int64_t k = x.size();
            if (k % 32 != 0) throw std::invalid_argument("cuda_math: activations must be a multiple of 32 long");
            py::array_t<float> d(k / 32);
            py::array_t<int32_t> sum(k / 32);
            py::array_t<int8_t> qs({k / 32, int64_t(32)});
            for (int64_t t = 0; t < k / 32; ++t) {
                bm::ActQ8 a;
                bm::quantize_act(x.data() + 32 * t, a);
                d.mutable_data()[t] = a.d;
                sum.mutable_data()[t] = a.sum;
                std::copy(a.qs, a.qs + 32, qs.mutable_data() + 32 * t);
            }
            return py::make_tuple(d, sum, qs);
        },
        py::arg("x"), "activations → (scale per 32, Σ q per 32, int8 q [k/32, 32]) as the GPU quantizes them");
    cm.def(
        "dot",
        [](const std::string &type, py::array_t<uint8_t, py::array::c_style> data,
           py::array_t<float, py::array::c_style | py::array::forcecast> x) {
            const GGMLType t = type_named(type);
            const int64_t k = x.size();
            const uint8_t *row = row_bytes(t, data, k);
            double acc = 0.0;
            visit_subs(t, row, k, [&](int64_t i, const bm::Sub32 &s) {
                bm::ActQ8 a;
                bm::quantize_act(x.data() + 32 * i, a);
                acc += double(bm::dot(s, a));
            });
            return acc;
        },
        py::arg("type"), py::arg("data"), py::arg("x"),
        "one row · x with x quantized to int8 per 32, through the dp4a path (int products, one scale per half)");
    cm.def(
        "gpu_gemv",
        [](const std::string &type, py::array_t<uint8_t, py::array::c_style> w, int64_t rows, int64_t k,
           py::array_t<float, py::array::c_style | py::array::forcecast> x) {
            const CudaLib &lib = cuda_lib();
            if (!lib.probe) throw std::runtime_error(lib.reason);
            const GGMLType t = type_named(type);
            const auto row = ggml_row_size(t, uint64_t(k));
            if (!row || uint64_t(w.size()) != *row * uint64_t(rows))
                throw std::invalid_argument("gpu_gemv: weights are not rows × a whole row of k elements");
            if (x.size() % k != 0) throw std::invalid_argument("gpu_gemv: x is not n rows of k");
            const int64_t n = x.size() / k;
            py::array_t<float> y({n, rows});
            char msg[512] = {0};
            int rc;
            {
                py::gil_scoped_release release;
                rc = lib.gemv_host(int(t), w.data(), int64_t(w.size()), rows, k, x.data(), n, y.mutable_data(), msg,
                                   sizeof msg);
            }
            if (rc != 0) throw std::runtime_error(std::string("gpu_gemv: ") + msg);
            return y;
        },
        py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("x"),
        "y [n, rows] = W · x on CUDA device 0 (copies included; RuntimeError with the reason without a device)");
}

}  // namespace ktd
