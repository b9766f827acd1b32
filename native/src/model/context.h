// A Context runs batches through a Model: it checks a batch against the sequence slots, cuts it
// into chunks of n_batch rows, embeds each chunk, runs it through the layers on its backend
// (backend.h) and computes the output head. The backend owns the scratch and the per-sequence
// memory of its layers (a KV cache, MLA's latent cache; sequence_memory.h); the context keeps
// only the slots' lengths over it and hands the backend the taps it reports into.
#pragma once
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "model/backend_setup.h"
#include "model/profile.h"
#include "model/sequence_memory.h"
#include "sampling/greedy.h"

namespace ktd {

class Backend;
class HybridBackend;
class Model;
struct HybridStats;

// A position at or beyond the context limit. Python: ktd._native.ContextOverflow.
struct ContextOverflowError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// One batch row per token: (token, position, sequence id, wants logits).
struct Batch {
    const int32_t *tokens = nullptr, *positions = nullptr, *seq_ids = nullptr;
    const uint8_t *want_logits = nullptr;
    int64_t n = 0;
};

class Context {
public:
    // n_ctx: per-sequence limit; n_seq_max: sequence slots; n_batch: rows computed at once (a
    // longer batch is run in chunks of n_batch).
    Context(const Model &model, int64_t n_ctx, int n_seq_max, int64_t n_batch = 512);
    ~Context();

    // Rows of one sequence must have consecutive positions in row order, starting at or before the
    // sequence's current length (starting before it discards the tail). Writes logits of marked
    // rows, in row order, to `logits` [n_marked][n_vocab]. ContextOverflowError if a position is
    // >= n_ctx; std::invalid_argument for any other bad row (nothing is computed then).
    // With `greedy` (then `logits` may be null): also the greedy token of every marked row, in row
    // order, into greedy [n_marked] — the sampler's temperature-0 choice, or a sampling::kGreedy*
    // code where the sampler would reject the logits (sampling/greedy.h) — taken by the output head
    // as it writes each piece of the logits, so no second pass reads them back from memory.
    // With `greedy` and `keep` [n] (a step whose rows are partly sampled by the caller): the greedy
    // token of every marked row into greedy, and into logits [n_kept][n_vocab] the logits of the
    // marked rows i with keep[i] only, in row order (the others' stay in the context's scratch).
    void forward(const Batch &batch, float *logits, int32_t *greedy = nullptr, const uint8_t *keep = nullptr);
    // Perplexity (score.cpp): runs `batch` like forward (its want_logits is ignored) and, for every
    // row i with targets[i] >= 0, writes -log softmax(logits of row i)[targets[i]] to nll[k], k the
    // rank of row i among those rows. The logits stay here: rows are run in pieces of at most
    // n_batch rows and kScoreRows scored rows, each piece's scored logits reduced to one number per
    // row. std::invalid_argument for a target outside [-1, n_vocab) or a bad row, before any row runs.
    static constexpr int64_t kScoreRows = 128;
    void score(const Batch &batch, const int32_t *targets, double *nll);
    // The backend's sequence memory (SequenceMemory: the ids and n_tokens checked).
    void free_seq(int seq_id) { mem_->free_seq(seq_id); }
    void copy_seq(int src, int dst, int64_t n_tokens) { mem_->copy_seq(src, dst, n_tokens); }
    int64_t seq_len(int seq_id) const;

    const Model &model() const { return model_; }
    int64_t n_ctx() const { return n_ctx_; }
    int n_seq_max() const { return n_seq_max_; }
    int64_t n_batch() const { return n_batch_; }
    // Bytes of per-sequence memory one token takes over all layers (MLA: the latent and the rope key
    // only).
    int64_t kv_bytes_per_token() const { return mem_->bytes_per_token(); }

    // Expert statistics: tokens routed to each expert, [n_layer][n_expert] row-major, counted by
    // moe_ffn since creation or the last reset (dense layers stay 0; empty for a dense model).
    const std::vector<uint64_t> &expert_counts() const { return taps_.expert_counts; }
    void reset_expert_counts();
    // What the backends report into (bench and test hooks read and set it: the recorded states).
    ForwardTaps &taps() { return taps_; }

