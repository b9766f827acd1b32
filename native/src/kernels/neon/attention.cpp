// NEON attention (see kernels/attention.h), the twin of kernels/avx2/attention.cpp with 4-float
// registers: keys and values are read as F16 straight from the cache (FCVTL, Armv8-A) and a row's
// query heads go up to four at a time, so that each key or value vector loaded feeds four queries
// from registers. Per query the arithmetic is the same whatever the heads it goes with:
//   scores: 4 keys at a time, 4 lane-parallel dot products (FMLA, ascending d) reduced with one
//           pairwise-add tree
//   softmax: vectorised exp (neon/vec_math.h, Cephes polynomial, ~2 ulp), lanes outside the
//            query's range are 0
//   P·V:    the queries' accumulators, 4·NV floats each, stay in registers over the keys
// Head dims that are not multiples of 4 go to the reference kernel. Within F32 rounding of the
// reference (tests/kernels/test_attention.py's tolerance for every ISA). dotprod and i8mm use it
// (isa_fallback).
#include <arm_neon.h>

#include <math.h>

#include <cstring>

#include "kernels/attention.h"
#include "kernels/neon/vec_math.h"

namespace ktd::neon {

namespace {

int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
float max_f(float a, float b) { return a > b ? a : b; }

float32x4_t load_f16(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

// Scores of NH queries (q[h], hdk floats each) against 4 consecutive F16 keys (row stride ks
// elements): lane i of s4[h] = q[h] · key i, one accumulator per (query, key) summed over d in
// ascending order, so a query's scores do not depend on the heads it is computed with. Every key
// vector loaded (and widened) feeds NH queries from registers.
template <int NH>
void scores4(const float *const *q, const uint16_t *k, size_t ks, int64_t hdk, float32x4_t *s4) {
    float32x4_t acc[NH][4];
    for (int h = 0; h < NH; ++h)
        for (int i = 0; i < 4; ++i) acc[h][i] = vdupq_n_f32(0.0f);
    for (int64_t d = 0; d < hdk; d += 4) {
        float32x4_t kv[4];
        for (int i = 0; i < 4; ++i) kv[i] = load_f16(k + i * ks + d);
        for (int h = 0; h < NH; ++h) {
            const float32x4_t qv = vld1q_f32(q[h] + d);
            for (int i = 0; i < 4; ++i) acc[h][i] = vfmaq_f32(acc[h][i], qv, kv[i]);
        }
    }
    // lane i = the sum of acc[h][i]'s lanes
    for (int h = 0; h < NH; ++h)
        s4[h] = vpaddq_f32(vpaddq_f32(acc[h][0], acc[h][1]), vpaddq_f32(acc[h][2], acc[h][3]));
}

// For each of NH queries: acc[h][0..4·NV) = acc[h] · c[h] + Σ_{j in [a, e)} p[h][j] · v_j[0..4·NV)
// (F16 value rows, stride vs elements), keys in ascending order; each value vector loaded feeds NH
// queries.
template <int NH, int NV>
void pv_chunk(float *const *acc, const float *c, const float *const *p, const uint16_t *v, size_t vs, int a, int e) {
    float32x4_t o[NH][NV];
    for (int h = 0; h < NH; ++h) {
        const float32x4_t ch = vdupq_n_f32(c[h]);
        for (int i = 0; i < NV; ++i) o[h][i] = vmulq_f32(vld1q_f32(acc[h] + 4 * i), ch);
    }
    for (int j = a; j < e; ++j) {
        const uint16_t *vj = v + size_t(j) * vs;
        float32x4_t vv[NV];
        for (int i = 0; i < NV; ++i) vv[i] = load_f16(vj + 4 * i);
        for (int h = 0; h < NH; ++h) {
            const float32x4_t pj = vdupq_n_f32(p[h][j]);
            for (int i = 0; i < NV; ++i) o[h][i] = vfmaq_f32(o[h][i], pj, vv[i]);
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int i = 0; i < NV; ++i) vst1q_f32(acc[h] + 4 * i, o[h][i]);
}

// pv_chunk over the whole head_dim_v (a multiple of 4) in chunks of NV vectors, the rest one by one.
template <int NH, int NV>
void pv(float *const *acc, int64_t hdv, const float *c, const float *const *p, const uint16_t *v, size_t vs, int a,
        int e) {
    float *ac[NH];
    int64_t d0 = 0;
    for (; d0 + 4 * NV <= hdv; d0 += 4 * NV) {
        for (int h = 0; h < NH; ++h) ac[h] = acc[h] + d0;
        pv_chunk<NH, NV>(ac, c, p, v + d0, vs, a, e);
    }
    for (; d0 < hdv; d0 += 4) {
        for (int h = 0; h < NH; ++h) ac[h] = acc[h] + d0;
        pv_chunk<NH, 1>(ac, c, p, v + d0, vs, a, e);
    }
}

// Query heads per block: their scores and P·V read each key/value vector once for all of them.
constexpr int kHeadBlock = 4;

// One tile of kAttnTile keys from t0 as the queries read it, F16 straight from the cache. The
// scores go 4 keys at a time from offset (a & ~3): a 4-key group that reaches outside the tile's
// keys [ta, tb) (cache rows that may not exist) is read from a zero-padded copy instead, pad[0]
// for the group at offset pad_at[0], the next 4 × hdk values for pad_at[1] (-1: none).
struct Tile {
    const uint16_t *k, *v;  // key / value t0
    size_t ks, vs;          // row strides (elements)
    int64_t hdk, hdv;
    const uint16_t *pad;
    int pad_at[2];

    // Key j (offset from t0, a multiple of 4) and its row stride.
    const uint16_t *keys4(int j, size_t &stride) const {
        for (int i = 0; i < 2; ++i)
            if (j == pad_at[i]) {
                stride = size_t(hdk);
                return pad + size_t(i) * 4 * size_t(hdk);
            }
        stride = ks;
        return k + size_t(j) * ks;
    }
};

// Queries (r, g0 .. g0 + NH) over keys [a, e) of one tile (offsets from its start): scores, the
// online-softmax update and P·V (NV value vectors per pv_chunk: NH·NV accumulators in registers).
template <int NH>
void attend_heads(const AttnBlock &b, int r, int g0, const Tile &t, int a, int e, float *scratch,
                  const AttnScratchLayout &lay) {
    constexpr int NV = NH <= 2 ? 8 : 4;
    const float *q[NH];
    float *s[NH], *acc[NH];
    int qi[NH];
    for (int h = 0; h < NH; ++h) {
        qi[h] = r * b.n_group + g0 + h;
        q[h] = b.q + size_t(r) * b.q_row_stride + size_t(g0 + h) * size_t(t.hdk);
        s[h] = scratch + lay.s + size_t(qi[h]) * kAttnTile;
        acc[h] = scratch + lay.acc + size_t(qi[h]) * size_t(t.hdv);
    }
    float *mx = scratch + lay.m, *sum = scratch + lay.l;
    const int32_t lanes[4] = {0, 1, 2, 3};
    const int32x4_t lane = vld1q_s32(lanes), va = vdupq_n_s32(a), ve = vdupq_n_s32(e);
    const float32x4_t ninf = vdupq_n_f32(-INFINITY);
    const int j0 = a & ~3;
    float32x4_t vmax[NH];
    for (int h = 0; h < NH; ++h) vmax[h] = ninf;
    for (int j = j0; j < e; j += 4) {
        const int32x4_t idx = vaddq_s32(lane, vdupq_n_s32(j));
        const uint32x4_t in = vandq_u32(vcleq_s32(va, idx), vcgtq_s32(ve, idx));  // a <= idx < e
        size_t ks;
        const uint16_t *k4 = t.keys4(j, ks);
        float32x4_t s4[NH];
        scores4<NH>(q, k4, ks, t.hdk, s4);
        for (int h = 0; h < NH; ++h) {
            const float32x4_t m4 = vbslq_f32(in, s4[h], ninf);
            vst1q_f32(s[h] + j, m4);
            vmax[h] = vmaxq_f32(vmax[h], m4);
        }
    }
    float correction[NH];
    for (int h = 0; h < NH; ++h) {
        const float m_old = mx[qi[h]], m_new = max_f(m_old, vmaxvq_f32(vmax[h]));
        correction[h] = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
        const float32x4_t vm = vdupq_n_f32(m_new);
        float32x4_t psum = vdupq_n_f32(0.0f);
        for (int j = j0; j < e; j += 4) {
            const float32x4_t s4 = vld1q_f32(s[h] + j);
            // Lanes out of range hold -inf: exp_ps would give ~1e-38 there, so zero them.
            const uint32x4_t drop = vceqq_f32(s4, ninf);
            const float32x4_t p4 =
                vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(exp_ps(vsubq_f32(s4, vm))), drop));
            vst1q_f32(s[h] + j, p4);
            psum = vaddq_f32(psum, p4);
        }
        sum[qi[h]] = sum[qi[h]] * correction[h] + vaddvq_f32(psum);
        mx[qi[h]] = m_new;
    }
    pv<NH, NV>(acc, t.hdv, correction, s, t.v, t.vs, a, e);
}

void attend_block(const AttnBlock &b, float *scratch) {
    const int64_t hdk = b.head_dim_k, hdv = b.head_dim_v;
    if (hdk % 4 != 0 || hdv % 4 != 0) {
        find_attention_kernel(Isa::Ref)(b, scratch);
        return;
    }
    const AttnScratchLayout lay = attn_scratch_layout(b.n_rows, b.n_group, hdk, hdv);
    uint16_t *pad = reinterpret_cast<uint16_t *>(scratch + lay.pad);  // the padded 4-key groups
    float *mx = scratch + lay.m, *sum = scratch + lay.l, *acc = scratch + lay.acc;
    const int nq = b.n_rows * b.n_group;
    int64_t lo_min = b.lo[0], hi_max = b.hi[0];
    for (int r = 1; r < b.n_rows; ++r) {
        lo_min = min64(lo_min, b.lo[r]);
        hi_max = max64(hi_max, b.hi[r]);
    }
    for (int i = 0; i < nq; ++i) {
        mx[i] = -INFINITY;
        sum[i] = 0.0f;
    }
    std::memset(acc, 0, sizeof(float) * size_t(nq) * size_t(hdv));
    for (int64_t t0 = lo_min - lo_min % kAttnTile; t0 < hi_max; t0 += kAttnTile) {
        const int64_t ta = max64(t0, lo_min), tb = min64(t0 + kAttnTile, hi_max);
        Tile t{b.k + size_t(t0) * b.k_stride, b.v + size_t(t0) * b.v_stride, b.k_stride, b.v_stride, hdk, hdv,
               pad, {}};
        attn_pad_key_groups(b, t0, ta, tb, 4, pad, t.pad_at);
        for (int r = 0; r < b.n_rows; ++r) {
            const int64_t a64 = max64(t0, b.lo[r]), e64 = min64(t0 + kAttnTile, b.hi[r]);
            if (a64 >= e64) continue;
            const int a = int(a64 - t0), e = int(e64 - t0);  // the row's keys in this tile
            // The row's query heads kHeadBlock at a time, the remainder as one smaller block.
            int g = 0;
            for (; g + kHeadBlock <= b.n_group; g += kHeadBlock) attend_heads<kHeadBlock>(b, r, g, t, a, e, scratch, lay);
            switch (b.n_group - g) {
                case 1: attend_heads<1>(b, r, g, t, a, e, scratch, lay); break;
                case 2: attend_heads<2>(b, r, g, t, a, e, scratch, lay); break;
                case 3: attend_heads<3>(b, r, g, t, a, e, scratch, lay); break;
                default: break;
            }
        }
    }
    for (int r = 0; r < b.n_rows; ++r)
        for (int g = 0; g < b.n_group; ++g) {
            const int qi = r * b.n_group + g;
            const float32x4_t inv = vdupq_n_f32(sum[qi] > 0.0f ? 1.0f / sum[qi] : 0.0f);
            const float *a = acc + size_t(qi) * size_t(hdv);
            float *o = b.out + size_t(r) * b.out_row_stride + size_t(g) * size_t(hdv);
            for (int64_t d = 0; d < hdv; d += 4) vst1q_f32(o + d, vmulq_f32(vld1q_f32(a + d), inv));
            if (b.m_out) b.m_out[qi] = mx[qi];
            if (b.l_out) b.l_out[qi] = sum[qi];
        }
}

}  // namespace

KTD_REGISTER_ATTENTION(Isa::NEON, attend_block);

}  // namespace ktd::neon
