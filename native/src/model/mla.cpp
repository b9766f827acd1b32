// Multi-head latent attention (deepseek2) on the CPU backend, in the absorbed form over the latent
// KV cache. Per token (nope = qk_nope_head_dim, rope = qk_rope_head_dim, r = kv_lora_rank,
// H = n_head):
//   q [H][nope + rope] = wq · xn, or wq_b · rms(wq_a · xn) with the q LoRA
//   [c; k_pe] [r + rope] = wkv_a_mqa · xn;  c = rms(c) · attn_kv_a_norm;  q_pe, k_pe roped
//   cache row (F16): [c; k_pe], r + rope values per token and layer — never the decompressed K/V
//   q_lat_h [r] = wk_b_h · q_nope_h          (absorption: q_nope_h · (W_kb_h^T c) = q_lat_h · c)
//   o_h [r] = Σ_j softmax_j(kq_scale · (q_lat_h · c_j + q_pe_h · k_pe_j)) · c_j
//             (CpuBackend::attention as multi-query attention: head_dim_k r + rope, values = the
//             first r entries of each cached row)
//   v_h [v_head_dim] = wv_b_h · o_h  → Attn [n][H·v_head_dim]
#include <cstring>
#include <optional>

#include "kernels/kernels.h"
#include "cpu/thread_pool.h"
#include "model/blocks.h"
#include "model/cpu_backend.h"
#include "model/model.h"
#include "model/profile.h"

namespace ktd {

// y_h [n][rows] = st.mats[h] · x_h [n][k] for every head h; x and y are head-major
// ([n_head][n][k] and [n_head][n][rows]). With at least as many heads as workers each worker runs
// whole heads (small decode matmuls would not amortize a pool dispatch each); otherwise every head
// is one pooled matmul.
void CpuBackend::per_head_matmul(const MatrixStack &st, const float *x, int64_t k, float *y, int64_t rows) {
    const int64_t n = n_;
    const size_t n_head = st.mats.size();
    if (n_head >= size_t(pool_.size())) {
        pool_.parallel_for(n_head, [&](size_t h0, size_t h1, int tid) {
            for (size_t h = h0; h < h1; ++h)
                matmul(nullptr, st.mats[h].for_worker(tid), x + int64_t(h) * n * k, n, y + int64_t(h) * n * rows,
                       s_.mm_thread[size_t(tid)]);
        });
        return;
    }
    for (size_t h = 0; h < n_head; ++h) matmul(&pool_, st.mats[h], x + int64_t(h) * n * k, n, y + int64_t(h) * n * rows, s_.mm);
}

void CpuBackend::mla_attention(const LayerWeights &w, int il) {
    const HParams &hp = hp_;
    const MlaParams &m = hp.mla;
    const int64_t n = n_, H = hp.n_head, ql = m.q_lora_rank;
    const int64_t nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim, r = m.kv_lora_rank, dv = m.v_head_dim;
    const int64_t hq = nope + rope;  // decompressed q head
    const int64_t hk = r + rope;     // absorbed q head = cache row
    float *q = s_.mla_q.data();      // [n][H][hq]
    float *kv = s_.k.data();         // [n][r + rope]: the cache rows
    // Each emplace ends the previous part's timer (no-ops unless profiling; profile.h).
    ForwardProfile *prof = taps_.profile;
    std::optional<OpTimer> part(std::in_place, prof, ForwardOp::MlaProject);
    // The query's first projection and the latent read the same input: one pool region.
    const MatmulJob in[] = {{w.wq_a ? &w.wq_a.pw : &w.wq.pw, w.wq_a ? s_.mla_q_a.data() : q, nullptr},
                            {&w.wkv_a_mqa.pw, kv, nullptr}};
    matmul_multi(&pool_, in, 2, s_.xn.data(), n, s_.mm);
    if (w.wq_a) {
        float *qa = s_.mla_q_a.data();  // [n][q_lora_rank]
        for_each_row(pool_, n, kMinParallelRows,
                     [&](int64_t i) { rms_norm(qa + i * ql, w.attn_q_a_norm.data(), qa + i * ql, ql, hp.norm_eps); });
        linear(w.wq_b, qa, q);
    }
    part.emplace(prof, ForwardOp::MlaAbsorb);
    float *heads = s_.mla_heads.data();  // head-major scratch
    for_each_row(pool_, n, kMinParallelRows, [&](int64_t i) {
        const float *cs = &s_.rope_cs[size_t(i * hp.rope.n_rot)];
        float *ki = kv + i * hk, *qi = q + i * H * hq;
        rms_norm(ki, w.attn_kv_a_norm.data(), ki, r, hp.norm_eps);
        rope_apply(hp.rope, cs, ki + r, 1, rope);
        rope_apply(hp.rope, cs, qi + nope, int(H), hq);
        for (int64_t h = 0; h < H; ++h) std::memcpy(heads + (h * n + i) * nope, qi + h * hq, size_t(nope) * sizeof(float));
    });
    // Absorb q_nope into the latent: q_lat [H][n][r] (in s.attn, free until attention runs), then
    // the scaled MQA query [n][H][r + rope] = [q_lat; q_pe].
    float *q_lat = s_.attn.data();
    per_head_matmul(w.wk_b, heads, nope, q_lat, r);
    for_each_row(pool_, n, kMinParallelRows, [&](int64_t i) {
        for (int64_t h = 0; h < H; ++h) {
            float *dst = s_.q.data() + (i * H + h) * hk;
            const float *lat = q_lat + (h * n + i) * r, *pe = q + (i * H + h) * hq + nope;
            for (int64_t d = 0; d < r; ++d) dst[d] = lat[d] * hp.attn_scale;
            for (int64_t d = 0; d < rope; ++d) dst[r + d] = pe[d] * hp.attn_scale;
        }
    });
    part.emplace(prof, ForwardOp::MlaCache);
    attention(il);  // s.attn [n][H][r]: latent outputs
    part.emplace(prof, ForwardOp::MlaDecompress);
    // Decompress each head's output: head-major copy (into s.q, free now), v [H][n][dv], then the
    // token-major Attn [n][H·dv] that wo reads.
    float *o_lat = s_.q.data();
    for_each_row(pool_, n, kMinParallelRows, [&](int64_t i) {
        for (int64_t h = 0; h < H; ++h)
            std::memcpy(o_lat + (h * n + i) * r, s_.attn.data() + (i * H + h) * r, size_t(r) * sizeof(float));
    });
    per_head_matmul(w.wv_b, o_lat, r, heads, dv);
    for_each_row(pool_, n, kMinParallelRows, [&](int64_t i) {
        for (int64_t h = 0; h < H; ++h)
            std::memcpy(s_.attn.data() + (i * H + h) * dv, heads + (h * n + i) * dv, size_t(dv) * sizeof(float));
    });
}

}  // namespace ktd
