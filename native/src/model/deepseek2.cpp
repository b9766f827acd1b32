// deepseek2 (DeepSeek-V2, V2-Lite, V3, R1): multi-head latent attention (MLA) over a latent KV
// cache, leading dense SwiGLU layers, then routed + shared experts.
//
// Attention of one layer, per token (nope = qk_nope_head_dim, rope = qk_rope_head_dim,
// r = kv_lora_rank, H = n_head):
//   q [H][nope + rope] = wq · xn, or wq_b · rms(wq_a · xn) with the q LoRA
//   [c; k_pe] [r + rope] = wkv_a_mqa · xn;  c = rms(c) · attn_kv_a_norm;  q_pe, k_pe roped (NORM)
//   cache row (F16): [c; k_pe], r + rope values per token and layer — never the decompressed K/V
//   q_lat_h [r] = wk_b_h · q_nope_h          (absorption: q_nope_h · (W_kb_h^T c) = q_lat_h · c)
//   o_h [r] = Σ_j softmax_j(kq_scale · (q_lat_h · c_j + q_pe_h · k_pe_j)) · c_j
//             (Context::attention as multi-query attention: head_dim_k r + rope, values = the
//             first r entries of each cached row)
//   v_h [v_head_dim] = wv_b_h · o_h;  x += wo · v
// then x += FFN(rms(x)): SwiGLU in the leading dense layers, moe_ffn in the others.
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/error.h"
#include "gguf/gguf_file.h"
#include "model/blocks.h"
#include "model/model.h"
#include "model/moe.h"

