// The sampler's vector passes with AVX-512 (kernels/sampling.h), 16 floats at a time; bit-identical
// to the reference and to AVX2: e^x with the same steps as avx2::exp_ps, the draw's float64 sums in
// the same 16 lanes (here the two halves of one 16-float vector).
// GCC 12's AVX-512 headers raise false -W(maybe-)uninitialized warnings from their own
// _mm512_undefined_* placeholders (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <limits>

#include "kernels/sampling.h"

namespace ktd::avx512 {

namespace {

// avx2::exp_ps on 16 lanes, step for step (arguments here are <= 0: no overflow).
__m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.37626f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

__mmask16 head(int64_t r) { return r >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << r) - 1); }

float max(const float *x, int64_t n, bool *nan) {
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 m[4] = {ninf, ninf, ninf, ninf};
    __mmask16 unordered = 0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int j = 0; j < 4; ++j) {
            const __m512 a = _mm512_loadu_ps(x + i + 16 * j);
            m[j] = _mm512_max_ps(m[j], a);
            unordered |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        }
    for (; i < n; i += 16) {
        const __m512 a = _mm512_mask_loadu_ps(ninf, head(n - i), x + i);
        m[0] = _mm512_max_ps(m[0], a);
        unordered |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    }
    *nan = unordered != 0;
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
}

// d = (x · scale) − shift, rounded twice as the reference (the empty asm keeps GCC from fusing
// the product into the subtraction).
__m512 exp_floor(__m512 x, __m512 scale, __m512 shift) {
    __m512 y = _mm512_mul_ps(x, scale);
    asm("" : "+v"(y));
    const __m512 d = _mm512_sub_ps(y, shift);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(kSampleExpFloor), _CMP_NLT_UQ), exp_ps(d));
}

void exp_scaled(const float *x, int64_t n, float scale, float shift, float *w) {
    const __m512 sc = _mm512_set1_ps(scale), sh = _mm512_set1_ps(shift);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(w + i, exp_floor(_mm512_loadu_ps(x + i), sc, sh));
    if (i < n) {
        const __mmask16 k = head(n - i);
        _mm512_mask_storeu_ps(w + i, k, exp_floor(_mm512_maskz_loadu_ps(k, x + i), sc, sh));
    }
}

int64_t select_ge(const float *x, int64_t n, float t, int32_t *out) {
    const __m512 tv = _mm512_set1_ps(t);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t c = 0;
    for (int64_t i = 0; i < n; i += 16, idx = _mm512_add_epi32(idx, step)) {
        const __mmask16 k = _mm512_mask_cmp_ps_mask(head(n - i), _mm512_maskz_loadu_ps(head(n - i), x + i), tv, _CMP_GE_OQ);
        if (k) {  // usually not: the threshold is met by a few of the entries
            _mm512_mask_compressstoreu_epi32(out + c, k, idx);
            c += __builtin_popcount(k);
        }
    }
    return c;
}

void kept_block_sums(const float *w, int64_t n, float v, int64_t tie_end, int64_t block, double *sums) {
    const __m512 vv = _mm512_set1_ps(v);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t b0 = 0, b = 0; b0 < n; b0 += block, ++b) {
        const int64_t b1 = b0 + block < n ? b0 + block : n;
        __m512d lo = _mm512_setzero_pd(), hi = lo;  // lanes 0-7 and 8-15
        for (int64_t i = b0; i < b1; i += 16) {
            const __mmask16 in_range = head(b1 - i);
            const __m512 x = _mm512_maskz_loadu_ps(in_range, w + i);
            const int64_t ties = tie_end - i < 0 ? 0 : (tie_end - i > 16 ? 16 : tie_end - i);
            const __mmask16 keep = _mm512_cmp_ps_mask(x, vv, _CMP_GT_OQ) |
                                   (_mm512_cmp_ps_mask(x, vv, _CMP_EQ_OQ) &
                                    _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(int(ties))));
            const __m512 kx = _mm512_maskz_mov_ps(keep & in_range, x);
            lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(kx)));
            hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(kx), 1))));
        }
        const __m512d t = _mm512_add_pd(lo, hi);  // t_l = lane_l + lane_l+8
        const __m256d u = _mm256_add_pd(_mm512_castpd512_pd256(t), _mm512_extractf64x4_pd(t, 1));
        const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(u), _mm256_extractf128_pd(u, 1));
        sums[b] = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    }
}

// As the AVX2 pass; the weights' bits compare as non-negative int32.
void split_pass(const float *w, int64_t n, uint32_t lo, uint32_t hi, double mass[3], uint32_t *out_mid,
                int64_t *n_mid, uint32_t *out_hi, int64_t *n_hi) {
    const __m512i lo_v = _mm512_set1_epi32(int(lo)), hi_v = _mm512_set1_epi32(int(hi));
    __m512d acc[3][2];  // [range][lanes 0-7, 8-15]
    for (auto &r : acc) r[0] = r[1] = _mm512_setzero_pd();
    int64_t cm = 0, ch = 0;
    auto step = [&](__m512i bits, __mmask16 in_range) {
        const __mmask16 ge_hi = _mm512_mask_cmpge_epi32_mask(in_range, bits, hi_v);
        const __mmask16 ge_lo = _mm512_mask_cmpge_epi32_mask(in_range, bits, lo_v);
        const __mmask16 band = __mmask16(ge_lo & ~ge_hi), low = __mmask16(in_range & ~ge_lo);
        const __m512 x = _mm512_castsi512_ps(bits);
        const __m512d x0 = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
        const __m512d x1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
        const __mmask16 m[3] = {low, band, ge_hi};
        for (int r = 0; r < 3; ++r) {
            acc[r][0] = _mm512_mask_add_pd(acc[r][0], __mmask8(m[r]), acc[r][0], x0);
            acc[r][1] = _mm512_mask_add_pd(acc[r][1], __mmask8(m[r] >> 8), acc[r][1], x1);
        }
        // compress in a register, then a full store (the outputs have room for 16 more): a
        // compressing store to memory is microcoded and several times slower
        _mm512_storeu_si512(out_mid + cm, _mm512_maskz_compress_epi32(band, bits));
        cm += __builtin_popcount(band);
        if (out_hi) {
            _mm512_storeu_si512(out_hi + ch, _mm512_maskz_compress_epi32(ge_hi, bits));
            ch += __builtin_popcount(ge_hi);
        }
    };
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) step(_mm512_loadu_si512(w + i), 0xFFFF);
    if (i < n) step(_mm512_maskz_loadu_epi32(head(n - i), w + i), head(n - i));
    for (int r = 0; r < 3; ++r) mass[r] = _mm512_reduce_add_pd(_mm512_add_pd(acc[r][0], acc[r][1]));
    *n_mid = cm;
    if (out_hi) *n_hi = ch;
}

constexpr SamplingKernels kKernels{max, exp_scaled, select_ge, kept_block_sums, split_pass};

}  // namespace

KTD_REGISTER_SAMPLING(Isa::AVX512, kKernels);

}  // namespace ktd::avx512
