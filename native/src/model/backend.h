// The blocks a layer is composed of, behind one interface: an architecture's layer function
// (arch.h) calls these and never touches memory itself, so the same composition runs on any
// backend. The CPU backend (cpu_backend.cpp) is the kernels and the thread pool; an accelerator
// backend implements the same blocks over its own memory.
//
// A backend owns what its blocks compute in: its scratch and the per-sequence memory of the layers
// it runs (sequence_memory.h: a KV cache, MLA's latent cache), which it hands the context as
// LayerMemory. It holds one chunk of n batch rows at a time (Context::forward cuts a batch into
// chunks) and the activations of that chunk, named by Act, each [n][width] F32 row-major:
//   X     [n][n_embd]            the residual stream
//   XN    [n][n_embd]            a normed copy of it, the input of attention and FFN
//   Attn  [n][n_head·head_dim_v] the attention output (MLA: the decompressed values [n][n_head·v_head_dim])
//   Tmp   [n][n_embd]            a block's output on its way into X
// Every block is parallel over the backend's workers; none changes a bit with their number.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/elementwise.h"
#include "model/profile.h"

namespace ktd {

class LayerMemory;
struct LayerWeights;

enum class Act { X, XN, Attn, Tmp };

class Backend {
public:
    virtual ~Backend() = default;

    // The chunk the next blocks run on: n rows at these positions of these sequences. x [n][n_embd]
    // in host memory holds their embeddings, and the final residual after end_chunk (a device
    // backend copies it up here and down there; the CPU's X is x).
    virtual void begin_chunk(float *x, const int32_t *positions, const int32_t *seq_ids, int64_t n) = 0;
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

    // After the chunk's layers: X is back in begin_chunk's x for the output head (a device backend
    // copies it down and waits for its stream). The CPU's X is x: nothing to do.
    virtual void end_chunk() {}

    // The per-sequence memory of the layers this backend runs, one entry per layer in layer order
    // (owned by the backend, valid while it lives).
    virtual std::vector<LayerMemory *> memory() = 0;
};

// The blocks as a layer function calls them: the backend's, each call timed into the profile while
// one is set (null: one pointer test per block, no clock read). The context's layer loop owns it.
class Blocks {
public:
    Blocks(Backend &be, ForwardProfile *profile) : be_(be), p_(profile) {}

    void norm(const std::vector<float> &w, Act in, Act out) {
        OpTimer t(p_, ForwardOp::Norm);
        be_.norm(w, in, out);
    }
    void residual_add(Act a) {
        OpTimer t(p_, ForwardOp::ResidualAdd);
        be_.residual_add(a);
    }
    void attention_in(const LayerWeights &w, int il) {
        OpTimer t(p_, ForwardOp::AttentionIn);
        be_.attention_in(w, il);
    }
    void attention(int il) {
        OpTimer t(p_, ForwardOp::Attention);
        be_.attention(il);
    }
    void attention_out(const LayerWeights &w) {
        OpTimer t(p_, ForwardOp::AttentionOut);
        be_.attention_out(w);
    }
    void mla_attention(const LayerWeights &w, int il) {
        OpTimer t(p_, ForwardOp::MlaAttention);
        be_.mla_attention(w, il);
    }
    void glu_ffn(const LayerWeights &w, Glu act) {
        OpTimer t(p_, ForwardOp::GluFfn);
        be_.glu_ffn(w, act);
    }
    void moe_ffn(const LayerWeights &w, int il) {
        OpTimer t(p_, ForwardOp::MoeFfn);
        be_.moe_ffn(w, il);
    }

private:
    Backend &be_;
    ForwardProfile *p_;
};

}  // namespace ktd
