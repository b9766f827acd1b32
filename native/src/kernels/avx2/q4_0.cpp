// Q4_0 weights (w = d * (q - 8)), AVX2+FMA; activations Q8_0.
#include "kernels/avx2/avx2.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {

namespace {
void dequantize_row_q4_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q4_0 *>(vx);
    for (int64_t b = 0; b < k / QK4_0; ++b, y += QK4_0) {
        const __m256 d = _mm256_set1_ps(f16(x[b].d));
        const __m256i q = _mm256_sub_epi8(unpack_nibbles(x[b].qs), _mm256_set1_epi8(8));
        alignas(32) int8_t v[32];
        _mm256_store_si256(reinterpret_cast<__m256i *>(v), q);
        for (int i = 0; i < 4; ++i) {
            const __m128i qi = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(v + 8 * i));
            _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qi))));
        }
    }
}

struct Q4_0 {
    using Block = block_q4_0;
    template <int NC>
    static inline void dot_block(const Block &w, const block_q8_0 *const *a, __m256 *acc) {
        const __m256i qu = unpack_nibbles(w.qs);
        const __m256i off = _mm256_set1_epi8(8);
        const float dw = f16(w.d);
        for (int c = 0; c < NC; ++c) {
            const __m256 p = _mm256_cvtepi32_ps(dot_u8s8_offset(qu, loadu_q8(*a[c]), off));
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * f16(a[c]->d)), p, acc[c]);
        }
    }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::Q4_0, GGMLType::Q8_0, dequantize_row_q4_0,
                                            quantize_row_q8_0, gemm_q8_0_act<Q4_0>});

}  // namespace ktd::avx2
