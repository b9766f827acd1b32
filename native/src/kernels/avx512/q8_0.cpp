// Q8_0 weights, AVX-512 BW/VL + VNNI; activations Q8_0. Definition in kernels/ref/q8_0.cpp; the
// 16-row layout in kernels/repacked_q32.h, its GEMM in kernels/avx512/q32_vnni.h.
// GCC 12's AVX-512 headers raise false -W(maybe-)uninitialized warnings from their own
// _mm512_undefined_* placeholders (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>

#include "kernels/avx512/q32_vnni.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/repacked_q32.h"

namespace ktd::avx512 {

namespace {
void dequantize_row_q8_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q8_0 *>(vx);
    for (int64_t b = 0; b < k / QK8_0; ++b, y += QK8_0) {
        const __m512 d = _mm512_set1_ps(f16(x[b].d));
        for (int h = 0; h < 2; ++h) {
            const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i *>(x[b].qs + 16 * h));
            _mm512_storeu_ps(y + 16 * h, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
        }
    }
}

// The plain-layout tile (used when weights are not repacked).
void gemm_q8_0(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y, size_t ldy,
               int nr, int nc) {
    gemm_plain<block_q8_0>(k, w, w_stride, xq, x_stride, y, ldy, nr, nc, [](const block_q8_0 &x) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x.qs));
    });
}

struct Q8_0x16 {
    using GroupBlock = block_q8_0x16;
    static constexpr int kActOffset = 128;
    static inline __m256i scales(const GroupBlock &g) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.d));
    }
    static inline void load(const GroupBlock &g, __m512i v[8]) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) v[j] = _mm512_loadu_si512(g.qs + 64 * j);
    }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX512, TypeKernels{.type = GGMLType::Q8_0,
                                              .act_type = GGMLType::Q8_0,
                                              .dequantize_row = dequantize_row_q8_0,
                                              .quantize_act_row = avx2::quantize_row_q8_0,
                                              .gemm = gemm_q8_0,
                                              .repack_rows = kRepackRows16,
                                              .repack_layout = kRepackLayoutQ32x16,
                                              .repacked_group_bytes = ref::group_bytes_q8_0_x16,
                                              .repack = avx2::repack_q8_0_x16,
                                              .gemm_repacked = gemm_repacked_r16<Q8_0x16>});

}  // namespace ktd::avx512
