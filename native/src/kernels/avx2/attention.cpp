// AVX2+FMA+F16C attention (see kernels/attention.h): keys and values are read as F16 straight
// from the cache (vcvtph2ps as they are loaded) and a row's query heads (the GQA group, or MLA's
// heads over the one latent) go two at a time, so that each key or value vector loaded feeds two
// queries from registers, next to four keys' (or four value vectors') accumulators per query: the
// cache rows are read once per two heads instead of once per head. Per query the arithmetic is
// the same whatever the heads it goes with:
//   scores: 8 keys at a time, 8 lane-parallel dot products (ascending d) reduced with one hadd tree
//   softmax: vectorised exp (Cephes polynomial, ~2 ulp), lanes outside the query's range are 0
//   P·V:    the queries' accumulators, 8·NV floats each, stay in registers over the keys
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

__m256 load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }

// Dot products of NH queries (q[h], hdk floats each) with KB consecutive F16 keys (row stride
// ks elements), one 8-lane accumulator per (query, key), summed over d in ascending order:
// out[h][i] is key i's accumulator for query h. Every key vector loaded (and widened) feeds NH
// queries from registers.
template <int NH, int KB>
void dot_block(const float *const *q, const uint16_t *k, size_t ks, int64_t hdk, __m256 (*out)[8]) {
    __m256 acc[NH][KB];
    for (int h = 0; h < NH; ++h)
        for (int i = 0; i < KB; ++i) acc[h][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hdk; d += 8) {
        __m256 kv[KB];
        for (int i = 0; i < KB; ++i) kv[i] = load_f16(k + i * ks + d);
        for (int h = 0; h < NH; ++h) {
            const __m256 qv = _mm256_loadu_ps(q[h] + d);
            for (int i = 0; i < KB; ++i) acc[h][i] = _mm256_fmadd_ps(qv, kv[i], acc[h][i]);
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int i = 0; i < KB; ++i) out[h][i] = acc[h][i];
}

// Scores of NH queries against 8 consecutive F16 keys (row stride ks): lane i of s8[h] =
// q[h] · key i. The (query, key) accumulators are the same for any NH and KB, so a query's scores
// do not depend on the heads it is computed with.
template <int NH, int KB>
void scores8(const float *const *q, const uint16_t *k, size_t ks, int64_t hdk, __m256 *s8) {
    __m256 acc[NH][8];
    for (int i = 0; i < 8; i += KB) {
        __m256 part[NH][8];
        dot_block<NH, KB>(q, k + i * ks, ks, hdk, part);
        for (int h = 0; h < NH; ++h)
            for (int b = 0; b < KB; ++b) acc[h][i + b] = part[h][b];
    }
    for (int h = 0; h < NH; ++h) s8[h] = reduce8(acc[h]);
}

// For each of NH queries: acc[h][0..8·NV) = acc[h] · c[h] + Σ_{j in [a, e)} p[h][j] · v_j[0..8·NV)
// (F16 value rows, stride vs elements), keys in ascending order; each value vector loaded feeds NH
// queries.
template <int NH, int NV>
void pv_chunk(float *const *acc, const float *c, const float *const *p, const uint16_t *v, size_t vs, int a, int e) {
    __m256 o[NH][NV];
    for (int h = 0; h < NH; ++h) {
        const __m256 ch = _mm256_set1_ps(c[h]);
        for (int i = 0; i < NV; ++i) o[h][i] = _mm256_mul_ps(_mm256_loadu_ps(acc[h] + 8 * i), ch);
    }
    for (int j = a; j < e; ++j) {
        const uint16_t *vj = v + size_t(j) * vs;
        __m256 vv[NV];
        for (int i = 0; i < NV; ++i) vv[i] = load_f16(vj + 8 * i);
        for (int h = 0; h < NH; ++h) {
            const __m256 pj = _mm256_broadcast_ss(p[h] + j);
            for (int i = 0; i < NV; ++i) o[h][i] = _mm256_fmadd_ps(pj, vv[i], o[h][i]);
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc[h] + 8 * i, o[h][i]);
}

// pv_chunk over the whole head_dim_v (a multiple of 8) in chunks of NV vectors, the rest one by one.
template <int NH, int NV>
void pv(float *const *acc, int64_t hdv, const float *c, const float *const *p, const uint16_t *v, size_t vs, int a,
        int e) {
    float *ac[NH];
    int64_t d0 = 0;
    for (; d0 + 8 * NV <= hdv; d0 += 8 * NV) {
        for (int h = 0; h < NH; ++h) ac[h] = acc[h] + d0;
        pv_chunk<NH, NV>(ac, c, p, v + d0, vs, a, e);
    }
    for (; d0 < hdv; d0 += 8) {
        for (int h = 0; h < NH; ++h) ac[h] = acc[h] + d0;
        pv_chunk<NH, 1>(ac, c, p, v + d0, vs, a, e);
    }
}

// Query heads per block: their scores and P·V read each key/value vector once for all of them.
// Two heads × four keys (and × four value vectors) beat four heads × two: measured hot, one
// thread, builds alternated over 8 rounds (Zen 4, 1024 keys): MLA's 16 heads over the 576-wide
// latent 1.29x (and 1.30x over 64 keys), 8 GQA heads of 128 1.14x, 16 prefill rows of them
// 1.16x, 7 heads of 64 even (0.99-1.07x). One head × eight keys was 0.65-0.86x of two.
constexpr int kHeadBlock = 2;

// One tile of kAttnTile keys from t0 as the queries read it, F16 straight from the cache. The
// scores go 8 keys at a time from offset (a & ~7): an 8-key group that reaches outside the tile's
// keys [ta, tb) (cache rows that may not exist) is read from a zero-padded copy instead, pad[0]
// for the group at offset pad_at[0], the next 8 × hdk values for pad_at[1] (-1: none).
struct Tile {
    const uint16_t *k, *v;  // key / value t0
    size_t ks, vs;          // row strides (elements)
    int64_t hdk, hdv;
    const uint16_t *pad;
    int pad_at[2];

    // Key j (offset from t0, a multiple of 8) and its row stride.
    const uint16_t *keys8(int j, size_t &stride) const {
        for (int i = 0; i < 2; ++i)
            if (j == pad_at[i]) {
                stride = size_t(hdk);
                return pad + size_t(i) * 8 * size_t(hdk);
            }
        stride = ks;
        return k + size_t(j) * ks;
    }
};

// Queries (r, g0 .. g0 + NH) over keys [a, e) of one tile (offsets from its start): scores, the
// online-softmax update and P·V. KB keys per dot_block: NH·KB accumulators stay in registers next
// to the KB key vectors; NV value vectors per pv_chunk likewise.
template <int NH>
void attend_heads(const AttnBlock &b, int r, int g0, const Tile &t, int a, int e, float *scratch,
                  const AttnScratchLayout &lay) {
    constexpr int KB = NH == 1 ? 8 : NH == 2 ? 4 : 2;
    constexpr int NV = NH == 1 ? 8 : NH == 2 ? 4 : 2;
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
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i va = _mm256_set1_epi32(a), ve = _mm256_set1_epi32(e);
    const int j0 = a & ~7;
    __m256 vmax[NH];
    for (int h = 0; h < NH; ++h) vmax[h] = _mm256_set1_ps(-INFINITY);
    for (int j = j0; j < e; j += 8) {
        const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(j));
        // in range: a <= idx < e
        const __m256 in = _mm256_castsi256_ps(
            _mm256_andnot_si256(_mm256_cmpgt_epi32(va, idx), _mm256_cmpgt_epi32(ve, idx)));
        size_t ks;
        const uint16_t *k8 = t.keys8(j, ks);
        __m256 s8[NH];
        scores8<NH, KB>(q, k8, ks, t.hdk, s8);
        for (int h = 0; h < NH; ++h) {
            const __m256 m8 = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s8[h], in);
            _mm256_storeu_ps(s[h] + j, m8);
            vmax[h] = _mm256_max_ps(vmax[h], m8);
        }
    }
    float correction[NH];
    for (int h = 0; h < NH; ++h) {
        const float m_old = mx[qi[h]], m_new = max_f(m_old, hmax(vmax[h]));
        correction[h] = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
        const __m256 vm = _mm256_set1_ps(m_new);
        __m256 psum = _mm256_setzero_ps();
        for (int j = j0; j < e; j += 8) {
            const __m256 s8 = _mm256_loadu_ps(s[h] + j);
            // Lanes out of range hold -inf: exp_ps would give ~1e-38 there, so zero them.
            const __m256 keep = _mm256_cmp_ps(s8, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m256 p8 = _mm256_and_ps(exp_ps(_mm256_sub_ps(s8, vm)), keep);
            _mm256_storeu_ps(s[h] + j, p8);
            psum = _mm256_add_ps(psum, p8);
        }
        // Fused explicitly: this TU is built with FMA and GCC's default -ffp-contract=fast, which
        // fused the written a·b + c in some instantiations of this template and not in others
        // (so a head's result depended on the heads it went with, once the code around changed).
        sum[qi[h]] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(sum[qi[h]]), _mm_set_ss(correction[h]), _mm_set_ss(hsum(psum))));
        mx[qi[h]] = m_new;
    }
    pv<NH, NV>(acc, t.hdv, correction, s, t.v, t.vs, a, e);
}

