// Float weights F32, F16 and BF16, AVX2+FMA; activations F32 (see kernels/ref/float.cpp for why).
// F16 is widened with F16C, BF16 by a 16-bit shift; both exact, so dequantization is bitwise
// the reference's.
#include <algorithm>

#include "kernels/x86/common.h"
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

// GEMV: one weight row against one activation row, four independent accumulators.
template <typename L>
float dot_row(int64_t k, const typename L::T *w, const float *a) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= k; i += 32)
        for (int u = 0; u < 4; ++u)
            acc[u] = _mm256_fmadd_ps(L::load8(w + i + 8 * u), _mm256_loadu_ps(a + i + 8 * u), acc[u]);
    for (; i + 8 <= k; i += 8) acc[0] = _mm256_fmadd_ps(L::load8(w + i), _mm256_loadu_ps(a + i), acc[0]);
    float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; i < k; ++i) sum += L::load1(w + i) * a[i];
    return sum;
}

// GEMM micro-tile: RM weight rows × RN activation rows in RM·RN accumulators (≤ 12 + 3 + 1
// registers); each widened weight vector is used RN times, each activation vector RM times.
template <typename L, int RM, int RN>
void dot_tile(int64_t k, const typename L::T *const *w, const float *const *a, float *y, size_t ldy) {
    __m256 acc[RM][RN];
    for (int r = 0; r < RM; ++r)
        for (int c = 0; c < RN; ++c) acc[r][c] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 wv[RM];
        for (int r = 0; r < RM; ++r) wv[r] = L::load8(w[r] + i);
        for (int c = 0; c < RN; ++c) {
            const __m256 av = _mm256_loadu_ps(a[c] + i);
            for (int r = 0; r < RM; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], av, acc[r][c]);
        }
    }
    for (int r = 0; r < RM; ++r)
        for (int c = 0; c < RN; ++c) {
            float sum = hsum(acc[r][c]);
            for (int64_t t = i; t < k; ++t) sum += L::load1(w[r] + t) * a[c][t];
            y[size_t(c) * ldy + size_t(r)] = sum;
        }
}

template <typename L>
void gemm(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y, size_t ldy,
          int nr, int nc) {
    using T = typename L::T;
    const char *wb = static_cast<const char *>(w);
    auto row = [&](int r) { return reinterpret_cast<const T *>(wb + size_t(r) * w_stride); };
    if (nc == 1) {
        for (int r = 0; r < nr; ++r) y[r] = dot_row<L>(k, row(r), static_cast<const float *>(xq));
        return;
    }
    // Units of kRM rows (micro-tiles), in chunks of ~16 rows (weights in L2) × column tiles
    // (activations in L1). Every output element is one dot_tile accumulator, whatever the tiling.
    constexpr int kRM = 3, kRN = 4;
    const auto tile = [&]<int NC>(int u, int c0, const float *const *a) {
        const int r = kRM * u, rm = std::min(kRM, nr - r);
        const T *wr[kRM];
        for (int i = 0; i < rm; ++i) wr[i] = row(r + i);
        float *yt = y + size_t(c0) * ldy + size_t(r);
        switch (rm) {
            case 1: dot_tile<L, 1, NC>(k, wr, a, yt, ldy); break;
            case 2: dot_tile<L, 2, NC>(k, wr, a, yt, ldy); break;
            default: dot_tile<L, 3, NC>(k, wr, a, yt, ldy); break;
        }
    };
    for_each_tile<float, kRN>((nr + kRM - 1) / kRM, 5, xq, x_stride, nc, tile);
}
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::F32, GGMLType::F32, dequantize_row<F32>,
                                            ref::copy_row_f32, gemm<F32>});
KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::F16, GGMLType::F32, dequantize_row<F16>,
                                            ref::copy_row_f32, gemm<F16>});
KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{GGMLType::BF16, GGMLType::F32, dequantize_row<BF16>,
                                            ref::copy_row_f32, gemm<BF16>});

}  // namespace ktd::avx2
