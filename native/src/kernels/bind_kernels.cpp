// Python bindings of the kernels (for tests and benchmarks; the forward calls them from C++).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "bindings.h"
#include "common/error.h"
#include "cpu/thread_pool.h"
#include "kernels/bench.h"
#include "kernels/kernels.h"
#include "memory/arena.h"

namespace py = pybind11;

namespace ktd {

namespace {
GGMLType parse_type(const std::string &name) {
    for (uint32_t id = 0; id < 64; ++id)
        if (auto info = ggml_type_info(id); info && info->name == name) return info->type;
    throw py::value_error("unknown GGML type '" + name + "'");
}

const TypeKernels &lookup(const std::string &type, const std::optional<std::string> &isa) {
    GGMLType t = parse_type(type);
    Isa i = isa ? parse_isa(*isa) : active_isa();
    if (isa && !isa_supported_by_cpu(i)) throw py::value_error("this CPU does not support ISA " + *isa);
    const TypeKernels *tk = isa ? find_type_kernels(t, i) : kernels_for(t);
    if (!tk) throw py::value_error("no " + std::string(isa_name(i)) + " kernels for type " + type);
    return *tk;
}

// Pools for tests/benchmarks, one per thread count, kept for the life of the module.
ThreadPool *pool_for(int threads) {
    static std::mutex mu;
    static std::map<int, std::unique_ptr<ThreadPool>> pools;
    if (threads <= 1) return nullptr;
    std::lock_guard<std::mutex> lk(mu);
    auto &p = pools[threads];
    if (!p) {
        ThreadPoolOptions o;
        o.n_threads = threads;
        try {
            p = std::make_unique<ThreadPool>(o);
        } catch (const std::invalid_argument &) {
            // More threads than usable cores (tests run 3 threads on 2 cores): unpinned workers.
            o.pin = false;
            p = std::make_unique<ThreadPool>(o);
        }
    }
    return p.get();
}

using u8array = py::array_t<uint8_t, py::array::c_style>;
using f32array = py::array_t<float, py::array::c_style | py::array::forcecast>;

size_t checked_row_bytes(const TypeKernels &tk, const u8array &w, int64_t rows, int64_t k) {
    auto row = ggml_row_size(tk.type, uint64_t(k));
    if (k < 1 || !row) throw py::value_error("k is not a whole number of blocks");
    if (rows < 0 || w.size() != py::ssize_t(*row * uint64_t(rows))) throw py::value_error("w has the wrong size for [rows, k]");
    return size_t(*row);
}

const float *bias_ptr(const f32array &b) { return b.size() > 0 ? b.data() : nullptr; }

int64_t check_x(const f32array &x, int64_t k) {
    if (x.ndim() != 2 || x.shape(1) != k) throw py::value_error("x must be [n, k]");
    return x.shape(0);
}

// The ISAs: which one runs, which ones this CPU and this build have, what each runs per type.
void bind_isa(py::module_ &k) {
    k.def("active_isa", [] { return std::string(isa_name(active_isa())); },
          "ISA used by default (CPUID, or KTD_ISA)");
    k.def("set_active_isa", [](const std::string &name) { set_active_isa(parse_isa(name)); });
    k.def("isa_supported", [](const std::string &name) { return isa_supported_by_cpu(parse_isa(name)); });
    k.def("isa_compiled", [](const std::string &name) { return isa_compiled(parse_isa(name)); });
    k.def("supported_types", [](const std::string &name) {
        std::vector<std::string> out;
        for (GGMLType t : supported_types(parse_isa(name))) out.emplace_back(ggml_type_name(t));
        return out;
    });
    k.def("kernels_isa", [](const std::string &type) -> py::object {
        const TypeKernels *tk = kernels_for(parse_type(type));
        if (!tk) return py::none();
        for (Isa i : kAllIsas)
            if (find_type_kernels(tk->type, i) == tk) return py::str(std::string(isa_name(i)));
        return py::none();
    }, py::arg("type"),
       "the ISA whose kernels a model's matrices of this type run by default (kernels_for: the active ISA, its "
       "fallbacks, or AVX-512 for the types measured faster there), None if no kernels");
    k.def("act_type", [](const std::string &type, std::optional<std::string> isa) {
        return std::string(ggml_type_name(lookup(type, isa).act_type));
    }, py::arg("type"), py::arg("isa") = py::none());
}

// The repacked decode GEMV's software prefetch mode and its tuning.
void bind_decode_prefetch(py::module_ &k) {
    k.def("decode_prefetch", [] { return k_decode_prefetch(); },
          "the repacked x86 decode GEMV's software prefetch mode: 0 off, 1 l1 (prefetcht0 a few KiB ahead), 2 l2 "
          "(prefetcht1 9 KiB ahead, paced) (the CPU default, tuned, or KTD_DECODE_PREFETCH)");
    k.def("decode_prefetch_default", [] { return k_decode_prefetch_default(); },
          "this CPU's default decode_prefetch mode (0 on AMD Zen 4 and later, 2 on Intel, else 1)");
    k.def("decode_prefetch_modes", [] {
              py::list l;
              for (int i = 0; i < kPrefetchModes; ++i) l.append(prefetch_mode_name(i));
              return l;
          },
          "the modes' names by number: off, l1, l2");
    k.def("decode_prefetch_state", [] {
              const DecodePrefetchState s = k_decode_prefetch_state();
              py::dict d;
              d["mode"] = s.mode;
              d["name"] = prefetch_mode_name(s.mode);
              d["source"] = s.source;
              py::list ms;
              for (double v : s.median_ms) ms.append(v);
              d["median_ms"] = ms;
              return d;
          },
          "the decode prefetch: mode, name, source (env, set, default, tuning: the first one-row forwards try "
          "every mode in turn, tuned: the fastest stayed if clearly faster than the default) and the median step "
          "time of each mode in the tuning (ms; 0 before it ends)");
    k.attr("DECODE_PREFETCH_TUNE_STEPS") = kPrefetchTuneSteps * kPrefetchModes;  // one-row steps a tuning takes
    k.def("decode_prefetch_tune_step", [](int mode, uint64_t ns) { k_decode_prefetch_tune_end(mode, ns); },
          py::arg("mode"), py::arg("ns"), "record a one-row step of `mode` as the tuning would (tests)");
    k.def("decode_prefetch_tune_begin", [] { return k_decode_prefetch_tune_begin(); },
          "the mode the next one-row step would run with while tuning, -1 when not tuning (tests)");
    k.def("set_decode_prefetch", [](int mode) { set_k_decode_prefetch(mode); }, py::arg("mode"),
          "0 (off), 1 (l1) or 2 (l2) to force the decode prefetch mode, -1 for the CPU default (and the tuning "
          "starts over)");
}

// Block formats: dequantization, activation quantization, the repacked layouts and their sizes.
void bind_block_formats(py::module_ &k) {
    k.def("dequantize", [](const std::string &type, u8array w, int64_t k_, std::optional<std::string> isa) {
        const TypeKernels &tk = lookup(type, isa);
        auto row = ggml_row_size(tk.type, uint64_t(k_));
        if (!row || w.size() % py::ssize_t(*row) != 0) throw py::value_error("data is not a whole number of rows");
        int64_t rows = w.size() / py::ssize_t(*row);
        f32array y({rows, k_});
        const uint8_t *src = w.data();
        float *dst = y.mutable_data();
        {
            py::gil_scoped_release nogil;
            for (int64_t r = 0; r < rows; ++r) tk.dequantize_row(src + r * *row, dst + r * k_, k_);
        }
        return y;
    }, py::arg("type"), py::arg("data"), py::arg("k"), py::arg("isa") = py::none(),
       "Dequantize rows of k elements: data (uint8, whole rows) -> float32 [rows, k]");
    k.def("quantize_act", [](const std::string &type, f32array x, std::optional<std::string> isa) {
        const TypeKernels &tk = lookup(type, isa);
        if (x.ndim() != 2) throw py::value_error("x must be [n, k]");
        int64_t n = x.shape(0), k_ = x.shape(1);
        size_t arow = act_row_size(tk, k_);
        u8array out({n, int64_t(arow)});
        for (int64_t c = 0; c < n; ++c) tk.quantize_act_row(x.data() + c * k_, out.mutable_data() + c * arow, k_);
        return out;
    }, py::arg("type"), py::arg("x"), py::arg("isa") = py::none(),
       "Quantize activations x [n, k] to the type's activation format -> uint8 [n, row_bytes]");
    k.def("repack_rows", [](const std::string &type, std::optional<std::string> isa) {
        return lookup(type, isa).repack_rows;
    }, py::arg("type"), py::arg("isa") = py::none(),
       "Rows per interleaved group of the type's repacked layout (0: the type has none)");
    k.def("gemv_plain", [](const std::string &type, std::optional<std::string> isa) {
        return lookup(type, isa).gemv_plain;
    }, py::arg("type"), py::arg("isa") = py::none(),
       "Whether the type's plain rows stream faster than its repacked layout at n = 1 (a matrix only "
       "ever multiplied by one row, the output head, then stays plain at load)");
    k.def("repack_layout", [](const std::string &type, std::optional<std::string> isa) {
        return lookup(type, isa).repack_layout;
    }, py::arg("type"), py::arg("isa") = py::none(),
       "Version of the type's repacked layout (0: the type has none); caches of repacked weights key on it");
    k.def("repack", [](const std::string &type, u8array w, int64_t rows, int64_t k_,
                       std::optional<std::string> isa, int threads) {
        const TypeKernels &tk = lookup(type, isa);
        const size_t row = checked_row_bytes(tk, w, rows, k_);
        const size_t size = repacked_size(tk, rows, k_);
        u8array out{py::ssize_t(size)};
        uint8_t *dst = out.mutable_data();
        ThreadPool *pool = pool_for(threads);
        {
            py::gil_scoped_release nogil;
            repack_weights(pool, tk, w.data(), row, rows, k_, dst);
        }
        return out;
    }, py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("isa") = py::none(),
       py::arg("threads") = 1, "W [rows, k] -> the type's row-interleaved layout (uint8)");
    k.def("prepared_bytes", [](const std::string &type, int64_t rows, int64_t k_, std::optional<std::string> isa,
                               bool allow_repack) {
        if (rows < 0) throw py::value_error("rows must be >= 0");
        return prepared_bytes(lookup(type, isa), rows, k_, allow_repack);
    }, py::arg("type"), py::arg("rows"), py::arg("k"), py::arg("isa") = py::none(), py::arg("allow_repack") = true,
       "Arena bytes prepare_weights takes for a [rows, k] matrix (0: not repacked)");
}

// One matmul on plain or repacked weights, and one tile kernel call.
void bind_matmul(py::module_ &k) {
    k.def("matmul", [](const std::string &type, u8array w, int64_t rows, int64_t k_, f32array x,
                       std::optional<std::string> isa, int threads) {
        const TypeKernels &tk = lookup(type, isa);
        auto row = ggml_row_size(tk.type, uint64_t(k_));
        if (!row) throw py::value_error("k is not a whole number of blocks");
        if (w.size() != py::ssize_t(*row * rows)) throw py::value_error("w has the wrong size for [rows, k]");
        if (x.ndim() != 2 || x.shape(1) != k_) throw py::value_error("x must be [n, k]");
        int64_t n = x.shape(0);
        f32array y({n, rows});
        ThreadPool *pool = pool_for(threads);
        MatmulScratch scratch;
        {
            py::gil_scoped_release nogil;
            matmul(pool, tk, w.data(), *row, rows, k_, x.data(), n, y.mutable_data(), scratch);
        }
        return y;
    }, py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("x"),
       py::arg("isa") = py::none(), py::arg("threads") = 1,
       "Y[n, rows] = W[rows, k] . X[n, k]^T with W in the given block type");
    k.def("matmul_into", [](const std::string &type, u8array w, int64_t rows, int64_t k_, f32array x,
                            py::array_t<float, py::array::c_style> out, int64_t offset,
                            std::optional<std::string> isa, int threads, bool repacked) {
        const TypeKernels &tk = lookup(type, isa);
        const size_t row = repacked ? 0 : checked_row_bytes(tk, w, rows, k_);
        if (repacked && (rows < 0 || w.size() != py::ssize_t(repacked_size(tk, rows, k_))))
            throw py::value_error("w has the wrong size for repacked [rows, k]");
        const int64_t n = check_x(x, k_);
        if (out.ndim() != 1 || offset < 0 || offset + n * rows > out.shape(0))
            throw py::value_error("out must be 1-D with room for n*rows floats at offset");
        float *dst = out.mutable_data() + offset;
        ThreadPool *pool = pool_for(threads);
        MatmulScratch scratch;
        py::gil_scoped_release nogil;
        if (repacked)
            matmul_repacked(pool, tk, w.data(), rows, k_, x.data(), n, dst, scratch);
        else
            matmul(pool, tk, w.data(), row, rows, k_, x.data(), n, dst, scratch);
    }, py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("x"), py::arg("out"),
       py::arg("offset"), py::arg("isa") = py::none(), py::arg("threads") = 1, py::arg("repacked") = false,
       "matmul writing Y[n, rows] into out[offset : offset + n*rows] (for guard-byte tests); "
       "repacked: w comes from repack()");
    k.def("matmul_repacked", [](const std::string &type, u8array wp, int64_t rows, int64_t k_, f32array x,
                                std::optional<std::string> isa, int threads) {
        const TypeKernels &tk = lookup(type, isa);
        if (rows < 0 || wp.size() != py::ssize_t(repacked_size(tk, rows, k_)))
            throw py::value_error("wp has the wrong size for repacked [rows, k]");
        const int64_t n = check_x(x, k_);
        f32array y({n, rows});
        float *dst = y.mutable_data();
        ThreadPool *pool = pool_for(threads);
        MatmulScratch scratch;
        {
            py::gil_scoped_release nogil;
            matmul_repacked(pool, tk, wp.data(), rows, k_, x.data(), n, dst, scratch);
        }
        return y;
    }, py::arg("type"), py::arg("wp"), py::arg("rows"), py::arg("k"), py::arg("x"),
       py::arg("isa") = py::none(), py::arg("threads") = 1, "matmul on weights from repack()");
    // One call of a type's tile kernel on caller-provided output (tests: ldy > nr, guard values
    // around the tile, and the activation bytes exactly as given).
    k.def("gemm_tile", [](const std::string &type, u8array w, int64_t k_, u8array xq, int nr, int nc,
                          py::array_t<float, py::array::c_style> y, int64_t y_offset, int64_t ldy,
                          std::optional<std::string> isa) {
        const TypeKernels &tk = lookup(type, isa);
        auto row = ggml_row_size(tk.type, uint64_t(k_));
        if (!row) throw py::value_error("k is not a whole number of blocks");
        if (nr < 1 || nc < 1) throw py::value_error("nr and nc must be >= 1");
        const size_t arow = act_row_size(tk, k_);
        if (w.size() != py::ssize_t(*row) * nr) throw py::value_error("w must be nr whole rows");
        if (xq.size() != py::ssize_t(arow) * nc) throw py::value_error("xq must be nc activation rows");
        if (ldy < nr || y_offset < 0 || y_offset + (nc - 1) * ldy + nr > y.size())
            throw py::value_error("the tile does not fit in y");
        float *dst = y.mutable_data() + y_offset;
        {
            py::gil_scoped_release nogil;
            tk.gemm(k_, w.data(), *row, xq.data(), arow, dst, size_t(ldy), nr, nc);
        }
    }, py::arg("type"), py::arg("w"), py::arg("k"), py::arg("xq"), py::arg("nr"), py::arg("nc"), py::arg("y"),
       py::arg("y_offset"), py::arg("ldy"), py::arg("isa") = py::none(),
       "y[y_offset + c*ldy + r] = dot(W row r, activation row c) for r < nr, c < nc, in place");
}

// The forward's path: weights prepared (repacked where the type has a layout), then multiplied.
void bind_prepared_matmul(py::module_ &k) {
    k.def("matmul_multi", [](py::list mats, int64_t k_, f32array x, int threads, bool repack) {
        // mats: (type, w uint8 [rows * row_bytes], rows, bias float32 [rows] or None) per matrix.
        const int64_t n = check_x(x, k_);
        ThreadPool *pool = pool_for(threads);
        std::vector<PreparedWeights> pws;
        std::vector<f32array> biases, ys;
        std::vector<u8array> ws;  // keep the weight arrays alive while the kernels read them
        for (py::handle h : mats) {
            auto t = h.cast<py::tuple>();
            if (t.size() != 4) throw py::value_error("each matrix is (type, w, rows, bias or None)");
            const TypeKernels &tk = lookup(t[0].cast<std::string>(), std::nullopt);
            ws.push_back(t[1].cast<u8array>());
            const int64_t rows = t[2].cast<int64_t>();
            const size_t row = checked_row_bytes(tk, ws.back(), rows, k_);
            pws.push_back(prepare_weights(pool, tk, ws.back().data(), row, rows, k_, repack));
            biases.push_back(t[3].is_none() ? f32array() : t[3].cast<f32array>());
            if (!t[3].is_none() && (biases.back().ndim() != 1 || biases.back().shape(0) != rows))
                throw py::value_error("bias must be float32 [rows]");
            ys.push_back(f32array({n, rows}));
        }
        std::vector<MatmulJob> jobs;
        for (size_t j = 0; j < pws.size(); ++j)
            jobs.push_back({&pws[j], ys[j].mutable_data(), bias_ptr(biases[j])});
        MatmulScratch scratch;
        {
            py::gil_scoped_release nogil;
            matmul_multi(pool, jobs.data(), int(jobs.size()), x.data(), n, scratch);
        }
        return ys;
    }, py::arg("mats"), py::arg("k"), py::arg("x"), py::arg("threads") = 1, py::arg("repack") = false,
       "matmul_multi over [(type, w, rows, bias or None), ...] on x [n, k] -> [Y_j [n, rows_j]] "
       "(repack: the weights are prepared in the active ISA's interleaved layout where it has one)");
    k.def("matmul_prepared", [](const std::string &type, u8array w, int64_t rows, int64_t k_, f32array x,
                                std::optional<std::string> isa, int threads, bool allow_repack) {
        const TypeKernels &tk = lookup(type, isa);
        const size_t row = checked_row_bytes(tk, w, rows, k_);
        const int64_t n = check_x(x, k_);
        f32array y({n, rows});
        float *dst = y.mutable_data();
        ThreadPool *pool = pool_for(threads);
        MatmulScratch scratch;
        bool repacked;
        {
            py::gil_scoped_release nogil;
            PreparedWeights pw = prepare_weights(pool, tk, w.data(), row, rows, k_, allow_repack);
            matmul(pool, pw, x.data(), n, dst, scratch);
            repacked = pw.repacked;
        }
        return py::make_tuple(y, repacked);
    }, py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("x"), py::arg("isa") = py::none(),
       py::arg("threads") = 1, py::arg("allow_repack") = true,
       "prepare_weights + matmul (the forward's path) -> (Y[n, rows], whether the weights were repacked)");
    k.def("matmul_prepared_in_arena", [](const std::string &type, u8array w, int64_t rows, int64_t k_, f32array x,
                                         const std::string &hugepages, std::optional<std::string> isa, int threads) {
        const TypeKernels &tk = lookup(type, isa);
        const size_t row = checked_row_bytes(tk, w, rows, k_);
        const int64_t n = check_x(x, k_);
        ArenaOptions ao;
        ao.hugepages = parse_hugepages(hugepages);
        const size_t bytes = prepared_bytes(tk, rows, k_);
        auto arena = std::make_shared<Arena>(std::max<size_t>(bytes, 1), ao);
        f32array y({n, rows});
        float *dst = y.mutable_data();
        ThreadPool *pool = pool_for(threads);
        MatmulScratch scratch;
        PreparedWeights pw;
        {
            py::gil_scoped_release nogil;
            pw = prepare_weights(pool, tk, w.data(), row, rows, k_, true, arena);
            matmul(pool, pw, x.data(), n, dst, scratch);
        }
        py::dict info;
        info["y"] = y;
        info["repacked"] = pw.repacked;
        info["prepared_bytes"] = bytes;
        info["repacked_bytes"] = pw.repacked_bytes;
        info["data_offset"] = reinterpret_cast<intptr_t>(pw.data) - reinterpret_cast<intptr_t>(arena->base());
        info["arena_capacity"] = arena->capacity();
        info["arena_used"] = arena->used();
        info["kind"] = std::string(arena_kind_name(arena->kind()));
        info["smaps"] = arena->smaps();
        return info;
    }, py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("x"), py::arg("hugepages") = "auto",
       py::arg("isa") = py::none(), py::arg("threads") = 1,
       "prepare_weights into a fresh weights arena (sized by prepared_bytes) + matmul -> dict: y, repacked, "
       "prepared_bytes, repacked_bytes, data_offset (of the repacked bytes from the arena base), arena_capacity, "
       "arena_used, kind, smaps (of the arena, read after the repack)");
}

// A hook's calls (r0, r1, n, tid) as a list of tuples.
py::list calls_list(const std::vector<std::array<int64_t, 4>> &calls) {
    py::list out;
    for (const auto &c : calls) out.append(py::make_tuple(c[0], c[1], c[2], c[3]));
    return out;
}

// The MatmulRowHook contract (kernels.h): every row of Y once, all n columns, bias added, the
// values final when the hook sees them. The hook copies what it sees into seen and records each
// call (r0, r1, n, tid).
auto matmul_hook_calls(const std::string &type, u8array w, int64_t rows, int64_t k_, f32array x,
                       std::optional<f32array> bias, std::optional<std::string> isa, int threads) {
    const TypeKernels &tk = lookup(type, isa);
    const size_t row = checked_row_bytes(tk, w, rows, k_);
    const int64_t n = check_x(x, k_);
    if (bias && (bias->ndim() != 1 || bias->shape(0) != rows)) throw py::value_error("bias must be [rows]");
    f32array y({n, rows}), seen({n, rows});
    std::fill(seen.mutable_data(), seen.mutable_data() + n * rows, std::numeric_limits<float>::quiet_NaN());
    struct Rec {
        float *seen;
        std::mutex mu;
        std::vector<std::array<int64_t, 4>> calls;
    } rec{seen.mutable_data(), {}, {}};
    const MatmulRowHook hook{[](void *ctx, float *yv, int64_t rws, int64_t r0, int64_t r1, int64_t nn, int tid) {
                                 auto &r = *static_cast<Rec *>(ctx);
                                 for (int64_t c = 0; c < nn; ++c)
                                     std::copy(yv + c * rws + r0, yv + c * rws + r1, r.seen + c * rws + r0);
                                 std::lock_guard<std::mutex> lk(r.mu);
                                 r.calls.push_back({r0, r1, nn, tid});
                             },
                             &rec};
    ThreadPool *pool = pool_for(threads);
    MatmulScratch scratch;
    {
        py::gil_scoped_release nogil;
        PreparedWeights pw = prepare_weights(pool, tk, w.data(), row, rows, k_, true);
        const MatmulJob job{&pw, y.mutable_data(), bias ? bias->data() : nullptr, &hook};
        matmul_multi(pool, &job, 1, x.data(), n, scratch);
    }
    return py::make_tuple(y, seen, calls_list(rec.calls));
}

// The MatmulPairHook contract (kernels.h): a = (type, w, rows, bias or None), b the same with
// the same rows. The hook copies what it sees of both into seen_a/seen_b, records each call
// (r0, r1, n, tid), then writes ya = ya + 2·yb on its rows (so the returned ya shows that a
// hook's writes land where it was given them).
auto matmul_pair_calls(py::tuple a, py::tuple b, int64_t k_, f32array x, int threads, bool repack) {
    struct Mat {
        const TypeKernels *tk;
        u8array w;
        int64_t rows;
        f32array bias;
    };
    auto mat = [&](py::tuple t) {
        if (t.size() != 4) throw py::value_error("each matrix is (type, w, rows, bias or None)");
        Mat mt{&lookup(t[0].cast<std::string>(), std::nullopt), t[1].cast<u8array>(), t[2].cast<int64_t>(),
               t[3].is_none() ? f32array() : t[3].cast<f32array>()};
        if (!t[3].is_none() && (mt.bias.ndim() != 1 || mt.bias.shape(0) != mt.rows))
            throw py::value_error("bias must be float32 [rows]");
        return mt;
    };
    Mat ma = mat(a), mb = mat(b);
    const int64_t n = check_x(x, k_);
    ThreadPool *pool = pool_for(threads);
    const size_t row_a = checked_row_bytes(*ma.tk, ma.w, ma.rows, k_);
    const size_t row_b = checked_row_bytes(*mb.tk, mb.w, mb.rows, k_);
    f32array ya({n, ma.rows}), yb({n, mb.rows}), seen_a({n, ma.rows}), seen_b({n, mb.rows});
    std::fill(seen_a.mutable_data(), seen_a.mutable_data() + n * ma.rows, std::numeric_limits<float>::quiet_NaN());
    std::fill(seen_b.mutable_data(), seen_b.mutable_data() + n * mb.rows, std::numeric_limits<float>::quiet_NaN());
    struct Rec {
        float *seen_a, *seen_b;
        std::mutex mu;
        std::vector<std::array<int64_t, 4>> calls;
    } rec{seen_a.mutable_data(), seen_b.mutable_data(), {}, {}};
    const MatmulPairHook hook{[](void *ctx, float *pa, float *pb, int64_t rws, int64_t r0, int64_t r1, int64_t nn,
                                 int tid) {
                                  auto &r = *static_cast<Rec *>(ctx);
                                  for (int64_t c = 0; c < nn; ++c)
                                      for (int64_t i = c * rws + r0; i < c * rws + r1; ++i) {
                                          r.seen_a[i] = pa[i];
                                          r.seen_b[i] = pb[i];
                                          pa[i] += 2.0f * pb[i];
                                      }
                                  std::lock_guard<std::mutex> lk(r.mu);
                                  r.calls.push_back({r0, r1, nn, tid});
                              },
                              &rec};
    MatmulScratch scratch;
    {
        py::gil_scoped_release nogil;
        const PreparedWeights pa = prepare_weights(pool, *ma.tk, ma.w.data(), row_a, ma.rows, k_, repack);
        const PreparedWeights pb = prepare_weights(pool, *mb.tk, mb.w.data(), row_b, mb.rows, k_, repack);
        matmul_pair(pool, {&pa, ya.mutable_data(), bias_ptr(ma.bias)}, {&pb, yb.mutable_data(), bias_ptr(mb.bias)},
                    hook, x.data(), n, scratch);
    }
    return py::make_tuple(ya, yb, seen_a, seen_b, calls_list(rec.calls));
}

// Tests of the hooks matmul_multi and matmul_pair call on each finished block of rows.
void bind_matmul_hooks(py::module_ &k) {
    k.def("matmul_hook_calls", &matmul_hook_calls, py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("k"),
          py::arg("x"), py::arg("bias") = py::none(), py::arg("isa") = py::none(), py::arg("threads") = 1,
          "tests: matmul_multi with a row hook -> (Y[n, rows], what the hook saw [n, rows], its calls (r0, r1, n, "
          "tid))");
    k.def("matmul_pair_calls", &matmul_pair_calls, py::arg("a"), py::arg("b"), py::arg("k"), py::arg("x"),
          py::arg("threads") = 1, py::arg("repack") = false,
          "tests: matmul_pair with a hook -> (Y_a after the hook (Y_a + 2 Y_b), Y_b, what the hook saw of "
          "each [n, rows], its calls (r0, r1, n, tid))");
}

// Benchmarks timed in C++: read bandwidth and one matmul.
void bind_kernel_bench(py::module_ &k) {
    k.def("bench_read_bandwidth", [](size_t bytes, int threads, int reps, int64_t prefetch) {
        ThreadPool *pool = pool_for(threads);
        py::gil_scoped_release nogil;
        return bench_read_bandwidth(pool, bytes, reps, prefetch);
    }, py::arg("bytes"), py::arg("threads"), py::arg("reps"), py::arg("prefetch") = -1,
       "Best-of-reps read bandwidth (bytes/s) streaming a fresh buffer of `bytes` with `threads` workers; "
       "prefetch -1: the best of every loop in READ_BANDWIDTH_PREFETCH, >= 0: only the loop prefetching "
       "that many bytes ahead (0: none)");
    // The pool of a thread count lives as long as the module (pool_for), so the buffer keeps the
    // count, not the pool.
    struct PyReadBuffer {
        int threads;
        std::unique_ptr<ReadBuffer> buf;
    };
    py::class_<PyReadBuffer>(k, "ReadBuffer",
                             "A read-bandwidth buffer kept between passes: allocated and written once (by the workers "
                             "that read it), then one loop per read() call")
        .def(py::init([](size_t bytes, int threads) {
                 ThreadPool *pool = pool_for(threads);
                 py::gil_scoped_release nogil;
                 return PyReadBuffer{threads, std::make_unique<ReadBuffer>(pool, bytes)};
             }),
             py::arg("bytes"), py::arg("threads"))
        .def("read", [](PyReadBuffer &b, int64_t prefetch) {
                 if (prefetch < 0) throw py::value_error("prefetch must be >= 0 bytes (0: none)");
                 ThreadPool *pool = pool_for(b.threads);
                 py::gil_scoped_release nogil;
                 return b.buf->pass(pool, size_t(prefetch));
             },
             py::arg("prefetch") = 0, "bytes/s of one pass of the loop prefetching `prefetch` bytes ahead")
        .def_property_readonly("bytes", [](const PyReadBuffer &b) { return b.buf->bytes(); })
        .def_property_readonly("threads", [](const PyReadBuffer &b) { return b.threads; });
    {
        py::tuple variants(std::size(kReadBandwidthPrefetch));
        for (size_t i = 0; i < std::size(kReadBandwidthPrefetch); ++i) variants[i] = kReadBandwidthPrefetch[i];
        k.attr("READ_BANDWIDTH_PREFETCH") = variants;  // the loops' prefetch distances, bytes
    }
    k.def("bench_matmul", [](const std::string &type, u8array w, int64_t rows, int64_t k_, int64_t n, int threads,
                             int reps, std::optional<std::string> isa, bool repacked) {
        const TypeKernels &tk = lookup(type, isa);
        ThreadPool *pool = pool_for(threads);
        if (repacked) {
            if (rows < 0 || w.size() != py::ssize_t(repacked_size(tk, rows, k_)))
                throw py::value_error("w has the wrong size for repacked [rows, k]");
            py::gil_scoped_release nogil;
            return bench_matmul_repacked(pool, tk, w.data(), rows, k_, n, reps);
        }
        const size_t row = checked_row_bytes(tk, w, rows, k_);
        py::gil_scoped_release nogil;
        return bench_matmul(pool, tk, w.data(), row, rows, k_, n, reps);
    }, py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("n"), py::arg("threads"),
       py::arg("reps"), py::arg("isa") = py::none(), py::arg("repacked") = false,
       "Best-of-reps seconds of one matmul (timed in C++; synthetic activations)");
}

}  // namespace

void bind_kernels(py::module_ &m) {
    auto k = m.def_submodule("kernels", "matrix kernels per GGUF block type and ISA");
    bind_isa(k);
    bind_decode_prefetch(k);
    bind_block_formats(k);
    bind_matmul(k);
    bind_prepared_matmul(k);
    bind_matmul_hooks(k);
    bind_kernel_bench(k);
}

}  // namespace ktd