namespace ktd {

namespace {

// y_h [n][rows] = st.mats[h] · x_h [n][k] for every head h; x and y are head-major
// ([n_head][n][k] and [n_head][n][rows]). With at least as many heads as workers each worker runs
// whole heads (small decode matmuls would not amortize a pool dispatch each); otherwise every head
// is one pooled matmul.
void per_head_matmul(Context &ctx, const MatrixStack &st, const float *x, int64_t k, int64_t n, float *y,
                     int64_t rows) {
    ThreadPool &pool = ctx.model().pool();
    ForwardScratch &s = ctx.scratch();
    const size_t n_head = st.mats.size();
    if (n_head >= size_t(pool.size())) {
        pool.parallel_for(n_head, [&](size_t h0, size_t h1, int tid) {
            for (size_t h = h0; h < h1; ++h)
                matmul(nullptr, st.mats[h].for_worker(tid), x + int64_t(h) * n * k, n, y + int64_t(h) * n * rows,
                       s.mm_thread[size_t(tid)]);
        });
        return;
    }
    for (size_t h = 0; h < n_head; ++h)
        matmul(&pool, st.mats[h], x + int64_t(h) * n * k, n, y + int64_t(h) * n * rows, s.mm);
}

void deepseek2_layer(Context &ctx, const LayerWeights &w, int il, const Batch &b, int64_t r0, int64_t n) {
    const HParams &hp = ctx.model().hparams();
    const MlaParams &m = hp.mla;
    ForwardScratch &s = ctx.scratch();
    const int64_t E = hp.n_embd, H = hp.n_head;
    const int64_t nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim, r = m.kv_lora_rank, dv = m.v_head_dim;
    const int64_t hq = nope + rope;  // decompressed q head
    const int64_t hk = r + rope;     // absorbed q head = cache row
    float *x = s.x.data(), *xn = s.xn.data();

    for (int64_t i = 0; i < n; ++i) rms_norm(x + i * E, w.attn_norm.data(), xn + i * E, E, hp.norm_eps);
    float *q = s.mla_q.data();  // [n][H][hq]
    if (w.wq_a) {
        float *qa = s.mla_q_a.data();  // [n][q_lora_rank]
        ctx.linear(w.wq_a, xn, n, qa);
        for (int64_t i = 0; i < n; ++i)
            rms_norm(qa + i * m.q_lora_rank, w.attn_q_a_norm.data(), qa + i * m.q_lora_rank, m.q_lora_rank, hp.norm_eps);
        ctx.linear(w.wq_b, qa, n, q);
    } else {
        ctx.linear(w.wq, xn, n, q);
    }
    float *kv = s.k.data();  // [n][r + rope]: the cache rows
    ctx.linear(w.wkv_a_mqa, xn, n, kv);
    float *heads = s.mla_heads.data();  // head-major scratch
    for (int64_t i = 0; i < n; ++i) {
        const float *cs = &s.rope_cs[size_t(i * hp.rope.n_rot)];
        float *ki = kv + i * hk, *qi = q + i * H * hq;
        rms_norm(ki, w.attn_kv_a_norm.data(), ki, r, hp.norm_eps);
        rope_apply(hp.rope, cs, ki + r, 1, rope);
        rope_apply(hp.rope, cs, qi + nope, int(H), hq);
        for (int64_t h = 0; h < H; ++h) std::memcpy(heads + (h * n + i) * nope, qi + h * hq, size_t(nope) * sizeof(float));
    }
    // Absorb q_nope into the latent: q_lat [H][n][r] (in s.attn, free until attention runs), then
    // the scaled MQA query [n][H][r + rope] = [q_lat; q_pe].
    float *q_lat = s.attn.data();
    per_head_matmul(ctx, w.wk_b, heads, nope, n, q_lat, r);
    const float scale = hp.attn_scale;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < H; ++h) {
            float *dst = s.q.data() + (i * H + h) * hk;
            const float *lat = q_lat + (h * n + i) * r, *pe = q + (i * H + h) * hq + nope;
            for (int64_t d = 0; d < r; ++d) dst[d] = lat[d] * scale;
            for (int64_t d = 0; d < rope; ++d) dst[r + d] = pe[d] * scale;
        }
    ctx.attention(il, b.positions + r0, b.seq_ids + r0, n);  // s.attn [n][H][r]: latent outputs
    // Decompress each head's output: head-major copy (into s.q, free now), v [H][n][dv], then the
    // token-major [n][H·dv] that wo reads.
    float *o_lat = s.q.data();
    for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < H; ++h)
            std::memcpy(o_lat + (h * n + i) * r, s.attn.data() + (i * H + h) * r, size_t(r) * sizeof(float));
    per_head_matmul(ctx, w.wv_b, o_lat, r, n, heads, dv);
    float *v = s.mla_v.data();
    for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < H; ++h)
            std::memcpy(v + (i * H + h) * dv, heads + (h * n + i) * dv, size_t(dv) * sizeof(float));
    ctx.linear(w.wo, v, n, s.tmp.data());
    for (int64_t j = 0; j < n * E; ++j) x[j] += s.tmp[size_t(j)];

    for (int64_t i = 0; i < n; ++i) rms_norm(x + i * E, w.ffn_norm.data(), xn + i * E, E, hp.norm_eps);
    if (w.ffn_gate_inp) {  // routed + shared experts
        moe_record_state(ctx, il, 0, x + (n - 1) * E);
        moe_ffn(ctx, w, il, xn, n, s.tmp.data());
    } else {  // a leading dense layer
        ctx.linear(w.ffn_gate, xn, n, s.gate.data());
        ctx.linear(w.ffn_up, xn, n, s.up.data());
        swiglu(s.gate.data(), s.up.data(), n * hp.n_ff);
        ctx.linear(w.ffn_down, s.gate.data(), n, s.tmp.data());
    }
    for (int64_t j = 0; j < n * E; ++j) x[j] += s.tmp[size_t(j)];
    if (w.ffn_gate_inp) moe_record_state(ctx, il, 1, x + (n - 1) * E);
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

