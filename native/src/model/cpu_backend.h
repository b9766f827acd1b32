// The CPU backend: the blocks of backend.h on the weight kernels and the context's thread pool,
// over the activations in the context's ForwardScratch. Row loops go through for_each_row (split
// over the pool from kMinParallelRows rows on, on the calling thread below: a decode row costs less
// than a hand-over); matrix products are one pool region each (matmul, matmul_multi; matmul_pair for
// an FFN's gate and up, the GLU applied in the same region by the worker that computed each row).
#pragma once
#include <cstdint>
#include <vector>

#include "model/backend.h"

namespace ktd {

class Context;
class ThreadPool;
struct ForwardScratch;
struct HParams;
struct MatrixStack;

// Below this many batch rows the per-row work stays on the calling thread (see for_each_row).
constexpr int64_t kMinParallelRows = 32;

class CpuBackend final : public Backend {
public:
    explicit CpuBackend(Context &ctx);

    void begin_chunk(const int32_t *positions, const int32_t *seq_ids, int64_t n) override;
    void norm(const std::vector<float> &w, Act in, Act out) override;
    void residual_add(Act t) override;
    void attention_in(const LayerWeights &w, int il) override;
    void attention(int il) override;
    void attention_out(const LayerWeights &w) override;
    void mla_attention(const LayerWeights &w, int il) override;  // mla.cpp
    void glu_ffn(const LayerWeights &w, Glu act) override;
    void moe_ffn(const LayerWeights &w, int il) override;

    // The activation a in the context's ForwardScratch (LoopbackDevice shares it).
    float *buf(Act a);

private:
    // x [n][k] head-major per head of st → y [n_head][n][rows] (mla.cpp).
    void per_head_matmul(const MatrixStack &st, const float *x, int64_t k, float *y, int64_t rows);

    Context &ctx_;
    const HParams &hp_;
    ThreadPool &pool_;
    ForwardScratch &s_;
    const int32_t *positions_ = nullptr, *seq_ids_ = nullptr;  // [n] of the chunk
    int64_t n_ = 0;
    std::vector<float> moe_after_;  // [n_embd] the recorded residual after an MoE FFN (bench hook)
};

}  // namespace ktd
