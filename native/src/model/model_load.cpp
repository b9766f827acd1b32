// Model::open: the file's architecture and hyperparameters → the pool and its NUMA slices → the
// load plan (plan_load: arenas or the file's mapping, NUMA sharding and replication, the cache) →
// the architecture's tensor table checked against the file → the memory plan (plan_memory: the
// arenas' bytes) → the weights arenas → the prepared-weights cache's entry read into them, or every
// tensor loaded (vectors dequantized, matrices prepared for the kernels: repacked into an arena,
// one copy per node, or cut into per-node row slices for routed experts) → a new entry written.
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>
#include <type_traits>
#include <variant>

#include "common/crc32c.h"
#include "common/error.h"
#include "cpu/features.h"
#include "memory/arena.h"
#include "memory/numa_policy.h"
#include "model/model.h"

namespace ktd {

namespace {

std::string tensor_name(const std::string &fmt, int il) {
    char buf[256];
    std::snprintf(buf, sizeof buf, fmt.c_str(), il);
    return buf;
}

std::string shape_str(int64_t a, int64_t b, int64_t c = 1) {
    return "[" + std::to_string(a) + ", " + std::to_string(b) + (c != 1 ? ", " + std::to_string(c) : "") + "]";
}

const TypeKernels &kernels_or_throw(const GGUFTensorInfo &t) {
    const TypeKernels *tk = kernels_for(t.type);
    if (!tk || !tk->dequantize_row)
        throw GGUFError("tensor " + std::string(t.name) + " has type " + std::string(ggml_type_name(t.type)) +
                        ", which has no kernels in this build");
    return *tk;
}

std::vector<float> load_vector(const GGUFFile &f, const GGUFTensorInfo &t) {
    const TypeKernels &tk = kernels_or_throw(t);
    std::vector<float> v(size_t(t.n_elements));
    tk.dequantize_row(f.tensor_data(t), v.data(), int64_t(t.n_elements));
    return v;
}

// Whether a matrix of class `cls` is repacked: the output head multiplies one activation row per
// sequence (decode, and the last prompt row of a prefill), so it keeps the plain rows where the
// type's repacked layout streams slower at n = 1 (TypeKernels::gemv_plain). A function of the
// build and the active ISA only, both in the weights cache's layout key, with kLayoutChoice (the
// version of these rules: bump it when they change).
constexpr int kLayoutChoice = 1;
bool repack_matrix(const TypeKernels &tk, TensorClass cls, bool allow_repack) {
    return allow_repack && !(cls == TensorClass::Output && tk.gemv_plain);
}

// Arena bytes of a slice of `rows` rows: repacked, or (a type without repacking) the rows copied,
// so that a slice always lives in its node's arena rather than in the file's page cache.
size_t slice_prepared_bytes(const TypeKernels &tk, size_t row_bytes, int64_t rows, int64_t k, bool allow_repack) {
    const size_t repacked = prepared_bytes(tk, rows, k, allow_repack);
    if (repacked || rows == 0) return repacked;
    return (size_t(rows) * row_bytes + kPreparedAlign - 1) / kPreparedAlign * kPreparedAlign;
}

// Copies n bytes over the pool (the arena's fresh pages are first touched by the workers, in
// parallel, as a repack touches them).
void parallel_copy(ThreadPool *pool, void *dst, const void *src, size_t n) {
    constexpr size_t kChunk = size_t(1) << 20;
    if (!pool || n < 2 * kChunk) {
        std::memcpy(dst, src, n);
        return;
    }
    const size_t chunks = (n + kChunk - 1) / kChunk;
    pool->parallel_for(chunks, [&](size_t c0, size_t c1, int) {
        const size_t b0 = c0 * kChunk, b1 = std::min(n, c1 * kChunk);
        if (b1 > b0) std::memcpy(static_cast<uint8_t *>(dst) + b0, static_cast<const uint8_t *>(src) + b0, b1 - b0);
    });
}

// prepare_weights into an arena, the rows copied as they are when the type does not repack: after
// the load nothing of a matrix is read from the file's mapping.
// fill = false: the allocation only (the arena already holds the bytes: a cache hit).
PreparedWeights prepare_slice(ThreadPool *pool, const TypeKernels &tk, const uint8_t *w, size_t row_bytes,
                              int64_t rows, int64_t k, bool allow_repack, const std::shared_ptr<Arena> &arena,
                              bool fill) {
    if (rows == 0 || prepared_bytes(tk, rows, k, allow_repack))
        return prepare_weights(pool, tk, w, row_bytes, rows, k, allow_repack, rows ? arena : nullptr, fill);
    PreparedWeights pw;
    pw.tk = &tk;
    pw.row_bytes = row_bytes;
    pw.rows = rows;
    pw.k = k;
    void *out = arena->alloc(size_t(rows) * row_bytes, kPreparedAlign);
    if (fill) parallel_copy(pool, out, w, size_t(rows) * row_bytes);
    pw.data = out;
    pw.storage = std::shared_ptr<const void>(arena, out);
    return pw;
}

// An arena with the NUMA placement of `o` (a node, or interleaved over nodes). The kernel refuses
// a node it does not have (a fake topology in tests, a node without memory): the arena is then
// mapped without placement and `note` says why — the compute partition does not depend on it.
std::shared_ptr<Arena> open_placed_arena(size_t bytes, ArenaOptions o, std::string &note) {
    try {
        auto arena = std::make_shared<Arena>(bytes, o);
        if (!o.interleave.empty()) {
            // The kernel interleaves over the listed nodes it has memory on and drops the rest
            // silently: say which ones were dropped.
            const std::vector<int> kept = range_policy_nodes(arena->base());
            std::string kept_s, dropped_s;
            for (int node : o.interleave) {
                std::string &list = std::find(kept.begin(), kept.end(), node) != kept.end() ? kept_s : dropped_s;
                if (!list.empty()) list += ',';
                list += std::to_string(node);
            }
            if (!dropped_s.empty())
                note = "interleaved over node(s) " + kept_s + " only: the kernel has no memory on node(s) " +
                       dropped_s + " (e.g. a fake topology)";
        }
        return arena;
    } catch (const SysError &e) {
        if (o.node < 0 && o.interleave.empty()) throw;
        note = std::string("NUMA placement not applied (") + e.what() +
               "; the kernel has no such memory node, e.g. a fake topology): pages go where first touched";
    }
    o.node = -1;
    o.interleave.clear();
    return std::make_shared<Arena>(bytes, o);
}

}  // namespace


// The plain kernels and dequantize_row read blocks through the block struct (alignof 2, or 4
// where it holds a float) and F32/F16 through their element type: the power of two that divides
// the block's byte size, up to 4 (sizeof is a multiple of alignof). Rows start at multiples of
// the row size, so a tensor whose data is aligned so has every row aligned.
size_t plain_alignment(GGMLType t) {
    const uint32_t ts = ggml_type_info(t).type_size;
    return std::min<size_t>(size_t(ts & (~ts + 1)), 4);
}

std::pair<int64_t, int64_t> numa_slice_rows(int64_t rows, int n_slice, int s) {
    if (n_slice <= 1) return {0, rows};
    const int64_t blocks = (rows + kNumaRowAlign - 1) / kNumaRowAlign;
    auto bound = [&](int i) { return std::min(rows, blocks * i / n_slice * kNumaRowAlign); };
    return {bound(s), bound(s + 1)};
}


// One table row applied to one layer (il = 0 for a model-level tensor): the tensor the file holds.
struct TensorUse {
    const TensorSpec *spec;
    int il;
    const GGUFTensorInfo *t;
};

// Every row of the table against the file: a required tensor present, a tensor outside its layers
// absent, every shape the expected one. Throws GGUFError naming the tensor.
static std::vector<TensorUse> check_tensors(const GGUFFile &file, const TensorTable &table, const HParams &hp) {
    std::vector<TensorUse> uses;
    for (const TensorSpec &spec : table.specs) {
        const bool per_layer = spec.per_layer();
        for (int il = 0; il < (per_layer ? hp.n_layer : 1); ++il) {
            const std::string name = tensor_name(spec.name, il);
            const GGUFTensorInfo *t = file.find_tensor(name);
            if (per_layer && !layer_in_set(spec.layers, hp, il)) {
                if (t) throw GGUFError("unexpected tensor " + name + " (layer " + std::to_string(il) + " of " + hp.arch +
                                       " has no such tensor)");
                continue;
            }
            if (!t) {
                if (spec.required) throw GGUFError("missing tensor " + name + " (required by " + hp.arch + ")");
                continue;
            }
            const auto &e = spec.ne;
            if (int64_t(t->ne[0]) != e[0] || int64_t(t->ne[1]) != e[1] || int64_t(t->ne[2]) != e[2] || t->ne[3] != 1)
                throw GGUFError("tensor " + name + " has shape " +
                                shape_str(int64_t(t->ne[0]), int64_t(t->ne[1]), int64_t(t->ne[2])) +
                                (t->n_dims > 3 ? " (" + std::to_string(t->n_dims) + " dims)" : "") + ", expected " +
                                shape_str(e[0], e[1], e[2]));
            uses.push_back({&spec, il, t});
        }
    }
    return uses;
}

namespace {

bool is_matrix(const TensorSpec &s) {
    return std::holds_alternative<Matrix LayerWeights::*>(s.dest) || std::holds_alternative<Matrix ModelWeights::*>(s.dest) ||
           std::holds_alternative<MatrixStack LayerWeights::*>(s.dest);
}

}  // namespace

// Arena bytes the prepared matrices take: the dense matrices (in the dense arena, or in each
// node's copy, replicate) and, when routed experts are sharded, each node's slices. Every matrix
// is in an arena, repacked or (a type without repacking) copied as it is, and so are the rows of
// token_embd the embedding lookup reads (embd_bytes, in the dense arena, never replicated): once
// the model is loaded nothing is read from the file's mapping (a file truncated or rewritten
// under a serving daemon cannot SIGBUS it). `tied`: token_embd when it is also the output head
// (prepared like a dense matrix besides). Tensors without kernels are left to the loader's error.
struct MemoryPlan {
    size_t dense_bytes = 0;  // one copy of the dense matrices
    size_t embd_bytes = 0;
    std::vector<size_t> slice_bytes;  // [n_slice]
};
namespace {
size_t copied_bytes(uint64_t nbytes) { return (size_t(nbytes) + kPreparedAlign - 1) / kPreparedAlign * kPreparedAlign; }

MemoryPlan plan_memory(const GGUFFile &f, const std::vector<TensorUse> &uses, int n_slice, bool shard,
                       bool allow_repack) {
    const GGUFTensorInfo *embd = f.find_tensor("token_embd.weight");  // required by every table
    if (!embd) throw GGUFError("missing tensor token_embd.weight");
    const GGUFTensorInfo *tied = f.find_tensor("output.weight") ? nullptr : embd;
    MemoryPlan p;
    p.slice_bytes.assign(size_t(n_slice), 0);
    auto add = [&](const GGUFTensorInfo &t, bool sharded, TensorClass cls) {
        const TypeKernels *tk = kernels_for(t.type);
        if (!tk || !ggml_row_size(tk->act_type, t.ne[0]) || !ggml_row_size(t.type, t.ne[0])) return;
        const size_t row_bytes = *ggml_row_size(t.type, t.ne[0]);
        const int64_t rows = int64_t(t.ne[1]), k = int64_t(t.ne[0]);
        const bool repack = repack_matrix(*tk, cls, allow_repack);
        if (sharded) {
            for (int sl = 0; sl < n_slice; ++sl) {
                const auto [r0, r1] = numa_slice_rows(rows, n_slice, sl);
                p.slice_bytes[size_t(sl)] += slice_prepared_bytes(*tk, row_bytes, r1 - r0, k, repack) * size_t(t.ne[2]);
            }
            return;
        }
        p.dense_bytes += slice_prepared_bytes(*tk, row_bytes, rows, k, repack) * size_t(t.ne[2]);
    };
    for (const TensorUse &u : uses)
        if (is_matrix(*u.spec)) add(*u.t, shard && u.spec->cls == TensorClass::RoutedExpert, u.spec->cls);
    if (tied) add(*tied, false, TensorClass::Output);
    p.embd_bytes = copied_bytes(embd->nbytes);
    return p;
}

}  // namespace

// The arenas of a plan (huge pages when a hugetlb pool is reserved, THP otherwise). One node: one
// dense arena. Several: the dense arena interleaved over them, or one per node holding a copy of
// the dense weights (replicate), and, when the experts are sharded, one per node for its slices.
struct Arenas {
    std::shared_ptr<Arena> dense;                // not replicated
    std::vector<std::shared_ptr<Arena>> copies;  // [n_slice] replicate
    std::vector<std::shared_ptr<Arena>> slices;  // [n_slice]
};
namespace {
Arenas open_arenas(const MemoryPlan &plan, const ModelOptions &opts, const std::vector<int> &nodes, bool replicate,
                   MemoryLayout &mem) {
    const size_t n_slice = nodes.size();
    ArenaOptions aopts;
    aopts.hugepages = opts.hugepages;
    aopts.hugetlb_page_size = opts.hugetlb_page_size;
    aopts.mlock = opts.mlock;
    Arenas a;
    a.copies.resize(replicate ? n_slice : 0);
    for (size_t sl = 0; sl < a.copies.size() && plan.dense_bytes; ++sl) {
        aopts.node = nodes[sl];
        std::string note;
        a.copies[sl] = open_placed_arena(plan.dense_bytes, aopts, note);
        if (note.empty()) continue;
        if (!mem.dense_note.empty()) mem.dense_note += "; ";
        mem.dense_note += "copy on node " + std::to_string(nodes[sl]) + ": " + note;
    }
    aopts.node = -1;
    // The dense arena: the dense matrices (not replicated) and token_embd's lookup rows.
    if (const size_t dense = (replicate ? 0 : plan.dense_bytes) + plan.embd_bytes) {
        if (n_slice > 1) aopts.interleave = nodes;
        std::string note;
        a.dense = open_placed_arena(dense, aopts, note);
        if (!note.empty()) mem.dense_note += (mem.dense_note.empty() ? "" : "; ") + note;
        aopts.interleave.clear();
    }
    a.slices.resize(n_slice);
    for (size_t sl = 0; sl < n_slice; ++sl) {
        if (!plan.slice_bytes[sl]) continue;
        aopts.node = nodes[sl];
        a.slices[sl] = open_placed_arena(plan.slice_bytes[sl], aopts, mem.nodes[sl].note);
        mem.nodes[sl].bound = a.slices[sl]->node() >= 0;
    }
    for (const Arena *ar : {a.dense.get(), a.copies.empty() ? nullptr : a.copies[0].get(),
                            a.slices.empty() ? nullptr : a.slices[0].get()})
        if (ar && mem.page_kind.empty()) {
            mem.page_kind = arena_kind_name(ar->kind());
            mem.page_size = ar->page_size();
            mem.page_reason = ar->fallback_reason();
        }
    mem.dense_bytes = plan.dense_bytes;
    mem.embd_bytes = plan.embd_bytes;
    return a;
}

// The arenas in the cache's section order: dense, each node's copy, each node's slices.
std::vector<Arena *> arena_list(const Arenas &a) {
    std::vector<Arena *> out;
    if (a.dense) out.push_back(a.dense.get());
    for (const auto &c : a.copies)
        if (c) out.push_back(c.get());
    for (const auto &sl : a.slices)
        if (sl) out.push_back(sl.get());
    return out;
}

// Tests only: KTD_TEST_LOAD_TENSOR_DELAY_MS makes the load sleep after each tensor, so that a
// test can watch (or kill) a load in progress without depending on how fast the machine is.
long test_load_delay_ms() {
    const char *d = std::getenv("KTD_TEST_LOAD_TENSOR_DELAY_MS");
    return d ? std::strtol(d, nullptr, 10) : 0;
}

const TypeKernels &matmul_kernels_or_throw(const GGUFTensorInfo &t, std::string_view what) {
    const TypeKernels &tk = kernels_or_throw(t);
    if (!tk.gemm)
        throw GGUFError("tensor " + std::string(what) + " has type " + std::string(ggml_type_name(t.type)) +
                        ", which has no matmul kernel" + (what == t.name ? " in this build" : ""));
    return tk;
}

}  // namespace

// Loads the checked tensors into the model's weights, preparing matrices into the arenas.
class WeightLoader {
public:
    // attach: the arenas already hold every prepared byte (read from the cache): the same
    // allocations, nothing read from the file but the vectors, nothing written.
    // gguf: every matrix and token_embd served from the file's mapping (no arenas, see serve()).
    WeightLoader(Model &m, const ModelOptions &opts, const Arenas &arenas, bool shard, bool replicate, bool attach,
                 bool gguf = false)
        : m_(m), f_(m.file_), opts_(opts), a_(arenas), shard_(shard), replicate_(replicate), fill_(!attach),
          gguf_(gguf) {}

