// Python bindings of ktd._native.Context: batches, sequences, backends, statistics and the test
// and bench hooks, one function per area.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <mutex>

#include "bindings.h"
#include "model/context.h"
#include "model/cpu_backend.h"
#include "model/hybrid_backend.h"
#include "model/model.h"
#include "model/moe.h"

namespace py = pybind11;

namespace ktd {

namespace {

// A Context plus the lock that keeps two Python threads from running it at once (the GIL is
// released during forward).
struct PyContext {
    std::shared_ptr<Model> model;
    std::unique_ptr<Context> ctx;
    std::mutex mu;
};
using PyContextClass = py::class_<PyContext>;

using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// A batch's row arrays, each 1-D; check() compares their lengths and a fourth array's (`last`).
struct BatchArrays {
    I32 tokens, positions, seq_ids;
    int64_t n;
    BatchArrays(py::handle t, py::handle p, py::handle s)
        : tokens(vec1d<int32_t>(t, "tokens")), positions(vec1d<int32_t>(p, "positions")),
          seq_ids(vec1d<int32_t>(s, "seq_ids")), n(tokens.shape(0)) {}
    void check(int64_t n_last, const char *last) const {
        if (positions.shape(0) != n || seq_ids.shape(0) != n || n_last != n)
            throw std::invalid_argument(std::string("tokens, positions, seq_ids and ") + last +
                                        " must have the same length");
    }
    Batch batch() const { return Batch{tokens.data(), positions.data(), seq_ids.data(), nullptr, n}; }
};

// Context.forward: logits [n_marked, n_vocab]; greedy ids [n_marked] (greedy=True); or with a per-row
// greedy mask, (ids [n_marked], the logits of the marked rows not greedy [n_sampled, n_vocab]).
py::object context_forward(PyContext &c, py::handle tokens, py::handle positions, py::handle seq_ids,
                           py::handle want, py::handle greedy) {
    const BatchArrays a(tokens, positions, seq_ids);
    auto w = vec1d<bool>(want, "want_logits");
    a.check(w.shape(0), "want_logits");
    Batch b = a.batch();
    b.want_logits = reinterpret_cast<const uint8_t *>(w.data());
    int64_t n_marked = 0;
    for (int64_t i = 0; i < a.n; ++i) n_marked += w.data()[i] ? 1 : 0;
    const int64_t n_vocab = c.model->hparams().n_vocab;
    const bool mixed = py::isinstance<py::array>(greedy) || py::isinstance<py::list>(greedy) ||
                       py::isinstance<py::tuple>(greedy);
    std::vector<uint8_t> keep;  // mixed: the marked rows whose logits come back
    int64_t n_kept = 0;
    if (mixed) {
        auto g = vec1d<bool>(greedy, "greedy");
        a.check(g.shape(0), "greedy");
        keep.resize(size_t(a.n));
        for (int64_t i = 0; i < a.n; ++i) n_kept += keep[size_t(i)] = w.data()[i] && !g.data()[i];
    }
    const bool ids_only = mixed ? n_kept == 0 : py::cast<bool>(greedy);
    py::array_t<int32_t> ids(mixed || ids_only ? n_marked : 0);
    py::array_t<float> logits({mixed ? n_kept : ids_only ? 0 : n_marked, n_vocab});
    int32_t *ids_out = ids.mutable_data();
    float *logits_out = logits.mutable_data();
    {
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(c.mu);
        if (ids_only)
            c.ctx->forward(b, nullptr, ids_out);
        else if (mixed)
            c.ctx->forward(b, logits_out, ids_out, keep.data());
        else
            c.ctx->forward(b, logits_out);
    }
    if (mixed) return py::make_tuple(ids, logits);
    if (ids_only) return ids;
    return logits;
}

void bind_context_run(PyContextClass &cls) {
    cls.def("forward", &context_forward, py::arg("tokens"), py::arg("positions"), py::arg("seq_ids"),
            py::arg("want_logits"), py::arg("greedy") = false,
            "One batch step; returns float32 [n_marked, n_vocab] (GIL released). greedy=True: int32 "
            "[n_marked] instead, each marked row's greedy token (the sampler's temperature-0 choice, "
            "taken as the output head writes the logits) or, where the sampler would reject the "
            "logits, a negative code (ktd._native.sampling.greedy_error). greedy=bool [n] (a step "
            "whose marked rows are partly greedy): (int32 [n_marked] every marked row's greedy token, "
            "float32 [n_sampled, n_vocab] the logits of the marked rows with greedy[i] False, in row "
            "order)")
        .def(
            "score",
            [](PyContext &c, py::handle tokens, py::handle positions, py::handle seq_ids, py::handle targets) {
                const BatchArrays a(tokens, positions, seq_ids);
                auto g = vec1d<int32_t>(targets, "targets");
                a.check(g.shape(0), "targets");
                int64_t n_scored = 0;
                for (int64_t i = 0; i < a.n; ++i) n_scored += g.data()[i] >= 0 ? 1 : 0;
                py::array_t<double> out(n_scored);
                const Batch b = a.batch();
                const int32_t *tg = g.data();
                double *dst = out.mutable_data();
                {
                    py::gil_scoped_release release;
                    std::lock_guard<std::mutex> lock(c.mu);
                    c.ctx->score(b, tg, dst);
                }
                return out;
            },
            py::arg("tokens"), py::arg("positions"), py::arg("seq_ids"), py::arg("targets"),
            "Runs a batch like forward and returns float64 [n_scored]: -log softmax(logits of row i)[targets[i]] "
            "for each row with targets[i] >= 0, in row order (-1: not scored); the logits stay native (GIL "
            "released)");
}

void bind_context_sequences(PyContextClass &cls) {
    cls.def_property_readonly("n_ctx", [](PyContext &c) { return c.ctx->n_ctx(); })
        .def_property_readonly("n_seq_max", [](PyContext &c) { return c.ctx->n_seq_max(); })
        .def_property_readonly("n_batch", [](PyContext &c) { return c.ctx->n_batch(); })
        .def_property_readonly("kv_bytes_per_token", [](PyContext &c) { return c.ctx->kv_bytes_per_token(); },
                               "Bytes of per-sequence memory one token takes over all layers (KV cache; MLA: "
                               "latent + rope key)")
        .def("free_seq", [](PyContext &c, int s) { std::lock_guard<std::mutex> l(c.mu); c.ctx->free_seq(s); })
        .def("copy_seq", [](PyContext &c, int src, int dst, int64_t n) {
            std::lock_guard<std::mutex> l(c.mu);
            c.ctx->copy_seq(src, dst, n);
        })
        .def("seq_len", [](PyContext &c, int s) { std::lock_guard<std::mutex> l(c.mu); return c.ctx->seq_len(s); });
}

void bind_context_profile(PyContextClass &cls) {
    cls.def(
           "set_profiling",
           [](PyContext &c, bool on) {
               std::lock_guard<std::mutex> l(c.mu);
               c.ctx->set_profiling(on);
           },
           py::arg("on"), "Time every block of every forward from now on (off: no timing at all)")
        .def(
            "profile",
            [](PyContext &c) {
                std::lock_guard<std::mutex> l(c.mu);
                const ForwardProfile &p = c.ctx->profile();
                py::dict out;
                for (int i = 0; i < kForwardOps; ++i)
                    out[forward_op_name(ForwardOp(i))] = py::make_tuple(p.ns[size_t(i)], p.calls[size_t(i)]);
                return out;
            },
            "{block: (nanoseconds, calls)} summed over the forwards since profiling began or the last reset; "
            "'forward' is the whole forward, the rest its parts; moe_router, moe_gate_up and moe_down are parts of "
            "moe_ffn (its one-token path), mla_project, mla_absorb, mla_cache and mla_decompress parts of "
            "mla_attention (the CPU backend's), not blocks of their own (model/profile.h)")
        .def("reset_profile", [](PyContext &c) {
            std::lock_guard<std::mutex> l(c.mu);
            c.ctx->reset_profile();
        });
}

void bind_context_pool(PyContextClass &cls) {
    cls.def(
           "set_pool_stats",
           [](PyContext &c, bool on) {
               std::lock_guard<std::mutex> l(c.mu);
               c.ctx->model().pool().set_stats(on);
           },
           py::arg("on"),
           "Time the model's thread pool region by region from now on (sums cleared; cpu/thread_pool.h PoolStats)")
        .def(
            "pool_stats",
            [](PyContext &c) {
                std::lock_guard<std::mutex> l(c.mu);
                return pool_stats_dict(c.ctx->model().pool().stats());
            },
            "The model's pool sums since set_pool_stats(True): runs, barriers, run_ns, join_wait_ns, join_sleeps, "
            "barrier_wait_ns, busy_ns [tid], start_ns [tid], worker_sleeps")
        .def_property(
            "pool_spin_us",
            [](PyContext &c) {
                std::lock_guard<std::mutex> l(c.mu);
                return c.ctx->model().pool().spin_us();
            },
            [](PyContext &c, int us) {
                std::lock_guard<std::mutex> l(c.mu);
                c.ctx->model().pool().set_spin_us(us);
            },
            "The model's pool's bounded spin before a waiting worker sleeps, microseconds (ThreadPool::set_spin_us; "
            "the hybrid forward raises it: gpu.pool_spin_us)");
}

// Context.hybrid_stats as a dict.
py::dict hybrid_stats_dict(const HybridStats &st) {
    py::dict d;
    d["bytes_to_host"] = st.bytes_to_host;
    d["bytes_to_device"] = st.bytes_to_device;
    d["moe_calls"] = st.moe_calls;
    d["device_layers"] = st.device_layers;
    d["routed_pairs"] = st.routed_pairs;
    d["device_pairs"] = st.device_pairs;
    d["early_launches"] = st.early_launches;
    d["to_host_ns"] = st.to_host_ns;
    d["host_experts_ns"] = st.host_experts_ns;
    d["sync_wait_ns"] = st.sync_wait_ns;
    d["from_host_ns"] = st.from_host_ns;
    return d;
}

void set_backend(PyContext &c, const std::string &name, int device, uint64_t vram_budget, int layers,
                 const std::map<int, std::vector<int32_t>> &experts) {
    HeldExperts held;
    for (const auto &[il, list] : experts) {
        if (il < 0 || il >= c.ctx->model().hparams().n_layer)
            throw std::invalid_argument("hot experts: layer " + std::to_string(il) + " out of range");
        if (size_t(il) >= held.size()) held.resize(size_t(il) + 1);
        held[size_t(il)] = list;
    }
    std::lock_guard<std::mutex> l(c.mu);
    if (name == "cuda" || name == "cuda-emulated")
        c.ctx->set_device_backend(name, device, vram_budget, layers, held);
    else
        c.ctx->set_backend(name, layers, held);
}

void bind_context_backend(PyContextClass &cls) {
    cls.def("set_backend", &set_backend, py::arg("name"), py::arg("device") = 0, py::arg("vram_budget") = 0,
            py::arg("layers") = 0, py::arg("experts") = std::map<int, std::vector<int32_t>>{},
            "'cpu' (default), 'loopback': the hybrid CPU+accelerator data flow with the CPU playing the "
            "device (model/hybrid_backend.h), or 'cuda': that data flow with the device part on CUDA device "
            "`device` within vram_budget bytes (0: the device's memory; model/cuda_device.h). A new backend "
            "holds its own sequence memory (KV cache): the sequences held are dropped; DeviceError / "
            "DeviceMemoryError when 'cuda' cannot be used, the context unchanged. layers (loopback, cuda; "
            "gpu.layers): only the first `layers` layers on the device, the others on the CPU (0: all; "
            "ValueError outside [0, n_layer]). experts (loopback, cuda; gpu.experts): {layer: [expert, ...]} the "
            "routed experts the device holds and computes (the host routes, the device adds the held experts' "
            "pairs; hybrid_stats' device_pairs / routed_pairs is the hit rate)")
        .def_property_readonly("backend", [](PyContext &c) { return c.ctx->backend_name(); })
        .def(
            "hybrid_stats",
            [](PyContext &c) {
                std::lock_guard<std::mutex> l(c.mu);
                return hybrid_stats_dict(c.ctx->hybrid_stats());
            },
            "bytes of activations sent device→host and host→device, MoE layers run, and the time (ns) of the "
            "copies, the routed experts on the CPU and the wait for the device after them, by the hybrid backend; "
            "routed_pairs / device_pairs: routed (token, expert) pairs of the device's layers and those the device "
            "computed (held experts); early_launches: MoE layers whose held experts went to the device once routed, "
            "from inside the host's call");
}

void bind_context_experts(PyContextClass &cls) {
    cls.def(
           "expert_counts",
           [](PyContext &c) {
               const HParams &hp = c.model->hparams();
               py::array_t<uint64_t> out({int64_t(hp.n_layer), int64_t(hp.moe.n_expert)});
               std::lock_guard<std::mutex> l(c.mu);
               const std::vector<uint64_t> &counts = c.ctx->expert_counts();
               std::copy(counts.begin(), counts.end(), out.mutable_data());
               return out;
           },
           "uint64 [n_layer, n_expert]: tokens routed to each expert since creation or the last reset "
           "(dense layers 0; n_expert = 0 for a dense model)")
        .def("reset_expert_counts", [](PyContext &c) {
            std::lock_guard<std::mutex> l(c.mu);
            c.ctx->reset_expert_counts();
        });
}

// Context._moe_ffn: the MoE FFN of one layer on given rows, with scratch of its own.
py::array_t<float> context_moe_ffn(PyContext &c, int il, py::handle xn_h) {
    const HParams &hp = c.model->hparams();
    if (il < 0 || il >= hp.n_layer || !c.model->weights().layers[size_t(il)].ffn_gate_inp)
        throw std::invalid_argument("layer " + std::to_string(il) + " has no routed experts");
    auto xn = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(xn_h);
    if (!xn || xn.ndim() != 2 || xn.shape(1) != hp.n_embd || xn.shape(0) < 1 || xn.shape(0) > c.ctx->n_batch())
        throw std::invalid_argument("xn must be a float32 array [n, n_embd] with 1 <= n <= n_batch");
    const int64_t n = xn.shape(0);
    py::array_t<float> y({n, hp.n_embd});
    float *dst = y.mutable_data();
    {
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> l(c.mu);
        MoeScratch s;
        MatmulScratch mm;
        moe_ffn(MoeRun{*c.model, s, mm, c.ctx->taps()}, c.model->weights().layers[size_t(il)], il, xn.data(), n, dst);
    }
    return y;
}

// The test and bench hooks: one MoE FFN on given rows, the recorded residuals.
void bind_context_hooks(PyContextClass &cls) {
    cls.def("_moe_ffn", &context_moe_ffn, py::arg("il"), py::arg("xn"),
            "Test hook: the MoE FFN of layer il on normed rows xn [n, n_embd] → [n, n_embd] (counts the routing)")
        .def(
            "_record_states",
            [](PyContext &c, bool on) {
                const HParams &hp = c.model->hparams();
                std::lock_guard<std::mutex> l(c.mu);
                std::vector<float> &st = c.ctx->taps().moe_states;
                if (on)
                    st.assign(size_t(hp.n_layer) * 2 * size_t(hp.n_embd), 0.0f);
                else
                    std::vector<float>().swap(st);
            },
            py::arg("on"),
            "Bench hook: from now on (on) or no longer, record the residual of each batch's last row before "
            "and after every MoE layer's FFN (see _states)")
        .def(
            "_states",
            [](PyContext &c) {
                const HParams &hp = c.model->hparams();
                std::lock_guard<std::mutex> l(c.mu);
                const std::vector<float> &st = c.ctx->taps().moe_states;
                if (st.empty()) throw std::invalid_argument("state recording is off (call _record_states(True))");
                py::array_t<float> out({int64_t(hp.n_layer), int64_t(2), hp.n_embd});
                std::copy(st.begin(), st.end(), out.mutable_data());
                return out;
            },
            "float32 [n_layer, 2, n_embd]: the last recorded residuals before ([:, 0]) and after ([:, 1]) each "
            "MoE layer's FFN (dense layers: zeros)");
}

}  // namespace

void bind_context(py::module_ &m) {
    PyContextClass cls(m, "Context", "Sequence slots over the backend's per-sequence memory (KV cache); runs batches");
    cls.def(py::init([](std::shared_ptr<Model> model, int64_t n_ctx, int n_seq_max, int64_t n_batch) {
                auto c = std::make_unique<PyContext>();
                c->model = model;
                c->ctx = std::make_unique<Context>(*model, n_ctx, n_seq_max, n_batch);
                return c;
            }),
            py::arg("model"), py::arg("n_ctx"), py::arg("n_seq_max") = 1, py::arg("n_batch") = 512);
    bind_context_run(cls);
    bind_context_sequences(cls);
    bind_context_profile(cls);
    bind_context_pool(cls);
    bind_context_backend(cls);
    bind_context_experts(cls);
    bind_context_hooks(cls);
}

}  // namespace ktd
