// bitnet (BitNet b1.58): a llama-style layer with ternary weights, each matmul optionally scaled by
// a per-tensor "*.scale" [1], RMSNorm sub-norms before the attention output and FFN down
// projections, and either SwiGLU or (b1.58 2B4T, `bitnet.hidden_activation = relu2`) squared ReLU.
//   x [n][n_embd] → attn [n][n_head·hd] → sub-norm → x += wo·attn
//   → gate/up [n][n_ff] → act(gate) ⊙ up → sub-norm → x += w_down·(...)
#include <utility>

#include "common/error.h"
#include "gguf/gguf_file.h"
#include "model/arch.h"
#include "model/backend.h"
#include "model/model.h"

namespace ktd {

namespace {

void bitnet_layer(Blocks &b, const HParams &hp, const LayerWeights &w, int il) {
    b.norm(w.attn_norm, Act::X, Act::XN);
    b.attention_in(w, il);
    b.attention(il);
    b.norm(w.attn_sub_norm, Act::Attn, Act::Attn);
    b.attention_out(w);
    b.residual_add(Act::Tmp);
    b.norm(w.ffn_norm, Act::X, Act::XN);
    b.glu_ffn(w, hp.ffn_relu2 ? Glu::ReLU2 : Glu::SwiGLU);
    b.residual_add(Act::Tmp);
}

void tune_bitnet(HParams &hp, const GGUFFile &f) {
    hp.rope.type = hp.rope_swa.type = RopeType::Neox;
    const std::string key = hp.arch + ".hidden_activation";
    const std::string act = f.find_key(key) ? std::string(f.get_string(key)) : "silu";
    if (act != "silu" && act != "relu2")
        throw GGUFError("unsupported " + key + " '" + act + "' (supported: silu, relu2)");
    hp.ffn_relu2 = act == "relu2";
}

// llama's attention and FFN, with the sub-norms and each matrix's optional scale.
void bitnet_tensors(TensorTable &t, const HParams &hp) {
    using LW = LayerWeights;
    add_io_tensors(t, hp);
    add_attention_tensors(t, hp, {});
    t.add("blk.%d.attn_sub_norm.weight", {int64_t(hp.n_head) * hp.head_dim_v}, &LW::attn_sub_norm);
    add_glu_ffn_tensors(t, hp, LayerSet::All);
    t.add("blk.%d.ffn_sub_norm.weight", {hp.n_ff}, &LW::ffn_sub_norm);
    const std::pair<const char *, float LW::*> scales[] = {
        {"attn_q", &LW::wq_scale},   {"attn_k", &LW::wk_scale}, {"attn_v", &LW::wv_scale},
        {"attn_output", &LW::wo_scale}, {"ffn_gate", &LW::gate_scale}, {"ffn_up", &LW::up_scale},
        {"ffn_down", &LW::down_scale}};
    for (const auto &[name, dest] : scales) t.add(std::string("blk.%d.") + name + ".scale", {1}, dest).optional();
}

}  // namespace

KTD_REGISTER_ARCH("bitnet", tune_bitnet, bitnet_tensors, bitnet_layer);

}  // namespace ktd
