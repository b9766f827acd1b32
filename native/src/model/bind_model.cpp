// Python bindings of the forward: ktd._native.Model, ContextOverflow, the device errors (the Context:
// bind_context.cpp).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>

#include "bindings.h"
#include "kernels/kernels.h"
#include "memory/arena.h"
#include "model/context.h"
#include "model/model.h"
#include "model/cuda_device.h"
#include "common/crc32c.h"
#include "model/moe.h"
#include "model/weights_cache.h"

namespace py = pybind11;

namespace ktd {

namespace {

// Model.memory: where the weights went.
py::dict memory_dict(const Model &x) {
    const MemoryLayout &l = x.memory();
    py::list nodes;
    for (const NumaNodeMemory &n : l.nodes) {
        py::dict d;
        d["node"] = n.node;
        d["threads"] = n.n_threads;
        d["expert_bytes"] = n.expert_bytes;
        d["dense_copy_bytes"] = n.dense_copy_bytes;
        d["bound"] = n.bound;
        d["note"] = n.note;
        nodes.append(d);
    }
    py::dict d;
    d["nodes"] = nodes;
    d["experts_sharded"] = l.experts_sharded;
    d["dense_policy"] = l.dense_policy;
    d["dense_note"] = l.dense_note;
    d["dense_bytes"] = l.dense_bytes;
    d["embd_bytes"] = l.embd_bytes;
    d["page_kind"] = l.page_kind;
    d["page_size"] = l.page_size;
    d["page_reason"] = l.page_reason;
    d["weights_map"] = l.weights_map;
    d["weights_map_note"] = l.weights_map_note;
    d["file_bytes"] = l.file_bytes;
    d["file_copy_note"] = l.file_copy_note;
    return d;
}

// Model._expert_slice_ranges: per expert the parts of layer il's gate, up or down stack.
py::list expert_slice_ranges(const Model &x, int il, const std::string &which) {
    if (il < 0 || il >= x.hparams().n_layer) throw std::invalid_argument("layer out of range");
    const LayerWeights &lw = x.weights().layers[size_t(il)];
    const MatrixStack *st = which == "gate"   ? &lw.ffn_gate_exps
                            : which == "up"   ? &lw.ffn_up_exps
                            : which == "down" ? &lw.ffn_down_exps
                                              : nullptr;
    if (!st) throw std::invalid_argument("which must be gate, up or down");
    if (!*st) throw std::invalid_argument("layer has no routed experts");
    // Per expert and part: (address, bytes, first row, rows) of the prepared data.
    py::list out;
    for (size_t e = 0; e < st->info->ne[2]; ++e) {
        py::list parts;
        for (int p = 0; p < st->n_parts(); ++p) {
            const PreparedWeights &pw = st->parts(e)[p];
            const size_t bytes = pw.repacked ? pw.repacked_bytes : size_t(pw.rows) * pw.row_bytes;
            parts.append(py::make_tuple(reinterpret_cast<uintptr_t>(pw.data), bytes,
                                        st->part_rows(p).first, pw.rows));
        }
        out.append(parts);
    }
    return out;
}

// Model.tensor_table: the architecture's table for this model, one dict per row.
py::list tensor_table(const Model &x) {
    py::list out;
    for (const TensorSpec &t : x.tensor_table().specs) {
        py::dict d;
        d["name"] = t.name;
        d["shape"] = py::make_tuple(t.ne[0], t.ne[1], t.ne[2]);
        d["required"] = t.required;
        d["class"] = tensor_class_name(t.cls);
        d["layers"] = t.layers == LayerSet::All ? "all" : t.layers == LayerSet::Dense ? "dense" : "moe";
        d["per_layer"] = t.per_layer();
        out.append(d);
    }
    return out;
}

}  // namespace

static void bind_model_hooks(py::module_ &m) {

    m.def(
        "_moe_route",
        [](py::handle logits_h, int n_expert_used, const std::string &gating, bool weights_norm, float weights_scale,
           py::object probs_b_h, int n_group, int n_group_used) {
            auto logits = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(logits_h);
            if (!logits || logits.ndim() != 2 || logits.shape(1) < 1 || logits.shape(1) > 4096)
                throw std::invalid_argument("logits must be a float32 array [n, n_expert] with 1 <= n_expert <= 4096");
            MoeParams mp;
            mp.n_expert = int(logits.shape(1));
            mp.n_expert_used = n_expert_used;
            if (n_expert_used < 1 || n_expert_used > mp.n_expert)
                throw std::invalid_argument("n_expert_used must be in [1, n_expert]");
            if (gating != "softmax" && gating != "sigmoid")
                throw std::invalid_argument("gating must be 'softmax' or 'sigmoid'");
            mp.gating = gating == "softmax" ? ExpertGating::Softmax : ExpertGating::Sigmoid;
            mp.weights_norm = weights_norm;
            mp.weights_scale = weights_scale;
            if (n_group > 1) {
                const int gsize = mp.n_expert / n_group;
                if (mp.n_expert % n_group != 0 || gsize < 2 || n_group_used < 1 || n_group_used > n_group ||
                    n_group_used * gsize < n_expert_used)
                    throw std::invalid_argument("bad expert groups");
                mp.n_group = n_group;
                mp.n_group_used = n_group_used;
            }
            std::vector<float> bias;
            if (!probs_b_h.is_none()) {
                auto b = vec1d<float>(probs_b_h, "exp_probs_b");
                if (b.shape(0) != mp.n_expert) throw std::invalid_argument("exp_probs_b must have n_expert entries");
                bias.assign(b.data(), b.data() + mp.n_expert);
            }
            const int64_t n = logits.shape(0);
            std::vector<float> probs(logits.data(), logits.data() + n * mp.n_expert), select(size_t(mp.n_expert));
            py::array_t<int32_t> ids({n, int64_t(n_expert_used)});
            py::array_t<float> weights({n, int64_t(n_expert_used)});
            moe_route(mp, probs.data(), bias.empty() ? nullptr : bias.data(), n, ids.mutable_data(),
                      weights.mutable_data(), select.data());
            return py::make_tuple(ids, weights);
        },
        py::arg("logits"), py::arg("n_expert_used"), py::arg("gating") = "softmax", py::arg("weights_norm") = false,
        py::arg("weights_scale") = 1.0f, py::arg("exp_probs_b") = py::none(), py::arg("n_group") = 0,
        py::arg("n_group_used") = 0,
        "Test hook: moe_route on router logits [n, n_expert] → (ids int32 [n, k] best first, weights float32 [n, k])");

    m.def(
        "numa_slice_rows",
        [](int64_t rows, int n_slice, int s) {
            if (rows < 0 || n_slice < 1 || s < 0 || s >= n_slice)
                throw std::invalid_argument("need rows >= 0 and 0 <= s < n_slice");
            return numa_slice_rows(rows, n_slice, s);
        },
        py::arg("rows"), py::arg("n_slice"), py::arg("s"),
        "Rows [first, last) of a matrix that NUMA slice s of n_slice holds and computes (boundaries "
        "on multiples of 16 rows, balanced)");

}

static void bind_weights_cache(py::module_ &m) {
    py::class_<LoadProgress, std::shared_ptr<LoadProgress>>(
        m, "LoadProgress", "Progress of a Model load, readable from another thread while it runs")
        .def(py::init<>())
        .def_property_readonly("phase",
                               [](const LoadProgress &p) {
                                   static const char *names[] = {"starting", "reading the weights cache",
                                                                 "preparing weights", "writing the weights cache",
                                                                 "done"};
                                   const int i = p.phase.load();
                                   return std::string(i >= 0 && i <= 4 ? names[i] : "?");
                               })
        .def_property_readonly("done", [](const LoadProgress &p) { return p.done.load(); })
        .def_property_readonly("total", [](const LoadProgress &p) { return p.total.load(); });
    m.def(
        "weights_cache_header",
        [](const std::string &path) {
            WeightsCacheHeader h;
            {
                py::gil_scoped_release release;
                h = read_weights_cache_header(path);
            }
            py::dict d;
            d["ok"] = h.ok;
            d["problem"] = h.problem;
            py::dict key;
            size_t a = 0;
            while (a < h.key.size()) {
                const size_t e = std::min(h.key.find('\n', a), h.key.size());
                const std::string line = h.key.substr(a, e - a);
                const size_t eq = line.find('=');
                if (eq != std::string::npos) key[py::str(line.substr(0, eq))] = line.substr(eq + 1);
                a = e + 1;
            }
            d["key"] = key;
            d["file_bytes"] = h.file_bytes;
            d["section_bytes"] = h.section_bytes;
            return d;
        },
        py::arg("path"),
        "The header of a prepared-weights cache file: ok, problem (what is wrong when not ok), key "
        "{name: value} (model, size, mtime_ns, header_crc32c, format, build_id, isa, ...), file_bytes, "
        "section_bytes");
    m.def(
        "weights_cache_verify",
        [](const std::string &path) {
            py::gil_scoped_release release;
            return verify_weights_cache(path);
        },
        py::arg("path"), "Every checksum of a prepared-weights cache file: '' or the first problem");
    m.def("native_build_id", &native_build_id, "The native module's GNU build id (hex), '' when it has none");
    m.def(
        "crc32c",
        [](py::buffer b, uint32_t crc) {
            py::buffer_info info = b.request();
            return crc32c(info.ptr, size_t(info.size * info.itemsize), crc);
        },
        py::arg("data"), py::arg("crc") = 0, "CRC-32C of a buffer (continuing crc)");
    m.def(
        "crc32c_x4",
        [](py::buffer b) {
            py::buffer_info info = b.request();
            const auto c = crc32c_x4(info.ptr, size_t(info.size * info.itemsize));
            return py::make_tuple(c[0], c[1], c[2], c[3]);
        },
        py::arg("data"), "The cache's block checksum: CRC-32C of the four quarters (common/crc32c.h)");
    m.def("crc32c_hardware", &crc32c_hardware, "Whether CRC-32C runs on the SSE4.2 instruction");
}

namespace {

// Model(numa_experts=...): whether routed experts are sharded over the NUMA nodes.
bool parse_numa_experts(const std::string &s) {
    if (s != "shard" && s != "off") throw std::invalid_argument("numa_experts must be 'shard' or 'off', got '" + s + "'");
    return s == "shard";
}

NumaDense parse_numa_dense(const std::string &s) {
    if (s != "interleave" && s != "replicate")
        throw std::invalid_argument("numa_dense must be 'interleave' or 'replicate', got '" + s + "'");
    return s == "replicate" ? NumaDense::Replicate : NumaDense::Interleave;
}

WeightsMap parse_weights_map(const std::string &s) {
    if (s != "arena" && s != "gguf" && s != "auto")
        throw std::invalid_argument("weights_map must be 'arena', 'gguf' or 'auto', got '" + s + "'");
    return s == "gguf" ? WeightsMap::Gguf : s == "auto" ? WeightsMap::Auto : WeightsMap::Arena;
}

// Model.cache: what the load did with the prepared-weights cache.
py::dict cache_dict(const Model &x) {
    const WeightsCacheStatus c = x.cache();
    py::dict d;
    d["path"] = c.path;
    d["state"] = c.state;
    d["reason"] = c.reason;
    d["bytes"] = c.bytes;
    d["seconds"] = c.seconds;
    d["mapped"] = c.mapped;
    d["direct"] = c.direct;
    return d;
}

using PyModel = py::class_<Model, std::shared_ptr<Model>>;

// Model(path, ...): opening a model with its options, and what a file holds before it is opened.
void bind_model_open(PyModel &model) {
    model.def(py::init([](const std::string &path, int n_threads, bool pin, bool allow_repack, std::vector<int> nodes,
                         bool smt, const std::string &sysfs_root, std::vector<int> affinity,
                         const std::string &hugepages, size_t hugetlb_page_size, bool mlock,
                         const std::string &numa_experts, const std::string &numa_dense,
                         const std::string &cache_dir, std::shared_ptr<LoadProgress> progress,
                         bool cache_write_background, bool cache_map, bool cache_direct,
                         const std::string &weights_map) {
                 ModelOptions o;
                 o.n_threads = n_threads;
                 o.pin = pin;
                 o.allow_repack = allow_repack;
                 o.nodes = std::move(nodes);
                 o.smt = smt;
                 o.sysfs_root = sysfs_root;
                 o.affinity = std::move(affinity);
                 o.hugepages = parse_hugepages(hugepages);
                 o.hugetlb_page_size = hugetlb_page_size;
                 o.mlock = mlock;
                 o.shard_experts = parse_numa_experts(numa_experts);
                 o.numa_dense = parse_numa_dense(numa_dense);
                 o.cache_dir = cache_dir;
                 o.progress = std::move(progress);
                 o.cache_write_background = cache_write_background;
                 o.cache_map = cache_map;
                 o.cache_direct = cache_direct;
                 o.weights_map = parse_weights_map(weights_map);
                 py::gil_scoped_release release;
                 return std::shared_ptr<Model>(Model::open(path, o));
             }),
             py::arg("path"), py::arg("n_threads") = 0, py::arg("pin") = true, py::arg("allow_repack") = true,
             py::arg("nodes") = std::vector<int>{}, py::arg("smt") = false, py::arg("sysfs_root") = "/sys",
             py::arg("affinity") = std::vector<int>{}, py::arg("hugepages") = "auto",
             py::arg("hugetlb_page_size") = kPage2M, py::arg("mlock") = false, py::arg("numa_experts") = "shard",
             py::arg("numa_dense") = "interleave", py::arg("cache_dir") = "",
             py::arg("progress") = std::shared_ptr<LoadProgress>(), py::arg("cache_write_background") = false,
             py::arg("cache_map") = true, py::arg("cache_direct") = true, py::arg("weights_map") = "arena")
        .def_static("supported_archs", &Model::supported_archs)
        .def_static(
            "tensor_classes",
            [](const std::string &path) {
                py::dict out;
                for (const auto &[name, cls] : Model::tensor_classes(path)) out[py::str(name)] = tensor_class_name(cls);
                return out;
            },
            py::arg("path"),
            "{tensor name: placement class} for the tensors of a GGUF file that its architecture's table names "
            "(embedding, output, dense, router, routed_expert, shared_expert); reads the header only");
}

// What a loaded model is: its hyperparameters and tensor table, its sizes, its threads.
void bind_model_hparams(PyModel &model) {
    model.def_property_readonly("arch", [](const Model &x) { return x.hparams().arch; })
        .def_property_readonly("n_vocab", [](const Model &x) { return x.hparams().n_vocab; })
        .def_property_readonly("n_embd", [](const Model &x) { return x.hparams().n_embd; })
        .def_property_readonly("n_layer", [](const Model &x) { return x.hparams().n_layer; })
        .def_property_readonly("n_head", [](const Model &x) { return x.hparams().n_head; })
        .def_property_readonly("n_head_kv", [](const Model &x) { return x.hparams().n_head_kv; })
        .def_property_readonly("n_ff", [](const Model &x) { return x.hparams().n_ff; })
        .def_property_readonly("n_ctx_train", [](const Model &x) { return x.hparams().n_ctx_train; })
        .def_property_readonly("n_expert", [](const Model &x) { return x.hparams().moe.n_expert; })
        .def_property_readonly("n_expert_used", [](const Model &x) { return x.hparams().moe.n_expert_used; })
        .def_property_readonly("n_params", &Model::n_params)
        .def_property_readonly("repacked_bytes", &Model::repacked_bytes)
        .def_property_readonly("copied_bytes", &Model::copied_bytes,
                               "bytes copied into the arenas as they are in the file (types without repacking, "
                               "token_embd's lookup rows)")
        .def_property_readonly("n_threads", [](const Model &x) { return x.pool().size(); })
        .def(
            "pin_forward_thread",
            [](Model &x) {
                if (x.pool().nodes().size() < 2) return false;
                x.pool().pin_caller();
                return x.pool().cpu_of(0) >= 0;
            },
            "When the pool spans several NUMA nodes: pin the calling thread (it must be the one that runs "
            "every forward: the pool's tid 0) to the pool's first CPU, so that its share of each op reads "
            "its node's weights, as the workers are pinned to theirs. On one node there is nothing to gain "
            "and the OS keeps the freedom to move it off a core the event loop wants. Returns whether it "
            "pinned; OSError if the CPU cannot be taken.")
        .def_property_readonly("forward_cpu", [](const Model &x) { return x.pool().cpu_of(0); },
                               "CPU of the pool's tid 0 (-1 until pin_forward_thread)")
        .def_property_readonly("isa", [](const Model &) { return std::string(isa_name(active_isa())); })
        .def_property_readonly("tensor_table", &tensor_table,
                               "The architecture's tensor table for this model: name (%d = layer), expected "
                               "shape (GGML order), required, placement class, layer set");
}

// Where the weights went: the cache, the arenas and their pages, the expert slices.
void bind_model_memory(PyModel &model) {
    model.def_property_readonly(
            "cache", &cache_dict,
            "What the load did with the prepared-weights cache: path (of the entry), state (off, hit, "
            "writing (in the background), written, not written, absent (weights_map: auto, a miss: served from the "
            "model file, the entry left to a background builder)), reason (why an existing entry was not used, or why none was written), "
            "bytes (of the entry), seconds (reading or writing it), mapped (a hit: the entry's pages mapped into "
            "the arenas rather than read into fresh ones), direct (written: the weights were prepared straight into "
            "the entry's pages, which the model serves from)")
        .def_property_readonly(
            "memory", &memory_dict,
            "Where the weights went: NUMA nodes (pool order) with their routed-expert bytes and "
            "binding, the dense policy, the arenas' page kind and why better ones were not used; "
            "weights_map (arena or gguf, as loaded) with weights_map_note (why not the requested one), "
            "file_bytes (gguf: matrix and token_embd bytes served from the file's mapping) and "
            "file_copy_note (gguf: the tensors copied instead, and why)")
        .def("arena_pages", [](const Model &x) {
                 py::dict d;
                 for (const auto &[k, v] : x.arena_pages()) d[py::str(k)] = v;
                 return d;
             },
             "What the kernel gives the weights arenas now, summed over them, from /proc/self/smaps (bytes: "
             "Rss, AnonHugePages, Private_Hugetlb, ...; KernelPageSize the largest); {} without arenas "
             "(weights_map: gguf)")
        .def("_expert_slice_ranges", &expert_slice_ranges,
             py::arg("layer"), py::arg("which"),
             "Test hook: per expert the parts of a routed-expert stack as (address, bytes, first row, rows)");
}

}  // namespace

static void bind_model_class(py::module_ &m) {
    m.def(
        "plain_alignment",
        [](uint32_t type_id) {
            const auto info = ggml_type_info(type_id);
            if (!info) throw std::invalid_argument("unknown GGML type id " + std::to_string(type_id));
            return plain_alignment(info->type);
        },
        py::arg("type_id"),
        "Bytes a tensor's data must be aligned to for model.weights_map: gguf to serve it from the file's mapping "
        "(the plain kernels' block alignment); less aligned, it is copied");

    PyModel model(m, "Model", "A loaded GGUF model (weights checked and prepared)");
    bind_model_open(model);
    bind_model_hparams(model);
    bind_model_memory(model);
}

void bind_model(py::module_ &m) {
    py::register_exception<ContextOverflowError>(m, "ContextOverflow", PyExc_RuntimeError);
    {
        static py::exception<DeviceError> device_error(m, "DeviceError", PyExc_RuntimeError);
        // DeviceMemoryError: a DeviceError and a MemoryError.
        static py::handle device_memory_error = [&] {
            py::object bases = py::make_tuple(device_error, py::handle(PyExc_MemoryError));
            py::object t = py::reinterpret_steal<py::object>(
                PyErr_NewException("ktd._native.DeviceMemoryError", bases.ptr(), nullptr));
            m.attr("DeviceMemoryError") = t;
            return t.release();
        }();
        py::register_exception_translator([](std::exception_ptr p) {
            try {
                if (p) std::rethrow_exception(p);
            } catch (const DeviceMemoryError &e) {
                PyErr_SetString(device_memory_error.ptr(), e.what());
            } catch (const DeviceError &e) {
                PyErr_SetString(device_error.ptr(), e.what());
            }
        });
    }
    bind_model_hooks(m);
    bind_weights_cache(m);  // first: Model's constructor takes a LoadProgress
    bind_model_class(m);
    bind_context(m);
}

}  // namespace ktd