    // Every checked tensor, then the output head (tie_output), into weights and counts reset first
    // (and the arenas: a second pass, after a cache entry was rejected, allocates the same way).
    // progress: the table's bytes as they are prepared (null: not reported).
    void load_all(const std::vector<TensorUse> &uses, LoadProgress *progress) {
        m_.w_ = ModelWeights{};
        m_.n_params_ = m_.repacked_bytes_ = m_.copied_bytes_ = 0;
        for (NumaNodeMemory &n : m_.mem_.nodes) n.expert_bytes = n.dense_copy_bytes = 0;
        for (Arena *a : arena_list(a_)) a->reset();
        m_.w_.layers.resize(size_t(m_.hp_.n_layer));
        if (progress) {
            uint64_t total = 0;  // the file's tensors the table names (token_embd among them)
            for (const TensorUse &u : uses) total += u.t->nbytes;
            progress->start(LoadProgress::Preparing, total);
        }
        const long delay_ms = test_load_delay_ms();
        for (const TensorUse &u : uses) {
            load(u);
            if (progress) progress->add(u.t->nbytes);
            if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
        }
        tie_output();
    }

    void load(const TensorUse &u) {
        const GGUFTensorInfo &t = *u.t;
        LayerWeights *lw = u.spec->per_layer() ? &m_.w_.layers[size_t(u.il)] : nullptr;
        m_.n_params_ += t.n_elements;
        std::visit(
            [&](auto dest) {
                using D = decltype(dest);
                if constexpr (std::is_same_v<D, std::vector<float> LayerWeights::*>) lw->*dest = load_vector(f_, t);
                if constexpr (std::is_same_v<D, std::vector<float> ModelWeights::*>) m_.w_.*dest = load_vector(f_, t);
                if constexpr (std::is_same_v<D, float LayerWeights::*>) lw->*dest = load_vector(f_, t)[0];
                if constexpr (std::is_same_v<D, Matrix LayerWeights::*>) load_matrix(lw->*dest, t, u.spec->cls);
                if constexpr (std::is_same_v<D, Matrix ModelWeights::*>) load_matrix(m_.w_.*dest, t, u.spec->cls);
                if constexpr (std::is_same_v<D, MatrixStack LayerWeights::*>)
                    load_stack(lw->*dest, t, shard_ && u.spec->cls == TensorClass::RoutedExpert);
            },
            u.spec->dest);
    }

