// The blocks a layer is composed of, behind one interface: an architecture's layer function
// (arch.h) calls these and never touches memory itself, so the same composition runs on any
// backend. The CPU backend (cpu_backend.cpp) is the kernels and the thread pool; an accelerator
// backend implements the same blocks over its own memory.
//
// A backend holds one chunk of n batch rows at a time (Context::forward cuts a batch into chunks)
// and the activations of that chunk, named by Act, each [n][width] F32 row-major:
//   X     [n][n_embd]            the residual stream
//   XN    [n][n_embd]            a normed copy of it, the input of attention and FFN
//   Attn  [n][n_head·head_dim_v] the attention output (MLA: the decompressed values [n][n_head·v_head_dim])
//   Tmp   [n][n_embd]            a block's output on its way into X
// Every block is parallel over the backend's workers; none changes a bit with their number.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/elementwise.h"

namespace ktd {

struct LayerWeights;

enum class Act { X, XN, Attn, Tmp };

class Backend {
public:
    virtual ~Backend() = default;

    // The chunk the next blocks run on: n rows at these positions of these sequences (the
    // activations X already hold their embeddings).
    virtual void begin_chunk(const int32_t *positions, const int32_t *seq_ids, int64_t n) = 0;
    // Layer il's blocks come next (Context::forward_chunk calls it before each layer, in order): a
    // backend that runs its layers in two places (HybridBackend with gpu.layers) switches here.
    virtual void begin_layer(int /*il*/) {}

    // Rows of act: y = x / sqrt(mean(x²) + eps) · w, w [width of act]; out may be in.
    virtual void norm(const std::vector<float> &w, Act in, Act out) = 0;
    // X += t.
    virtual void residual_add(Act t) = 0;

    // XN → q, k, v of layer il: the projections (+ biases, × the tensors' scales), per-head q/k
    // norms when the layer has them, RoPE (the sliding-window layer's own when it is one), and q
    // scaled by attn_scale.
    virtual void attention_in(const LayerWeights &w, int il) = 0;
    // q, k, v → Attn: this chunk's K/V into layer il's cache, softmax(q·kᵀ)·v over each row's keys.
    virtual void attention(int il) = 0;
    // Attn → Tmp: wo · attn (+ bo, × wo's scale).
    virtual void attention_out(const LayerWeights &w) = 0;
    // Multi-head latent attention (deepseek2): XN → Attn, through the latent KV cache of layer il.
    virtual void mla_attention(const LayerWeights &w, int il) = 0;

    // XN → Tmp: down · (act(gate · xn) ⊙ up · xn), × the tensors' scales, the intermediate
    // RMS-normed by ffn_sub_norm when the layer has one (bitnet).
    virtual void glu_ffn(const LayerWeights &w, Glu act) = 0;
    // XN → Tmp: routed experts (+ shared) of layer il (moe.h).
    virtual void moe_ffn(const LayerWeights &w, int il) = 0;

    // After the chunk's layers: X is back in the context's scratch for the output head (a device
    // backend copies it down and waits for its stream). The CPU's X is the scratch: nothing to do.
    virtual void end_chunk() {}
    // Context::copy_seq on a KV cache the backend holds itself (a device's): the first n_tokens
    // rows of sequence src copied to dst in every layer. The CPU backend uses the context's cache.
    virtual void copy_kv(int /*src*/, int /*dst*/, int64_t /*n_tokens*/) {}
};

}  // namespace ktd
