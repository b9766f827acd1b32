// The sampler's vector passes with AVX2 (kernels/sampling.h), 8 floats at a time; bit-identical to
// the reference: the same e^x steps (vec_math.h), the draw's float64 sums in the same 16 lanes.
#include <immintrin.h>

#include <limits>

#include "kernels/avx2/vec_math.h"
#include "kernels/sampling.h"

namespace ktd::avx2 {

namespace {

// Mask of the first r (< 8) lanes.
__m256i head_mask(int64_t r) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(r)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Left-packing by a lane mask: row m holds the indices of the set bits of m, in order.
struct PackTable {
    alignas(32) int32_t idx[256][8];
    constexpr PackTable() : idx{} {
        for (int m = 0; m < 256; ++m) {
            int c = 0;
            for (int l = 0; l < 8; ++l)
                if (m >> l & 1) idx[m][c++] = l;
        }
    }
};
constexpr PackTable kPack{};

// Stores the lanes of v selected by mask m (8 bits) contiguously at out (which has room for 8
// more elements); returns how many.
int pack_store(uint32_t *out, __m256i v, unsigned m) {
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i *>(kPack.idx[m]));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), _mm256_permutevar8x32_epi32(v, perm));
    return __builtin_popcount(m);
}

float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// Four independent running maxima: one would wait on vmaxps' latency every 8 elements.
float max(const float *x, int64_t n, bool *nan) {
    const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 m[4] = {ninf, ninf, ninf, ninf}, unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; ++j) {
            const __m256 a = _mm256_loadu_ps(x + i + 8 * j);
            m[j] = _mm256_max_ps(m[j], a);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        }
    for (; i < n; i += 8) {
        const __m256i mask = head_mask(n - i < 8 ? n - i : 8);
        const __m256 a = _mm256_blendv_ps(ninf, _mm256_maskload_ps(x + i, mask), _mm256_castsi256_ps(mask));
        m[0] = _mm256_max_ps(m[0], a);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    *nan = _mm256_movemask_ps(unordered) != 0;
    return hmax(_mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
}

// d = (x · scale) − shift, rounded twice as the reference: the empty asm makes the product a
// value the compiler cannot fuse into the subtraction (GCC contracts vector mul + sub into an FMA).
__m256 exp_floor(__m256 x, __m256 scale, __m256 shift) {
    __m256 y = _mm256_mul_ps(x, scale);
    asm("" : "+x"(y));
    const __m256 d = _mm256_sub_ps(y, shift);
    const __m256 below = _mm256_cmp_ps(d, _mm256_set1_ps(kSampleExpFloor), _CMP_LT_OQ);
    return _mm256_andnot_ps(below, exp_ps(d));
}

void exp_scaled(const float *x, int64_t n, float scale, float shift, float *w) {
    const __m256 sc = _mm256_set1_ps(scale), sh = _mm256_set1_ps(shift);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(w + i, exp_floor(_mm256_loadu_ps(x + i), sc, sh));
    if (i < n) {
        const __m256i mask = head_mask(n - i);
        _mm256_maskstore_ps(w + i, mask, exp_floor(_mm256_maskload_ps(x + i, mask), sc, sh));
    }
}

int64_t select_ge(const float *x, int64_t n, float t, int32_t *out) {
    const __m256 tv = _mm256_set1_ps(t);
    int64_t c = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        unsigned bits = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), tv, _CMP_GE_OQ)));
        while (bits) {  // usually none: the threshold is met by a few percent of the entries
            out[c++] = int32_t(i + __builtin_ctz(bits));
            bits &= bits - 1;
        }
    }
    for (; i < n; ++i)
        if (x[i] >= t) out[c++] = int32_t(i);
    return c;
}

// The kept w of 8 elements at i (lanes past b1 are 0): w > v, or w == v and i + lane < tie_end.
__m256 kept8(const float *w, int64_t i, int64_t b1, __m256 v, int64_t tie_end) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i in_range = head_mask(b1 - i < 8 ? b1 - i : 8);
    const __m256 x = _mm256_maskload_ps(w + i, in_range);
    const int64_t ties = tie_end - i < 0 ? 0 : (tie_end - i > 8 ? 8 : tie_end - i);
    const __m256 before_tie_end = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(ties)), lane));
    const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(x, v, _CMP_GT_OQ),
                                     _mm256_and_ps(_mm256_cmp_ps(x, v, _CMP_EQ_OQ), before_tie_end));
    return _mm256_and_ps(keep, x);
}

