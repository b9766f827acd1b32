// AVX2+FMA element-wise activations (kernels/elementwise.h): 8 floats at a time with the vector
// exp of vec_math.h; the last n % 8 elements go through masked loads/stores, so every element is
// computed the same way.
#include <immintrin.h>

#include "kernels/avx2/vec_math.h"
#include "kernels/elementwise.h"

namespace ktd::avx2 {

namespace {

__m256 silu_mul(__m256 x, __m256 y) {
    const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x)));
    return _mm256_mul_ps(_mm256_div_ps(x, den), y);
}

// Same operation order as the reference: u2 = ((-2·√(2/π))·x)·(1 + 0.044715·x·x).
__m256 gelu_mul(__m256 x, __m256 y) {
    const __m256 x2 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), x);
    const __m256 u2 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(-2.0f * 0.79788456080286535588f), x),
                                    _mm256_add_ps(_mm256_set1_ps(1.0f), x2));
    const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps(u2));
    return _mm256_mul_ps(_mm256_div_ps(x, den), y);
}

__m256 relu2_mul(__m256 x, __m256 y) {
    const __m256 r = _mm256_max_ps(x, _mm256_setzero_ps());
    return _mm256_mul_ps(_mm256_mul_ps(r, r), y);
}

template <__m256 (*Op)(__m256, __m256)>
void apply(float *a, const float *b, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, Op(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    if (i < n) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_maskstore_ps(a + i, mask, Op(_mm256_maskload_ps(a + i, mask), _mm256_maskload_ps(b + i, mask)));
    }
}

}  // namespace

KTD_REGISTER_GLU(Glu::SwiGLU, Isa::AVX2, apply<silu_mul>);
KTD_REGISTER_GLU(Glu::GeGLU, Isa::AVX2, apply<gelu_mul>);
KTD_REGISTER_GLU(Glu::ReLU2, Isa::AVX2, apply<relu2_mul>);

}  // namespace ktd::avx2
