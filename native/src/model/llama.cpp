// llama (and Mistral-style), qwen2 (QKV biases), qwen3 (per-head q/k RMSNorm): one pre-norm
// decoder layer — RMSNorm → GQA attention with RoPE → residual → RMSNorm → SwiGLU FFN → residual.
//   x [n][n_embd] → q [n][n_head·hd] k [n][n_head_kv·hd] v [n][n_head_kv·hd] → attn [n][n_head·hd]
//   → x += wo·attn;  x += w_down·(silu(w_gate·xn) ⊙ w_up·xn),  gate/up [n][n_ff]
#include "model/blocks.h"
#include "model/model.h"

namespace ktd {

namespace {

// Below this many batch rows the per-row work stays on the calling thread (see for_each_row).
constexpr int64_t kMinParallelRows = 32;

void llama_layer(Context &ctx, const LayerWeights &w, int il, const Batch &b, int64_t r0, int64_t n) {
    const HParams &hp = ctx.model().hparams();
    ForwardScratch &s = ctx.scratch();
    ThreadPool &pool = ctx.model().pool();
    const int64_t E = hp.n_embd, hd = hp.head_dim_k;

    for_each_row(pool, n, kMinParallelRows, [&](int64_t i) {
        rms_norm(&s.x[size_t(i * E)], w.attn_norm.data(), &s.xn[size_t(i * E)], E, hp.norm_eps);
    });
    ctx.linear(w.wq, s.xn.data(), n, s.q.data(), &w.bq);
    ctx.linear(w.wk, s.xn.data(), n, s.k.data(), &w.bk);
    ctx.linear(w.wv, s.xn.data(), n, s.v.data(), &w.bv);
    for_each_row(pool, n, kMinParallelRows, [&](int64_t i) {
        float *qi = &s.q[size_t(i * hp.n_embd_q())], *ki = &s.k[size_t(i * hp.n_embd_k_gqa())];
        if (!w.attn_q_norm.empty()) {  // qwen3: RMSNorm over each head before RoPE
            for (int h = 0; h < hp.n_head; ++h) rms_norm(qi + h * hd, w.attn_q_norm.data(), qi + h * hd, hd, hp.norm_eps);
            for (int h = 0; h < hp.n_head_kv; ++h) rms_norm(ki + h * hd, w.attn_k_norm.data(), ki + h * hd, hd, hp.norm_eps);
        }
        const float *cs = &s.rope_cs[size_t(i * hp.rope.n_rot)];
        rope_apply(hp.rope, cs, qi, hp.n_head, hd);
        rope_apply(hp.rope, cs, ki, hp.n_head_kv, hd);
        for (int64_t d = 0; d < hp.n_embd_q(); ++d) qi[d] *= hp.attn_scale;
    });
    ctx.attention(il, b.positions + r0, b.seq_ids + r0, n);
    ctx.linear(w.wo, s.attn.data(), n, s.tmp.data(), &w.bo);
    // Residual add, then the FFN's norm of the same row.
    for_each_row(pool, n, kMinParallelRows, [&](int64_t i) {
        float *xi = &s.x[size_t(i * E)];
        const float *ti = &s.tmp[size_t(i * E)];
        for (int64_t d = 0; d < E; ++d) xi[d] += ti[d];
        rms_norm(xi, w.ffn_norm.data(), &s.xn[size_t(i * E)], E, hp.norm_eps);
    });
    ctx.linear(w.ffn_gate, s.xn.data(), n, s.gate.data());
    ctx.linear(w.ffn_up, s.xn.data(), n, s.up.data());
    for_each_row(pool, n, kMinParallelRows, [&](int64_t i) {
        swiglu(&s.gate[size_t(i * hp.n_ff)], &s.up[size_t(i * hp.n_ff)], hp.n_ff);
    });
    ctx.linear(w.ffn_down, s.gate.data(), n, s.tmp.data());
    for_each_row(pool, n, kMinParallelRows, [&](int64_t i) {
        float *xi = &s.x[size_t(i * E)];
        const float *ti = &s.tmp[size_t(i * E)];
        for (int64_t d = 0; d < E; ++d) xi[d] += ti[d];
    });
}

// llama.cpp's converter permutes llama's q/k rows for the adjacent-pair rotation; qwen2/qwen3
// keep the half-split (NeoX) layout.
void tune_norm_rope(HParams &hp, const GGUFFile &) { hp.rope.type = hp.rope_swa.type = RopeType::Norm; }
void tune_neox_rope(HParams &hp, const GGUFFile &) { hp.rope.type = hp.rope_swa.type = RopeType::Neox; }

std::vector<TensorSpec> llama_tensors(bool bias_required, bool qk_norm) {
    using D = Dim;
    std::vector<TensorSpec> t = {
        C("token_embd.weight", D::Embd, D::Vocab, kRequired, Placement::Input),
        G("output_norm.weight", D::Embd, D::One, kRequired, Placement::Output, &ModelWeights::output_norm),
        G("output.weight", D::Embd, D::Vocab, kOptional, Placement::Output, &ModelWeights::output),
        G("rope_freqs.weight", D::RotHalf, D::One, kOptional, Placement::Input, &ModelWeights::rope_freqs),
        L("blk.%d.attn_norm.weight", D::Embd, D::One, kRequired, &LayerWeights::attn_norm),
        L("blk.%d.attn_q.weight", D::Embd, D::EmbdQ, kRequired, &LayerWeights::wq),
        L("blk.%d.attn_k.weight", D::Embd, D::EmbdKGqa, kRequired, &LayerWeights::wk),
        L("blk.%d.attn_v.weight", D::Embd, D::EmbdVGqa, kRequired, &LayerWeights::wv),
        L("blk.%d.attn_output.weight", D::EmbdAttnOut, D::Embd, kRequired, &LayerWeights::wo),
        L("blk.%d.attn_q.bias", D::EmbdQ, D::One, bias_required, &LayerWeights::bq),
        L("blk.%d.attn_k.bias", D::EmbdKGqa, D::One, bias_required, &LayerWeights::bk),
        L("blk.%d.attn_v.bias", D::EmbdVGqa, D::One, bias_required, &LayerWeights::bv),
        L("blk.%d.attn_output.bias", D::Embd, D::One, kOptional, &LayerWeights::bo),
        L("blk.%d.ffn_norm.weight", D::Embd, D::One, kRequired, &LayerWeights::ffn_norm),
        L("blk.%d.ffn_gate.weight", D::Embd, D::FF, kRequired, &LayerWeights::ffn_gate),
        L("blk.%d.ffn_up.weight", D::Embd, D::FF, kRequired, &LayerWeights::ffn_up),
        L("blk.%d.ffn_down.weight", D::FF, D::Embd, kRequired, &LayerWeights::ffn_down),
    };
    if (qk_norm) {
        t.push_back(L("blk.%d.attn_q_norm.weight", D::HeadK, D::One, kRequired, &LayerWeights::attn_q_norm));
        t.push_back(L("blk.%d.attn_k_norm.weight", D::HeadK, D::One, kRequired, &LayerWeights::attn_k_norm));
    }
    return t;
}

}  // namespace

const ArchSpec kArchLlama{"llama", llama_tensors(kOptional, false), tune_norm_rope, llama_layer};
const ArchSpec kArchQwen2{"qwen2", llama_tensors(kRequired, false), tune_neox_rope, llama_layer};
const ArchSpec kArchQwen3{"qwen3", llama_tensors(kOptional, true), tune_neox_rope, llama_layer};

}  // namespace ktd
