#include "model/arch.h"

#include <algorithm>
#include <cstring>

#include "model/model.h"

namespace ktd {

namespace {
std::vector<const ArchSpec *> &registry() {
    static std::vector<const ArchSpec *> archs;  // owned: registered once per module load
    return archs;
}
}  // namespace

void register_arch(const ArchSpec &spec) { registry().push_back(new ArchSpec(spec)); }

const ArchSpec *find_arch(const std::string &name) {
    for (const ArchSpec *a : registry())
        if (name == a->name) return a;
    return nullptr;
}

std::vector<const ArchSpec *> all_archs() {
    std::vector<const ArchSpec *> v = registry();
    std::sort(v.begin(), v.end(), [](const ArchSpec *a, const ArchSpec *b) { return std::strcmp(a->name, b->name) < 0; });
    return v;
}

const char *tensor_class_name(TensorClass c) {
    switch (c) {
        case TensorClass::Embedding: return "embedding";
        case TensorClass::Output: return "output";
        case TensorClass::Dense: return "dense";
        case TensorClass::Router: return "router";
        case TensorClass::RoutedExpert: return "routed_expert";
        case TensorClass::SharedExpert: return "shared_expert";
    }
    return "?";
}

bool layer_in_set(LayerSet set, const HParams &hp, int il) {
    switch (set) {
        case LayerSet::All: return true;
        case LayerSet::Dense: return hp.moe.n_expert == 0 || il < hp.moe.n_layer_dense_lead;
        case LayerSet::Moe: return hp.moe.n_expert > 0 && il >= hp.moe.n_layer_dense_lead;
    }
    return true;
}

using LW = LayerWeights;
using MW = ModelWeights;

void add_io_tensors(TensorTable &t, const HParams &hp) {
    const int64_t E = hp.n_embd, V = hp.n_vocab;
    t.add("token_embd.weight", {E, V}, {}).as(TensorClass::Embedding);
    t.add("output_norm.weight", {E}, &MW::output_norm).as(TensorClass::Output);
    t.add("output.weight", {E, V}, &MW::output).as(TensorClass::Output).optional();
}

void add_attention_tensors(TensorTable &t, const HParams &hp, AttentionTensors a) {
    const int64_t E = hp.n_embd, q = hp.n_embd_q(), k = hp.n_embd_k_gqa(), v = hp.n_embd_v_gqa();
    const int64_t out = int64_t(hp.n_head) * hp.head_dim_v;
    t.add("blk.%d.attn_norm.weight", {E}, &LW::attn_norm);
    t.add("blk.%d.attn_q.weight", {E, q}, &LW::wq);
    t.add("blk.%d.attn_k.weight", {E, k}, &LW::wk);
    t.add("blk.%d.attn_v.weight", {E, v}, &LW::wv);
    t.add("blk.%d.attn_output.weight", {out, E}, &LW::wo);
    t.add("blk.%d.attn_q.bias", {q}, &LW::bq).optional(!a.qkv_bias);
    t.add("blk.%d.attn_k.bias", {k}, &LW::bk).optional(!a.qkv_bias);
    t.add("blk.%d.attn_v.bias", {v}, &LW::bv).optional(!a.qkv_bias);
    t.add("blk.%d.attn_output.bias", {E}, &LW::bo).optional();
    if (a.qk_norm) {
        t.add("blk.%d.attn_q_norm.weight", {hp.head_dim_k}, &LW::attn_q_norm);
        t.add("blk.%d.attn_k_norm.weight", {hp.head_dim_k}, &LW::attn_k_norm);
    }
}

void add_glu_ffn_tensors(TensorTable &t, const HParams &hp, LayerSet layers) {
    const int64_t E = hp.n_embd, F = hp.n_ff;
    t.add("blk.%d.ffn_norm.weight", {E}, &LW::ffn_norm);
    t.add("blk.%d.ffn_gate.weight", {E, F}, &LW::ffn_gate).in(layers);
    t.add("blk.%d.ffn_up.weight", {E, F}, &LW::ffn_up).in(layers);
    t.add("blk.%d.ffn_down.weight", {F, E}, &LW::ffn_down).in(layers);
}

void add_moe_tensors(TensorTable &t, const HParams &hp, bool selection_bias) {
    const int64_t E = hp.n_embd, X = hp.moe.n_expert, F = hp.moe.n_ff_exp;
    t.add("blk.%d.ffn_gate_inp.weight", {E, X}, &LW::ffn_gate_inp).as(TensorClass::Router).in(LayerSet::Moe);
    if (selection_bias)
        t.add("blk.%d.exp_probs_b.bias", {X}, &LW::exp_probs_b).as(TensorClass::Router).in(LayerSet::Moe).optional();
    t.add("blk.%d.ffn_gate_exps.weight", {E, F, X}, &LW::ffn_gate_exps).as(TensorClass::RoutedExpert).in(LayerSet::Moe);
    t.add("blk.%d.ffn_up_exps.weight", {E, F, X}, &LW::ffn_up_exps).as(TensorClass::RoutedExpert).in(LayerSet::Moe);
    t.add("blk.%d.ffn_down_exps.weight", {F, E, X}, &LW::ffn_down_exps).as(TensorClass::RoutedExpert).in(LayerSet::Moe);
}

void add_shared_expert_tensors(TensorTable &t, const HParams &hp, bool gated) {
    const int64_t E = hp.n_embd, F = hp.moe.n_ff_shexp;
    if (gated)
        t.add("blk.%d.ffn_gate_inp_shexp.weight", {E}, &LW::ffn_gate_inp_shexp).as(TensorClass::SharedExpert).in(LayerSet::Moe);
    t.add("blk.%d.ffn_gate_shexp.weight", {E, F}, &LW::ffn_gate_shexp).as(TensorClass::SharedExpert).in(LayerSet::Moe);
    t.add("blk.%d.ffn_up_shexp.weight", {E, F}, &LW::ffn_up_shexp).as(TensorClass::SharedExpert).in(LayerSet::Moe);
    t.add("blk.%d.ffn_down_shexp.weight", {F, E}, &LW::ffn_down_shexp).as(TensorClass::SharedExpert).in(LayerSet::Moe);
}

}  // namespace ktd