    // token_embd is read row by row (dequantize_row), and is the output head when untied.
    void tie_output() {
        ModelWeights &w = m_.w_;
        const HParams &hp = m_.hp_;
        w.token_embd = f_.find_tensor("token_embd.weight");
        w.token_embd_tk = &kernels_or_throw(*w.token_embd);
        if (gguf_) {
            // The lookup reads its rows where the file has them (a copy only if misaligned).
            const std::shared_ptr<const void> keep = served(*w.token_embd, f_.tensor_data(*w.token_embd),
                                                            size_t(w.token_embd->nbytes));
            w.token_embd_data = static_cast<const uint8_t *>(keep ? keep.get() : f_.tensor_data(*w.token_embd));
            w.token_embd_storage = keep;
            if (w.output) return;
            const TypeKernels &tk = matmul_kernels_or_throw(*w.token_embd, "token_embd.weight (tied output)");
            w.output.info = w.token_embd;
            // The same rows as the lookup's (served, or copied, once).
            w.output.pw = prepare_weights(nullptr, tk, w.token_embd_data, row_bytes(*w.token_embd), hp.n_vocab,
                                          hp.n_embd, false, nullptr);
            w.output.pw.storage = keep;
            return;
        }
        void *embd = a_.dense->alloc(size_t(w.token_embd->nbytes), kPreparedAlign);
        if (fill_) parallel_copy(m_.pool_.get(), embd, f_.tensor_data(*w.token_embd), size_t(w.token_embd->nbytes));
        m_.copied_bytes_ += w.token_embd->nbytes;
        w.token_embd_data = static_cast<const uint8_t *>(embd);
        w.token_embd_storage = std::shared_ptr<const void>(a_.dense, embd);
        if (w.output) {
            if (fill_) f_.release_pages(*w.token_embd);
            return;
        }
        const TypeKernels &tk = matmul_kernels_or_throw(*w.token_embd, "token_embd.weight (tied output)");
        w.output.info = w.token_embd;
        w.output.pw = prepare_dense(tk, f_.tensor_data(*w.token_embd), row_bytes(*w.token_embd), hp.n_vocab, hp.n_embd,
                                    TensorClass::Output);
        if (fill_) f_.release_pages(*w.token_embd);
    }

private:
    static size_t row_bytes(const GGUFTensorInfo &t) { return size_t(*ggml_row_size(t.type, t.ne[0])); }

