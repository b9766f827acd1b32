// The llama family: llama (and Mistral-style; Mixtral when llama.expert_count is set), qwen2 (QKV
// biases), qwen3 (per-head q/k RMSNorm), qwen2moe (QKV biases, routed experts + a sigmoid-gated
// shared expert), qwen3moe (q/k norm, routed experts). One pre-norm decoder layer — RMSNorm → GQA
// attention with RoPE → residual → RMSNorm → FFN → residual, the FFN being SwiGLU or, in a layer
// with experts, the MoE FFN (moe.h).
//   x [n][n_embd] → q [n][n_head·hd] k [n][n_head_kv·hd] v [n][n_head_kv·hd] → attn [n][n_head·hd]
//   → x += wo·attn;  x += w_down·(silu(w_gate·xn) ⊙ w_up·xn),  gate/up [n][n_ff]
//                 or x += moe_ffn(xn)
#include "common/error.h"
#include "gguf/gguf_file.h"
#include "kernels/kernels.h"
#include "model/blocks.h"
#include "model/model.h"
#include "model/moe.h"

namespace ktd {

namespace {

// Below this many batch rows the per-row work stays on the calling thread (see for_each_row).
constexpr int64_t kMinParallelRows = 32;

const float *bias_or_null(const std::vector<float> &b) { return b.empty() ? nullptr : b.data(); }

// x [n][n_embd] += t [n][n_embd], row by row.
void add_rows(ThreadPool &pool, float *x, const float *t, int64_t n, int64_t E) {
    for_each_row(pool, n, kMinParallelRows, [&](int64_t i) {
        float *xi = x + i * E;
        const float *ti = t + i * E;
        for (int64_t d = 0; d < E; ++d) xi[d] += ti[d];
    });
}

// x += wo · attention(rope(q), rope(k), v) of rms_norm(x).
void llama_attention(Context &ctx, const LayerWeights &w, int il, const Batch &b, int64_t r0, int64_t n) {
    const HParams &hp = ctx.model().hparams();
    ForwardScratch &s = ctx.scratch();
    ThreadPool &pool = ctx.model().pool();
    const int64_t E = hp.n_embd, hd = hp.head_dim_k;

    for_each_row(pool, n, kMinParallelRows, [&](int64_t i) {
        rms_norm(&s.x[size_t(i * E)], w.attn_norm.data(), &s.xn[size_t(i * E)], E, hp.norm_eps);
    });
    // Q, K and V read the same input: one pool region (matmul_multi) instead of three.
    const MatmulJob qkv[] = {{&w.wq.pw, s.q.data(), bias_or_null(w.bq)},
                             {&w.wk.pw, s.k.data(), bias_or_null(w.bk)},
                             {&w.wv.pw, s.v.data(), bias_or_null(w.bv)}};
    matmul_multi(&pool, qkv, 3, s.xn.data(), n, s.mm);
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
    add_rows(pool, s.x.data(), s.tmp.data(), n, E);
}

// x += FFN(rms_norm(x)): the layer's experts when it has them, else SwiGLU.
void llama_ffn(Context &ctx, const LayerWeights &w, int il, int64_t n) {
    const HParams &hp = ctx.model().hparams();
    ForwardScratch &s = ctx.scratch();
    ThreadPool &pool = ctx.model().pool();
    const int64_t E = hp.n_embd;
    for_each_row(pool, n, kMinParallelRows, [&](int64_t i) {
        rms_norm(&s.x[size_t(i * E)], w.ffn_norm.data(), &s.xn[size_t(i * E)], E, hp.norm_eps);
    });
    if (w.ffn_gate_inp) {
        moe_record_state(ctx, il, 0, &s.x[size_t((n - 1) * E)]);
        moe_ffn(ctx, w, il, s.xn.data(), n, s.tmp.data());
    } else {
        const MatmulJob gate_up[] = {{&w.ffn_gate.pw, s.gate.data(), nullptr}, {&w.ffn_up.pw, s.up.data(), nullptr}};
        matmul_multi(&pool, gate_up, 2, s.xn.data(), n, s.mm);
        for_each_row(pool, n, kMinParallelRows, [&](int64_t i) {
            swiglu(&s.gate[size_t(i * hp.n_ff)], &s.up[size_t(i * hp.n_ff)], hp.n_ff);
        });
        ctx.linear(w.ffn_down, s.gate.data(), n, s.tmp.data());
    }
    add_rows(pool, s.x.data(), s.tmp.data(), n, E);
    if (w.ffn_gate_inp) moe_record_state(ctx, il, 1, &s.x[size_t((n - 1) * E)]);
}

void llama_layer(Context &ctx, const LayerWeights &w, int il, const Batch &b, int64_t r0, int64_t n) {
    llama_attention(ctx, w, il, b, r0, n);
    llama_ffn(ctx, w, il, n);
}

// qwen2/qwen3 (and their MoE variants) keep the half-split (NeoX) rotary layout; llama uses
// adjacent pairs (tune_llama).
void tune_neox_rope(HParams &hp, const GGUFFile &) { hp.rope.type = hp.rope_swa.type = RopeType::Neox; }

// The routing llama.cpp hard-codes for these architectures (build_moe_ffn's gating and norm_w
// arguments), whatever the file says; it does not read expert_weights_scale for them either, but
// it does apply expert_group_count (checked against llama.cpp in tests/test_moe_forward.py).
void set_softmax_routing(HParams &hp, bool weights_norm) {
    hp.moe.gating = ExpertGating::Softmax;
    hp.moe.weights_norm = weights_norm;
    hp.moe.weights_scale = 1.0f;
}

void require_experts(const HParams &hp) {
    if (hp.moe.n_expert == 0) throw GGUFError(hp.arch + " requires metadata key " + hp.arch + ".expert_count > 0");
}

// llama: llama.cpp's converter permutes q/k rows for the adjacent-pair rotation. With
// llama.expert_count, Mixtral: every layer routed, experts as wide as feed_forward_length unless the
// file says otherwise, renormalised softmax top-k.
void tune_llama(HParams &hp, const GGUFFile &f) {
    hp.rope.type = hp.rope_swa.type = RopeType::Norm;
    if (hp.moe.n_expert == 0) return;
    if (!f.find_key("llama.expert_feed_forward_length")) hp.moe.n_ff_exp = hp.n_ff;
    set_softmax_routing(hp, true);
}

// qwen2moe: softmax top-k without renormalisation; the shared expert is feed_forward_length wide
// when the file gives no width of its own (llama.cpp's default).
void tune_qwen2moe(HParams &hp, const GGUFFile &f) {
    tune_neox_rope(hp, f);
    require_experts(hp);
    set_softmax_routing(hp, false);
    if (!f.find_key("qwen2moe.expert_shared_feed_forward_length")) hp.moe.n_ff_shexp = hp.n_ff;
}

// qwen3moe: llama.cpp always renormalises the top-k (Qwen3-MoE's norm_topk_prob is true).
void tune_qwen3moe(HParams &hp, const GGUFFile &f) {
    tune_neox_rope(hp, f);
    require_experts(hp);
    set_softmax_routing(hp, true);
}

enum class Experts { None, Routed, RoutedShared };

std::vector<TensorSpec> llama_tensors(bool bias_required, bool qk_norm, Experts experts = Experts::None) {
    using D = Dim;
    // Without an expert table every layer has the dense FFN, whatever expert_count says.
    const LayerSet dense = experts == Experts::None ? LayerSet::All : LayerSet::Dense;
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
        in_layers(L("blk.%d.ffn_gate.weight", D::Embd, D::FF, kRequired, &LayerWeights::ffn_gate), dense),
        in_layers(L("blk.%d.ffn_up.weight", D::Embd, D::FF, kRequired, &LayerWeights::ffn_up), dense),
        in_layers(L("blk.%d.ffn_down.weight", D::FF, D::Embd, kRequired, &LayerWeights::ffn_down), dense),
    };
    if (qk_norm) {
        t.push_back(L("blk.%d.attn_q_norm.weight", D::HeadK, D::One, kRequired, &LayerWeights::attn_q_norm));
        t.push_back(L("blk.%d.attn_k_norm.weight", D::HeadK, D::One, kRequired, &LayerWeights::attn_k_norm));
    }
    if (experts == Experts::None) return t;
    for (TensorSpec s : {
             L("blk.%d.ffn_gate_inp.weight", D::Embd, D::Expert, kRequired, &LayerWeights::ffn_gate_inp),
             L3("blk.%d.ffn_gate_exps.weight", D::Embd, D::FFExp, D::Expert, kRequired, &LayerWeights::ffn_gate_exps),
             L3("blk.%d.ffn_up_exps.weight", D::Embd, D::FFExp, D::Expert, kRequired, &LayerWeights::ffn_up_exps),
             L3("blk.%d.ffn_down_exps.weight", D::FFExp, D::Embd, D::Expert, kRequired, &LayerWeights::ffn_down_exps),
         })
        t.push_back(in_layers(s, LayerSet::Moe));
    if (experts == Experts::RoutedShared)
        for (TensorSpec s : {
                 L("blk.%d.ffn_gate_inp_shexp.weight", D::Embd, D::One, kRequired, &LayerWeights::ffn_gate_inp_shexp),
                 L("blk.%d.ffn_gate_shexp.weight", D::Embd, D::FFShexp, kRequired, &LayerWeights::ffn_gate_shexp),
                 L("blk.%d.ffn_up_shexp.weight", D::Embd, D::FFShexp, kRequired, &LayerWeights::ffn_up_shexp),
                 L("blk.%d.ffn_down_shexp.weight", D::FFShexp, D::Embd, kRequired, &LayerWeights::ffn_down_shexp),
             })
            t.push_back(in_layers(s, LayerSet::Moe));
    return t;
}

}  // namespace

const ArchSpec kArchLlama{"llama", llama_tensors(kOptional, false, Experts::Routed), tune_llama, llama_layer};
const ArchSpec kArchQwen2{"qwen2", llama_tensors(kRequired, false), tune_neox_rope, llama_layer};
const ArchSpec kArchQwen3{"qwen3", llama_tensors(kOptional, true), tune_neox_rope, llama_layer};
const ArchSpec kArchQwen2Moe{"qwen2moe", llama_tensors(kRequired, false, Experts::RoutedShared), tune_qwen2moe,
                             llama_layer};
const ArchSpec kArchQwen3Moe{"qwen3moe", llama_tensors(kOptional, true, Experts::Routed), tune_qwen3moe, llama_layer};

}  // namespace ktd