void attend_simd(const AttnBlock &b, float *scratch) {
    const int64_t hdk = b.head_dim_k, hdv = b.head_dim_v;
    const AttnScratchLayout lay = attn_scratch_layout(b.n_rows, b.n_group, hdk, hdv);
    uint16_t *pad = reinterpret_cast<uint16_t *>(scratch + lay.pad);  // the padded 8-key groups
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
        attn_pad_key_groups(b, t0, ta, tb, 8, pad, t.pad_at);
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
            const __m256 inv = _mm256_set1_ps(sum[qi] > 0.0f ? 1.0f / sum[qi] : 0.0f);
            const float *a = acc + size_t(qi) * size_t(hdv);
            float *o = b.out + size_t(r) * b.out_row_stride + size_t(g) * size_t(hdv);
            for (int64_t d = 0; d < hdv; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), inv));
            if (b.m_out) b.m_out[qi] = mx[qi];
            if (b.l_out) b.l_out[qi] = sum[qi];
        }
}

// Subnormal floats flushed to zero (MXCSR FTZ and DAZ) while attend_simd runs, the caller's mode
// restored after. Without it, a query whose scores spread widely makes subnormals: exp_ps's
// smallest result (~1e-38) times a value, acc·correction with a correction near 0, and every
// FMA that reads or writes one takes a microcode assist on Intel cores. Measured on the Xeon
// (family 6 model 167, 2 threads), the Qwen2.5-7B-shaped bench file (random weights: wide scores)
// decoding after a 256-token prompt, `ktd.bench.decode --breakdown`, runs alternating: attention
// 11.5 and 11.7 ms a step without, 2.4 and 2.4 with; the step 151.5 / 149.8 -> 144.9 / 141.3 ms.
// What is flushed is below 1.2e-38 of a sum normalised by at least 1: no value the output can
// show. The reference kernel (the fallback) keeps IEEE subnormals. Set and restored by hand, not
// by a guard object: its destructor would need unwinding tables here, whose personality symbol is
// shared with the baseline code (tests/kernels/test_isa_isolation.py); nothing in attend_simd throws.
void attend_block(const AttnBlock &b, float *scratch) {
    if (b.head_dim_k % 8 != 0 || b.head_dim_v % 8 != 0) {
        find_attention_kernel(Isa::Ref)(b, scratch);
        return;
    }
    constexpr unsigned kFtzDaz = 0x8040;  // bit 15 flush-to-zero, bit 6 denormals-are-zero
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | kFtzDaz);
    attend_simd(b, scratch);
    _mm_setcsr(saved);
}

}  // namespace

KTD_REGISTER_ATTENTION(Isa::AVX2, attend_block);

}  // namespace ktd::avx2