    void load_matrix(Matrix &mat, const GGUFTensorInfo &t, TensorClass cls) {
        const TypeKernels &tk = matmul_kernels_or_throw(t, t.name);
        mat.info = &t;
        if (gguf_) {
            mat.pw = serve(tk, t, f_.tensor_data(t), row_bytes(t), int64_t(t.ne[1]), int64_t(t.ne[0]));
            return;
        }
        mat.pw = prepare_dense(tk, f_.tensor_data(t), row_bytes(t), int64_t(t.ne[1]), int64_t(t.ne[0]), cls);
        if (fill_) f_.release_pages(t);  // repacked or copied: not read from the file again
    }

    // A stack of ne[2] matrices, each prepared on its own; routed experts on several nodes: each
    // cut into the nodes' row slices, in their arenas.
    void load_stack(MatrixStack &st, const GGUFTensorInfo &t, bool sharded) {
        const TypeKernels &tk = matmul_kernels_or_throw(t, t.name);
        const size_t rb = row_bytes(t);
        const int64_t rows = int64_t(t.ne[1]), k = int64_t(t.ne[0]), n_mat = int64_t(t.ne[2]);
        const uint8_t *src = f_.tensor_data(t);
        st.info = &t;
        st.rows = rows;
        if (gguf_) {  // one node: never sharded
            st.mats.resize(size_t(n_mat));
            for (int64_t e = 0; e < n_mat; ++e)
                st.mats[size_t(e)] = serve(tk, t, src + size_t(e) * size_t(rows) * rb, rb, rows, k);
            return;
        }
        if (!sharded) {
            st.mats.resize(size_t(n_mat));
            for (int64_t e = 0; e < n_mat; ++e)
                st.mats[size_t(e)] = prepare_dense(tk, src + size_t(e) * size_t(rows) * rb, rb, rows, k);
            if (fill_) f_.release_pages(t);
            return;
        }
        const int n_slice = m_.n_slices();
        st.n_slices = n_slice;
        st.slices.resize(size_t(n_mat) * size_t(n_slice));
        for (int64_t e = 0; e < n_mat; ++e)
            for (int sl = 0; sl < n_slice; ++sl) {
                const auto [r0, r1] = numa_slice_rows(rows, n_slice, sl);
                PreparedWeights &pw = st.slices[size_t(e) * size_t(n_slice) + size_t(sl)];
                pw = prepare_slice(m_.pool_.get(), tk, src + (size_t(e) * size_t(rows) + size_t(r0)) * rb, rb, r1 - r0,
                                   k, opts_.allow_repack, a_.slices[size_t(sl)], fill_);
                m_.repacked_bytes_ += pw.repacked_bytes;
                if (!pw.repacked) m_.copied_bytes_ += size_t(r1 - r0) * rb;
                m_.mem_.nodes[size_t(sl)].expert_bytes += pw.repacked ? pw.repacked_bytes : size_t(r1 - r0) * rb;
            }
        if (fill_) f_.release_pages(t);
    }

