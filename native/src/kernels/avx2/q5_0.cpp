// Q5_0 weights (w = d * (q - 16)), AVX2+FMA; activations Q8_0.
#include "kernels/avx2/avx2.h"
#include "kernels/kernels.h"

namespace ktd::avx2 {

namespace {
inline __m256i q5_values(const uint8_t *qs, const uint8_t *qh) {
    return _mm256_or_si256(unpack_nibbles(qs), expand_qh_bit4(qh));
}

void dequantize_row_q5_0(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q5_0 *>(vx);
    for (int64_t b = 0; b < k / QK5_0; ++b, y += QK5_0) {
        const __m256 d = _mm256_set1_ps(f16(x[b].d));
        const __m256i q = _mm256_sub_epi8(q5_values(x[b].qs, x[b].qh), _mm256_set1_epi8(16));
        alignas(32) int8_t v[32];
        _mm256_store_si256(reinterpret_cast<__m256i *>(v), q);
        for (int i = 0; i < 4; ++i) {
            const __m128i qi = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(v + 8 * i));
            _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qi))));
        }
    }
}

struct Q5_0 {
    using Block = block_q5_0;
    template <int NC>
    static inline void dot_block(const Block &w, const block_q8_0 *const *a, __m256 *acc) {
        const __m256i qu = q5_values(w.qs, w.qh);
        const __m256i off = _mm256_set1_epi8(16);
        const float dw = f16(w.d);
        for (int c = 0; c < NC; ++c) {
            const __m256 p = _mm256_cvtepi32_ps(dot_u8s8_offset(qu, loadu_q8(*a[c]), off));
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * f16(a[c]->d)), p, acc[c]);
        }
    }
};

// Repacked layout (version 1): block b of 8 rows, q unsigned (0..31, w = d·(q - 16)): low four
// bits in the nibble layout of avx2.h (put_nibbles), fifth bits as put_bit4.
struct block_q5_0x8 {
    uint16_t d[kRepackRows];
    uint8_t qh[32];
    uint8_t qs[128];
};
static_assert(sizeof(block_q5_0x8) == kRepackRows * sizeof(block_q5_0));

size_t group_bytes_q5_0(int64_t k) { return size_t(k / QK5_0) * sizeof(block_q5_0x8); }

void repack_q5_0(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    const int64_t nb = k / QK5_0;
    auto *o = static_cast<block_q5_0x8 *>(out);
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            block_q5_0x8 &dst = o[g * nb + b];
            std::memset(&dst, 0, sizeof dst);
            for_group_rows<block_q5_0>(w, w_stride, rows, g, b, [&](int r, const block_q5_0 &src) {
                dst.d[r] = src.d;
                put_nibbles(dst.qs, r, src.qs);
                put_bit4(dst.qh, r, src.qh);
            });
        }
}

struct Q5_0x8 {
    using GroupBlock = block_q5_0x8;
    static constexpr int kActSumScale = 16;
    template <int NC>
    static inline void dot_group(const GroupBlock &g, const block_q8_0 *const *a, const int32_t *off, __m256 *acc) {
        const __m256 d8 = load_d8(g.d);
        __m256i v[8];
        load_nibbles(g.qs, v);
        add_bit4(g.qh, v);
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
            const __m256i isum = _mm256_sub_epi32(dot_group_u5(v, *a[c]), _mm256_set1_epi32(off[c]));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_set1_ps(f16(a[c]->d))), acc[c]);
        }
    }
};
}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, TypeKernels{.type = GGMLType::Q5_0,
                                            .act_type = GGMLType::Q8_0,
                                            .dequantize_row = dequantize_row_q5_0,
                                            .quantize_act_row = quantize_row_q8_0,
                                            .gemm = gemm_q8_0_act<Q5_0>,
                                            .repack_rows = kRepackRows,
                                            .repack_layout = 1,
                                            .repacked_group_bytes = group_bytes_q5_0,
                                            .repack = repack_q5_0,
                                            .gemm_repacked = gemm_repacked_r8<Q5_0x8>});

}  // namespace ktd::avx2
