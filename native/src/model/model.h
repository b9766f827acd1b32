// A loaded model: the weights checked against its architecture's tensor table and prepared for
// the kernels (a Context, model/context.h, runs batches through it).
//
// Shapes (GGML order in the file, row-major here): W [rows][k] is a GGUF tensor with ne[0] = k.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/thread_pool.h"
#include "gguf/gguf_file.h"
#include "kernels/kernels.h"
#include "kernels/tile.h"
#include "memory/arena.h"
#include "model/arch.h"
#include "model/hparams.h"
#include "model/weights_cache.h"

namespace ktd {

// A weight matrix prepared for matmul (null `info`: the optional tensor is absent).
struct Matrix {
    const GGUFTensorInfo *info = nullptr;
    PreparedWeights pw;
    explicit operator bool() const { return info != nullptr; }
};

// Rows [first, second) of a matrix of `rows` rows that NUMA slice s of n_slice computes (and, for
// sharded experts, stores): contiguous, boundaries on multiples of kNumaRowAlign (a multiple of
// every repacked row group, so a slice repacks on its own into the same groups), as equal as that
// allows. n_slice = 1: all rows.
constexpr int64_t kNumaRowAlign = kRowBlock;
std::pair<int64_t, int64_t> numa_slice_rows(int64_t rows, int n_slice, int s);

// weights_map: gguf serves a tensor from the file's mapping when its data is aligned to this
// (bytes) for type t, and copies it otherwise. GGUF data is aligned to general.alignment (32
// unless the file says otherwise; the format allows 1).
size_t plain_alignment(GGMLType t);

// A 3-D GGUF tensor ne = {k, rows, n_mat}: a stack of n_mat matrices [rows][k] (the experts of a
// layer, or deepseek2's per-head attn_k_b/attn_v_b), each prepared on its own so one matrix is one
// contiguous stream.
//
// Sharded (routed experts on a pool spanning several NUMA nodes): every matrix is cut into
// n_slice row slices (numa_slice_rows), slice s prepared on its own in the memory of the pool's
// s-th node, so the workers of that node stream only local memory. No duplication: `mats` is then
// empty and `slices` holds [n_mat][n_slice].
struct MatrixStack {
    const GGUFTensorInfo *info = nullptr;
    int64_t rows = 0;                     // of each matrix
    std::vector<PreparedWeights> mats;    // [n_mat] whole matrices (not sharded)
    int n_slices = 1;                     // > 1: sharded
    std::vector<PreparedWeights> slices;  // [n_mat][n_slices] (sharded)
    explicit operator bool() const { return info != nullptr; }
    bool sharded() const { return n_slices > 1; }
    // The parts of matrix e: n_parts() consecutive PreparedWeights, part p holding rows
    // part_rows(p) (its row 0 is row part_rows(p).first). One part = the whole matrix.
    const PreparedWeights *parts(size_t e) const {
        return sharded() ? &slices[e * size_t(n_slices)] : &mats[e];
    }
    int n_parts() const { return n_slices; }
    std::pair<int64_t, int64_t> part_rows(int p) const { return numa_slice_rows(rows, n_slices, p); }
};

// Per-layer tensors; an optional one that is absent stays empty.
struct LayerWeights {
    std::vector<float> attn_norm;            // [n_embd]
    Matrix wq, wk, wv, wo;                   // [n_embd_q][n_embd] [n_embd_k_gqa][n_embd] ... [n_embd][n_head·hd_v]
    std::vector<float> bq, bk, bv, bo;       // [n_embd_q] [n_embd_k_gqa] [n_embd_v_gqa] [n_embd] (qwen2)
    std::vector<float> attn_q_norm, attn_k_norm;  // [head_dim_k] per-head RMSNorm (qwen3, gemma3)
    std::vector<float> attn_sub_norm;        // [n_head·hd_v] before wo (bitnet)
    std::vector<float> post_attention_norm;  // [n_embd] (gemma3)
    std::vector<float> ffn_norm;             // [n_embd]
    Matrix ffn_gate, ffn_up, ffn_down;       // [n_ff][n_embd] [n_ff][n_embd] [n_embd][n_ff]
    std::vector<float> ffn_sub_norm;         // [n_ff] before ffn_down (bitnet)
    std::vector<float> post_ffw_norm;        // [n_embd] (gemma3)
    // Routed experts (MoE layers only; see MoeParams).
    Matrix ffn_gate_inp;                     // router [n_expert][n_embd]
    std::vector<float> exp_probs_b;          // [n_expert] selection bias (DeepSeek-V3), optional
    MatrixStack ffn_gate_exps, ffn_up_exps;  // [n_expert] × [n_ff_exp][n_embd]
    MatrixStack ffn_down_exps;               // [n_expert] × [n_embd][n_ff_exp]
    Matrix ffn_gate_shexp, ffn_up_shexp;     // shared expert(s) [n_ff_shexp][n_embd], optional
    Matrix ffn_down_shexp;                   // [n_embd][n_ff_shexp]
    std::vector<float> ffn_gate_inp_shexp;   // [n_embd] sigmoid gate of the shared expert (qwen2moe)
    // Multi-head latent attention (deepseek2; see MlaParams). q from a plain wq [n_head·(nope+rope)][n_embd]
    // or through the q LoRA: wq_b [n_head·(nope+rope)][q_lora] · rms(wq_a [q_lora][n_embd] · x).
    Matrix wq_a, wq_b;
    std::vector<float> attn_q_a_norm;        // [q_lora_rank]
    Matrix wkv_a_mqa;                        // [kv_lora_rank + qk_rope][n_embd]: the latent and the shared rope key
    std::vector<float> attn_kv_a_norm;       // [kv_lora_rank]
    MatrixStack wk_b;                        // [n_head] × [kv_lora_rank][qk_nope]: absorbs q_nope into the latent
    MatrixStack wv_b;                        // [n_head] × [v_head_dim][kv_lora_rank]: latent output -> v
    // Scalar multipliers of a ternary weight (bitnet "*.scale" tensors), 1 when absent.
    float wq_scale = 1, wk_scale = 1, wv_scale = 1, wo_scale = 1, gate_scale = 1, up_scale = 1, down_scale = 1;
};

struct ModelWeights {
    const GGUFTensorInfo *token_embd = nullptr;  // [n_vocab][n_embd], rows dequantized on lookup
    const TypeKernels *token_embd_tk = nullptr;
    const uint8_t *token_embd_data = nullptr;    // its rows as in the file, copied into the dense arena
    std::shared_ptr<const void> token_embd_storage;  // keeps that arena alive
    std::vector<float> output_norm;              // [n_embd]
    Matrix output;                               // [n_vocab][n_embd]; token_embd when tied
    std::vector<float> rope_freqs;               // [n_rot/2] frequency divisors (llama 3.1), optional
    std::vector<LayerWeights> layers;
};

// How dense (non-expert) weights are placed when the pool spans several NUMA nodes: pages
// interleaved over the nodes, or one copy per node (each worker reads its node's; n_node times
// the memory).
enum class NumaDense { Interleave, Replicate };

// Where the matrices a forward reads live (model.weights_map). Arena: repacked (or copied) into
// the weights arenas at load, or mapped from a prepared-weights cache entry; the file is unmapped
// after the load. Gguf: served in their plain GGUF layout straight from the file's read-only
// mapping (its pages are the page cache: nothing is repacked, copied or zeroed at load; the plain
// kernels decode slower where the type has a repacked layout). One NUMA node only: on several the
// load falls back to Arena and MemoryLayout::weights_map_note says why. Auto: Arena when the
// weights cache has the entry (a hit), Gguf on a miss (cache state "absent": the entry is left
// to someone else to prepare: the daemon's background builder, whose entry the daemon then
// switches to, daemon/ktd/server/engine.py); Arena without a cache or on several nodes.
enum class WeightsMap { Arena, Gguf, Auto };

struct ModelOptions {
    int n_threads = 0;       // 0: one per physical core
    bool pin = true;
    bool allow_repack = true;
    // Pool placement (ThreadPoolOptions): nodes ([] = all), SMT siblings, the sysfs tree the
    // topology is read from and the allowed CPUs (empty = the process's; tests: fake machines).
    std::vector<int> nodes;
    bool smt = false;
    std::string sysfs_root = "/sys";
    std::vector<int> affinity;
    // Weights arenas (ArenaOptions).
    HugePages hugepages = HugePages::Auto;
    size_t hugetlb_page_size = kPage2M;
    bool mlock = false;
    // Several nodes: routed experts sharded by row slices (false: they stay with the dense
    // weights), dense weights placed per numa_dense.
    bool shard_experts = true;
    NumaDense numa_dense = NumaDense::Interleave;
    // The prepared-weights cache (weights_cache.h): the directory of its entries, "" = off.
    std::string cache_dir;
    // Updated while open() runs (null: not reported).
    std::shared_ptr<LoadProgress> progress;
    // Write a new cache entry from a thread of its own after open() returns (state "writing"
    // until it is done), instead of before: the model serves meanwhile. One thread, not the pool
    // (the forward's). Destroying the model cancels an unfinished write (its temporary file is
    // removed).
    bool cache_write_background = false;
    // A cache hit maps the entry's sections into the arenas where they allow it rather than
    // reading them (read_weights_cache's map: no page zeroed or copied; false: always read).
    bool cache_map = true;
    // A miss with cache_map: the new entry is written while the weights are prepared, into its
    // own pages, which the model then serves from (WeightsCacheWriter); false: prepared into
    // anonymous arenas and written after the load (as where mapping is not possible).
    bool cache_direct = true;
    // Gguf: the matrices and token_embd are served from the GGUF mapping (no arena, no cache).
    WeightsMap weights_map = WeightsMap::Arena;
};

// Where the weights went, for the load log and status. nodes: the pool's NUMA nodes, in slice
// order; per node the routed-expert bytes it holds (0 everywhere when not sharded) and whether its
// arena is bound to it (binding fails on a node the kernel does not have, e.g. a fake topology:
// the slice then stays unbound, `note` says why; the compute partition is the same either way).
struct NumaNodeMemory {
    int node = 0;
    int n_threads = 0;
    uint64_t expert_bytes = 0;
    uint64_t dense_copy_bytes = 0;  // numa.dense: replicate: this node's copy of the dense weights
    bool bound = false;
    std::string note;
};
struct MemoryLayout {
    std::vector<NumaNodeMemory> nodes;
    bool experts_sharded = false;
    std::string dense_policy;     // "local" (one node), "interleave", "replicate"
    std::string dense_note;       // why the policy could not be applied ("" when it was)
    uint64_t dense_bytes = 0;     // arena bytes of the dense (non-expert) prepared weights (replicate: per copy)
    uint64_t embd_bytes = 0;      // arena bytes of token_embd's lookup rows (dense arena, one copy)
    std::string page_kind;        // arena_kind_name of the dense arena ("" when no arena)
    size_t page_size = 0;         // its page size, bytes
    std::string page_reason;      // why better page kinds were not used ("" when the first choice worked)
    // The weights map the load used ("arena" or "gguf"; the requested one unless weights_map_note
    // says why not), the bytes of matrices and token_embd served from the file's mapping (gguf),
    // and which tensors gguf copied rather than served, and why ("" when none).
    std::string weights_map = "arena";
    std::string weights_map_note;
    uint64_t file_bytes = 0;
    std::string file_copy_note;
};

class Model {
public:
    // Opens, checks and prepares. GGUFError names the tensor/key/type on bad input.
    static std::unique_ptr<Model> open(const std::string &path, const ModelOptions &opts = {});
    // Supported architecture names, comma-separated (for messages).
    static std::string supported_archs();
    // The placement class of every tensor of a file that its architecture's table names (reads
    // the header only; GGUFError as open() for an unsupported architecture or bad metadata).
    static std::vector<std::pair<std::string, TensorClass>> tensor_classes(const std::string &path);