void kept_block_sums(const float *w, int64_t n, float v, int64_t tie_end, int64_t block, double *sums) {
    const __m256 vv = _mm256_set1_ps(v);
    for (int64_t b0 = 0, b = 0; b0 < n; b0 += block, ++b) {
        const int64_t b1 = b0 + block < n ? b0 + block : n;
        // lanes 0-3, 4-7, 8-11, 12-15 of the 16-lane pattern
        __m256d l0 = _mm256_setzero_pd(), l1 = l0, l2 = l0, l3 = l0;
        for (int64_t i = b0; i < b1; i += 16) {
            const __m256 a = kept8(w, i, b1, vv, tie_end), c = kept8(w, i + 8, b1, vv, tie_end);
            l0 = _mm256_add_pd(l0, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
            l1 = _mm256_add_pd(l1, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
            l2 = _mm256_add_pd(l2, _mm256_cvtps_pd(_mm256_castps256_ps128(c)));
            l3 = _mm256_add_pd(l3, _mm256_cvtps_pd(_mm256_extractf128_ps(c, 1)));
        }
        // t = lanes l + l+8; u = t_l + t_l+4; (u0 + u2, u1 + u3); their sum
        const __m256d u = _mm256_add_pd(_mm256_add_pd(l0, l2), _mm256_add_pd(l1, l3));
        const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(u), _mm256_extractf128_pd(u, 1));
        sums[b] = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    }
}

double hsum(__m256d a, __m256d b) {
    const __m256d s = _mm256_add_pd(a, b);
    const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

// The weights are >= 0, so their bits compare as non-negative int32 (lo, hi < 2^31 here).
void split_pass(const float *w, int64_t n, uint32_t lo, uint32_t hi, double mass[3], uint32_t *out_mid,
                int64_t *n_mid, uint32_t *out_hi, int64_t *n_hi) {
    const __m256i lo_1 = _mm256_set1_epi32(int(lo) - 1), hi_1 = _mm256_set1_epi32(int(hi) - 1);
    __m256d acc[3][2];  // [range][lanes 0-3, 4-7]
    for (auto &r : acc) r[0] = r[1] = _mm256_setzero_pd();
    int64_t cm = 0, ch = 0;
    auto add = [&](int r, __m256i m, __m256i bits) {
        const __m256 x = _mm256_castsi256_ps(_mm256_and_si256(m, bits));
        acc[r][0] = _mm256_add_pd(acc[r][0], _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        acc[r][1] = _mm256_add_pd(acc[r][1], _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
    };
    auto step = [&](__m256i bits, __m256i in_range) {
        const __m256i ge_hi = _mm256_and_si256(_mm256_cmpgt_epi32(bits, hi_1), in_range);
        const __m256i ge_lo = _mm256_and_si256(_mm256_cmpgt_epi32(bits, lo_1), in_range);
        const __m256i band = _mm256_andnot_si256(ge_hi, ge_lo);
        add(0, _mm256_andnot_si256(ge_lo, in_range), bits);
        add(1, band, bits);
        add(2, ge_hi, bits);
        // branch-free packing: bands of tens of thousands are common
        cm += pack_store(out_mid + cm, bits, unsigned(_mm256_movemask_ps(_mm256_castsi256_ps(band))));
        if (out_hi) ch += pack_store(out_hi + ch, bits, unsigned(_mm256_movemask_ps(_mm256_castsi256_ps(ge_hi))));
    };
    int64_t i = 0;
    const __m256i all = _mm256_set1_epi32(-1);
    for (; i + 8 <= n; i += 8) step(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(w + i)), all);
    if (i < n) {  // lanes past n load as 0.0f and are masked out of every range
        const __m256i in_range = head_mask(n - i);
        step(_mm256_maskload_epi32(reinterpret_cast<const int *>(w + i), in_range), in_range);
    }
    for (int r = 0; r < 3; ++r) mass[r] = hsum(acc[r][0], acc[r][1]);
    *n_mid = cm;
    if (out_hi) *n_hi = ch;
}

constexpr SamplingKernels kKernels{max, exp_scaled, select_ge, kept_block_sums, split_pass};

}  // namespace

KTD_REGISTER_SAMPLING(Isa::AVX2, kKernels);

}  // namespace ktd::avx2
