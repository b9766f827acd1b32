// Where a forward's time goes, block by block: the layer loop times each block call (Blocks in
// backend.h, while profiling is on), the context times the parts of the forward outside the layers
// (embedding, output head) and the whole forward. Off by default: nothing is timed then.
// "embed" is the rows' embeddings and the chunk's hand-over to the backend (Backend::begin_chunk:
// the rotary angles on the CPU, the copies up on a device).
//
// Times are wall-clock nanoseconds of the calling thread, which waits for the pool inside every
// block, so a block's time includes its hand-over to the workers and the wait for the slowest one.
// Everything the forward does outside these blocks is the forward's time minus their sum.
//
// Three parts of moe_ffn are timed inside it, on its one-token (decode) path only: moe_router (the
// router rows, the barrier after them, the routing), moe_gate_up (this thread's gate/up items and
// its wait at the barrier after them) and moe_down (its down items and row sums), each from the
// calling thread's point of view (tid 0 of the layer's one pool region). moe_ffn minus the three
// is the region's set-up, hand-over and the wait for the last worker. Four parts of mla_attention
// (the CPU backend's, every batch size): mla_project (the query's and the latent's projections,
// the q LoRA's norm and up-projection), mla_absorb (norm and rope of the new cache rows, the
// per-head wk_b that takes the query into the latent space, the scaled query), mla_cache (the
// attention over the latent cache) and mla_decompress (the per-head wv_b back out of it). None of
// these parts are blocks of their own: a sum over the blocks leaves them out.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>

namespace ktd {

enum class ForwardOp : int {
    Embed, Norm, ResidualAdd, AttentionIn, Attention, AttentionOut, MlaAttention, GluFfn, MoeFfn,
    OutputHead, Forward, MoeRouter, MoeGateUp, MoeDown, MlaProject, MlaAbsorb, MlaCache, MlaDecompress, kCount
};
inline constexpr int kForwardOps = int(ForwardOp::kCount);

inline const char *forward_op_name(ForwardOp op) {
    static constexpr const char *names[kForwardOps] = {
        "embed", "norm", "residual_add", "attention_in", "attention", "attention_out", "mla_attention",
        "glu_ffn", "moe_ffn", "output_head", "forward", "moe_router", "moe_gate_up", "moe_down",
        "mla_project", "mla_absorb", "mla_cache", "mla_decompress"};
    return names[int(op)];
}

struct ForwardProfile {
    std::array<uint64_t, kForwardOps> ns{}, calls{};
    void reset() { ns.fill(0); calls.fill(0); }
};

// Adds the time from construction to destruction to one entry of a profile (none when null).
class OpTimer {
public:
    OpTimer(ForwardProfile *p, ForwardOp op) : p_(p), op_(op) {
        if (p_) t0_ = std::chrono::steady_clock::now();
    }
    ~OpTimer() {
        if (!p_) return;
        const auto dt = std::chrono::steady_clock::now() - t0_;
        p_->ns[size_t(op_)] += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count());
        p_->calls[size_t(op_)] += 1;
    }
    OpTimer(const OpTimer &) = delete;
    OpTimer &operator=(const OpTimer &) = delete;

private:
    ForwardProfile *p_;
    ForwardOp op_;
    std::chrono::steady_clock::time_point t0_{};
};

}  // namespace ktd