    const HParams &hparams() const { return hp_; }
    const ModelWeights &weights() const { return w_; }
    const GGUFFile &file() const { return file_; }
    ThreadPool &pool() const { return *pool_; }
    const ArchSpec &arch() const { return *arch_; }
    uint64_t n_params() const { return n_params_; }
    uint64_t repacked_bytes() const { return repacked_bytes_; }
    // Bytes of tensors copied into the arenas as they are in the file (matrices of types without
    // repacking, token_embd's lookup rows; replicate: one copy counted).
    uint64_t copied_bytes() const { return copied_bytes_; }
    const MemoryLayout &memory() const { return mem_; }
    // What the kernel gives the weights arenas now, summed over them (smaps: Rss, AnonHugePages,
    // Private_Hugetlb, ... in bytes; empty without arenas, model.weights_map: gguf). Read, not
    // assumed: transparent huge pages are a request the kernel may refuse at fault time (a
    // fragmented machine) or undo later (compaction splits them), and a decode streaming 4 KiB
    // pages is slower; page_kind only says what was asked for.
    std::map<std::string, uint64_t> arena_pages() const;
    // What the load did with the prepared-weights cache.
    WeightsCacheStatus cache() const {
        std::lock_guard<std::mutex> l(cache_mu_);
        return cache_;
    }
    ~Model();
    // NUMA slice of worker tid: the index of its node in the pool's nodes (0 on one node), i.e.
    // pool().node_index(tid), kept in tid_slice_ for the per-item loops.
    int n_slices() const { return int(mem_.nodes.size()); }
    int slice_of(int tid) const { return tid_slice_[size_t(tid)]; }

    // The architecture's tensor table for this model's hyperparameters (concrete shapes, classes).
    const TensorTable &tensor_table() const { return table_; }

private:
    friend class WeightLoader;  // model_load.cpp
    Model(GGUFFile file) : file_(std::move(file)) {}
    void init_pool(const ModelOptions &opts);  // the pool and its NUMA slices (mem_.nodes, tid_slice_)
    GGUFFile file_;
    HParams hp_;
    TensorTable table_;
    ModelWeights w_;
    const ArchSpec *arch_ = nullptr;
    std::unique_ptr<ThreadPool> pool_;
    uint64_t n_params_ = 0, repacked_bytes_ = 0, copied_bytes_ = 0;
    MemoryLayout mem_;
    std::vector<std::shared_ptr<const Arena>> arenas_;  // every weights arena (arena_pages)
    WeightsCacheStatus cache_;  // under cache_mu_ once a background write runs
    mutable std::mutex cache_mu_;
    std::atomic<bool> cache_cancel_{false};
    std::thread cache_writer_;
    std::vector<int> tid_slice_;  // [n_threads]
};

}  // namespace ktd
