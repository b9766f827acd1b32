// NEON attention (see kernels/attention.h), the twin of kernels/avx2/attention.cpp with 4-float
// registers: per block, each K/V tile is converted from F16 once (FCVTL, Armv8-A) into F32
// scratch and then used by all the block's queries.
//   scores: 4 keys at a time, 4 lane-parallel dot products (FMLA) reduced with one pairwise-add tree
//   softmax: vectorised exp (neon/vec_math.h, Cephes polynomial, ~2 ulp), lanes outside the
//            query's range are 0
//   P·V:    the query's accumulator, up to 64 floats at a time, stays in registers over the keys
// Head dims that are not multiples of 4 go to the reference kernel. Within F32 rounding of the
// reference (tests/test_attention.py's tolerance for every ISA). dotprod and i8mm use it
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

// Scores of query q against the 4 F32 keys kf[0..4) (row stride hdk).
float32x4_t scores4(const float *q, const float *kf, int64_t hdk) {
    float32x4_t acc[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    for (int64_t d = 0; d < hdk; d += 4) {
        const float32x4_t qv = vld1q_f32(q + d);
        for (int i = 0; i < 4; ++i) acc[i] = vfmaq_f32(acc[i], qv, vld1q_f32(kf + i * hdk + d));
    }
    // lane i = the sum of acc[i]'s lanes
    return vpaddq_f32(vpaddq_f32(acc[0], acc[1]), vpaddq_f32(acc[2], acc[3]));
}

// acc[0..4·NV) = acc · correction + Σ_{j in [a, e)} p[j] · vf[j][0..4·NV)  (vf row stride ldv)
template <int NV>
void pv_chunk(float *acc, float correction, const float *p, const float *vf, size_t ldv, int a, int e) {
    const float32x4_t c = vdupq_n_f32(correction);
    float32x4_t o[NV];
    for (int i = 0; i < NV; ++i) o[i] = vmulq_f32(vld1q_f32(acc + 4 * i), c);
    for (int j = a; j < e; ++j) {
        const float32x4_t pj = vdupq_n_f32(p[j]);
        const float *vj = vf + size_t(j) * ldv;
        for (int i = 0; i < NV; ++i) o[i] = vfmaq_f32(o[i], pj, vld1q_f32(vj + 4 * i));
    }
    for (int i = 0; i < NV; ++i) vst1q_f32(acc + 4 * i, o[i]);
}

void pv(float *acc, int64_t hdv, float correction, const float *p, const float *vf, size_t ldv, int a, int e) {
    for (int64_t d0 = 0; d0 < hdv; d0 += 64) {
        const int nv = int(min64(64, hdv - d0) / 4);
        float *ac = acc + d0;
        const float *vc = vf + d0;
        switch (nv) {
            case 1: pv_chunk<1>(ac, correction, p, vc, ldv, a, e); break;
            case 2: pv_chunk<2>(ac, correction, p, vc, ldv, a, e); break;
            case 3: pv_chunk<3>(ac, correction, p, vc, ldv, a, e); break;
            case 4: pv_chunk<4>(ac, correction, p, vc, ldv, a, e); break;
            case 5: pv_chunk<5>(ac, correction, p, vc, ldv, a, e); break;
            case 6: pv_chunk<6>(ac, correction, p, vc, ldv, a, e); break;
            case 7: pv_chunk<7>(ac, correction, p, vc, ldv, a, e); break;
            case 8: pv_chunk<8>(ac, correction, p, vc, ldv, a, e); break;
            case 9: pv_chunk<9>(ac, correction, p, vc, ldv, a, e); break;
            case 10: pv_chunk<10>(ac, correction, p, vc, ldv, a, e); break;
            case 11: pv_chunk<11>(ac, correction, p, vc, ldv, a, e); break;
            case 12: pv_chunk<12>(ac, correction, p, vc, ldv, a, e); break;
            case 13: pv_chunk<13>(ac, correction, p, vc, ldv, a, e); break;
            case 14: pv_chunk<14>(ac, correction, p, vc, ldv, a, e); break;
            case 15: pv_chunk<15>(ac, correction, p, vc, ldv, a, e); break;
            default: pv_chunk<16>(ac, correction, p, vc, ldv, a, e); break;
        }
    }
}

// Rows [j0, j1) of an F16 matrix (row stride `stride` elements) → F32 rows of `dim` floats.
void convert_rows(const uint16_t *src, size_t stride, int64_t j0, int64_t j1, int64_t dim, float *dst) {
    for (int64_t j = j0; j < j1; ++j) {
        const uint16_t *s = src + size_t(j) * stride;
        float *o = dst + size_t(j - j0) * size_t(dim);
        for (int64_t d = 0; d < dim; d += 4) vst1q_f32(o + d, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(s + d))));
    }
}

