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
#include "model/arch.h"
#include "model/backend.h"
#include "model/model.h"

namespace ktd {

namespace {

void llama_layer(Blocks &b, const HParams &, const LayerWeights &w, int il) {
    b.norm(w.attn_norm, Act::X, Act::XN);
    b.attention_in(w, il);
    b.attention(il);
    b.attention_out(w);
    b.residual_add(Act::Tmp);
    b.norm(w.ffn_norm, Act::X, Act::XN);
    if (w.ffn_gate_inp)
        b.moe_ffn(w, il);
    else
        b.glu_ffn(w, Glu::SwiGLU);
    b.residual_add(Act::Tmp);
}

// qwen2/qwen3 (and their MoE variants) keep the half-split (NeoX) rotary layout; llama uses
// adjacent pairs (tune_llama).
void tune_neox_rope(HParams &hp, const GGUFFile &) { hp.rope.type = hp.rope_swa.type = RopeType::Neox; }

// The routing llama.cpp hard-codes for these architectures (build_moe_ffn's gating and norm_w
// arguments), whatever the file says; it does not read expert_weights_scale for them either, but
// it does apply expert_group_count (checked against llama.cpp in tests/model/test_moe_forward.py).
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

// The family's table: attention (with or without QKV biases / q-k norms), and the dense FFN in
// every layer or, with experts (llama: when the file has expert_count), the routed experts.
enum class Experts { None, Routed, RoutedShared };
void family_tensors(TensorTable &t, const HParams &hp, AttentionTensors a, Experts experts) {
    add_io_tensors(t, hp);
    t.add("rope_freqs.weight", {hp.rope.n_rot / 2}, &ModelWeights::rope_freqs).optional();
    add_attention_tensors(t, hp, a);
    // Without an expert table every layer has the dense FFN, whatever expert_count says.
    add_glu_ffn_tensors(t, hp, experts == Experts::None ? LayerSet::All : LayerSet::Dense);
    if (experts == Experts::None) return;
    add_moe_tensors(t, hp, false);
    if (experts == Experts::RoutedShared) add_shared_expert_tensors(t, hp, true);
}

void llama_tensors(TensorTable &t, const HParams &hp) { family_tensors(t, hp, {}, Experts::Routed); }
void qwen2_tensors(TensorTable &t, const HParams &hp) { family_tensors(t, hp, {.qkv_bias = true}, Experts::None); }
void qwen3_tensors(TensorTable &t, const HParams &hp) { family_tensors(t, hp, {.qk_norm = true}, Experts::None); }
void qwen2moe_tensors(TensorTable &t, const HParams &hp) {
    family_tensors(t, hp, {.qkv_bias = true}, Experts::RoutedShared);
}
void qwen3moe_tensors(TensorTable &t, const HParams &hp) { family_tensors(t, hp, {.qk_norm = true}, Experts::Routed); }

}  // namespace

KTD_REGISTER_ARCH("llama", tune_llama, llama_tensors, llama_layer);
KTD_REGISTER_ARCH("qwen2", tune_neox_rope, qwen2_tensors, llama_layer);
KTD_REGISTER_ARCH("qwen3", tune_neox_rope, qwen3_tensors, llama_layer);
KTD_REGISTER_ARCH("qwen2moe", tune_qwen2moe, qwen2moe_tensors, llama_layer);
KTD_REGISTER_ARCH("qwen3moe", tune_qwen3moe, qwen3moe_tensors, llama_layer);

}  // namespace ktd
