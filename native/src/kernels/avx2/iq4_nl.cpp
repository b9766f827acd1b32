// IQ4_NL weights (w = d * kvalues_iq4nl[q]), AVX2+FMA; activations Q8_0. The code book lookup is
// one byte shuffle per block.
#include "kernels/avx2/avx2.h"
#include "kernels/kernels.h"

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

// Repacked layout (version 1): block b of 8 rows, code book indices in the nibble layout of avx2.h.
struct block_iq4_nlx8 {
    uint16_t d[kRepackRows];
    uint8_t qs[128];
};
static_assert(sizeof(block_iq4_nlx8) == kRepackRows * sizeof(block_iq4_nl));

size_t group_bytes_iq4_nl(int64_t k) { return size_t(k / QK4_NL) * sizeof(block_iq4_nlx8); }

void repack_iq4_nl(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    const int64_t nb = k / QK4_NL;
    auto *o = static_cast<block_iq4_nlx8 *>(out);
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            block_iq4_nlx8 &dst = o[g * nb + b];
            std::memset(&dst, 0, sizeof dst);  // rows past the end: d = 0
            for_group_rows<block_iq4_nl>(w, w_stride, rows, g, b, [&](int r, const block_iq4_nl &src) {
                dst.d[r] = src.d;
                put_nibbles(dst.qs, r, src.qs);
            });
        }
}

struct IQ4_NLx8 {
    using GroupBlock = block_iq4_nlx8;
    static constexpr int kActSumScale = 0;
    template <int NC>
    static inline void dot_group(const GroupBlock &g, const block_q8_0 *const *a, const int32_t *, __m256 *acc) {
        const __m256 d8 = load_d8(g.d);
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
                                            .repack_layout = 1,
                                            .repacked_group_bytes = group_bytes_iq4_nl,
                                            .repack = repack_iq4_nl,
                                            .gemm_repacked = gemm_repacked_r8<IQ4_NLx8>});

}  // namespace ktd::avx2