void attend_block(const AttnBlock &b, float *scratch) {
    const int64_t hdk = b.head_dim_k, hdv = b.head_dim_v;
    if (hdk % 4 != 0 || hdv % 4 != 0) {
        find_attention_kernel(Isa::Ref)(b, scratch);
        return;
    }
    const AttnScratchLayout lay = attn_scratch_layout(b.n_rows, b.n_group, hdk, hdv);
    // Values that are the leading entries of the key rows (MLA's latent) are read from the K tile.
    const bool v_in_k = b.v == b.k && b.v_stride == b.k_stride && hdv <= hdk;
    float *kf = scratch + lay.kf, *vf = v_in_k ? kf : scratch + lay.vf, *sc = scratch + lay.s;
    const size_t ldv = size_t(v_in_k ? hdk : hdv);
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
    const int32_t lanes[4] = {0, 1, 2, 3};
    const int32x4_t lane = vld1q_s32(lanes);
    const float32x4_t ninf = vdupq_n_f32(-INFINITY);
    for (int64_t t0 = lo_min - lo_min % kAttnTile; t0 < hi_max; t0 += kAttnTile) {
        const int64_t ta = max64(t0, lo_min), tb = min64(t0 + kAttnTile, hi_max);
        // The tile's keys in F32; the rows that share a 4-key group with them but are outside
        // [ta, tb) are zeroed (their scores are computed, then masked).
        const int64_t za = (ta - t0) & ~int64_t(3), zb = min64(kAttnTile, ((tb - t0) + 3) & ~int64_t(3));
        std::memset(kf + za * hdk, 0, sizeof(float) * size_t((ta - t0 - za) * hdk));
        std::memset(kf + (tb - t0) * hdk, 0, sizeof(float) * size_t((zb - (tb - t0)) * hdk));
        convert_rows(b.k, b.k_stride, ta, tb, hdk, kf + (ta - t0) * hdk);
        if (!v_in_k) convert_rows(b.v, b.v_stride, ta, tb, hdv, vf + (ta - t0) * hdv);
        for (int r = 0; r < b.n_rows; ++r) {
            const int64_t a64 = max64(t0, b.lo[r]), e64 = min64(t0 + kAttnTile, b.hi[r]);
            if (a64 >= e64) continue;
            const int a = int(a64 - t0), e = int(e64 - t0);  // the row's keys in this tile
            const int32x4_t va = vdupq_n_s32(a), ve = vdupq_n_s32(e);
            const int g0 = a & ~3;
            for (int g = 0; g < b.n_group; ++g) {
                const int qi = r * b.n_group + g;
                const float *q = b.q + size_t(r) * b.q_row_stride + size_t(g) * size_t(hdk);
                float *s = sc + size_t(qi) * kAttnTile;
                float32x4_t vmax = ninf;
                for (int j = g0; j < e; j += 4) {
                    const int32x4_t idx = vaddq_s32(lane, vdupq_n_s32(j));
                    const uint32x4_t in = vandq_u32(vcleq_s32(va, idx), vcgtq_s32(ve, idx));  // a <= idx < e
                    const float32x4_t s4 = vbslq_f32(in, scores4(q, kf + j * hdk, hdk), ninf);
                    vst1q_f32(s + j, s4);
                    vmax = vmaxq_f32(vmax, s4);
                }
                const float m_old = mx[qi], m_new = max_f(m_old, vmaxvq_f32(vmax));
                const float correction = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                const float32x4_t vm = vdupq_n_f32(m_new);
                float32x4_t psum = vdupq_n_f32(0.0f);
                for (int j = g0; j < e; j += 4) {
                    const float32x4_t s4 = vld1q_f32(s + j);
                    // Lanes out of range hold -inf: exp_ps would give ~1e-38 there, so zero them.
                    const uint32x4_t drop = vceqq_f32(s4, ninf);
                    const float32x4_t p4 =
                        vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(exp_ps(vsubq_f32(s4, vm))), drop));
                    vst1q_f32(s + j, p4);
                    psum = vaddq_f32(psum, p4);
                }
                sum[qi] = sum[qi] * correction + vaddvq_f32(psum);
                mx[qi] = m_new;
                pv(acc + size_t(qi) * size_t(hdv), hdv, correction, s, vf, ldv, a, e);
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