    // The backend the layers run on: "cpu" (the default) or "loopback" (the hybrid data flow of
    // model/hybrid_backend.h with the device played by the CPU). std::invalid_argument otherwise.
    // layers (loopback): the first `layers` layers through the hybrid data flow, the others on the
    // CPU backend (0: all).
    // experts (loopback): the routed experts the device holds per layer (hybrid_backend.h).
    // A new backend holds its own sequence memory: the sequences held so far are dropped.
    void set_backend(const std::string &name, int layers = 0, const HeldExperts &experts = {});
    // The hybrid forward on a CUDA device (model/cuda_device.h): "cuda" (libktd_cuda.so) or
    // "cuda-emulated" (its ABI emulated on the host: tests), device index, VRAM budget in bytes
    // (0: the device's). The device holds its own KV cache: sequences held so far are dropped.
    // DeviceError / DeviceMemoryError (the context unchanged) when it cannot be used.
    // layers: the first `layers` layers on the device, the others on the CPU (gpu.layers; 0: all).
    // experts: the routed experts it holds and computes per layer (gpu.experts; hybrid_backend.h).
    void set_device_backend(const std::string &name, int device, uint64_t vram_budget, int layers = 0,
                            const HeldExperts &experts = {});
    const std::string &backend_name() const { return backend_name_; }
    // What crossed between device and host since the hybrid backend was set (zeros on "cpu").
    HybridStats hybrid_stats() const;

    // Per-block timing of every forward while on (model/profile.h); reset() clears the sums.
    void set_profiling(bool on) { taps_.profile = on ? &profile_ : nullptr; }
    bool profiling() const { return taps_.profile != nullptr; }
    const ForwardProfile &profile() const { return profile_; }
    void reset_profile() { profile_.reset(); }

private:
    BackendSetup setup() { return {model_, n_ctx_, n_seq_max_, n_batch_, taps_}; }
    // The backend from now on, with a sequence memory of its own (every slot empty).
    void use_backend(std::unique_ptr<Backend> be, const HybridBackend *hybrid, const std::string &name, int layers,
                     const HeldExperts &experts);
    void forward_chunk(const Batch &b, int64_t r0, int64_t n, float *logits, int32_t *greedy, const uint8_t *keep);
    void embed(const Batch &b, int64_t r0, int64_t n);  // the rows' embeddings into x_
    // The final norm and the output matmul on the chunk's marked rows (greedy ids too when asked;
    // forward's keep).
    void output_head(const Batch &b, int64_t r0, int64_t n, float *logits, int32_t *greedy, const uint8_t *keep);
    // The output matmul of n_out normed rows into logits [n_out][n_vocab] with each row's greedy
    // token taken as the pieces come out, into greedy [n_out].
    void greedy_head(int64_t n_out, float *logits, int32_t *greedy);
    void check_batch(const Batch &b);  // every row of a batch valid (forward's checks)

    const Model &model_;
    int64_t n_ctx_;
    int n_seq_max_;
    int64_t n_batch_;
    ForwardTaps taps_;
    ForwardProfile profile_;
    std::unique_ptr<Backend> backend_;    // the blocks the layers are composed of
    std::unique_ptr<SequenceMemory> mem_;  // over backend_'s layer memory
    std::string backend_name_ = "cpu";
    int backend_layers_ = 0;  // the hybrid backend's device layers as set (0: all)
    HeldExperts backend_experts_;  // and the routed experts its device holds
    const HybridBackend *hybrid_ = nullptr;  // backend_ when it is the hybrid one
    std::vector<int64_t> next_pos_;  // [n_seq_max] check_batch's scratch
    // The chunk's residual stream x [n_batch][n_embd] (embeddings in, the final residual out), and
    // the output head's scratch: the normed marked rows [n_batch][n_embd], a greedy forward's logits
    // [n_marked][n_vocab] and its per-worker argmax views [n_threads][n_marked].
    std::vector<float> x_, head_xn_, greedy_logits_;
    std::vector<sampling::GreedyBest> greedy_best_;
    MatmulScratch head_mm_;
};

}  // namespace ktd
