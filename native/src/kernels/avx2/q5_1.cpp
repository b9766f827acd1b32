// Q5_1 weights (w = d * q + m), AVX2+FMA; activations Q8_0.
#include "kernels/avx2/q32.h"
#include "kernels/kernels.h"
#include "kernels/repacked_q32.h"

namespace ktd::avx2 {

namespace {
inline __m256i q5_values(const uint8_t *qs, const uint8_t *qh) {
    return _mm256_or_si256(unpack_nibbles(qs), expand_qh_bit4(qh));
}

void dequantize_row_q5_1(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q5_1 *>(vx);
    for (int64_t b = 0; b < k / QK5_1; ++b, y += QK5_1) {
        const __m256 d = _mm256_set1_ps(f16(x[b].d)), m = _mm256_set1_ps(f16(x[b].m));
        alignas(32) uint8_t v[32];
        _mm256_store_si256(reinterpret_cast<__m256i *>(v), q5_values(x[b].qs, x[b].qh));
        for (int i = 0; i < 4; ++i) {
            const __m128i qi = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(v + 8 * i));
            __m256 dq = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(qi)));
            // Keep the product rounded on its own: the specification (gguf-py) is (d·q) + m, not an FMA.
            __asm__("" : "+x"(dq));
            _mm256_storeu_ps(y + 8 * i, _mm256_add_ps(dq, m));
        }
    }
}

struct Q5_1 {
    using Block = block_q5_1;
    template <int NC>
    static inline void dot_block(const Block &w, const block_q8_0 *const *a, __m256 *acc) {
        const __m256i qu = q5_values(w.qs, w.qh);
        const __m256i ones = _mm256_set1_epi8(1);
        const float dw = f16(w.d), mw = f16(w.m);
        for (int c = 0; c < NC; ++c) {
            const __m256i s = loadu_q8(*a[c]);
            const float da = f16(a[c]->d);
            const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(qu, s));
            const __m256 sa = _mm256_cvtepi32_ps(dot_u8s8(ones, s));
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * da), p, acc[c]);
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(mw * da), sa, acc[c]);
        }
    }
};

// acc += d·da·Σq·a + m·da·Σa per row lane (asum = Σa).
struct Q5_1x8 {
    using GroupBlock = block_q5_1x8;
    static constexpr int kActSumScale = 1;
    template <int NC>
    static inline void dot_group(const GroupBlock &g, const block_q8_0 *const *a, const int32_t *asum, __m256 *acc) {
        const __m256 d8 = f16x8(g.d), m8 = f16x8(g.m);
        __m256i v[8];
        load_nibbles(g.qs, v);
        add_bit4(g.qh, v);
        for (int c = 0; c < NC; ++c) {
            const float da = f16(a[c]->d);
            const __m256i isum = dot_group_u5(v, *a[c]);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_set1_ps(da)), acc[c]);
            acc[c] = _mm256_fmadd_ps(m8, _mm256_set1_ps(da * float(asum[c])), acc[c]);
        }
    }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{.type = GGMLType::Q5_1,
                                            .act_type = GGMLType::Q8_0,
                                            .dequantize_row = dequantize_row_q5_1,
                                            .quantize_act_row = quantize_row_q8_0,
                                            .gemm = gemm_q8_0_act<Q5_1>,
                                            .repack_rows = kRepackRows,
                                            .repack_layout = kRepackLayoutQ32x8,
                                            .repacked_group_bytes = ref::group_bytes_q5_1_x8,
                                            .repack = ref::repack_q5_1_x8,
                                            .gemm_repacked = gemm_repacked_r8<Q5_1x8>});

}  // namespace ktd::avx2
