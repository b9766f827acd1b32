// Q8_0 weights, AVX2+FMA (the dot products: kernels/avx2/q32_kernels.h, signed family); also the AVX2
// Q8_0 activation quantizer shared by the 32-element types.
#include "kernels/avx2/q32_kernels.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {

void quantize_row_q8_0(const float *x, void *vy, int64_t k) {
    auto *y = static_cast<block_q8_0 *>(vy);
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    for (int64_t b = 0; b < k / QK8_0; ++b, x += QK8_0) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(x + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float d = _mm_cvtss_f32(m) / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = uint16_t(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) {
            // Round half away from zero: truncate, then step away from zero when |fraction| ≥ 0.5
            // (x - trunc(x) is exact, so this matches lround bit for bit).
            const __m256 s = _mm256_mul_ps(v[i], vid);
            const __m256 t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __m256 frac = _mm256_andnot_ps(sign_bit, _mm256_sub_ps(s, t));
            const __m256 away = _mm256_or_ps(_mm256_and_ps(s, sign_bit), one);
            const __m256 step = _mm256_and_ps(_mm256_cmp_ps(frac, half, _CMP_GE_OQ), away);
            q[i] = _mm256_cvtps_epi32(_mm256_add_ps(t, step));
        }
        // int32 → int8 keeping element order: packs interleave 128-bit lanes, the permute undoes it.
        const __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
        const __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p = _mm256_packs_epi16(p01, p23);
        const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(y[b].qs), ordered);
    }
}

namespace {
void dequantize_row_q8_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q8_0 *>(vx);
    for (int64_t b = 0; b < k / QK8_0; ++b, y += QK8_0) {
        const __m256 d = _mm256_set1_ps(f16(x[b].d));
        for (int i = 0; i < 4; ++i) {
            const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(x[b].qs + 8 * i));
            _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
        }
    }
}

struct Q8_0Values {
    static __m256i q(const block_q8_0 &x) { return loadu_q8(x); }
};
struct Q8_0x8Load {
    static void load(const block_q8_0x8 &g, __m256i v[8]) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.qs + 32 * j));
    }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, q32_entry(GGMLType::Q8_0, dequantize_row_q8_0,
                                          gemm_q8_0_act<SignedDot<block_q8_0, Q8_0Values>>,
                                          gemm_repacked_r8<SignedDotX8<block_q8_0x8, Q8_0x8Load>>));

}  // namespace ktd::avx2