std::vector<TensorSpec> deepseek2_tensors() {
    using D = Dim;
    using LW = LayerWeights;
    return {
        C("token_embd.weight", D::Embd, D::Vocab, kRequired, Placement::Input),
        G("output_norm.weight", D::Embd, D::One, kRequired, Placement::Output, &ModelWeights::output_norm),
        G("output.weight", D::Embd, D::Vocab, kOptional, Placement::Output, &ModelWeights::output),
        L("blk.%d.attn_norm.weight", D::Embd, D::One, kRequired, &LW::attn_norm),
        // q LoRA or plain wq: which one is required is decided in tune_deepseek2 from q_lora_rank.
        L("blk.%d.attn_q_a.weight", D::Embd, D::QLora, kOptional, &LW::wq_a),
        L("blk.%d.attn_q_a_norm.weight", D::QLora, D::One, kOptional, &LW::attn_q_a_norm),
        L("blk.%d.attn_q_b.weight", D::QLora, D::EmbdQMla, kOptional, &LW::wq_b),
        L("blk.%d.attn_q.weight", D::Embd, D::EmbdQMla, kOptional, &LW::wq),
        L("blk.%d.attn_kv_a_mqa.weight", D::Embd, D::KvLoraRope, kRequired, &LW::wkv_a_mqa),
        L("blk.%d.attn_kv_a_norm.weight", D::KvLora, D::One, kRequired, &LW::attn_kv_a_norm),
        L3("blk.%d.attn_k_b.weight", D::HeadKNope, D::KvLora, D::Head, kRequired, &LW::wk_b),
        L3("blk.%d.attn_v_b.weight", D::KvLora, D::HeadVMla, D::Head, kRequired, &LW::wv_b),
        L("blk.%d.attn_output.weight", D::EmbdVMla, D::Embd, kRequired, &LW::wo),
        L("blk.%d.ffn_norm.weight", D::Embd, D::One, kRequired, &LW::ffn_norm),
        in_layers(L("blk.%d.ffn_gate.weight", D::Embd, D::FF, kRequired, &LW::ffn_gate), LayerSet::Dense),
        in_layers(L("blk.%d.ffn_up.weight", D::Embd, D::FF, kRequired, &LW::ffn_up), LayerSet::Dense),
        in_layers(L("blk.%d.ffn_down.weight", D::FF, D::Embd, kRequired, &LW::ffn_down), LayerSet::Dense),
        // layers from leading_dense_block_count on: routed experts (exp_probs_b: DeepSeek-V3's
        // selection bias) and the shared experts fused into one FFN of n_ff_exp · expert_shared_count
        in_layers(L("blk.%d.ffn_gate_inp.weight", D::Embd, D::Expert, kRequired, &LW::ffn_gate_inp), LayerSet::Moe),
        in_layers(L("blk.%d.exp_probs_b.bias", D::Expert, D::One, kOptional, &LW::exp_probs_b), LayerSet::Moe),
        in_layers(L3("blk.%d.ffn_gate_exps.weight", D::Embd, D::FFExp, D::Expert, kRequired, &LW::ffn_gate_exps),
                  LayerSet::Moe),
        in_layers(L3("blk.%d.ffn_up_exps.weight", D::Embd, D::FFExp, D::Expert, kRequired, &LW::ffn_up_exps),
                  LayerSet::Moe),
        in_layers(L3("blk.%d.ffn_down_exps.weight", D::FFExp, D::Embd, D::Expert, kRequired, &LW::ffn_down_exps),
                  LayerSet::Moe),
        in_layers(L("blk.%d.ffn_gate_shexp.weight", D::Embd, D::FFShexp, kRequired, &LW::ffn_gate_shexp), LayerSet::Moe),
        in_layers(L("blk.%d.ffn_up_shexp.weight", D::Embd, D::FFShexp, kRequired, &LW::ffn_up_shexp), LayerSet::Moe),
        in_layers(L("blk.%d.ffn_down_shexp.weight", D::FFShexp, D::Embd, kRequired, &LW::ffn_down_shexp), LayerSet::Moe),
    };
}

}  // namespace

const ArchSpec kArchDeepseek2{"deepseek2", deepseek2_tensors(), tune_deepseek2, deepseek2_layer};

}  // namespace ktd
