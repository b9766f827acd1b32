// gemma3: pre- and post-norms around attention and FFN, per-head q/k RMSNorm, GeGLU, embeddings
// scaled by sqrt(n_embd), tied output head, optional final logit soft-capping; sliding-window
// layers (window n_swa, their own rope base, unscaled) interleaved with global layers.
//   x [n][n_embd] → q [n][n_head·hd] k,v [n][n_head_kv·hd] → attn [n][n_head·hd]
//   → x += post_attention_norm(wo·attn);  x += post_ffw_norm(w_down·(gelu(w_gate·xn) ⊙ w_up·xn))
// GGUF norm weights already hold Gemma's (1 + w) (added by the converter).
#include <cmath>

#include "common/error.h"
#include "gguf/gguf_file.h"
#include "kernels/kernels.h"
#include "model/blocks.h"
#include "model/model.h"

namespace ktd {

namespace {

void gemma3_layer(Context &ctx, const LayerWeights &w, int il, const Batch &b, int64_t r0, int64_t n) {
    const HParams &hp = ctx.model().hparams();
    ForwardScratch &s = ctx.scratch();
    const int64_t E = hp.n_embd, hd = hp.head_dim_k;
    const bool swa = hp.layer_swa[size_t(il)];
    const RopeParams &rp = swa ? hp.rope_swa : hp.rope;
    const std::vector<float> &cs_all = swa ? s.rope_cs_swa : s.rope_cs;

    for (int64_t i = 0; i < n; ++i) rms_norm(&s.x[size_t(i * E)], w.attn_norm.data(), &s.xn[size_t(i * E)], E, hp.norm_eps);
    // Q, K and V read the same input: one pool region (matmul_multi) instead of three.
    const MatmulJob qkv[] = {{&w.wq.pw, s.q.data(), nullptr}, {&w.wk.pw, s.k.data(), nullptr}, {&w.wv.pw, s.v.data(), nullptr}};
    matmul_multi(&ctx.model().pool(), qkv, 3, s.xn.data(), n, s.mm);
    for (int64_t i = 0; i < n; ++i) {
        float *qi = &s.q[size_t(i * hp.n_embd_q())], *ki = &s.k[size_t(i * hp.n_embd_k_gqa())];
        for (int h = 0; h < hp.n_head; ++h) rms_norm(qi + h * hd, w.attn_q_norm.data(), qi + h * hd, hd, hp.norm_eps);
        for (int h = 0; h < hp.n_head_kv; ++h) rms_norm(ki + h * hd, w.attn_k_norm.data(), ki + h * hd, hd, hp.norm_eps);
        const float *cs = &cs_all[size_t(i * rp.n_rot)];
        rope_apply(rp, cs, qi, hp.n_head, hd);
        rope_apply(rp, cs, ki, hp.n_head_kv, hd);
        for (int64_t d = 0; d < hp.n_embd_q(); ++d) qi[d] *= hp.attn_scale;
    }
    ctx.attention(il, b.positions + r0, b.seq_ids + r0, n);
    ctx.linear(w.wo, s.attn.data(), n, s.tmp.data());
    for (int64_t i = 0; i < n; ++i) {
        rms_norm(&s.tmp[size_t(i * E)], w.post_attention_norm.data(), &s.tmp[size_t(i * E)], E, hp.norm_eps);
        for (int64_t d = 0; d < E; ++d) s.x[size_t(i * E + d)] += s.tmp[size_t(i * E + d)];
    }

    for (int64_t i = 0; i < n; ++i) rms_norm(&s.x[size_t(i * E)], w.ffn_norm.data(), &s.xn[size_t(i * E)], E, hp.norm_eps);
    const MatmulJob gate_up[] = {{&w.ffn_gate.pw, s.gate.data(), nullptr}, {&w.ffn_up.pw, s.up.data(), nullptr}};
    matmul_multi(&ctx.model().pool(), gate_up, 2, s.xn.data(), n, s.mm);
    geglu(s.gate.data(), s.up.data(), n * hp.n_ff);
    ctx.linear(w.ffn_down, s.gate.data(), n, s.tmp.data());
    for (int64_t i = 0; i < n; ++i) {
        rms_norm(&s.tmp[size_t(i * E)], w.post_ffw_norm.data(), &s.tmp[size_t(i * E)], E, hp.norm_eps);
        for (int64_t d = 0; d < E; ++d) s.x[size_t(i * E + d)] += s.tmp[size_t(i * E + d)];
    }
}

// llama.cpp's gemma3 defaults where the file is silent: 5 sliding layers then 1 global, local
// rope base 10000 without scaling.
constexpr int kSwaPattern = 6;
constexpr float kFreqBaseSwa = 10000.0f;

void tune_gemma3(HParams &hp, const GGUFFile &f) {
    const std::string p = hp.arch + ".";
    hp.rope.type = hp.rope_swa.type = RopeType::Neox;
    hp.embd_scale = std::sqrt(float(hp.n_embd));
    // Gemma 3 27B (62 layers) scales queries by 1/sqrt(n_embd/n_head) (query_pre_attn_scalar);
    // the other sizes by 1/sqrt(head_dim). The file does not carry it; llama.cpp decides the same way.
    hp.attn_scale = hp.n_layer == 62 ? 1.0f / std::sqrt(float(hp.n_embd / hp.n_head))
                                     : 1.0f / std::sqrt(float(hp.head_dim_k));
    hp.final_logit_softcap = gguf_get_float_or(f, p + "final_logit_softcapping", 0.0f);
    hp.rope_swa.freq_base = gguf_get_float_or(f, p + "rope.freq_base_swa", kFreqBaseSwa);
    hp.rope_swa.freq_scale = 1.0f;
    hp.rope_swa.scaling = RopeScaling::None;
    hp.rope_swa.attn_factor = 1.0f;
    hp.n_swa = int(gguf_get_uint_or(f, p + "attention.sliding_window", 0));
    if (hp.n_swa <= 0) return;  // every layer global
    const std::string key = p + "attention.sliding_window_pattern";
    if (const GGUFKeyValue *kv = f.find_key(key)) {
        const GGUFArray *a = std::get_if<GGUFArray>(&kv->value);
        if (!a || a->elem_type != GGUFValueType::BOOL || a->size != uint64_t(hp.n_layer))
            throw GGUFError("metadata key " + key + " must be an array of " + std::to_string(hp.n_layer) + " bools");
        for (int il = 0; il < hp.n_layer; ++il) hp.layer_swa[size_t(il)] = a->element<uint8_t>(uint64_t(il)) != 0;
    } else {
        for (int il = 0; il < hp.n_layer; ++il) hp.layer_swa[size_t(il)] = il % kSwaPattern < kSwaPattern - 1;
    }
}

std::vector<TensorSpec> gemma3_tensors() {
    using D = Dim;
    return {
        C("token_embd.weight", D::Embd, D::Vocab, kRequired, Placement::Input),
        G("output_norm.weight", D::Embd, D::One, kRequired, Placement::Output, &ModelWeights::output_norm),
        G("output.weight", D::Embd, D::Vocab, kOptional, Placement::Output, &ModelWeights::output),
        L("blk.%d.attn_norm.weight", D::Embd, D::One, kRequired, &LayerWeights::attn_norm),
        L("blk.%d.attn_q.weight", D::Embd, D::EmbdQ, kRequired, &LayerWeights::wq),
        L("blk.%d.attn_k.weight", D::Embd, D::EmbdKGqa, kRequired, &LayerWeights::wk),
        L("blk.%d.attn_v.weight", D::Embd, D::EmbdVGqa, kRequired, &LayerWeights::wv),
        L("blk.%d.attn_q_norm.weight", D::HeadK, D::One, kRequired, &LayerWeights::attn_q_norm),
        L("blk.%d.attn_k_norm.weight", D::HeadK, D::One, kRequired, &LayerWeights::attn_k_norm),
        L("blk.%d.attn_output.weight", D::EmbdAttnOut, D::Embd, kRequired, &LayerWeights::wo),
        L("blk.%d.post_attention_norm.weight", D::Embd, D::One, kRequired, &LayerWeights::post_attention_norm),
        L("blk.%d.ffn_norm.weight", D::Embd, D::One, kRequired, &LayerWeights::ffn_norm),
        L("blk.%d.ffn_gate.weight", D::Embd, D::FF, kRequired, &LayerWeights::ffn_gate),
        L("blk.%d.ffn_up.weight", D::Embd, D::FF, kRequired, &LayerWeights::ffn_up),
        L("blk.%d.ffn_down.weight", D::FF, D::Embd, kRequired, &LayerWeights::ffn_down),
        L("blk.%d.post_ffw_norm.weight", D::Embd, D::One, kRequired, &LayerWeights::post_ffw_norm),
    };
}

}  // namespace

const ArchSpec kArchGemma3{"gemma3", gemma3_tensors(), tune_gemma3, gemma3_layer};

}  // namespace ktd
