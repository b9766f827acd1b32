// The CUDA side as ktd._native sees it: cuda_status() loads libktd_cuda.so at run time (never
// linked: a CPU-only build and host are unchanged) and says whether a device can be used or
// exactly why not; cuda_math exposes the host/device block arithmetic of cuda/block_math.h as
// the CPU compiles it, so tests check the GPU kernels' math against gguf-py without a GPU.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>

#include "bindings.h"
#include "common/ggml_types.h"
#include "cuda/block_math.h"
#include "cuda/cuda_api.h"
#include "cuda/ktd_cuda.h"
#include "cuda/ops_math.h"
#include "kernels/rope.h"

namespace py = pybind11;

namespace ktd {
namespace {

// The loaded library's table (cuda/cuda_api.h) or the reason it cannot be used.
struct CudaLib {
    const CudaApi *api = nullptr;  // null when the library is unusable (then `reason` says why)
    std::string path, reason;
};

const CudaLib &cuda_lib() {
    static CudaLib lib;
    static std::once_flag once;
    std::call_once(once, [] {
        lib.api = cuda_api_library(&lib.reason, &lib.path);
    });
    return lib;
}

GGMLType type_named(const std::string &name) {
    for (uint32_t id = 0; id < 64; ++id) {
        if (!ggml_type_info(id)) continue;
        const GGMLType t = GGMLType(id);
        const bool kernel = t == GGMLType::F32 || t == GGMLType::F16 || t == GGMLType::BF16 ||
                            bm::visit_block_type(t, [](auto) {});
        if (kernel && ggml_type_name(t) == name) return t;
    }
    throw std::invalid_argument("cuda_math: no CUDA kernel for type '" + name + "' (" + bm::kBlockTypeNames +
                                ", F32, F16, BF16)");
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
    if (!bm::visit_block_type(type, [&](auto b) { for_each_sub<decltype(b)>(row, k, f); }))
        throw std::invalid_argument("cuda_math: " + std::string(ggml_type_name(type)) + " is not a block format");
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

using f32arr = py::array_t<float, py::array::c_style | py::array::forcecast>;

KtdRope rope_params(const py::dict &p) {
    KtdRope r{};
    r.n_rot = p["n_rot"].cast<int>();
    r.neox = p.contains("neox") ? int(p["neox"].cast<bool>()) : 1;
    r.yarn = p.contains("yarn") ? int(p["yarn"].cast<bool>()) : 0;
    r.n_ctx_orig = p.contains("n_ctx_orig") ? p["n_ctx_orig"].cast<int>() : 0;
    r.freq_base = p.contains("freq_base") ? p["freq_base"].cast<float>() : 10000.0f;
    r.freq_scale = p.contains("freq_scale") ? p["freq_scale"].cast<float>() : 1.0f;
    r.ext_factor = p.contains("ext_factor") ? p["ext_factor"].cast<float>() : 0.0f;
    r.attn_factor = p.contains("attn_factor") ? p["attn_factor"].cast<float>() : 1.0f;
    r.beta_fast = p.contains("beta_fast") ? p["beta_fast"].cast<float>() : 32.0f;
    r.beta_slow = p.contains("beta_slow") ? p["beta_slow"].cast<float>() : 1.0f;
    if (r.n_rot <= 0 || r.n_rot % 2 || r.n_rot > 512) throw std::invalid_argument("rope: n_rot must be even, in (0, 512]");
    if (r.yarn && r.n_ctx_orig <= 0) throw std::invalid_argument("rope: YaRN needs n_ctx_orig > 0");
    return r;
}

const float *freq_factors(const py::object &ff, const KtdRope &r) {
    if (ff.is_none()) return nullptr;
    auto a = ff.cast<f32arr>();
    if (a.size() != r.n_rot / 2) throw std::invalid_argument("rope: freq_factors must have n_rot/2 entries");
    return a.data();
}

const CudaLib &usable_lib() {
    const CudaLib &lib = cuda_lib();
    if (!lib.api) throw std::runtime_error(lib.reason);
    return lib;
}

void check_rc(int rc, const char *msg) {
    if (rc != 0) throw std::runtime_error(msg);
}

// The CPU forward's RopeParams (kernels/rope.h) of the GPU's KtdRope.
RopeParams cpu_rope_params(const KtdRope &r) {
    RopeParams rp;
    rp.type = r.neox ? RopeType::Neox : RopeType::Norm;
    rp.n_rot = r.n_rot;
    rp.freq_base = r.freq_base;
    rp.freq_scale = r.freq_scale;
    rp.scaling = r.yarn ? RopeScaling::Yarn : RopeScaling::None;
    rp.n_ctx_orig = r.n_ctx_orig;
    rp.ext_factor = r.ext_factor;
    rp.attn_factor = r.attn_factor;
    rp.beta_fast = r.beta_fast;
    rp.beta_slow = r.beta_slow;
    return rp;
}

// The rotary angles: their arithmetic compiled for the CPU (rope_cos_sin, and the CPU forward's
// own rope_cos_sin to compare with), and the GPU's rotation.
void bind_cuda_rope(py::module_ &cm) {
    cm.def(
        "rope_cos_sin",
        [](const py::dict &p, int64_t pos, const py::object &ff, bool cpu_forward) {
            const KtdRope r = rope_params(p);
            py::object keep = ff.is_none() ? ff : py::object(ff.cast<f32arr>());
            const float *f = freq_factors(keep, r);
            py::array_t<float> cs(r.n_rot);
            if (cpu_forward)
                rope_cos_sin(cpu_rope_params(r), f, pos, cs.mutable_data());
            else
                om::rope_cos_sin(r, f, pos, cs.mutable_data());
            return cs;
        },
        py::arg("params"), py::arg("pos"), py::arg("freq_factors") = py::none(), py::arg("cpu_forward") = false,
        "[cos θ0, sin θ0, ...] at pos as the GPU computes them (cuda/ops_math.h, compiled for the CPU), or with "
        "cpu_forward=True as the CPU forward does (kernels/rope.cpp); params: n_rot, neox, yarn, n_ctx_orig, "
        "freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow");
    cm.def(
        "gpu_rope",
        [](const py::dict &p, py::array_t<int32_t, py::array::c_style | py::array::forcecast> pos, f32arr x,
           const py::object &ff) {
            const KtdRope r = rope_params(p);
            if (x.ndim() != 3 || x.shape(0) != pos.size())
                throw std::invalid_argument("gpu_rope: x must be [n_tok, n_heads, head_dim] with one position per token");
            py::object keep = ff.is_none() ? ff : py::object(ff.cast<f32arr>());
            const float *f = freq_factors(keep, r);
            const CudaLib &lib = usable_lib();
            py::array_t<float> y({x.shape(0), x.shape(1), x.shape(2)});
            std::copy(x.data(), x.data() + x.size(), y.mutable_data());
            char msg[512] = {0};
            check_rc(lib.api->rope_host(&r, f, pos.data(), y.mutable_data(), x.shape(0), int(x.shape(1)), x.shape(2), msg,
                                   sizeof msg),
                     msg);
            return y;
        },
        py::arg("params"), py::arg("pos"), py::arg("x"), py::arg("freq_factors") = py::none(),
        "x rotated on CUDA device 0 (a copy)");
}

// The other non-matrix kernels' GPU entry points.
void bind_cuda_ops(py::module_ &cm) {
    cm.def(
        "gpu_rmsnorm",
        [](f32arr x, const py::object &w, float eps) {
            if (x.ndim() != 2) throw std::invalid_argument("gpu_rmsnorm: x must be [rows, n]");
            const int64_t rows = x.shape(0), n = x.shape(1);
            py::object keep = w.is_none() ? w : py::object(w.cast<f32arr>());
            const float *wp = nullptr;
            if (!keep.is_none()) {
                auto wa = keep.cast<f32arr>();
                if (wa.size() != n) throw std::invalid_argument("gpu_rmsnorm: w must have n entries");
                wp = wa.data();
            }
            const CudaLib &lib = usable_lib();
            py::array_t<float> y({rows, n});
            char msg[512] = {0};
            check_rc(lib.api->rmsnorm_host(x.data(), wp, y.mutable_data(), rows, n, eps, msg, sizeof msg), msg);
            return y;
        },
        py::arg("x"), py::arg("w") = py::none(), py::arg("eps") = 1e-6f, "RMSNorm of each row on CUDA device 0");
    cm.def(
        "gpu_glu",
        [](const std::string &act, f32arr a, f32arr b) {
            if (a.size() != b.size()) throw std::invalid_argument("gpu_glu: a and b differ in size");
            const int kind = act == "silu" ? 0 : act == "gelu" ? 1 : act == "relu2" ? 2 : -1;
            if (kind < 0) throw std::invalid_argument("gpu_glu: act is silu, gelu or relu2");
            const CudaLib &lib = usable_lib();
            py::array_t<float> y(a.size());
            std::copy(a.data(), a.data() + a.size(), y.mutable_data());
            char msg[512] = {0};
            check_rc(lib.api->glu_host(kind, y.mutable_data(), b.data(), a.size(), msg, sizeof msg), msg);
            return y;
        },
        py::arg("act"), py::arg("a"), py::arg("b"), "act(a) · b on CUDA device 0 (silu: SwiGLU, gelu: GeGLU, relu2: squared ReLU)");
    cm.def(
        "gpu_add",
        [](f32arr a, f32arr b) {
            if (a.size() != b.size()) throw std::invalid_argument("gpu_add: a and b differ in size");
            const CudaLib &lib = usable_lib();
            py::array_t<float> y(a.size());
            std::copy(a.data(), a.data() + a.size(), y.mutable_data());
            char msg[512] = {0};
            check_rc(lib.api->add_host(y.mutable_data(), b.data(), a.size(), msg, sizeof msg), msg);
            return y;
        },
        py::arg("a"), py::arg("b"), "a + b on CUDA device 0");
    cm.def(
        "gpu_attention",
        [](f32arr q, py::array_t<uint16_t, py::array::c_style> k, py::array_t<uint16_t, py::array::c_style> v,
           float scale) {
            if (q.ndim() != 2 || k.ndim() != 3 || v.ndim() != 3 || k.shape(2) != q.shape(1) ||
                v.shape(0) != k.shape(0) || v.shape(1) != k.shape(1) || v.shape(2) != k.shape(2))
                throw std::invalid_argument("gpu_attention: q [n_head, hd], k and v [n_kv, n_head_kv, hd] (fp16 bits)");
            const CudaLib &lib = usable_lib();
            const int n_head = int(q.shape(0)), n_head_kv = int(k.shape(1));
            const int64_t hd = q.shape(1), n_kv = k.shape(0);
            py::array_t<float> out({int64_t(n_head), hd});
            char msg[512] = {0};
            check_rc(lib.api->attn_host(q.data(), k.data(), v.data(), out.mutable_data(), n_head, n_head_kv, hd, n_kv,
                                   scale, msg, sizeof msg),
                     msg);
            return out;
        },
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"),
        "decode attention of one token over an F16 cache on CUDA device 0 (GQA: head h reads kv head h / group)");
}

// cuda_status(): whether the library loads, the devices it sees and each one's memory.
py::dict cuda_status() {
    const CudaLib &lib = cuda_lib();
    py::dict out;
    out["library"] = lib.path;
    if (!lib.api) {
        out["available"] = false;
        out["devices"] = 0;
        out["reason"] = lib.reason;
        return out;
    }
    int n = 0;
    char msg[512] = {0};
    const int rc = lib.api->probe(&n, msg, sizeof msg);
    out["available"] = rc == 0 && n > 0;
    out["devices"] = n;
    out["reason"] = rc == 0 && n == 0 ? std::string("no CUDA device is visible") : std::string(msg);
    if (rc == 0 && n > 0) {
        // Each device's total memory (what gpu.vram_budget: auto plans against; 0 where a
        // context could not be made), through a short-lived ABI v3 context.
        py::list mem;
        for (int d = 0; d < n; ++d) {
            KtdCudaCtx *c = nullptr;
            char why[256] = {0};
            uint64_t total = 0;
            if (lib.api->ctx_create(d, 0, &c, why, sizeof why) == 0 && c) {
                if (lib.api->mem_info(c, nullptr, nullptr, nullptr, &total) != 0) total = 0;
                lib.api->ctx_destroy(c);
            }
            mem.append(total);
        }
        out["device_memory"] = mem;
    }
    return out;
}

// The block formats as the GPU kernels read them (compiled for the CPU), and the GPU's matmul.
void bind_cuda_block_math(py::module_ &cm) {
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
            if (!lib.api) throw std::runtime_error(lib.reason);
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
                rc = lib.api->gemv_host(int(t), w.data(), int64_t(w.size()), rows, k, x.data(), n, y.mutable_data(), msg,
                                   sizeof msg);
            }
            if (rc != 0) throw std::runtime_error(std::string("gpu_gemv: ") + msg);
            return y;
        },
        py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("x"),
        "y [n, rows] = W · x on CUDA device 0 (copies included; RuntimeError with the reason without a device)");
}

}  // namespace

void bind_cuda(py::module_ &m) {
    m.def("cuda_status", &cuda_status,
          "{available, devices, reason, library[, device_memory]}: whether the optional CUDA backend "
          "(libktd_cuda.so) can run here, and why not; device_memory: each device's total bytes");
    auto cm = m.def_submodule("cuda_math", "the CUDA kernels' block arithmetic (cuda/block_math.h) compiled for the CPU");
    bind_cuda_block_math(cm);
    bind_cuda_rope(cm);
    bind_cuda_ops(cm);
}

}  // namespace ktd
