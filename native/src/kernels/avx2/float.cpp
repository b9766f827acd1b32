// Float weights F32, F16 and BF16, AVX2+FMA; activations F32 (see kernels/ref/float.cpp for why).
// F16 is widened with F16C, BF16 by a 16-bit shift; both exact, so dequantization is bitwise
// the reference's.
#include <algorithm>

#include "kernels/avx2/avx2.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::avx2 {

namespace {
struct F32 {
    using T = float;
    static __m256 load8(const float *w) { return _mm256_loadu_ps(w); }
    static float load1(const float *w) { return *w; }
};
struct F16 {
    using T = uint16_t;
    static __m256 load8(const uint16_t *w) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w)));
    }
    static float load1(const uint16_t *w) { return f16(*w); }
};
struct BF16 {
    using T = uint16_t;
    static __m256 load8(const uint16_t *w) {
        const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    }
    static float load1(const uint16_t *w) {
        const uint32_t u = uint32_t(*w) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
};

template <typename L>
void dequantize_row(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const typename L::T *>(vx);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) _mm256_storeu_ps(y + i, L::load8(x + i));
    for (; i < k; ++i) y[i] = L::load1(x + i);
}

// One weight row against NC activation rows; U independent accumulators per column.
template <typename L, int NC>
void dot_row(int64_t k, const typename L::T *w, const float *const *a, float *y, size_t ldy) {
    constexpr int U = NC == 1 ? 4 : 2;
    __m256 acc[U * NC];
    for (int j = 0; j < U * NC; ++j) acc[j] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 * U <= k; i += 8 * U)
        for (int u = 0; u < U; ++u) {
            const __m256 wv = L::load8(w + i + 8 * u);
            for (int c = 0; c < NC; ++c)
                acc[u * NC + c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a[c] + i + 8 * u), acc[u * NC + c]);
        }
    for (; i + 8 <= k; i += 8) {
        const __m256 wv = L::load8(w + i);
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a[c] + i), acc[c]);
    }
    for (int c = 0; c < NC; ++c) {
        __m256 s = acc[c];
        for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[u * NC + c]);
        float sum = hsum(s);
        for (int64_t t = i; t < k; ++t) sum += L::load1(w + t) * a[c][t];
        y[size_t(c) * ldy] = sum;
    }
}

template <typename L>
void gemm(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y, size_t ldy,
          int nr, int nc) {
    const char *wb = static_cast<const char *>(w);
    const char *xb = static_cast<const char *>(xq);
    for (int r0 = 0; r0 < nr; r0 += kRowChunk) {
        const int r1 = std::min(nr, r0 + kRowChunk);
        for (int c0 = 0; c0 < nc; c0 += kColTile) {
            const int ncc = std::min(kColTile, nc - c0);
            const float *a[kColTile];
            for (int c = 0; c < ncc; ++c) a[c] = reinterpret_cast<const float *>(xb + size_t(c0 + c) * x_stride);
            for (int r = r0; r < r1; ++r) {
                const auto *wr = reinterpret_cast<const typename L::T *>(wb + size_t(r) * w_stride);
                float *yr = y + size_t(c0) * ldy + size_t(r);
                switch (ncc) {
                    case 1: dot_row<L, 1>(k, wr, a, yr, ldy); break;
                    case 2: dot_row<L, 2>(k, wr, a, yr, ldy); break;
                    case 3: dot_row<L, 3>(k, wr, a, yr, ldy); break;
                    default: dot_row<L, 4>(k, wr, a, yr, ldy); break;
                }
            }
        }
    }
}
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::F32, GGMLType::F32, dequantize_row<F32>,
                                            ref::copy_row_f32, gemm<F32>});
KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::F16, GGMLType::F32, dequantize_row<F16>,
                                            ref::copy_row_f32, gemm<F16>});
KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::BF16, GGMLType::F32, dequantize_row<BF16>,
                                            ref::copy_row_f32, gemm<BF16>});

}  // namespace ktd::avx2
