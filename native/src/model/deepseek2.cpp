// deepseek2 (DeepSeek-V2, V2-Lite, V3, R1): multi-head latent attention (MLA, mla.cpp) over a
// latent KV cache, leading dense SwiGLU layers, then routed + shared experts.
//   x [n][n_embd] → MLA → attn [n][n_head·v_head_dim] → x += wo·attn
//   → x += FFN(rms(x)): SwiGLU in the leading dense layers, moe_ffn in the others
#include <cmath>
#include <cstdio>

#include "common/error.h"
#include "gguf/gguf_file.h"
#include "model/arch.h"
#include "model/backend.h"
#include "model/model.h"

namespace ktd {

namespace {

void deepseek2_layer(Blocks &b, const HParams &, const LayerWeights &w, int il) {
    b.norm(w.attn_norm, Act::X, Act::XN);
    b.mla_attention(w, il);
    b.attention_out(w);
    b.residual_add(Act::Tmp);
    b.norm(w.ffn_norm, Act::X, Act::XN);
    if (w.ffn_gate_inp)  // routed + shared experts
        b.moe_ffn(w, il);
    else  // a leading dense layer
        b.glu_ffn(w, Glu::SwiGLU);
    b.residual_add(Act::Tmp);
}

int64_t mla_key(const GGUFFile &f, const std::string &key, int64_t max) {
    if (!f.find_key(key)) throw GGUFError("missing metadata key " + key + " (required by deepseek2 MLA)");
    const uint64_t v = f.get_uint(key);
    if (v == 0 || v > uint64_t(max)) throw GGUFError("metadata key " + key + " = " + std::to_string(v) + " is out of range");
    return int64_t(v);
}

std::string layer_tensor(const char *fmt, int il) {
    char buf[128];
    std::snprintf(buf, sizeof buf, fmt, il);
    return buf;
}

// YaRN's attention temperature (llama.cpp's get_mscale): 1 + 0.1·mscale·ln(factor) above factor 1.
float yarn_mscale(float factor, float mscale) { return factor <= 1.0f ? 1.0f : 1.0f + 0.1f * mscale * std::log(factor); }

void tune_deepseek2(HParams &hp, const GGUFFile &f) {
    const std::string p = hp.arch + ".";
    hp.rope.type = hp.rope_swa.type = RopeType::Norm;
    MlaParams &m = hp.mla;
    // Files of converters before the attn_k_b/attn_v_b split store one attn_kv_b and no *_mla keys.
    if (f.find_tensor("blk.0.attn_kv_b.weight"))
        throw GGUFError("tensor blk.0.attn_kv_b.weight: unsplit MLA weights of an older convert_hf_to_gguf.py are not "
                        "supported; reconvert the model (current converters write attn_k_b/attn_v_b)");
    // Mistral-Large-3 files (also deepseek2) scale q by a position-dependent temperature, which this
    // forward does not implement: refuse them rather than compute something else.
    if (gguf_get_float_or(f, p + "attention.temperature_scale", 0.0f) != 0.0f)
        throw GGUFError("metadata key " + p + "attention.temperature_scale: attention temperature tuning is not supported");
    m.kv_lora_rank = mla_key(f, p + "attention.kv_lora_rank", 1 << 16);
    m.q_lora_rank = int64_t(gguf_get_uint_or(f, p + "attention.q_lora_rank", 0));  // 0 or absent: plain wq
    if (m.q_lora_rank > (1 << 20))
        throw GGUFError("metadata key " + p + "attention.q_lora_rank = " + std::to_string(m.q_lora_rank) + " is out of range");
    if (!f.find_key(p + "rope.dimension_count")) throw GGUFError("missing metadata key " + p + "rope.dimension_count");
    m.qk_rope_head_dim = hp.rope.n_rot;
    const int64_t head_k_mla = mla_key(f, p + "attention.key_length_mla", 1 << 16);
    m.v_head_dim = mla_key(f, p + "attention.value_length_mla", 1 << 16);
    m.qk_nope_head_dim = head_k_mla - m.qk_rope_head_dim;
    if (m.qk_nope_head_dim < 1)
        throw GGUFError(p + "attention.key_length_mla (" + std::to_string(head_k_mla) + ") must exceed " + p +
                        "rope.dimension_count (" + std::to_string(m.qk_rope_head_dim) + ")");
    // The cache geometry the converter declares: one kv head of [latent; rope key], values = latent.
    const int64_t want_k = m.kv_lora_rank + m.qk_rope_head_dim;
    if (hp.head_dim_k != want_k || hp.head_dim_v != m.kv_lora_rank)
        throw GGUFError(p + "attention.key_length/value_length (" + std::to_string(hp.head_dim_k) + "/" +
                        std::to_string(hp.head_dim_v) + ") do not match " + p + "attention.kv_lora_rank = " +
                        std::to_string(m.kv_lora_rank) + " (expected " + std::to_string(want_k) + "/" +
                        std::to_string(m.kv_lora_rank) + ": kv_lora_rank + rope.dimension_count / kv_lora_rank)");
    if (hp.n_head_kv != 1)
        throw GGUFError(p + "attention.head_count_kv = " + std::to_string(hp.n_head_kv) + ", expected 1 (MLA caches one latent head)");
    // The query comes from either the q LoRA or a plain wq, as q_lora_rank says.
    for (int il = 0; il < hp.n_layer; ++il) {
        const char *want[] = {"blk.%d.attn_q_a.weight", "blk.%d.attn_q_a_norm.weight", "blk.%d.attn_q_b.weight"};
        const std::string wq = layer_tensor("blk.%d.attn_q.weight", il);
        for (const char *fmt : want) {
            const std::string name = layer_tensor(fmt, il);
            if (m.q_lora_rank > 0 && !f.find_tensor(name))
                throw GGUFError("missing tensor " + name + " (required by deepseek2 with " + p + "attention.q_lora_rank = " +
                                std::to_string(m.q_lora_rank) + ")");
            if (m.q_lora_rank == 0 && f.find_tensor(name))
                throw GGUFError("unexpected tensor " + name + " (" + p + "attention.q_lora_rank is 0 or absent: plain " + wq + ")");
        }
        if (m.q_lora_rank == 0 && !f.find_tensor(wq))
            throw GGUFError("missing tensor " + wq + " (required by deepseek2 without q LoRA)");
        if (m.q_lora_rank > 0 && f.find_tensor(wq))
            throw GGUFError("unexpected tensor " + wq + " (deepseek2 with q LoRA has attn_q_a/attn_q_b)");
    }

    // Scaling, as llama.cpp computes it for deepseek2 (llama_context's yarn_attn_factor and the
    // deepseek2 graph's kq_scale). The converter writes yarn_log_multiplier = 0.1·mscale_all_dim.
    // With YaRN the rope's cos/sin magnitude is attn_factor·(1 + 0.1·ln factor) (rope_cos_sin);
    // DeepSeek's config has mscale = mscale_all_dim, so llama.cpp sets attn_factor to cancel that
    // term and folds the temperature into kq_scale instead: mscale² / sqrt(nope + rope).
    RopeParams &rp = hp.rope;
    const float log_mul = gguf_get_float_or(f, p + "rope.scaling.yarn_log_multiplier", 0.0f) / 0.1f;
    const float ln_factor = std::log(1.0f / rp.freq_scale);
    if (rp.scaling == RopeScaling::Yarn && rp.ext_factor != 0.0f) {
        const float factor = 1.0f / rp.freq_scale;
        float attn_factor = log_mul != 0.0f ? 1.0f : yarn_mscale(factor, 1.0f);
        attn_factor /= 1.0f + 0.1f * ln_factor;
        rp.attn_factor *= attn_factor;  // times rope.scaling.attn_factor (read_hparams)
    }
    const float attn_factor_org = rp.attn_factor * (1.0f + 0.1f * ln_factor);
    const float mscale = attn_factor_org * (1.0f + 0.1f * log_mul * ln_factor);
    hp.attn_scale = mscale * mscale / std::sqrt(float(m.n_embd_head_k()));
    hp.rope_swa = hp.rope;
}

void deepseek2_tensors(TensorTable &t, const HParams &hp) {
    using LW = LayerWeights;
    const MlaParams &m = hp.mla;
    const int64_t E = hp.n_embd, H = hp.n_head, r = m.kv_lora_rank, q = H * m.n_embd_head_k();
    add_io_tensors(t, hp);
    t.add("blk.%d.attn_norm.weight", {E}, &LW::attn_norm);
    // q LoRA or plain wq: which one is required is decided in tune_deepseek2 from q_lora_rank.
    t.add("blk.%d.attn_q_a.weight", {E, m.q_lora_rank}, &LW::wq_a).optional();
    t.add("blk.%d.attn_q_a_norm.weight", {m.q_lora_rank}, &LW::attn_q_a_norm).optional();
    t.add("blk.%d.attn_q_b.weight", {m.q_lora_rank, q}, &LW::wq_b).optional();
    t.add("blk.%d.attn_q.weight", {E, q}, &LW::wq).optional();
    t.add("blk.%d.attn_kv_a_mqa.weight", {E, r + m.qk_rope_head_dim}, &LW::wkv_a_mqa);
    t.add("blk.%d.attn_kv_a_norm.weight", {r}, &LW::attn_kv_a_norm);
    t.add("blk.%d.attn_k_b.weight", {m.qk_nope_head_dim, r, H}, &LW::wk_b);
    t.add("blk.%d.attn_v_b.weight", {r, m.v_head_dim, H}, &LW::wv_b);
    t.add("blk.%d.attn_output.weight", {H * m.v_head_dim, E}, &LW::wo);
    // Layers from leading_dense_block_count on: routed experts (exp_probs_b: DeepSeek-V3's
    // selection bias) and the shared experts fused into one FFN of n_ff_exp · expert_shared_count.
    add_glu_ffn_tensors(t, hp, LayerSet::Dense);
    add_moe_tensors(t, hp, true);
    add_shared_expert_tensors(t, hp, false);
}

}  // namespace

KTD_REGISTER_ARCH("deepseek2", tune_deepseek2, deepseek2_tensors, deepseek2_layer);

}  // namespace ktd
