// Python bindings of the float kernels, for tests and benchmarks, each with a chosen ISA:
// ktd._native.attention (one block of query rows × one GQA group against F16 keys/values) and
// ktd._native.elementwise (activations).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "kernels/attention.h"
#include "kernels/elementwise.h"

namespace py = pybind11;

namespace ktd {

namespace {

Isa supported_isa(const std::string &name) {
    const Isa i = parse_isa(name);
    if (!isa_supported_by_cpu(i)) throw std::invalid_argument("this CPU does not support ISA " + name);
    return i;
}

// As CpuBackend::attention splits a decode row: each row's keys in ranges at multiples of
// split_keys, one kernel call each (normalised o, m, l per head), merged by attn_merge.
void attend_split(AttnKernel fn, const AttnBlock &b, int64_t split_keys, float *scratch) {
    const int64_t n_group = b.n_group, hdv = b.head_dim_v;
    for (int64_t r = 0; r < b.n_rows; ++r) {
        const int64_t c0 = b.lo[r] / split_keys, c1 = (b.hi[r] + split_keys - 1) / split_keys;
        const size_t n_parts = size_t(c1 - c0), stride = size_t(n_group * hdv);
        std::vector<float> o(n_parts * stride), ml(2 * n_parts * size_t(n_group));
        std::vector<int64_t> part_lo(n_parts), part_hi(n_parts);
        for (size_t c = 0; c < n_parts; ++c) {
            part_lo[c] = std::max(b.lo[r], (c0 + int64_t(c)) * split_keys);
            part_hi[c] = std::min(b.hi[r], (c0 + int64_t(c) + 1) * split_keys);
            AttnBlock pb = b;
            pb.q = b.q + size_t(r) * b.q_row_stride;
            pb.n_rows = 1;
            pb.lo = &part_lo[c];
            pb.hi = &part_hi[c];
            pb.out = o.data() + c * stride;
            pb.m_out = ml.data() + c * size_t(n_group);
            pb.l_out = ml.data() + (n_parts + c) * size_t(n_group);
            fn(pb, scratch);
        }
        for (int64_t g = 0; g < n_group; ++g)
            attn_merge(int(n_parts), ml.data() + g, ml.data() + n_parts * size_t(n_group) + g, size_t(n_group),
                       o.data() + g * hdv, stride, hdv, b.out + size_t(r) * b.out_row_stride + size_t(g * hdv));
    }
}

using F32In = py::array_t<float, py::array::c_style | py::array::forcecast>;
using F16Bits = py::array_t<uint16_t, py::array::c_style>;
using I64In = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// attend's arguments against each other (shapes in attend's docstring); returns head_dim_v.
int64_t check_attend_args(const F32In &q, const F16Bits &k, const std::optional<F16Bits> &v_opt, const I64In &lo,
                          const I64In &hi, int head_kv, int64_t latent_v, int64_t split_keys) {
    if (q.ndim() != 3 || k.ndim() != 3 || (v_opt && v_opt->ndim() != 3))
        throw std::invalid_argument("q, k and v must be 3-D: [n_rows, n_group, head_dim_k], "
                                    "[n_keys, n_head_kv, head_dim_k], [n_keys, n_head_kv, head_dim_v]");
    const int64_t n_rows = q.shape(0), n_group = q.shape(1), hdk = q.shape(2);
    const int64_t n_keys = k.shape(0), n_kv = k.shape(1);
    if (v_opt.has_value() == (latent_v > 0))
        throw std::invalid_argument("attend: pass either v or latent_v (values = the leading entries of the keys)");
    if (latent_v > hdk) throw std::invalid_argument("attend: latent_v must be <= head_dim_k");
    const int64_t hdv = v_opt ? v_opt->shape(2) : latent_v;
    if (n_rows < 1 || n_group < 1 || hdk < 1 || hdv < 1 || n_keys < 1)
        throw std::invalid_argument("attend: empty q, k or v");
    if (k.shape(2) != hdk || (v_opt && (v_opt->shape(0) != n_keys || v_opt->shape(1) != n_kv)))
        throw std::invalid_argument("attend: k must be [n_keys, n_head_kv, head_dim_k] and v [n_keys, n_head_kv, "
                                    "head_dim_v] with q's head_dim_k");
    if (head_kv < 0 || head_kv >= n_kv) throw std::invalid_argument("attend: head_kv out of range");
    if (lo.ndim() != 1 || hi.ndim() != 1 || lo.shape(0) != n_rows || hi.shape(0) != n_rows)
        throw std::invalid_argument("attend: lo and hi must be 1-D with one entry per query row");
    for (int64_t r = 0; r < n_rows; ++r)
        if (lo.data()[r] < 0 || lo.data()[r] >= hi.data()[r] || hi.data()[r] > n_keys)
            throw std::invalid_argument("attend: row " + std::to_string(r) + " needs 0 <= lo < hi <= n_keys");
    if (split_keys < 0) throw std::invalid_argument("attend: split_keys must be >= 0");
    return hdv;
}

// ktd._native.attention.attend: one block of query rows of one GQA group through the kernel of
// `isa` (the active one when None), whole or split as the forward's long decode rows are.
py::array_t<float> attend(F32In q, F16Bits k, std::optional<F16Bits> v_opt, I64In lo, I64In hi, int head_kv,
                          std::optional<std::string> isa, int64_t latent_v, int64_t split_keys) {
    const int64_t hdv = check_attend_args(q, k, v_opt, lo, hi, head_kv, latent_v, split_keys);
    const int64_t n_rows = q.shape(0), n_group = q.shape(1), hdk = q.shape(2), n_kv = k.shape(1);
    AttnKernel fn = attention_kernel();
    if (isa) {
        fn = find_attention_kernel(supported_isa(*isa));
        if (!fn) throw std::invalid_argument("no " + *isa + " attention kernel in this build");
    }
    py::array_t<float> out({n_rows, n_group, hdv});
    AttnBlock b;
    b.q = q.data();
    b.q_row_stride = size_t(n_group * hdk);
    b.n_rows = int(n_rows);
    b.n_group = int(n_group);
    b.lo = lo.data();
    b.hi = hi.data();
    b.k = k.data() + head_kv * hdk;
    b.k_stride = size_t(n_kv * hdk);
    b.v = v_opt ? v_opt->data() + head_kv * hdv : b.k;
    b.v_stride = v_opt ? size_t(n_kv * hdv) : b.k_stride;
    b.head_dim_k = hdk;
    b.head_dim_v = hdv;
    b.out = out.mutable_data();
    b.out_row_stride = size_t(n_group * hdv);
    std::vector<float> scratch(attn_scratch_layout(b.n_rows, b.n_group, hdk, hdv).total);
    {
        py::gil_scoped_release release;
        if (split_keys == 0)
            fn(b, scratch.data());
        else
            attend_split(fn, b, split_keys, scratch.data());
    }
    return out;
}

// ktd._native.attention: the online-softmax kernels over an F16 KV cache.
void bind_attention(py::module_ &m) {
    auto att = m.def_submodule("attention", "attention kernels (online softmax over an F16 KV cache) per ISA");
    att.def("tile", [] { return kAttnTile; }, "keys per online-softmax tile");
    att.def("kernel_isas", [] {
        std::vector<std::string> out;
        for (Isa i : kAllIsas)
            if (find_attention_kernel(i)) out.emplace_back(isa_name(i));
        return out;
    }, "ISAs with their own attention kernel (others fall back as the matrix kernels do)");
    att.def("attend", &attend, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lo"), py::arg("hi"),
            py::arg("head_kv") = 0, py::arg("isa") = py::none(), py::arg("latent_v") = 0, py::arg("split_keys") = 0,
            "One block: q F32 [n_rows, n_group, head_dim_k] (already scaled), k/v F16 bits (uint16) "
            "[n_keys, n_head_kv, head_dim], row r attends keys [lo[r], hi[r]) of KV head head_kv; "
            "returns F32 [n_rows, n_group, head_dim_v]. v=None, latent_v=d: the values are the first d "
            "entries of each key row (MLA's latent). split_keys > 0: each row's keys in ranges at multiples "
            "of split_keys, computed apart and merged (the forward's decode over long contexts).");
}

// ktd._native.elementwise: the gated activations, one function per Glu.
void bind_elementwise(py::module_ &m) {
    auto ew = m.def_submodule("elementwise", "element-wise gated activation kernels per ISA");
    ew.def("kernel_isas", [] {
        std::vector<std::string> out;
        for (Isa i : kAllIsas)
            if (find_glu_kernel(Glu::SwiGLU, i) || find_glu_kernel(Glu::GeGLU, i) || find_glu_kernel(Glu::ReLU2, i))
                out.emplace_back(isa_name(i));
        return out;
    }, "ISAs with their own element-wise kernels");
    const std::pair<Glu, const char *> glus[] = {
        {Glu::SwiGLU, "silu(a) * b, F32 1-D"},
        {Glu::GeGLU, "gelu_tanh(a) * b (Gemma's gelu_pytorch_tanh), F32 1-D"},
        {Glu::ReLU2, "max(a, 0)^2 * b, F32 1-D"},
    };
    for (const auto &[glu, doc] : glus) {
        const std::string name = glu_name(glu);
        ew.def(
            name.c_str(),
            [glu, name](py::array_t<float, py::array::c_style | py::array::forcecast> a,
                        py::array_t<float, py::array::c_style | py::array::forcecast> b, std::optional<std::string> isa) {
                if (a.ndim() != 1 || b.ndim() != 1 || a.shape(0) != b.shape(0))
                    throw std::invalid_argument(name + ": a and b must be 1-D of the same length");
                GluKernel fn = glu_kernel(glu);
                if (isa) {
                    fn = find_glu_kernel(glu, supported_isa(*isa));
                    if (!fn) throw std::invalid_argument("no " + *isa + " " + name + " kernel in this build");
                }
                py::array_t<float> out(a.shape(0));
                std::copy(a.data(), a.data() + a.shape(0), out.mutable_data());
                fn(out.mutable_data(), b.data(), a.shape(0));
                return out;
            },
            py::arg("a"), py::arg("b"), py::arg("isa") = py::none(), doc);
    }
}

}  // namespace

void bind_float_kernels(py::module_ &m) {
    bind_attention(m);
    bind_elementwise(m);
}

}  // namespace ktd
