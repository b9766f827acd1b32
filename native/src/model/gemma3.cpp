// gemma3: pre- and post-norms around attention and FFN, per-head q/k RMSNorm, GeGLU, embeddings
// scaled by sqrt(n_embd), tied output head, optional final logit soft-capping; sliding-window
// layers (window n_swa, their own rope base, unscaled) interleaved with global layers.
//   x [n][n_embd] → q [n][n_head·hd] k,v [n][n_head_kv·hd] → attn [n][n_head·hd]
//   → x += post_attention_norm(wo·attn);  x += post_ffw_norm(w_down·(gelu(w_gate·xn) ⊙ w_up·xn))
// GGUF norm weights already hold Gemma's (1 + w) (added by the converter).
#include <cmath>

#include "common/error.h"
#include "gguf/gguf_file.h"
#include "model/arch.h"
#include "model/backend.h"
#include "model/model.h"

namespace ktd {

namespace {

void gemma3_layer(Blocks &b, const HParams &, const LayerWeights &w, int il) {
    b.norm(w.attn_norm, Act::X, Act::XN);
    b.attention_in(w, il);
    b.attention(il);
    b.attention_out(w);
    b.norm(w.post_attention_norm, Act::Tmp, Act::Tmp);
    b.residual_add(Act::Tmp);
    b.norm(w.ffn_norm, Act::X, Act::XN);
    b.glu_ffn(w, Glu::GeGLU);
    b.norm(w.post_ffw_norm, Act::Tmp, Act::Tmp);
    b.residual_add(Act::Tmp);
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

// llama's attention with per-head q/k norms, post-norms after attention and FFN.
void gemma3_tensors(TensorTable &t, const HParams &hp) {
    add_io_tensors(t, hp);
    add_attention_tensors(t, hp, {.qk_norm = true});
    t.add("blk.%d.post_attention_norm.weight", {hp.n_embd}, &LayerWeights::post_attention_norm);
    add_glu_ffn_tensors(t, hp, LayerSet::All);
    t.add("blk.%d.post_ffw_norm.weight", {hp.n_embd}, &LayerWeights::post_ffw_norm);
}

}  // namespace

KTD_REGISTER_ARCH("gemma3", tune_gemma3, gemma3_tensors, gemma3_layer);

}  // namespace ktd