    // A dense matrix: into the dense arena, or (replicate) one copy per node with node_copies
    // telling matmul which copy each worker reads.
    PreparedWeights prepare_dense(const TypeKernels &tk, const uint8_t *src, size_t rb, int64_t rows, int64_t k,
                                  TensorClass cls = TensorClass::Dense) {
        const bool repack = repack_matrix(tk, cls, opts_.allow_repack);
        if (!replicate_) {
            PreparedWeights pw = prepare_slice(m_.pool_.get(), tk, src, rb, rows, k, repack, a_.dense, fill_);
            m_.repacked_bytes_ += pw.repacked_bytes;
            if (!pw.repacked) m_.copied_bytes_ += size_t(rows) * rb;
            return pw;
        }
        auto copies = std::make_shared<PreparedCopies>();
        copies->copy_of_tid = m_.tid_slice_;
        for (size_t sl = 0; sl < a_.copies.size(); ++sl) {
            copies->copies.push_back(
                prepare_slice(m_.pool_.get(), tk, src, rb, rows, k, repack, a_.copies[sl], fill_));
            const PreparedWeights &c = copies->copies.back();
            m_.mem_.nodes[sl].dense_copy_bytes += c.repacked ? c.repacked_bytes : size_t(rows) * rb;
        }
        PreparedWeights pw = copies->copies[0];
        pw.node_copies = copies;
        m_.repacked_bytes_ += pw.repacked_bytes;
        if (!pw.repacked) m_.copied_bytes_ += size_t(rows) * rb;
        return pw;
    }

    // weights_map: gguf. Null when the `n` bytes at `src` (tensor t's) are served where they are,
    // in the file's mapping (counted in file_bytes); otherwise (data misaligned for the plain
    // kernels: plain_alignment) a 64-byte aligned heap copy of them, counted in copied_bytes and
    // named in file_copy_note.
    std::shared_ptr<const void> served(const GGUFTensorInfo &t, const uint8_t *src, size_t n) {
        const size_t need = plain_alignment(t.type);
        if (uintptr_t(src) % need == 0) {
            m_.mem_.file_bytes += n;
            return nullptr;
        }
        constexpr std::align_val_t kAlign{kPreparedAlign};
        void *copy = ::operator new(std::max<size_t>(n, 1), kAlign);
        std::shared_ptr<const void> keep(copy, [](const void *p) { ::operator delete(const_cast<void *>(p), kAlign); });
        std::memcpy(copy, src, n);
        m_.copied_bytes_ += n;
        if (last_copied_ != &t) {  // a stack's matrices come one after the other: named once
            std::string &note = m_.mem_.file_copy_note;
            note += (note.empty() ? "" : ", ") + std::string(t.name) + " (" + std::string(ggml_type_name(t.type)) +
                    ", at byte " + std::to_string(t.offset) + ", needs " + std::to_string(need) + ")";
            last_copied_ = &t;
        }
        return keep;
    }

    // A matrix in its plain GGUF layout, served from the file's mapping (or copied: served()).
    PreparedWeights serve(const TypeKernels &tk, const GGUFTensorInfo &t, const uint8_t *src, size_t rb, int64_t rows,
                          int64_t k) {
        const std::shared_ptr<const void> keep = served(t, src, size_t(rows) * rb);
        PreparedWeights pw = prepare_weights(nullptr, tk, keep ? keep.get() : src, rb, rows, k, false, nullptr);
        pw.storage = keep;
        return pw;
    }

