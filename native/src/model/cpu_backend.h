// The CPU backend: the blocks of backend.h on the weight kernels and the model's thread pool, over
// its own scratch (ForwardScratch) and the host KV caches of its layers (kv_cache.h). Row loops go
// through for_each_row (split over the pool from kMinParallelRows rows on, on the calling thread
// below: a decode row costs less than a hand-over); matrix products are one pool region each
// (matmul, matmul_multi; matmul_pair for an FFN's gate and up, the GLU applied in the same region by
// the worker that computed each row).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/kernels.h"
#include "model/attention.h"
#include "model/backend.h"
#include "model/backend_setup.h"
#include "model/kv_cache.h"
#include "model/moe.h"

namespace ktd {

class Model;
class ThreadPool;
struct HParams;
struct Matrix;
struct MatrixStack;

// Below this many batch rows the per-row work stays on the calling thread (see for_each_row).
constexpr int64_t kMinParallelRows = 32;

// The CPU backend's activations and working memory for a chunk of up to n_batch rows (the residual
// stream X is the chunk's x, begin_chunk's).
struct ForwardScratch {
    std::vector<float> xn, q, k, v, attn, gate, up, tmp;  // [n_batch][...]
    std::vector<float> rope_cs;                // [n_batch][n_rot] cos/sin pairs
    std::vector<float> rope_cs_swa;            // same for sliding-window layers
    std::vector<float> attn_tmp;               // [n_threads][attn_tmp_stride] attention kernel scratch
    size_t attn_tmp_stride = 0;
    AttnPlan attn_plan;                        // CpuBackend::attention's jobs (model/attention.h)
    MatmulScratch mm;
    MoeScratch moe;                            // routed experts (moe_ffn)
    // deepseek2 (MLA) only: q LoRA [n_batch][q_lora_rank], decompressed q [n_batch][n_head·(nope+rope)],
    // a head-major [n_head][n_batch][max(nope, v_head_dim)] buffer for the per-head matmuls, one
    // matmul scratch per thread.
    std::vector<float> mla_q_a, mla_q, mla_heads;
    std::vector<MatmulScratch> mm_thread;
    // Partial results of split key ranges (CpuBackend::attention): [n_part][AttnPlan::part_stride].
    std::vector<float> attn_part;

    ForwardScratch(const HParams &hp, int64_t n_batch, int n_threads);
};

class CpuBackend final : public Backend {
public:
    // Runs layers [layer_begin, layer_end) of the model (layer_end -1: to the last) and holds their
    // KV caches.
    explicit CpuBackend(const BackendSetup &setup, int layer_begin = 0, int layer_end = -1);
    ~CpuBackend() override;

    void begin_chunk(float *x, const int32_t *positions, const int32_t *seq_ids, int64_t n) override;
    void norm(const std::vector<float> &w, Act in, Act out) override;
    void residual_add(Act t) override;
    void attention_in(const LayerWeights &w, int il) override;
    void attention(int il) override;  // attention.cpp
    void attention_out(const LayerWeights &w) override;
    void mla_attention(const LayerWeights &w, int il) override;  // mla.cpp
    void glu_ffn(const LayerWeights &w, Glu act) override;
    void moe_ffn(const LayerWeights &w, int il) override;
    std::vector<LayerMemory *> memory() override;

    // The activation a of the current chunk (LoopbackDevice shares them).
    float *buf(Act a);

private:
    // y [n][rows] = m · x [n][k] (+ bias [rows] on every row when given).
    void linear(const Matrix &m, const float *x, float *y, const std::vector<float> *bias = nullptr);
    // x [n][k] head-major per head of st → y [n_head][n][rows] (mla.cpp).
    void per_head_matmul(const MatrixStack &st, const float *x, int64_t k, float *y, int64_t rows);
    KvCache &cache(int il) { return *kv_[size_t(il - layer_begin_)]; }

    const Model &model_;
    const HParams &hp_;
    ThreadPool &pool_;
    ForwardTaps &taps_;
    int layer_begin_;
    std::vector<std::unique_ptr<KvCache>> kv_;  // [layer_end - layer_begin]
    ForwardScratch s_;
    float *x_ = nullptr;  // [n][n_embd] the chunk's residual stream
    const int32_t *positions_ = nullptr, *seq_ids_ = nullptr;  // [n] of the chunk
    int64_t n_ = 0;
    std::vector<float> moe_after_;  // [n_embd] the recorded residual after an MoE FFN (bench hook)
};

}  // namespace ktd
