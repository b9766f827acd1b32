// Q4_0 weights (w = d * (q - 8)), AVX2+FMA; activations Q8_0.
#include "kernels/avx2/q32.h"
#include "kernels/kernels.h"
#include "kernels/repacked_q32.h"

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

struct Q4_0x8 {
    using GroupBlock = block_q4_0x8;
    static constexpr int kActSumScale = 8;
    template <int NC>
    static inline void dot_group(const GroupBlock &g, const block_q8_0 *const *a, const int32_t *off, __m256 *acc) {
        const __m256 d8 = f16x8(g.d);
        __m256i v[8];
        load_nibbles(g.qs, v);
        for (int c = 0; c < NC; ++c) {
            const __m256i isum = _mm256_sub_epi32(dot_group_u4(v, *a[c]), _mm256_set1_epi32(off[c]));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_set1_ps(f16(a[c]->d))), acc[c]);
        }
    }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{.type = GGMLType::Q4_0,
                                            .act_type = GGMLType::Q8_0,
                                            .dequantize_row = dequantize_row_q4_0,
                                            .quantize_act_row = quantize_row_q8_0,
                                            .gemm = gemm_q8_0_act<Q4_0>,
                                            .repack_rows = kRepackRows,
                                            .repack_layout = kRepackLayoutQ32x8,
                                            .repacked_group_bytes = ref::group_bytes_q4_0_x8,
                                            .repack = ref::repack_q4_0_x8,
                                            .gemm_repacked = gemm_repacked_r8<Q4_0x8>});

}  // namespace ktd::avx2