    Model &m_;
    const GGUFFile &f_;
    const ModelOptions &opts_;
    const Arenas &a_;
    bool shard_, replicate_, fill_, gguf_;
    const GGUFTensorInfo *last_copied_ = nullptr;
};

std::string Model::supported_archs() {
    std::string s;
    for (const ArchSpec *a : all_archs()) {
        if (!s.empty()) s.append(", ");
        s.append(a->name);
    }
    return s;
}

void Model::init_pool(const ModelOptions &opts) {
    ThreadPoolOptions popts;
    popts.n_threads = opts.n_threads;
    popts.pin = opts.pin;
    popts.nodes = opts.nodes;
    popts.smt = opts.smt;
    popts.sysfs_root = opts.sysfs_root;
    popts.affinity = opts.affinity;
    pool_ = std::make_unique<ThreadPool>(popts);
    // NUMA slices: one per node of the pool, in the pool's node order.
    const std::vector<int> nodes = pool_->nodes();
    for (int node : nodes) {
        NumaNodeMemory nm;
        nm.node = node;
        nm.n_threads = int(pool_->workers_of_node(node).size());
        mem_.nodes.push_back(nm);
    }
    tid_slice_.resize(size_t(pool_->size()));
    for (int tid = 0; tid < pool_->size(); ++tid)
        tid_slice_[size_t(tid)] = pool_->node_index(tid);
}

namespace {
// The file's architecture, its hyperparameters and its tensor table.
const ArchSpec &read_arch(const GGUFFile &f, HParams &hp, TensorTable &table) {
    const std::string arch_name(f.get_string("general.architecture"));
    const ArchSpec *arch = find_arch(arch_name);
    if (!arch)
        throw GGUFError("unsupported architecture '" + arch_name + "' (supported: " + Model::supported_archs() + ")");
    hp = read_hparams(f, arch_name);
    arch->tune(hp, f);
    arch->tensors(table, hp);
    return *arch;
}
}  // namespace

std::vector<std::pair<std::string, TensorClass>> Model::tensor_classes(const std::string &path) {
    const GGUFFile f = GGUFFile::open(path);
    HParams hp;
    TensorTable table;
    read_arch(f, hp, table);
    std::vector<std::pair<std::string, TensorClass>> out;
    for (const TensorSpec &spec : table.specs)
        for (int il = 0; il < (spec.per_layer() ? hp.n_layer : 1); ++il) {
            const std::string name = tensor_name(spec.name, il);
            if (f.find_tensor(name) && (!spec.per_layer() || layer_in_set(spec.layers, hp, il)))
                out.emplace_back(name, spec.cls);
        }
    return out;
}

namespace {

// The cache key's two parts (weights_cache.h): the file's identity and what the layout depends on.
std::string cache_identity(const GGUFFile &f, const std::string &realpath, const struct stat &st) {
    return "model=" + realpath + "\nsize=" + std::to_string(st.st_size) +
           "\nmtime_ns=" + std::to_string(int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec) +
           "\nheader_crc32c=" + std::to_string(crc32c(f.base(), size_t(f.data_offset()))) + "\n";
}

std::string cache_layout(const ModelOptions &opts, const std::vector<int> &nodes, bool shard, bool replicate,
                         const std::vector<Arena *> &arenas) {
    std::string s = "format=" + std::to_string(kWeightsCacheVersion) + "\nbuild_id=" + native_build_id() +
                    "\nisa=" + std::string(isa_name(active_isa())) + "\ncpu=" + cpu_features().model_name +
                    "\nallow_repack=" + (opts.allow_repack ? "1" : "0") +
                    "\nlayout_choice=" + std::to_string(kLayoutChoice) + "\nnodes=";
    for (size_t i = 0; i < nodes.size(); ++i) {
        if (i) s += ',';
        s += std::to_string(nodes[i]);
    }
    s += std::string("\nshard_experts=") + (shard ? "1" : "0") + "\nreplicate_dense=" + (replicate ? "1" : "0") +
         "\narenas=";
    for (size_t i = 0; i < arenas.size(); ++i) {
        if (i) s += ',';
        s += std::to_string(arenas[i]->requested());  // not the page-rounded capacity: any page kind
    }
    return s + "\n";
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

uint64_t file_bytes(const std::string &path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 ? uint64_t(st.st_size) : 0;
}

// What a load does, decided from the options and the pool's NUMA nodes before a byte is read:
// where the weights go, and whether the prepared-weights cache is used. Model::open records it in
// MemoryLayout (experts_sharded, dense_policy, weights_map_note), which the load log and status
// print.
struct LoadPlan {
    bool shard = false;      // routed experts cut into per-node row slices
    bool replicate = false;  // a copy of the dense weights on every node (else one, interleaved)
    bool gguf = false;       // the matrices served from the file's mapping: no arenas, no cache
    bool auto_map = false;   // weights_map auto on one node with a cache: a miss is served as gguf
    bool cache_on = false;   // the arenas looked up in the cache (and a missing entry written)
    std::string dense_policy;      // "local" (one node), "interleave", "replicate"
    std::string weights_map_note;  // why the requested weights_map is not the one taken ("" when it is)
};

LoadPlan plan_load(const ModelOptions &opts, const std::vector<NumaNodeMemory> &nodes) {
    const bool use_cache = !opts.cache_dir.empty();
    const size_t n_slice = nodes.size();
    LoadPlan p;
    p.shard = n_slice > 1 && opts.shard_experts;
    p.replicate = n_slice > 1 && opts.numa_dense == NumaDense::Replicate;
    p.dense_policy = n_slice == 1 ? "local" : p.replicate ? "replicate" : "interleave";
    // weights_map: gguf needs one node: the file's page cache is wherever the kernel read it, so
    // neither sharded slices nor node-local copies exist. On several, the arenas as configured
    // (a restart must not fail over a speed preference), and the note says why.
    p.gguf = opts.weights_map == WeightsMap::Gguf;
    // auto: the cache decides (a hit: arena; a miss: gguf); no cache or several nodes: arena.
    p.auto_map = opts.weights_map == WeightsMap::Auto && use_cache && n_slice == 1;
    if (opts.weights_map == WeightsMap::Auto && !p.auto_map)
        p.weights_map_note = use_cache ? "model.weights_map: auto: the threads span several NUMA nodes: arenas"
                                       : "model.weights_map: auto without a weights cache: arenas";
    if (p.gguf && n_slice > 1) {
        p.gguf = false;
        std::string nodes_s;
        for (const NumaNodeMemory &nm : nodes) nodes_s += (nodes_s.empty() ? "" : ",") + std::to_string(nm.node);
        p.weights_map_note = "model.weights_map: gguf needs the threads on one NUMA node, they span " +
                             std::to_string(n_slice) + " (" + nodes_s +
                             "): the file's page cache cannot be node-local, so the weights were prepared "
                             "into per-node arenas (model.numa_nodes: [N] serves from the file)";
    }
    p.cache_on = use_cache && !p.gguf;  // gguf: nothing prepared, nothing to cache
    return p;
}

// The model file's identity in the cache key: its stat and real path, taken before it is mapped
// (a rename in between changes the header checksum or the size, at worst into a miss). Without a
// cache: the path as given, nothing read.
struct FileIdentity {
    struct stat st {};
    std::string realpath;
};

FileIdentity identify_file(const std::string &path, bool use_cache) {
    FileIdentity id;
    id.realpath = path;
    if (!use_cache) return id;
    if (::stat(path.c_str(), &id.st) != 0) throw SysError("stat " + path, errno);
    if (char *rp = ::realpath(path.c_str(), nullptr)) {
        id.realpath = rp;
        std::free(rp);
    }
    return id;
}

// A cache lookup: the entry's key and, on a hit, each arena's bytes as read (or mapped) from it.
struct CacheEntry {
    std::string key;
    std::vector<uint64_t> cached;  // [arena] in arena_list order; empty: a miss
};

// The entry of this file and layout read into the arenas when its key matches (cs: its path and
// what happened; a miss advises the file's pages, which the load then reads).
CacheEntry look_up_cache(const GGUFFile &f, const FileIdentity &id, const ModelOptions &opts, const LoadPlan &plan,
                         ThreadPool &pool, const std::vector<Arena *> &arenas, WeightsCacheStatus &cs) {
    CacheEntry e;
    cs.state = "off";
    if (!opts.cache_dir.empty() && plan.gguf)
        cs.reason = "model.weights_map: gguf serves the weights from the model file: nothing to prepare";
    if (!plan.cache_on) return e;
    const std::string layout = cache_layout(opts, pool.nodes(), plan.shard, plan.replicate, arenas);
    e.key = cache_identity(f, id.realpath, id.st) + layout;
    cs.path = weights_cache_path(opts.cache_dir, id.realpath, layout);
    const auto t0 = std::chrono::steady_clock::now();
    size_t n_mapped = 0;
    e.cached = read_weights_cache(cs.path, e.key, arenas, pool, cs.reason, opts.progress.get(), opts.cache_map,
                                  &n_mapped);
    if (e.cached.empty()) {
        f.advise_willneed();
        return e;
    }
    cs.state = "hit";
    cs.mapped = n_mapped > 0 && n_mapped == arenas.size();
    cs.seconds = seconds_since(t0);
    return e;
}

// weights_map auto, a miss: the weights are served from the file at once and the entry is not
// prepared here (cs.path names it for whoever prepares it). The arenas go unused (nothing was
// touched), and so does what the layout said of them.
void serve_from_file(Arenas &arenas, std::vector<Arena *> &list, MemoryLayout &mem, WeightsCacheStatus &cs) {
    cs.state = "absent";
    arenas = Arenas{};
    list.clear();
    mem.page_kind.clear();
    mem.page_size = 0;
    mem.page_reason.clear();
    mem.dense_bytes = mem.embd_bytes = 0;
}

// A hit whose arenas the loader filled differently from the entry's sections (the key says they
// match; a mismatch is a bug in the key): the entry is not used (cs says why) and its mappings
// go. Returns whether it was rejected, for the load to prepare everything from the file.
bool reject_mismatched_entry(CacheEntry &e, const std::vector<Arena *> &list, WeightsCacheStatus &cs) {
    for (size_t i = 0; i < list.size(); ++i)
        if (list[i]->used() != e.cached[i]) {
            cs.state = "off";
            cs.reason = "the entry's section " + std::to_string(i) + " has " + std::to_string(e.cached[i]) +
                        " bytes, the layout " + std::to_string(list[i]->used()) + " (not used)";
            e.cached.clear();
            cs.mapped = false;
            for (Arena *a : list) a->unmap_file();
            return true;
        }
    return false;
}

// After the load. gguf: the forward reads the file's mapping from now on (the Model owns it, none
// of its pages was released; mlock locks those page-cache pages as it locks an arena), and the
// note names the tensors copied instead. Arenas: everything the forward reads is in them, so the
// file's pages leave the process (the header, which names and metadata point into, stays as an
// anonymous copy).
void finish_file(GGUFFile &f, bool gguf, bool mlock, MemoryLayout &mem) {
    if (!gguf) {
        f.detach_data();
        return;
    }
    if (mlock && f.file_size() && ::mlock(f.base(), size_t(f.file_size())) != 0)
        throw SysError("mlock of the model file's mapping (" + std::to_string(f.file_size()) +
                           " bytes; raise RLIMIT_MEMLOCK, systemd LimitMEMLOCK=)",
                       errno);
    if (!mem.file_copy_note.empty())
        mem.file_copy_note = "copied, their data not aligned as the plain kernels read it (general.alignment " +
                             std::to_string(f.alignment()) + "): " + mem.file_copy_note;
}

// A cache status's reason with err added (once: the same failure is often reported by two steps).
void add_reason(std::string &reason, const std::string &err) {
    reason = reason.empty() || reason == err ? err : reason + "; " + err;
}

// The entry prepared in place (WeightsCacheWriter) made final: its state in cs.
void commit_direct(WeightsCacheWriter &direct, ThreadPool &pool, LoadProgress *progress, WeightsCacheStatus &cs) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string err = direct.commit(pool, progress);
    if (!err.empty()) {
        cs.state = "not written";
        add_reason(cs.reason, err);
        return;
    }
    cs.state = "written";
    cs.direct = true;
    cs.seconds = seconds_since(t0);
    cs.bytes = file_bytes(cs.path);
}

// Where a new entry's outcome goes: the model's cache status, under its lock (a background write
// updates it while the model serves), and the flag that cancels the write (the model's destructor).
struct CacheStatusSink {
    WeightsCacheStatus &status;
    std::mutex &mu;
    std::atomic<bool> &cancel;
};

// A new entry written from the arenas, which are only read from here on (`keep` holds them while a
// background write runs).
void write_entry(const std::string &path, const std::string &key, const Arenas &keep, ThreadPool *pool,
                 LoadProgress *progress, CacheStatusSink out) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string err = write_weights_cache(path, key, arena_list(keep), pool, progress, &out.cancel);
    const uint64_t bytes = err.empty() ? file_bytes(path) : 0;
    std::lock_guard<std::mutex> l(out.mu);
    WeightsCacheStatus &c = out.status;
    if (err.empty()) {
        c.state = "written";
        c.seconds = seconds_since(t0);
        c.bytes = bytes;
    } else {
        c.state = "not written";
        add_reason(c.reason, err);
    }
}

GGUFOpenOptions file_open_options(const ModelOptions &opts) {
    GGUFOpenOptions o;
    // A cache hit reads only the vectors from the file; gguf serves every weight from it (auto: a
    // miss advises then).
    o.willneed = opts.cache_dir.empty() || opts.weights_map == WeightsMap::Gguf;
    return o;
}

}  // namespace

