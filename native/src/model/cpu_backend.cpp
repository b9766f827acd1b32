#include "model/cpu_backend.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/attention.h"
#include "kernels/kernels.h"
#include "model/blocks.h"
#include "model/model.h"
#include "model/moe.h"

namespace ktd {

namespace {

const float *bias_or_null(const std::vector<float> &b) { return b.empty() ? nullptr : b.data(); }

// y[j] *= s for j < n (a ternary tensor's scale; 1 when the file has none).
void scale(float *y, int64_t n, float s) {
    if (s != 1.0f)
        for (int64_t j = 0; j < n; ++j) y[j] *= s;
}

// RMSNorm of each of n_heads vectors of hd floats, in place, with the same weight w [hd].
void norm_heads(float *x, int n_heads, int64_t hd, const std::vector<float> &w, float eps) {
    for (int h = 0; h < n_heads; ++h) rms_norm(x + h * hd, w.data(), x + h * hd, hd, eps);
}

}  // namespace

ForwardScratch::ForwardScratch(const HParams &hp, int64_t n_batch, int n_threads) {
    const size_t nb = size_t(n_batch);
    xn.resize(nb * size_t(hp.n_embd));
    tmp.resize(nb * size_t(std::max(hp.n_embd, int64_t(hp.n_head) * hp.head_dim_v)));
    q.resize(nb * size_t(hp.n_embd_q()));
    k.resize(nb * size_t(hp.n_embd_k_gqa()));
    v.resize(nb * size_t(hp.n_embd_v_gqa()));
    attn.resize(nb * size_t(int64_t(hp.n_head) * hp.head_dim_v));
    gate.resize(nb * size_t(hp.n_ff));
    up.resize(nb * size_t(hp.n_ff));
    rope_cs.resize(nb * size_t(hp.rope.n_rot));
    rope_cs_swa.resize(nb * size_t(hp.rope_swa.n_rot));
    attn_tmp_stride = attn_scratch_layout(attn_rows_per_block(hp), hp.n_head / hp.n_head_kv, hp.head_dim_k,
                                          hp.head_dim_v).total;
    attn_tmp.resize(size_t(n_threads) * attn_tmp_stride);
    if (hp.is_mla()) {
        const MlaParams &mla = hp.mla;
        mla_q_a.resize(nb * size_t(mla.q_lora_rank));
        mla_q.resize(nb * size_t(hp.n_head) * size_t(mla.n_embd_head_k()));
        mla_heads.resize(nb * size_t(hp.n_head) * size_t(std::max(mla.qk_nope_head_dim, mla.v_head_dim)));
        mm_thread.resize(size_t(n_threads));
    }
}

CpuBackend::CpuBackend(const BackendSetup &setup, int layer_begin, int layer_end)
    : model_(setup.model), hp_(setup.model.hparams()), pool_(setup.model.pool()), taps_(setup.taps),
      layer_begin_(layer_begin), s_(hp_, setup.n_batch, pool_.size()) {
    if (layer_end < 0) layer_end = hp_.n_layer;
    if (layer_begin < 0 || layer_begin > layer_end || layer_end > hp_.n_layer)
        throw std::invalid_argument("CPU backend: layers [" + std::to_string(layer_begin) + ", " +
                                    std::to_string(layer_end) + ") outside the model's " + std::to_string(hp_.n_layer));
    for (int il = layer_begin; il < layer_end; ++il) kv_.push_back(make_kv_cache(hp_, setup.n_seq_max, setup.n_ctx));
}

CpuBackend::~CpuBackend() = default;

std::vector<LayerMemory *> CpuBackend::memory() {
    std::vector<LayerMemory *> out;
    for (const auto &c : kv_) out.push_back(c.get());
    return out;
}

void CpuBackend::begin_chunk(float *x, const int32_t *positions, const int32_t *seq_ids, int64_t n) {
    x_ = x;
    positions_ = positions;
    seq_ids_ = seq_ids;
    n_ = n;
    // Per row the rotary angles [n][n_rot] (and those of the sliding-window layers, when they differ).
    const float *ff = model_.weights().rope_freqs.empty() ? nullptr : model_.weights().rope_freqs.data();
    for_each_row(pool_, n, kMinParallelRows, [&](int64_t i) {
        rope_cos_sin(hp_.rope, ff, positions[i], s_.rope_cs.data() + i * hp_.rope.n_rot);
        rope_cos_sin(hp_.rope_swa, ff, positions[i], s_.rope_cs_swa.data() + i * hp_.rope_swa.n_rot);
    });
}

float *CpuBackend::buf(Act a) {
    switch (a) {
        case Act::X: return x_;
        case Act::XN: return s_.xn.data();
        case Act::Attn: return s_.attn.data();
        case Act::Tmp: return s_.tmp.data();
    }
    return nullptr;
}

void CpuBackend::norm(const std::vector<float> &w, Act in, Act out) {
    const int64_t width = int64_t(w.size());  // rows of every activation are packed: stride = width
    const float *x = buf(in);
    float *y = buf(out);
    for_each_row(pool_, n_, kMinParallelRows,
                 [&](int64_t i) { rms_norm(x + i * width, w.data(), y + i * width, width, hp_.norm_eps); });
}

void CpuBackend::residual_add(Act t) {
    const int64_t E = hp_.n_embd;
    float *x = x_;
    const float *ti = buf(t);
    for_each_row(pool_, n_, kMinParallelRows, [&](int64_t i) {
        for (int64_t d = 0; d < E; ++d) x[i * E + d] += ti[i * E + d];
    });
}

void CpuBackend::attention_in(const LayerWeights &w, int il) {
    const HParams &hp = hp_;
    const bool swa = hp.layer_swa[size_t(il)];
    const RopeParams &rp = swa ? hp.rope_swa : hp.rope;
    const float *cs_all = (swa ? s_.rope_cs_swa : s_.rope_cs).data();
    const int64_t hd = hp.head_dim_k, nq = hp.n_embd_q(), nk = hp.n_embd_k_gqa(), nv = hp.n_embd_v_gqa();
    // Q, K and V read the same input: one pool region (matmul_multi) instead of three.
    const MatmulJob qkv[] = {{&w.wq.pw, s_.q.data(), bias_or_null(w.bq)},
                             {&w.wk.pw, s_.k.data(), bias_or_null(w.bk)},
                             {&w.wv.pw, s_.v.data(), bias_or_null(w.bv)}};
    matmul_multi(&pool_, qkv, 3, s_.xn.data(), n_, s_.mm);
    for_each_row(pool_, n_, kMinParallelRows, [&](int64_t i) {
        float *qi = &s_.q[size_t(i * nq)], *ki = &s_.k[size_t(i * nk)];
        scale(qi, nq, w.wq_scale);
        scale(ki, nk, w.wk_scale);
        scale(&s_.v[size_t(i * nv)], nv, w.wv_scale);
        if (!w.attn_q_norm.empty()) norm_heads(qi, hp.n_head, hd, w.attn_q_norm, hp.norm_eps);
        if (!w.attn_k_norm.empty()) norm_heads(ki, hp.n_head_kv, hd, w.attn_k_norm, hp.norm_eps);
        const float *cs = cs_all + i * rp.n_rot;
        rope_apply(rp, cs, qi, hp.n_head, hd);
        rope_apply(rp, cs, ki, hp.n_head_kv, hd);
        for (int64_t d = 0; d < nq; ++d) qi[d] *= hp.attn_scale;
    });
}

void CpuBackend::linear(const Matrix &m, const float *x, float *y, const std::vector<float> *bias) {
    matmul(&pool_, m.pw, x, n_, y, s_.mm);
    if (bias && !bias->empty()) {
        const int64_t rows = m.pw.rows;
        const float *bv = bias->data();
        for_each_row(pool_, n_, kMinParallelRows, [&](int64_t i) {
            for (int64_t r = 0; r < rows; ++r) y[i * rows + r] += bv[r];
        });
    }
}

void CpuBackend::attention_out(const LayerWeights &w) {
    linear(w.wo, s_.attn.data(), s_.tmp.data(), &w.bo);
    if (w.wo_scale != 1.0f) {
        const int64_t E = hp_.n_embd;
        for_each_row(pool_, n_, kMinParallelRows, [&](int64_t i) { scale(&s_.tmp[size_t(i * E)], E, w.wo_scale); });
    }
}

namespace {

// matmul_pair's hook for a GLU FFN: rows [r0, r1) of gate and up of every batch row scaled, then
// gate = act(gate) ⊙ up there, on the worker that computed them.
struct GluHook {
    GluKernel glu;
    float gate_scale, up_scale;

