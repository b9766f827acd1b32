// IQ4_NL weights (w = d * kvalues_iq4nl[q]), AVX2+FMA; activations Q8_0. The code book lookup is
// one byte shuffle per block.
#include "kernels/avx2/q32.h"
#include "kernels/kernels.h"
#include "kernels/repacked_q32.h"

namespace ktd::avx2 {

namespace {
inline __m256i iq4nl_values(const uint8_t *qs) {
    const __m128i book = _mm_loadu_si128(reinterpret_cast<const __m128i *>(kvalues_iq4nl));
    return _mm256_shuffle_epi8(_mm256_set_m128i(book, book), unpack_nibbles(qs));
}

void dequantize_row_iq4_nl(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_iq4_nl *>(vx);
    for (int64_t b = 0; b < k / QK4_NL; ++b, y += QK4_NL) {
        const __m256 d = _mm256_set1_ps(f16(x[b].d));
        alignas(32) int8_t v[32];
        _mm256_store_si256(reinterpret_cast<__m256i *>(v), iq4nl_values(x[b].qs));
        for (int i = 0; i < 4; ++i) {
            const __m128i qi = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(v + 8 * i));
            _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qi))));
        }
    }
}

struct IQ4_NL {
    using Block = block_iq4_nl;
    template <int NC>
    static inline void dot_block(const Block &w, const block_q8_0 *const *a, __m256 *acc) {
        const __m256i qw = iq4nl_values(w.qs);
        const __m256i aw = _mm256_sign_epi8(qw, qw);
        const float dw = f16(w.d);
        for (int c = 0; c < NC; ++c) {
            const __m256i s = _mm256_sign_epi8(loadu_q8(*a[c]), qw);
            const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(aw, s));
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * f16(a[c]->d)), p, acc[c]);
        }
    }
};

struct IQ4_NLx8 {
    using GroupBlock = block_iq4_nlx8;
    static constexpr int kActSumScale = 0;
    template <int NC>
    static inline void dot_group(const GroupBlock &g, const block_q8_0 *const *a, const int32_t *, __m256 *acc) {
        const __m256 d8 = f16x8(g.d);
        const __m128i book = _mm_loadu_si128(reinterpret_cast<const __m128i *>(kvalues_iq4nl));
        const __m256i book2 = _mm256_set_m128i(book, book);
        __m256i v[8];
        load_nibbles(g.qs, v);
        for (int j = 0; j < 8; ++j) v[j] = _mm256_shuffle_epi8(book2, v[j]);
        for (int c = 0; c < NC; ++c) {
            __m256i isum = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) isum = _mm256_add_epi32(isum, dot_s8s8(v[j], act_quad(*a[c], j)));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_set1_ps(f16(a[c]->d))), acc[c]);
        }
    }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{.type = GGMLType::IQ4_NL,
                                            .act_type = GGMLType::Q8_0,
                                            .dequantize_row = dequantize_row_iq4_nl,
                                            .quantize_act_row = quantize_row_q8_0,
                                            .gemm = gemm_q8_0_act<IQ4_NL>,
                                            .repack_rows = kRepackRows,
                                            .repack_layout = kRepackLayoutQ32x8,
                                            .repacked_group_bytes = ref::group_bytes_iq4_nl_x8,
                                            .repack = ref::repack_iq4_nl_x8,
                                            .gemm_repacked = gemm_repacked_r8<IQ4_NLx8>});

}  // namespace ktd::avx2
