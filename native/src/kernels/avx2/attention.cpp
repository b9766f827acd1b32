// AVX2+FMA+F16C attention (see kernels/attention.h): per block, each K/V tile is converted from
// F16 once (vcvtph2ps) into F32 scratch and then used by all the block's queries.
//   scores: 8 keys at a time, 8 lane-parallel dot products reduced with one hadd tree
//   softmax: vectorised exp (Cephes polynomial, ~2 ulp), lanes outside the query's range are 0
//   P·V:    the query's accumulator, up to 64 floats at a time, stays in registers over the keys
// Head dims that are not multiples of 8 go to the reference kernel. No std:: templates or inline
// functions shared with baseline code here (see kernels/x86/common.h).
#include <immintrin.h>

#include <math.h>

#include <cstring>

#include "kernels/attention.h"
#include "kernels/avx2/vec_math.h"
#include "kernels/x86/common.h"

namespace ktd::avx2 {

namespace {

int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
float max_f(float a, float b) { return a > b ? a : b; }

float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// Lane i of the result = the sum of the 8 lanes of acc[i].
__m256 reduce8(const __m256 *acc) {
    const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of query q against the 8 F32 keys kf[0..8) (row stride hdk).
__m256 scores8(const float *q, const float *kf, int64_t hdk) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hdk; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + i * hdk + d), acc[i]);
    }
    return reduce8(acc);
}

// acc[0..8·NV) = acc · correction + Σ_{j in [a, e)} p[j] · vf[j][0..8·NV)  (vf row stride ldv)
template <int NV>
void pv_chunk(float *acc, float correction, const float *p, const float *vf, size_t ldv, int a, int e) {
    const __m256 c = _mm256_set1_ps(correction);
    __m256 o[NV];
    for (int i = 0; i < NV; ++i) o[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), c);
    for (int j = a; j < e; ++j) {
        const __m256 pj = _mm256_broadcast_ss(p + j);
        const float *vj = vf + size_t(j) * ldv;
        for (int i = 0; i < NV; ++i) o[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), o[i]);
    }
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, o[i]);
}

void pv(float *acc, int64_t hdv, float correction, const float *p, const float *vf, size_t ldv, int a, int e) {
    for (int64_t d0 = 0; d0 < hdv; d0 += 64) {
        const int nv = int(min64(64, hdv - d0) / 8);
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
            default: pv_chunk<8>(ac, correction, p, vc, ldv, a, e); break;
        }
    }
}

// Rows [j0, j1) of an F16 matrix (row stride `stride` elements) → F32 rows of `dim` floats.
void convert_rows(const uint16_t *src, size_t stride, int64_t j0, int64_t j1, int64_t dim, float *dst) {
    for (int64_t j = j0; j < j1; ++j) {
        const uint16_t *s = src + size_t(j) * stride;
        float *o = dst + size_t(j - j0) * size_t(dim);
        for (int64_t d = 0; d < dim; d += 8)
            _mm256_storeu_ps(o + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s + d))));
    }
}

void attend_block(const AttnBlock &b, float *scratch) {
    const int64_t hdk = b.head_dim_k, hdv = b.head_dim_v;
    if (hdk % 8 != 0 || hdv % 8 != 0) {
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
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t t0 = lo_min - lo_min % kAttnTile; t0 < hi_max; t0 += kAttnTile) {
        const int64_t ta = max64(t0, lo_min), tb = min64(t0 + kAttnTile, hi_max);
        // The tile's keys in F32; the rows that share an 8-key group with them but are outside
        // [ta, tb) are zeroed (their scores are computed, then masked).
        const int64_t za = (ta - t0) & ~int64_t(7), zb = min64(kAttnTile, ((tb - t0) + 7) & ~int64_t(7));
        std::memset(kf + za * hdk, 0, sizeof(float) * size_t((ta - t0 - za) * hdk));
        std::memset(kf + (tb - t0) * hdk, 0, sizeof(float) * size_t((zb - (tb - t0)) * hdk));
        convert_rows(b.k, b.k_stride, ta, tb, hdk, kf + (ta - t0) * hdk);
        if (!v_in_k) convert_rows(b.v, b.v_stride, ta, tb, hdv, vf + (ta - t0) * hdv);
        for (int r = 0; r < b.n_rows; ++r) {
            const int64_t a64 = max64(t0, b.lo[r]), e64 = min64(t0 + kAttnTile, b.hi[r]);
            if (a64 >= e64) continue;
            const int a = int(a64 - t0), e = int(e64 - t0);  // the row's keys in this tile
            const __m256i va = _mm256_set1_epi32(a), ve = _mm256_set1_epi32(e);
            const int g0 = a & ~7;
            for (int g = 0; g < b.n_group; ++g) {
                const int qi = r * b.n_group + g;
                const float *q = b.q + size_t(r) * b.q_row_stride + size_t(g) * size_t(hdk);
                float *s = sc + size_t(qi) * kAttnTile;
                __m256 vmax = _mm256_set1_ps(-INFINITY);
                for (int j = g0; j < e; j += 8) {
                    const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(j));
                    // in range: a <= idx < e
                    const __m256 in = _mm256_castsi256_ps(_mm256_andnot_si256(
                        _mm256_cmpgt_epi32(va, idx), _mm256_cmpgt_epi32(ve, idx)));
                    const __m256 s8 = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scores8(q, kf + j * hdk, hdk), in);
                    _mm256_storeu_ps(s + j, s8);
                    vmax = _mm256_max_ps(vmax, s8);
                }
                const float m_old = mx[qi], m_new = max_f(m_old, hmax(vmax));
                const float correction = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                const __m256 vm = _mm256_set1_ps(m_new);
                __m256 psum = _mm256_setzero_ps();
                for (int j = g0; j < e; j += 8) {
                    const __m256 s8 = _mm256_loadu_ps(s + j);
                    // Lanes out of range hold -inf: exp_ps would give ~1e-38 there, so zero them.
                    const __m256 keep = _mm256_cmp_ps(s8, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                    const __m256 p8 = _mm256_and_ps(exp_ps(_mm256_sub_ps(s8, vm)), keep);
                    _mm256_storeu_ps(s + j, p8);
                    psum = _mm256_add_ps(psum, p8);
                }
                sum[qi] = sum[qi] * correction + hsum(psum);
                mx[qi] = m_new;
                pv(acc + size_t(qi) * size_t(hdv), hdv, correction, s, vf, ldv, a, e);
            }
        }
    }
    for (int r = 0; r < b.n_rows; ++r)
        for (int g = 0; g < b.n_group; ++g) {
            const int qi = r * b.n_group + g;
            const __m256 inv = _mm256_set1_ps(sum[qi] > 0.0f ? 1.0f / sum[qi] : 0.0f);
            const float *a = acc + size_t(qi) * size_t(hdv);
            float *o = b.out + size_t(r) * b.out_row_stride + size_t(g) * size_t(hdv);
            for (int64_t d = 0; d < hdv; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), inv));
            if (b.m_out) b.m_out[qi] = mx[qi];
            if (b.l_out) b.l_out[qi] = sum[qi];
        }
}

}  // namespace

KTD_REGISTER_ATTENTION(Isa::AVX2, attend_block);

}  // namespace ktd::avx2