    static void fn(void *ctx, float *g, float *u, int64_t rows, int64_t r0, int64_t r1, int64_t n, int) {
        const GluHook &h = *static_cast<const GluHook *>(ctx);
        for (int64_t c = 0; c < n; ++c) {
            float *gc = g + c * rows + r0, *uc = u + c * rows + r0;
            scale(gc, r1 - r0, h.gate_scale);
            scale(uc, r1 - r0, h.up_scale);
            h.glu(gc, uc, r1 - r0);
        }
    }
};

}  // namespace

void CpuBackend::glu_ffn(const LayerWeights &w, Glu act) {
    const int64_t ff = w.ffn_gate.pw.rows, E = hp_.n_embd;
    // gate and up read the same input: one pool region, and the GLU (elementwise, so the same
    // result whichever rows a worker takes) runs in it on each worker's rows as they come out.
    const MatmulJob gate{&w.ffn_gate.pw, s_.gate.data(), nullptr}, up{&w.ffn_up.pw, s_.up.data(), nullptr};
    GluHook h{glu_kernel(act), w.gate_scale, w.up_scale};
    if (w.ffn_sub_norm.empty()) {
        matmul_pair(&pool_, gate, up, {&GluHook::fn, &h}, s_.xn.data(), n_, s_.mm);
    } else {
        // bitnet: the RMSNorm after the GLU needs whole rows.
        const MatmulJob gate_up[] = {gate, up};
        matmul_multi(&pool_, gate_up, 2, s_.xn.data(), n_, s_.mm);
        for_each_row(pool_, n_, kMinParallelRows, [&](int64_t i) {
            float *g = &s_.gate[size_t(i * ff)], *u = &s_.up[size_t(i * ff)];
            GluHook::fn(&h, g, u, ff, 0, ff, 1, 0);  // the whole row
            rms_norm(g, w.ffn_sub_norm.data(), g, ff, hp_.norm_eps);
        });
    }
    linear(w.ffn_down, s_.gate.data(), s_.tmp.data());
    if (w.down_scale != 1.0f)
        for_each_row(pool_, n_, kMinParallelRows, [&](int64_t i) { scale(&s_.tmp[size_t(i * E)], E, w.down_scale); });
}

void CpuBackend::moe_ffn(const LayerWeights &w, int il) {
    const int64_t E = hp_.n_embd;
    const float *x_last = x_ + (n_ - 1) * E;
    moe_record_state(taps_, E, il, 0, x_last);
    ::ktd::moe_ffn(MoeRun{model_, s_.moe, s_.mm, taps_}, w, il, s_.xn.data(), n_, s_.tmp.data());
    if (taps_.moe_states.empty()) return;
    // The bench hook's residual after the FFN: what residual_add will make of the last row.
    moe_after_.resize(size_t(E));
    const float *t_last = &s_.tmp[size_t((n_ - 1) * E)];
    for (int64_t d = 0; d < E; ++d) moe_after_[size_t(d)] = x_last[d] + t_last[d];
    moe_record_state(taps_, E, il, 1, moe_after_.data());
}

}  // namespace ktd
