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

// Repacked layout (version 1), block b of 8 rows, q unsigned (0..15, w = d·(q - 8)):
// qs[32i + 4r + t]: row r's element 4i + t in the low nibble, 16 + 4i + t in the high nibble
// (i < 4: register i's low nibbles are lane-per-row register j = i, its high nibbles j = i + 4).
struct block_q4_0x8 {
    uint16_t d[kRepackRows];
    uint8_t qs[128];
};
static_assert(sizeof(block_q4_0x8) == kRepackRows * sizeof(block_q4_0));

size_t group_bytes_q4_0(int64_t k) { return size_t(k / QK4_0) * sizeof(block_q4_0x8); }

void repack_q4_0(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    const int64_t nb = k / QK4_0;
    auto *o = static_cast<block_q4_0x8 *>(out);
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            block_q4_0x8 &dst = o[g * nb + b];
            std::memset(&dst, 0, sizeof dst);  // rows past the end stay zero (d = 0)
            for (int r = 0; r < kRepackRows && g * kRepackRows + r < rows; ++r) {
                const auto *src = reinterpret_cast<const block_q4_0 *>(static_cast<const char *>(w) +
                                                                       size_t(g * kRepackRows + r) * w_stride) + b;
                dst.d[r] = src->d;
                for (int e = 0; e < QK4_0; ++e) {
                    const int q = e < 16 ? (src->qs[e] & 0x0F) : (src->qs[e - 16] >> 4);
                    const int j = e / 4, t = e % 4;
                    dst.qs[32 * (j % 4) + 4 * r + t] |= uint8_t(q << (j < 4 ? 0 : 4));
                }
            }
        }
}

struct Q4_0x8 {
    using GroupBlock = block_q4_0x8;
    static constexpr int kActOffset = 8;
    template <int NC>
    static inline void dot_group(const GroupBlock &g, const block_q8_0 *const *a, const int32_t *off, __m256 *acc) {
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(g.d)));
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        __m256i v[8];
        for (int i = 0; i < 4; ++i) {
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.qs + 32 * i));
            v[i] = _mm256_and_si256(q, m4);
            v[i + 4] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        }
        for (int c = 0; c < NC; ++c) {
            // Eight u4·s8 pair sums per int16 stay below 8·2·15·127 = 30480.
            __m256i s = _mm256_maddubs_epi16(v[0], act_quad(*a[c], 0));
            for (int j = 1; j < 8; ++j) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v[j], act_quad(*a[c], j)));
            const __m256i isum = _mm256_sub_epi32(_mm256_madd_epi16(s, _mm256_set1_epi16(1)), _mm256_set1_epi32(off[c]));
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
                                            .repack_layout = 1,
                                            .repacked_group_bytes = group_bytes_q4_0,
                                            .repack = repack_q4_0,
                                            .gemm_repacked = gemm_repacked_r8<Q4_0x8>});

}  // namespace ktd::avx2
