// Where a forward's time goes, block by block: a Backend that times each call of the backend it
// wraps (the decorator Context::forward uses while profiling is on), plus the parts of the forward
// outside the layers (embedding, output head) and the whole forward. Off by default: the layers
// then call the CPU backend directly and nothing is timed.
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

#include "model/backend.h"

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

class ProfilingBackend final : public Backend {
public:
    ProfilingBackend(Backend &inner, ForwardProfile &p) : in_(inner), p_(p) {}

    void begin_chunk(const int32_t *positions, const int32_t *seq_ids, int64_t n) override {
        in_.begin_chunk(positions, seq_ids, n);
    }
    void norm(const std::vector<float> &w, Act in, Act out) override {
        OpTimer t(&p_, ForwardOp::Norm);
        in_.norm(w, in, out);
    }
    void residual_add(Act t) override {
        OpTimer tm(&p_, ForwardOp::ResidualAdd);
        in_.residual_add(t);
    }
    void attention_in(const LayerWeights &w, int il) override {
        OpTimer t(&p_, ForwardOp::AttentionIn);
        in_.attention_in(w, il);
    }
    void attention(int il) override {
        OpTimer t(&p_, ForwardOp::Attention);
        in_.attention(il);
    }
    void attention_out(const LayerWeights &w) override {
        OpTimer t(&p_, ForwardOp::AttentionOut);
        in_.attention_out(w);
    }
    void mla_attention(const LayerWeights &w, int il) override {
        OpTimer t(&p_, ForwardOp::MlaAttention);
        in_.mla_attention(w, il);
    }
    void glu_ffn(const LayerWeights &w, Glu act) override {
        OpTimer t(&p_, ForwardOp::GluFfn);
        in_.glu_ffn(w, act);
    }
    void moe_ffn(const LayerWeights &w, int il) override {
        OpTimer t(&p_, ForwardOp::MoeFfn);
        in_.moe_ffn(w, il);
    }
    void begin_layer(int il) override { in_.begin_layer(il); }
    void end_chunk() override { in_.end_chunk(); }
    void copy_kv(int src, int dst, int64_t n_tokens) override { in_.copy_kv(src, dst, n_tokens); }

private:
    Backend &in_;
    ForwardProfile &p_;
};

}  // namespace ktd
