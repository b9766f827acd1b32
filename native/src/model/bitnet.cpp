// bitnet (BitNet b1.58): a llama-style layer with ternary weights, each matmul optionally scaled by
// a per-tensor "*.scale" [1], RMSNorm sub-norms before the attention output and FFN down
// projections, and either SwiGLU or (b1.58 2B4T, `bitnet.hidden_activation = relu2`) squared ReLU.
//   x [n][n_embd] → attn [n][n_head·hd] → sub-norm → x += wo·attn
//   → gate/up [n][n_ff] → act(gate) ⊙ up → sub-norm → x += w_down·(...)
#include "gguf/gguf_file.h"
#include "kernels/kernels.h"
#include "common/error.h"
#include "model/blocks.h"
#include "model/model.h"

namespace ktd {

namespace {

void scale(float *y, int64_t n, float s) {
    if (s != 1.0f)
        for (int64_t j = 0; j < n; ++j) y[j] *= s;
}

void bitnet_layer(Context &ctx, const LayerWeights &w, int il, const Batch &b, int64_t r0, int64_t n) {
    const HParams &hp = ctx.model().hparams();
    ForwardScratch &s = ctx.scratch();
    const int64_t E = hp.n_embd, hd = hp.head_dim_k, n_attn = int64_t(hp.n_head) * hp.head_dim_v;

    for (int64_t i = 0; i < n; ++i) rms_norm(&s.x[size_t(i * E)], w.attn_norm.data(), &s.xn[size_t(i * E)], E, hp.norm_eps);
    // Q, K and V read the same input: one pool region (matmul_multi) instead of three.
    const MatmulJob qkv[] = {{&w.wq.pw, s.q.data(), nullptr}, {&w.wk.pw, s.k.data(), nullptr}, {&w.wv.pw, s.v.data(), nullptr}};
    matmul_multi(&ctx.model().pool(), qkv, 3, s.xn.data(), n, s.mm);
    scale(s.q.data(), n * hp.n_embd_q(), w.wq_scale);
    scale(s.k.data(), n * hp.n_embd_k_gqa(), w.wk_scale);
    scale(s.v.data(), n * hp.n_embd_v_gqa(), w.wv_scale);
    for (int64_t i = 0; i < n; ++i) {
        float *qi = &s.q[size_t(i * hp.n_embd_q())], *ki = &s.k[size_t(i * hp.n_embd_k_gqa())];
        const float *cs = &s.rope_cs[size_t(i * hp.rope.n_rot)];
        rope_apply(hp.rope, cs, qi, hp.n_head, hd);
        rope_apply(hp.rope, cs, ki, hp.n_head_kv, hd);
        for (int64_t d = 0; d < hp.n_embd_q(); ++d) qi[d] *= hp.attn_scale;
    }
    ctx.attention(il, b.positions + r0, b.seq_ids + r0, n);
    for (int64_t i = 0; i < n; ++i)
        rms_norm(&s.attn[size_t(i * n_attn)], w.attn_sub_norm.data(), &s.attn[size_t(i * n_attn)], n_attn, hp.norm_eps);
    ctx.linear(w.wo, s.attn.data(), n, s.tmp.data());
    scale(s.tmp.data(), n * E, w.wo_scale);
    for (int64_t j = 0; j < n * E; ++j) s.x[size_t(j)] += s.tmp[size_t(j)];

    for (int64_t i = 0; i < n; ++i) rms_norm(&s.x[size_t(i * E)], w.ffn_norm.data(), &s.xn[size_t(i * E)], E, hp.norm_eps);
    const MatmulJob gate_up[] = {{&w.ffn_gate.pw, s.gate.data(), nullptr}, {&w.ffn_up.pw, s.up.data(), nullptr}};
    matmul_multi(&ctx.model().pool(), gate_up, 2, s.xn.data(), n, s.mm);
    scale(s.gate.data(), n * hp.n_ff, w.gate_scale);
    scale(s.up.data(), n * hp.n_ff, w.up_scale);
    if (hp.ffn_relu2)
        relu2glu(s.gate.data(), s.up.data(), n * hp.n_ff);
    else
        swiglu(s.gate.data(), s.up.data(), n * hp.n_ff);
    for (int64_t i = 0; i < n; ++i)
        rms_norm(&s.gate[size_t(i * hp.n_ff)], w.ffn_sub_norm.data(), &s.gate[size_t(i * hp.n_ff)], hp.n_ff, hp.norm_eps);
    ctx.linear(w.ffn_down, s.gate.data(), n, s.tmp.data());
    scale(s.tmp.data(), n * E, w.down_scale);
    for (int64_t j = 0; j < n * E; ++j) s.x[size_t(j)] += s.tmp[size_t(j)];
}

void tune_bitnet(HParams &hp, const GGUFFile &f) {
    hp.rope.type = hp.rope_swa.type = RopeType::Neox;
    const std::string key = hp.arch + ".hidden_activation";
    const std::string act = f.find_key(key) ? std::string(f.get_string(key)) : "silu";
    if (act != "silu" && act != "relu2")
        throw GGUFError("unsupported " + key + " '" + act + "' (supported: silu, relu2)");
    hp.ffn_relu2 = act == "relu2";
}

std::vector<TensorSpec> bitnet_tensors() {
    using D = Dim;
    return {
        C("token_embd.weight", D::Embd, D::Vocab, kRequired, Placement::Input),
        G("output_norm.weight", D::Embd, D::One, kRequired, Placement::Output, &ModelWeights::output_norm),
        G("output.weight", D::Embd, D::Vocab, kOptional, Placement::Output, &ModelWeights::output),
        L("blk.%d.attn_norm.weight", D::Embd, D::One, kRequired, &LayerWeights::attn_norm),
        L("blk.%d.attn_q.weight", D::Embd, D::EmbdQ, kRequired, &LayerWeights::wq),
        L("blk.%d.attn_k.weight", D::Embd, D::EmbdKGqa, kRequired, &LayerWeights::wk),
        L("blk.%d.attn_v.weight", D::Embd, D::EmbdVGqa, kRequired, &LayerWeights::wv),
        L("blk.%d.attn_output.weight", D::EmbdAttnOut, D::Embd, kRequired, &LayerWeights::wo),
        L("blk.%d.attn_sub_norm.weight", D::EmbdAttnOut, D::One, kRequired, &LayerWeights::attn_sub_norm),
        L("blk.%d.attn_q.scale", D::One, D::One, kOptional, &LayerWeights::wq_scale),
        L("blk.%d.attn_k.scale", D::One, D::One, kOptional, &LayerWeights::wk_scale),
        L("blk.%d.attn_v.scale", D::One, D::One, kOptional, &LayerWeights::wv_scale),
        L("blk.%d.attn_output.scale", D::One, D::One, kOptional, &LayerWeights::wo_scale),
        L("blk.%d.ffn_norm.weight", D::Embd, D::One, kRequired, &LayerWeights::ffn_norm),
        L("blk.%d.ffn_gate.weight", D::Embd, D::FF, kRequired, &LayerWeights::ffn_gate),
        L("blk.%d.ffn_up.weight", D::Embd, D::FF, kRequired, &LayerWeights::ffn_up),
        L("blk.%d.ffn_down.weight", D::FF, D::Embd, kRequired, &LayerWeights::ffn_down),
        L("blk.%d.ffn_sub_norm.weight", D::FF, D::One, kRequired, &LayerWeights::ffn_sub_norm),
        L("blk.%d.ffn_gate.scale", D::One, D::One, kOptional, &LayerWeights::gate_scale),
        L("blk.%d.ffn_up.scale", D::One, D::One, kOptional, &LayerWeights::up_scale),
        L("blk.%d.ffn_down.scale", D::One, D::One, kOptional, &LayerWeights::down_scale),
    };
}

}  // namespace

const ArchSpec kArchBitnet{"bitnet", bitnet_tensors(), tune_bitnet, bitnet_layer};

}  // namespace ktd
