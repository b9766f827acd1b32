// The attention specification: every query on its own, scalar, keys converted with the exact
// F16 → F32 of common/float16.h. Tiles are aligned to multiples of kAttnTile in key position, so a
// query's tiles (and its result) depend only on its own key range [lo, hi).
#include <algorithm>
#include <cmath>

#include "common/float16.h"
#include "kernels/attention.h"

namespace ktd::ref {

namespace {

// Returns the query's max score and sum of exp(score - max) in *m_out, *l_out.
void attend_query(const float *q, const AttnBlock &b, int64_t lo, int64_t hi, float *out, float *scores, float *m_out,
                  float *l_out) {
    const int64_t hdk = b.head_dim_k, hdv = b.head_dim_v;
    float m = -INFINITY, sum = 0.0f;
    std::fill(out, out + hdv, 0.0f);
    for (int64_t t0 = lo - lo % kAttnTile; t0 < hi; t0 += kAttnTile) {
        const int64_t a = std::max(t0, lo), e = std::min(t0 + kAttnTile, hi);
        float tile_max = -INFINITY;
        for (int64_t j = a; j < e; ++j) {
            const uint16_t *kj = b.k + size_t(j) * b.k_stride;
            float s = 0.0f;
            for (int64_t d = 0; d < hdk; ++d) s += q[d] * fp16_to_fp32(kj[d]);
            scores[j - t0] = s;
            tile_max = std::max(tile_max, s);
        }
        const float m_new = std::max(m, tile_max);
        const float correction = std::exp(m - m_new);  // 0 on the first tile (m = -inf)
        sum *= correction;
        for (int64_t d = 0; d < hdv; ++d) out[d] *= correction;
        for (int64_t j = a; j < e; ++j) {
            const float p = std::exp(scores[j - t0] - m_new);
            sum += p;
            const uint16_t *vj = b.v + size_t(j) * b.v_stride;
            for (int64_t d = 0; d < hdv; ++d) out[d] += p * fp16_to_fp32(vj[d]);
        }
        m = m_new;
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t d = 0; d < hdv; ++d) out[d] *= inv;
    *m_out = m;
    *l_out = sum;
}

void attend_block(const AttnBlock &b, float *scratch) {
    float *scores = scratch + attn_scratch_layout(b.n_rows, b.n_group, b.head_dim_k, b.head_dim_v).s;
    for (int r = 0; r < b.n_rows; ++r)
        for (int g = 0; g < b.n_group; ++g) {
            const int qi = r * b.n_group + g;
            float m, l;
            attend_query(b.q + size_t(r) * b.q_row_stride + size_t(g) * size_t(b.head_dim_k), b, b.lo[r], b.hi[r],
                         b.out + size_t(r) * b.out_row_stride + size_t(g) * size_t(b.head_dim_v), scores, &m, &l);
            if (b.m_out) b.m_out[qi] = m;
            if (b.l_out) b.l_out[qi] = l;
        }
}

}  // namespace

KTD_REGISTER_ATTENTION(Isa::Ref, attend_block);

}  // namespace ktd::ref
