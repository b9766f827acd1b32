// Python bindings of the forward: ktd._native.Model, ktd._native.Context, ContextOverflow.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>

#include "bindings.h"
#include "kernels/kernels.h"
#include "model/model.h"

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

template <class T>
py::array_t<T, py::array::c_style | py::array::forcecast> vec1d(const py::handle &h, const char *name) {
    auto a = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(h);
    if (!a || a.ndim() != 1) throw std::invalid_argument(std::string(name) + " must be a 1-D array");
    return a;
}

}  // namespace

void bind_model(py::module_ &m) {
    py::register_exception<ContextOverflowError>(m, "ContextOverflow", PyExc_RuntimeError);

    py::class_<Model, std::shared_ptr<Model>>(m, "Model", "A loaded GGUF model (weights checked and prepared)")
        .def(py::init([](const std::string &path, int n_threads, bool pin, bool allow_repack) {
                 ModelOptions o;
                 o.n_threads = n_threads;
                 o.pin = pin;
                 o.allow_repack = allow_repack;
                 py::gil_scoped_release release;
                 return std::shared_ptr<Model>(Model::open(path, o));
             }),
             py::arg("path"), py::arg("n_threads") = 0, py::arg("pin") = true, py::arg("allow_repack") = true)
        .def_static("supported_archs", &Model::supported_archs)
        .def_property_readonly("arch", [](const Model &x) { return x.hparams().arch; })
        .def_property_readonly("n_vocab", [](const Model &x) { return x.hparams().n_vocab; })
        .def_property_readonly("n_embd", [](const Model &x) { return x.hparams().n_embd; })
        .def_property_readonly("n_layer", [](const Model &x) { return x.hparams().n_layer; })
        .def_property_readonly("n_head", [](const Model &x) { return x.hparams().n_head; })
        .def_property_readonly("n_head_kv", [](const Model &x) { return x.hparams().n_head_kv; })
        .def_property_readonly("n_ff", [](const Model &x) { return x.hparams().n_ff; })
        .def_property_readonly("n_ctx_train", [](const Model &x) { return x.hparams().n_ctx_train; })
        .def_property_readonly("n_params", &Model::n_params)
        .def_property_readonly("repacked_bytes", &Model::repacked_bytes)
        .def_property_readonly("n_threads", [](const Model &x) { return x.pool().size(); })
        .def_property_readonly("isa", [](const Model &) { return std::string(isa_name(active_isa())); });

    py::class_<PyContext>(m, "Context", "KV cache with sequence slots + scratch; runs batches")
        .def(py::init([](std::shared_ptr<Model> model, int64_t n_ctx, int n_seq_max, int64_t n_batch) {
                 auto c = std::make_unique<PyContext>();
                 c->model = model;
                 c->ctx = std::make_unique<Context>(*model, n_ctx, n_seq_max, n_batch);
                 return c;
             }),
             py::arg("model"), py::arg("n_ctx"), py::arg("n_seq_max") = 1, py::arg("n_batch") = 512)
        .def_property_readonly("n_ctx", [](PyContext &c) { return c.ctx->n_ctx(); })
        .def_property_readonly("n_seq_max", [](PyContext &c) { return c.ctx->n_seq_max(); })
        .def_property_readonly("n_batch", [](PyContext &c) { return c.ctx->n_batch(); })
        .def_property_readonly("kv_bytes_per_token", [](PyContext &c) { return c.ctx->kv_bytes_per_token(); },
                               "KV cache bytes one token takes over all layers (MLA: latent + rope key)")
        .def(
            "forward",
            [](PyContext &c, py::handle tokens, py::handle positions, py::handle seq_ids, py::handle want) {
                auto t = vec1d<int32_t>(tokens, "tokens");
                auto p = vec1d<int32_t>(positions, "positions");
                auto s = vec1d<int32_t>(seq_ids, "seq_ids");
                auto w = vec1d<bool>(want, "want_logits");
                const int64_t n = t.shape(0);
                if (p.shape(0) != n || s.shape(0) != n || w.shape(0) != n)
                    throw std::invalid_argument("tokens, positions, seq_ids and want_logits must have the same length");
                int64_t n_marked = 0;
                for (int64_t i = 0; i < n; ++i) n_marked += w.data()[i] ? 1 : 0;
                const int64_t n_vocab = c.model->hparams().n_vocab;
                py::array_t<float> out({n_marked, n_vocab});
                Batch b;
                b.tokens = t.data();
                b.positions = p.data();
                b.seq_ids = s.data();
                b.want_logits = reinterpret_cast<const uint8_t *>(w.data());
                b.n = n;
                float *dst = out.mutable_data();
                {
                    py::gil_scoped_release release;
                    std::lock_guard<std::mutex> lock(c.mu);
                    c.ctx->forward(b, dst);
                }
                return out;
            },
            py::arg("tokens"), py::arg("positions"), py::arg("seq_ids"), py::arg("want_logits"),
            "One batch step; returns float32 [n_marked, n_vocab] (GIL released)")
        .def("free_seq", [](PyContext &c, int s) { std::lock_guard<std::mutex> l(c.mu); c.ctx->free_seq(s); })
        .def("copy_seq", [](PyContext &c, int src, int dst, int64_t n) {
            std::lock_guard<std::mutex> l(c.mu);
            c.ctx->copy_seq(src, dst, n);
        })
        .def("seq_len", [](PyContext &c, int s) { std::lock_guard<std::mutex> l(c.mu); return c.ctx->seq_len(s); });
}

}  // namespace ktd