std::unique_ptr<Model> Model::open(const std::string &path, const ModelOptions &opts) {
    const FileIdentity id = identify_file(path, !opts.cache_dir.empty());
    std::unique_ptr<Model> m(new Model(GGUFFile::open(path, file_open_options(opts))));
    m->arch_ = &read_arch(m->file_, m->hp_, m->table_);
    m->init_pool(opts);
    const LoadPlan plan = plan_load(opts, m->mem_.nodes);
    m->mem_.experts_sharded = plan.shard;
    m->mem_.dense_policy = plan.dense_policy;
    m->mem_.weights_map_note = plan.weights_map_note;

    // What goes where, the arenas for it, and their bytes from the cache when it has them.
    const std::vector<TensorUse> uses = check_tensors(m->file_, m->table_, m->hp_);
    const MemoryPlan mem_plan = plan_memory(m->file_, uses, m->n_slices(), plan.shard, opts.allow_repack);
    Arenas arenas = plan.gguf ? Arenas{} : open_arenas(mem_plan, opts, m->pool_->nodes(), plan.replicate, m->mem_);
    std::vector<Arena *> list = arena_list(arenas);
    WeightsCacheStatus &cs = m->cache_;
    CacheEntry entry = look_up_cache(m->file_, id, opts, plan, *m->pool_, list, cs);
    const bool gguf = plan.gguf || (plan.auto_map && entry.cached.empty());
    if (gguf && !plan.gguf) serve_from_file(arenas, list, m->mem_, cs);
    m->mem_.weights_map = gguf ? "gguf" : "arena";
    const bool cache_on = plan.cache_on && !gguf;
    // A miss that may map: the new entry is written while preparing (WeightsCacheWriter: the
    // arenas become shared mappings of its temporary file). Otherwise (it cannot be created, a
    // placement that cannot map) the arenas are anonymous and the entry is written after the load.
    WeightsCacheWriter direct;
    if (cache_on && entry.cached.empty() && opts.cache_map && opts.cache_direct)
        (void)direct.begin(cs.path, entry.key, list);

    auto load = [&](bool attach) {
        WeightLoader(*m, opts, arenas, plan.shard, plan.replicate, attach, gguf)
            .load_all(uses, attach ? nullptr : opts.progress.get());
    };
    load(!entry.cached.empty());
    if (!entry.cached.empty() && reject_mismatched_entry(entry, list, cs)) {
        m->file_.advise_willneed();
        load(false);
    }
    finish_file(m->file_, gguf, opts.mlock, m->mem_);

    // The cache after the load: the entry prepared in place committed, or a new one written now or
    // (cache_write_background) from a thread of its own while the model serves.
    if (direct.active()) {
        commit_direct(direct, *m->pool_, opts.progress.get(), cs);
    } else if (cache_on && entry.cached.empty()) {
        const CacheStatusSink out{m->cache_, m->cache_mu_, m->cache_cancel_};
        if (opts.cache_write_background) {
            cs.state = "writing";
            m->cache_writer_ = std::thread(write_entry, cs.path, entry.key, arenas, nullptr, nullptr, out);
        } else {
            write_entry(cs.path, entry.key, arenas, m->pool_.get(), opts.progress.get(), out);
        }
    } else if (!entry.cached.empty()) {
        cs.bytes = file_bytes(cs.path);
    }
    if (arenas.dense) m->arenas_.push_back(arenas.dense);
    for (const auto *v : {&arenas.copies, &arenas.slices})
        for (const auto &ar : *v)
            if (ar) m->arenas_.push_back(ar);
    if (opts.progress) opts.progress->phase = LoadProgress::Done;
    return m;
}

std::map<std::string, uint64_t> Model::arena_pages() const {
    std::map<std::string, uint64_t> sum;
    for (const auto &ar : arenas_)
        for (const auto &[k, v] : ar->smaps()) {
            // Page sizes are the largest seen (page_report.h); the rest add up.
            if (k == "KernelPageSize" || k == "MMUPageSize")
                sum[k] = std::max(sum[k], v);
            else
                sum[k] += v;
        }
    return sum;
}

Model::~Model() {
    if (cache_writer_.joinable()) {
        cache_cancel_ = true;
        cache_writer_.join();
    }
}

}  // namespace ktd
