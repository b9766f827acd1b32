#include "model/model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/error.h"
#include "common/float16.h"
#include "memory/arena.h"
#include "memory/numa_policy.h"
#include "kernels/attention.h"
#include "model/blocks.h"

namespace ktd {

const std::vector<const ArchSpec *> &all_archs() {
    static const std::vector<const ArchSpec *> archs = {&kArchLlama,    &kArchQwen2,  &kArchQwen3,
                                                                &kArchQwen2Moe, &kArchQwen3Moe, &kArchGemma3,
                                                                &kArchBitnet,   &kArchDeepseek2};
    return archs;
}

const ArchSpec *find_arch(const std::string &name) {
    for (const ArchSpec *a : all_archs())
        if (name == a->name) return a;
    return nullptr;
}

std::string Model::supported_archs() {
    std::string s;
    for (const ArchSpec *a : all_archs()) {
        if (!s.empty()) s.append(", ");
        s.append(a->name);
    }
    return s;
}

namespace {

int64_t dim_value(Dim d, const HParams &hp) {
    switch (d) {
        case Dim::One: return 1;
        case Dim::Embd: return hp.n_embd;
        case Dim::EmbdQ: return hp.n_embd_q();
        case Dim::EmbdKGqa: return hp.n_embd_k_gqa();
        case Dim::EmbdVGqa: return hp.n_embd_v_gqa();
        case Dim::EmbdAttnOut: return int64_t(hp.n_head) * hp.head_dim_v;
        case Dim::FF: return hp.n_ff;
        case Dim::Vocab: return hp.n_vocab;
        case Dim::HeadK: return hp.head_dim_k;
        case Dim::RotHalf: return hp.rope.n_rot / 2;
        case Dim::Expert: return hp.moe.n_expert;
        case Dim::FFExp: return hp.moe.n_ff_exp;
        case Dim::FFShexp: return hp.moe.n_ff_shexp;
        case Dim::Head: return hp.n_head;
        case Dim::QLora: return hp.mla.q_lora_rank;
        case Dim::KvLora: return hp.mla.kv_lora_rank;
        case Dim::KvLoraRope: return hp.mla.kv_lora_rank + hp.mla.qk_rope_head_dim;
        case Dim::HeadKNope: return hp.mla.qk_nope_head_dim;
        case Dim::HeadVMla: return hp.mla.v_head_dim;
        case Dim::EmbdQMla: return int64_t(hp.n_head) * hp.mla.n_embd_head_k();
        case Dim::EmbdVMla: return int64_t(hp.n_head) * hp.mla.v_head_dim;
    }
    return 0;
}

std::string tensor_name(const char *fmt, int il) {
    char buf[256];
    std::snprintf(buf, sizeof buf, fmt, il);
    return buf;
}

std::string shape_str(int64_t a, int64_t b, int64_t c = 1) {
    return "[" + std::to_string(a) + ", " + std::to_string(b) + (c != 1 ? ", " + std::to_string(c) : "") + "]";
}

bool layer_in_set(LayerSet set, const HParams &hp, int il) {
    switch (set) {
        case LayerSet::All: return true;
        case LayerSet::Dense: return hp.moe.n_expert == 0 || il < hp.moe.n_layer_dense_lead;
        case LayerSet::Moe: return hp.moe.n_expert > 0 && il >= hp.moe.n_layer_dense_lead;
    }
    return true;
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

// The routed experts' weights: ffn_{gate,up,down}_exps (sharded over NUMA nodes).
bool is_expert_tensor(std::string_view name) {
    constexpr std::string_view suffix = "_exps.weight";
    return name.size() >= suffix.size() && name.substr(name.size() - suffix.size()) == suffix;
}

// Arena bytes of a slice of `rows` rows: repacked, or (a type without repacking) the rows copied,
// so that a slice always lives in its node's arena rather than in the file's page cache.
size_t slice_prepared_bytes(const TypeKernels &tk, size_t row_bytes, int64_t rows, int64_t k, bool allow_repack) {
    const size_t repacked = prepared_bytes(tk, rows, k, allow_repack);
    if (repacked || rows == 0) return repacked;
    return (size_t(rows) * row_bytes + kPreparedAlign - 1) / kPreparedAlign * kPreparedAlign;
}

// prepare_weights for one slice, into its node's arena (copied when the type does not repack).
PreparedWeights prepare_slice(ThreadPool *pool, const TypeKernels &tk, const uint8_t *w, size_t row_bytes,
                              int64_t rows, int64_t k, bool allow_repack, const std::shared_ptr<Arena> &arena) {
    if (rows == 0 || prepared_bytes(tk, rows, k, allow_repack))
        return prepare_weights(pool, tk, w, row_bytes, rows, k, allow_repack, rows ? arena : nullptr);
    PreparedWeights pw;
    pw.tk = &tk;
    pw.row_bytes = row_bytes;
    pw.rows = rows;
    pw.k = k;
    void *out = arena->alloc(size_t(rows) * row_bytes, kPreparedAlign);
    std::memcpy(out, w, size_t(rows) * row_bytes);
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

std::pair<int64_t, int64_t> numa_slice_rows(int64_t rows, int n_slice, int s) {
    if (n_slice <= 1) return {0, rows};
    const int64_t blocks = (rows + kNumaRowAlign - 1) / kNumaRowAlign;
    auto bound = [&](int i) { return std::min(rows, blocks * i / n_slice * kNumaRowAlign); };
    return {bound(s), bound(s + 1)};
}

std::unique_ptr<Model> Model::open(const std::string &path, const ModelOptions &opts) {
    GGUFFile f = GGUFFile::open(path);
    const std::string arch_name(f.get_string("general.architecture"));
    const ArchSpec *arch = find_arch(arch_name);
    if (!arch)
        throw GGUFError("unsupported architecture '" + arch_name + "' (supported: " + supported_archs() + ")");
    std::unique_ptr<Model> m(new Model(std::move(f)));
    const GGUFFile &file = m->file_;
    m->arch_ = arch;
    m->hp_ = read_hparams(file, arch_name);
    arch->tune(m->hp_, file);
    HParams &hp = m->hp_;

    ThreadPoolOptions popts;
    popts.n_threads = opts.n_threads;
    popts.pin = opts.pin;
    popts.nodes = opts.nodes;
    popts.smt = opts.smt;
    popts.sysfs_root = opts.sysfs_root;
    popts.affinity = opts.affinity;
    m->pool_ = std::make_unique<ThreadPool>(popts);
    const ThreadPool &pool = *m->pool_;

    // NUMA slices: one per node of the pool, in the pool's node order.
    MemoryLayout &mem = m->mem_;
    const std::vector<int> nodes = pool.nodes();
    const int n_slice = int(nodes.size());
    for (int node : nodes) {
        NumaNodeMemory nm;
        nm.node = node;
        nm.n_threads = int(pool.workers_of_node(node).size());
        mem.nodes.push_back(nm);
    }
    m->tid_slice_.resize(size_t(pool.size()));
    for (int tid = 0; tid < pool.size(); ++tid)
        m->tid_slice_[size_t(tid)] = int(std::find(nodes.begin(), nodes.end(), pool.node_of(tid)) - nodes.begin());
    const bool shard = n_slice > 1 && opts.shard_experts;
    mem.experts_sharded = shard;
    const bool replicate = n_slice > 1 && opts.numa_dense == NumaDense::Replicate;
    mem.dense_policy = n_slice == 1 ? "local" : replicate ? "replicate" : "interleave";

    // Weights arenas for every prepared matrix (huge pages when a hugetlb pool is reserved, THP
    // otherwise), sized before preparing from the file's matrices: an upper bound (tensors the
    // architecture does not use as matrices are counted too), bad shapes are left to the checks
    // below. One node: one arena. Several: the dense arena (interleaved) or one per node (a copy
    // of the dense weights each, replicate; non-repacked ones copied too), and, when the experts
    // are sharded, one arena per node for its slices.
    size_t dense_bytes = 0, dense_copy_bytes = 0;
    std::vector<size_t> slice_bytes(static_cast<size_t>(n_slice), 0);
    const bool has_output = file.find_tensor("output.weight") != nullptr;
    for (const GGUFTensorInfo &t : file.tensors()) {
        const TypeKernels *tk = kernels_for(t.type);
        if (!tk || t.n_dims < 2 || (has_output && std::string_view(t.name) == "token_embd.weight")) continue;
        if (!ggml_row_size(tk->act_type, t.ne[0]) || !ggml_row_size(t.type, t.ne[0])) continue;
        if (shard && is_expert_tensor(t.name)) {
            for (int sl = 0; sl < n_slice; ++sl) {
                const auto [r0, r1] = numa_slice_rows(int64_t(t.ne[1]), n_slice, sl);
                slice_bytes[size_t(sl)] += slice_prepared_bytes(*tk, *ggml_row_size(t.type, t.ne[0]), r1 - r0,
                                                                int64_t(t.ne[0]), opts.allow_repack) * size_t(t.ne[2]);
            }
            continue;
        }
        dense_bytes += prepared_bytes(*tk, int64_t(t.ne[1]), int64_t(t.ne[0]), opts.allow_repack) * size_t(t.ne[2]);
        dense_copy_bytes += slice_prepared_bytes(*tk, *ggml_row_size(t.type, t.ne[0]), int64_t(t.ne[1]),
                                                 int64_t(t.ne[0]), opts.allow_repack) * size_t(t.ne[2]);
    }
    ArenaOptions aopts;
    aopts.hugepages = opts.hugepages;
    aopts.hugetlb_page_size = opts.hugetlb_page_size;
    aopts.mlock = opts.mlock;
    std::shared_ptr<Arena> arena;  // dense weights (not replicated)
    std::vector<std::shared_ptr<Arena>> copy_arenas(static_cast<size_t>(replicate ? n_slice : 0));
    for (size_t sl = 0; sl < copy_arenas.size() && dense_copy_bytes; ++sl) {
        aopts.node = nodes[sl];
        std::string note;
        copy_arenas[sl] = open_placed_arena(dense_copy_bytes, aopts, note);
        if (note.empty()) continue;
        if (!mem.dense_note.empty()) mem.dense_note += "; ";
        mem.dense_note += "copy on node " + std::to_string(nodes[sl]) + ": " + note;
    }
    aopts.node = -1;
    if (dense_bytes && !replicate) {
        if (n_slice > 1) aopts.interleave = nodes;
        arena = open_placed_arena(dense_bytes, aopts, mem.dense_note);
        aopts.interleave.clear();
    }
    std::vector<std::shared_ptr<Arena>> slice_arenas(static_cast<size_t>(n_slice));
    for (int sl = 0; sl < n_slice; ++sl) {
        if (!slice_bytes[size_t(sl)]) continue;
        aopts.node = nodes[size_t(sl)];
        slice_arenas[size_t(sl)] = open_placed_arena(slice_bytes[size_t(sl)], aopts, mem.nodes[size_t(sl)].note);
        mem.nodes[size_t(sl)].bound = slice_arenas[size_t(sl)]->node() >= 0;
    }
    for (const Arena *a : {arena.get(), copy_arenas.empty() ? nullptr : copy_arenas[0].get(),
                           slice_arenas.empty() ? nullptr : slice_arenas[0].get()})
        if (a && mem.page_kind.empty()) {
            mem.page_kind = arena_kind_name(a->kind());
            mem.page_size = a->page_size();
            mem.page_reason = a->fallback_reason();
        }
    mem.dense_bytes = replicate ? dense_copy_bytes : dense_bytes;
    // A dense matrix: into the dense arena, or (replicate) one copy per node with node_copies
    // telling matmul which copy each worker reads.
    auto prepare_dense = [&](const TypeKernels &tk, const uint8_t *src, size_t row_bytes, int64_t rows, int64_t k) {
        if (!replicate) {
            PreparedWeights pw = prepare_weights(m->pool_.get(), tk, src, row_bytes, rows, k, opts.allow_repack, arena);
            m->repacked_bytes_ += pw.repacked_bytes;
            return pw;
        }
        auto copies = std::make_shared<PreparedCopies>();
        copies->copy_of_tid = m->tid_slice_;
        for (int sl = 0; sl < n_slice; ++sl) {
            copies->copies.push_back(prepare_slice(m->pool_.get(), tk, src, row_bytes, rows, k, opts.allow_repack,
                                                   copy_arenas[size_t(sl)]));
            const PreparedWeights &c = copies->copies.back();
            mem.nodes[size_t(sl)].dense_copy_bytes += c.repacked ? c.repacked_bytes : size_t(rows) * row_bytes;
        }
        PreparedWeights pw = copies->copies[0];
        pw.node_copies = copies;
        m->repacked_bytes_ += pw.repacked_bytes;
        return pw;
    };

    ModelWeights &w = m->w_;
    w.layers.resize(size_t(hp.n_layer));
    for (const TensorSpec &spec : arch->tensors) {
        const bool per_layer = spec.layer_mat || spec.layer_vec || spec.layer_scalar || spec.layer_stack;
        for (int il = 0; il < (per_layer ? hp.n_layer : 1); ++il) {
            const std::string name = tensor_name(spec.name, il);
            const GGUFTensorInfo *t = file.find_tensor(name);
            if (per_layer && !layer_in_set(spec.layers, hp, il)) {
                if (t) throw GGUFError("unexpected tensor " + name + " (layer " + std::to_string(il) + " of " + arch_name +
                                       " has no such tensor)");
                continue;
            }
            if (!t) {
                if (spec.required) throw GGUFError("missing tensor " + name + " (required by " + arch_name + ")");
                continue;
            }
            const int64_t e0 = dim_value(spec.ne0, hp), e1 = dim_value(spec.ne1, hp), e2 = dim_value(spec.ne2, hp);
            if (int64_t(t->ne[0]) != e0 || int64_t(t->ne[1]) != e1 || int64_t(t->ne[2]) != e2 || t->ne[3] != 1)
                throw GGUFError("tensor " + name + " has shape " +
                                shape_str(int64_t(t->ne[0]), int64_t(t->ne[1]), int64_t(t->ne[2])) +
                                (t->n_dims > 3 ? " (" + std::to_string(t->n_dims) + " dims)" : "") + ", expected " +
                                shape_str(e0, e1, e2));
            m->n_params_ += t->n_elements;
            LayerWeights *lw = per_layer ? &w.layers[size_t(il)] : nullptr;
            if (spec.layer_vec) lw->*spec.layer_vec = load_vector(file, *t);
            if (spec.model_vec) w.*spec.model_vec = load_vector(file, *t);
            if (spec.layer_scalar) lw->*spec.layer_scalar = load_vector(file, *t)[0];
            if (spec.layer_mat || spec.model_mat || spec.layer_stack) {
                const TypeKernels &tk = kernels_or_throw(*t);
                if (!tk.gemm)
                    throw GGUFError("tensor " + name + " has type " + std::string(ggml_type_name(t->type)) +
                                    ", which has no matmul kernel in this build");
                const size_t row_bytes = size_t(*ggml_row_size(t->type, t->ne[0]));
                const int64_t rows = int64_t(t->ne[1]), k = int64_t(t->ne[0]);
                if (spec.layer_stack) {
                    MatrixStack &st = lw->*spec.layer_stack;
                    st.info = t;
                    st.rows = rows;
                    if (shard && is_expert_tensor(t->name)) {
                        const uint8_t *src = file.tensor_data(*t);
                        st.n_slices = n_slice;
                        st.slices.resize(size_t(e2) * size_t(n_slice));
                        for (int64_t e = 0; e < e2; ++e)
                            for (int sl = 0; sl < n_slice; ++sl) {
                                const auto [r0, r1] = numa_slice_rows(rows, n_slice, sl);
                                PreparedWeights &pw = st.slices[size_t(e) * size_t(n_slice) + size_t(sl)];
                                pw = prepare_slice(m->pool_.get(), tk,
                                                   src + (size_t(e) * size_t(rows) + size_t(r0)) * row_bytes,
                                                   row_bytes, r1 - r0, k, opts.allow_repack,
                                                   slice_arenas[size_t(sl)]);
                                m->repacked_bytes_ += pw.repacked_bytes;
                                mem.nodes[size_t(sl)].expert_bytes += pw.repacked ? pw.repacked_bytes
                                                                                  : size_t(r1 - r0) * row_bytes;
                            }
                        if (st.slices[0].repacked) file.release_pages(*t);  // all or none repack
                        continue;
                    }
                    st.mats.resize(size_t(e2));
                    for (int64_t e = 0; e < e2; ++e)
                        st.mats[size_t(e)] = prepare_dense(tk, file.tensor_data(*t) + size_t(e) * size_t(rows) * row_bytes,
                                                           row_bytes, rows, k);
                    if (!st.mats.empty() && st.mats[0].repacked) file.release_pages(*t);  // all or none repack
                    continue;
                }
                Matrix &mat = spec.layer_mat ? lw->*spec.layer_mat : w.*spec.model_mat;
                mat.info = t;
                mat.pw = prepare_dense(tk, file.tensor_data(*t), row_bytes, rows, k);
                if (mat.pw.repacked) file.release_pages(*t);  // token_embd (read at run time) never gets here
            }
        }
    }
    // token_embd is read row by row (dequantize_row), and is the output head when untied.
    w.token_embd = file.find_tensor("token_embd.weight");
    w.token_embd_tk = &kernels_or_throw(*w.token_embd);
    if (int64_t(w.token_embd->ne[0]) != hp.n_embd)
        throw GGUFError("tensor token_embd.weight has shape " +
                        shape_str(int64_t(w.token_embd->ne[0]), int64_t(w.token_embd->ne[1])) + ", expected " +
                        shape_str(hp.n_embd, hp.n_vocab));
    if (!w.output) {
        const TypeKernels &tk = *w.token_embd_tk;
        if (!tk.gemm)
            throw GGUFError("tensor token_embd.weight (tied output) has type " +
                            std::string(ggml_type_name(w.token_embd->type)) + ", which has no matmul kernel");
        w.output.info = w.token_embd;
        w.output.pw = prepare_dense(tk, file.tensor_data(*w.token_embd),
                                    size_t(*ggml_row_size(w.token_embd->type, w.token_embd->ne[0])), hp.n_vocab,
                                    hp.n_embd);
    }
    return m;
}


Context::Context(const Model &model, int64_t n_ctx, int n_seq_max, int64_t n_batch)
    : model_(model), n_ctx_(n_ctx), n_seq_max_(n_seq_max), n_batch_(n_batch) {
    if (n_ctx < 1 || n_ctx > (int64_t(1) << 24)) throw std::invalid_argument("n_ctx must be in [1, 2^24]");
    if (n_seq_max < 1 || n_seq_max > 4096) throw std::invalid_argument("n_seq_max must be in [1, 4096]");
    if (n_batch < 1 || n_batch > 65536) throw std::invalid_argument("n_batch must be in [1, 65536]");
    const HParams &hp = model.hparams();
    const size_t rows = size_t(n_seq_max) * size_t(n_ctx);
    for (int il = 0; il < hp.n_layer; ++il) {
        // Not value-initialized: pages are touched only as positions are written.
        k_cache_.emplace_back(new uint16_t[rows * size_t(hp.n_embd_k_cache())]);
        v_cache_.emplace_back(hp.n_embd_v_cache() > 0 ? new uint16_t[rows * size_t(hp.n_embd_v_cache())] : nullptr);
    }
    seq_len_.assign(size_t(n_seq_max), 0);
    next_pos_.assign(size_t(n_seq_max), -1);
    expert_counts_.assign(size_t(hp.n_layer) * size_t(hp.moe.n_expert), 0);
    const size_t nb = size_t(n_batch);
    s_.x.resize(nb * size_t(hp.n_embd));
    s_.xn.resize(nb * size_t(hp.n_embd));
    s_.tmp.resize(nb * size_t(std::max(hp.n_embd, int64_t(hp.n_head) * hp.head_dim_v)));
    s_.q.resize(nb * size_t(hp.n_embd_q()));
    s_.k.resize(nb * size_t(hp.n_embd_k_gqa()));
    s_.v.resize(nb * size_t(hp.n_embd_v_gqa()));
    s_.attn.resize(nb * size_t(int64_t(hp.n_head) * hp.head_dim_v));
    s_.gate.resize(nb * size_t(hp.n_ff));
    s_.up.resize(nb * size_t(hp.n_ff));
    s_.rope_cs.resize(nb * size_t(hp.rope.n_rot));
    s_.rope_cs_swa.resize(nb * size_t(hp.rope_swa.n_rot));
    s_.attn_tmp_stride = attn_scratch_layout(attn_rows_per_block(hp), hp.n_head / hp.n_head_kv, hp.head_dim_k,
                                             hp.head_dim_v).total;
    s_.attn_tmp.resize(size_t(model.pool().size()) * s_.attn_tmp_stride);
    if (hp.is_mla()) {
        const MlaParams &mla = hp.mla;
        s_.mla_q_a.resize(nb * size_t(mla.q_lora_rank));
        s_.mla_q.resize(nb * size_t(hp.n_head) * size_t(mla.n_embd_head_k()));
        s_.mla_heads.resize(nb * size_t(hp.n_head) * size_t(std::max(mla.qk_nope_head_dim, mla.v_head_dim)));
        s_.mla_v.resize(nb * size_t(hp.n_head) * size_t(mla.v_head_dim));
        s_.mm_thread.resize(size_t(model.pool().size()));
    }
}

int64_t Context::kv_bytes_per_token() const {
    const HParams &hp = model_.hparams();
    return int64_t(hp.n_layer) * (hp.n_embd_k_cache() + hp.n_embd_v_cache()) * int64_t(sizeof(uint16_t));
}

void Context::check_seq(int seq_id, const char *what) const {
    if (seq_id < 0 || seq_id >= n_seq_max_)
        throw std::invalid_argument(std::string(what) + ": sequence id " + std::to_string(seq_id) +
                                    " out of range [0, " + std::to_string(n_seq_max_) + ")");
}

int64_t Context::seq_len(int seq_id) const {
    check_seq(seq_id, "seq_len");
    return seq_len_[size_t(seq_id)];
}

void Context::free_seq(int seq_id) {
    check_seq(seq_id, "free_seq");
    seq_len_[size_t(seq_id)] = 0;
}

void Context::copy_seq(int src, int dst, int64_t n_tokens) {
    check_seq(src, "copy_seq");
    check_seq(dst, "copy_seq");
    if (n_tokens < 0 || n_tokens > seq_len_[size_t(src)])
        throw std::invalid_argument("copy_seq: n_tokens " + std::to_string(n_tokens) + " exceeds the " +
                                    std::to_string(seq_len_[size_t(src)]) + " tokens of sequence " +
                                    std::to_string(src));
    if (src == dst) {
        seq_len_[size_t(dst)] = n_tokens;
        return;
    }
    const HParams &hp = model_.hparams();
    for (int il = 0; il < hp.n_layer; ++il) {
        for (auto [cache, dim] : {std::pair{k_cache_[size_t(il)].get(), hp.n_embd_k_cache()},
                                  std::pair{v_cache_[size_t(il)].get(), hp.n_embd_v_cache()}}) {
            if (dim == 0) continue;  // no V cache (MLA)
            const size_t row = size_t(dim);
            std::memcpy(cache + size_t(dst) * size_t(n_ctx_) * row, cache + size_t(src) * size_t(n_ctx_) * row,
                        size_t(n_tokens) * row * sizeof(uint16_t));
        }
    }
    seq_len_[size_t(dst)] = n_tokens;
}

void Context::forward(const Batch &b, float *logits) {
    if (b.n < 0) throw std::invalid_argument("forward: negative batch size");
    const HParams &hp = model_.hparams();
    // Validate every row before touching the cache: a rejected batch changes nothing.
    std::vector<int64_t> &next = next_pos_;  // expected next position per sequence, -1: none yet
    std::fill(next.begin(), next.end(), -1);
    for (int64_t i = 0; i < b.n; ++i) {
        const int s = b.seq_ids[i];
        check_seq(s, "forward");
        const int64_t p = b.positions[i];
        if (b.tokens[i] < 0 || b.tokens[i] >= hp.n_vocab)
            throw std::invalid_argument("forward: token id " + std::to_string(b.tokens[i]) + " out of range [0, " +
                                        std::to_string(hp.n_vocab) + ")");
        if (p >= n_ctx_)
            throw ContextOverflowError("position " + std::to_string(p) + " of sequence " + std::to_string(s) +
                                       " reaches the context limit n_ctx = " + std::to_string(n_ctx_));
        int64_t &nx = next[size_t(s)];
        if (nx < 0 ? (p < 0 || p > seq_len_[size_t(s)]) : p != nx)
            throw std::invalid_argument("forward: row " + std::to_string(i) + " has position " + std::to_string(p) +
                                        " for sequence " + std::to_string(s) + ", expected " +
                                        (nx < 0 ? "at most " + std::to_string(seq_len_[size_t(s)])
                                                : std::to_string(nx)) +
                                        " (positions of a sequence must be consecutive)");
        nx = p + 1;
    }
    int64_t out_row = 0;
    for (int64_t r0 = 0; r0 < b.n; r0 += n_batch_) {
        const int64_t n = std::min(n_batch_, b.n - r0);
        forward_chunk(b, r0, n, logits ? logits + out_row * hp.n_vocab : nullptr);
        for (int64_t i = r0; i < r0 + n; ++i) out_row += b.want_logits[i] ? 1 : 0;
    }
}

void Context::forward_chunk(const Batch &b, int64_t r0, int64_t n, float *logits) {
    const HParams &hp = model_.hparams();
    const ModelWeights &w = model_.weights();
    ThreadPool &pool = model_.pool();
    const int64_t E = hp.n_embd;

    // Embedding rows: x [n][n_embd].
    const size_t embd_row_bytes = size_t(*ggml_row_size(w.token_embd->type, w.token_embd->ne[0]));
    const uint8_t *embd = model_.file().tensor_data(*w.token_embd);
    for (int64_t i = 0; i < n; ++i) {
        float *xi = s_.x.data() + i * E;
        w.token_embd_tk->dequantize_row(embd + size_t(b.tokens[r0 + i]) * embd_row_bytes, xi, E);
        if (hp.embd_scale != 1.0f)
            for (int64_t d = 0; d < E; ++d) xi[d] *= hp.embd_scale;
    }
    // Rotary angles per row: [n][n_rot] (and for sliding-window layers when they differ).
    const float *ff = w.rope_freqs.empty() ? nullptr : w.rope_freqs.data();
    for (int64_t i = 0; i < n; ++i) {
        rope_cos_sin(hp.rope, ff, b.positions[r0 + i], s_.rope_cs.data() + i * hp.rope.n_rot);
        rope_cos_sin(hp.rope_swa, ff, b.positions[r0 + i], s_.rope_cs_swa.data() + i * hp.rope_swa.n_rot);
    }
    // The sequence slots grow before the layers run: attention reads positions [0, p] of each row.
    for (int64_t i = r0; i < r0 + n; ++i) seq_len_[size_t(b.seq_ids[i])] = int64_t(b.positions[i]) + 1;

    for (int il = 0; il < hp.n_layer; ++il) model_.arch().layer(*this, w.layers[size_t(il)], il, b, r0, n);

    // Output head on the marked rows only: gather, norm, logits [n_marked][n_vocab].
    int64_t n_out = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (!b.want_logits[r0 + i]) continue;
        rms_norm(s_.x.data() + i * E, w.output_norm.data(), s_.xn.data() + n_out * E, E, hp.norm_eps);
        ++n_out;
    }
    if (n_out > 0) matmul(&pool, w.output.pw, s_.xn.data(), n_out, logits, s_.mm);
    if (const float c = hp.final_logit_softcap; c > 0.0f && n_out > 0)
        for (int64_t j = 0; j < n_out * hp.n_vocab; ++j) logits[j] = c * std::tanh(logits[j] / c);
}

void Context::linear(const Matrix &m, const float *x, int64_t n, float *y, const std::vector<float> *bias) {
    matmul(&model_.pool(), m.pw, x, n, y, s_.mm);
    if (bias && !bias->empty()) {
        const int64_t rows = m.pw.rows;
        const float *bv = bias->data();
        for_each_row(model_.pool(), n, 32, [&](int64_t i) {
            for (int64_t r = 0; r < rows; ++r) y[i * rows + r] += bv[r];
        });
    }
}

}  // namespace ktd
