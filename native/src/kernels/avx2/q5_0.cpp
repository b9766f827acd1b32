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

// Repacked layout (version 1), block b of 8 rows, q stored unsigned (0..31, w = d·(q - 16)):
// qs[32i + 4r + t]: row r's element 4i + t in the low nibble, 16 + 4i + t in the high nibble
// (i < 4: register i's low nibbles are lane-per-row register j = i, its high nibbles j = i + 4);
// qh[4r + t] bit j = bit 4 of row r's element 4j + t.
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
            std::memset(&dst, 0, sizeof dst);  // rows past the end stay zero (d = 0)
            for (int r = 0; r < kRepackRows && g * kRepackRows + r < rows; ++r) {
                const auto *src = reinterpret_cast<const block_q5_0 *>(static_cast<const char *>(w) +
                                                                       size_t(g * kRepackRows + r) * w_stride) + b;
                dst.d[r] = src->d;
                uint32_t qh;
                std::memcpy(&qh, src->qh, 4);
                for (int e = 0; e < QK5_0; ++e) {
                    const int lo = e < 16 ? (src->qs[e] & 0x0F) : (src->qs[e - 16] >> 4);
                    const int j = e / 4, t = e % 4;
                    dst.qs[32 * (j % 4) + 4 * r + t] |= uint8_t(lo << (j < 4 ? 0 : 4));
                    dst.qh[4 * r + t] |= uint8_t(((qh >> e) & 1u) << j);
                }
            }
        }
}

struct Q5_0x8 {
    using GroupBlock = block_q5_0x8;
    static constexpr int kActOffset = 16;
    template <int NC>
    static inline void dot_group(const GroupBlock &g, const block_q8_0 *const *a, const int32_t *off, __m256 *acc) {
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(g.d)));
        const __m256i m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.qh));
        __m256i v[8];
        for (int i = 0; i < 4; ++i) {
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.qs + 32 * i));
            v[i] = _mm256_and_si256(q, m4);
            v[i + 4] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        }
        // Bit j of each qh byte → bit 4 (16-bit shifts: the 0x10 mask drops what crosses bytes).
        v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), b4));
        v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), b4));
        v[2] = _mm256_or_si256(v[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), b4));
        v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), b4));
        v[4] = _mm256_or_si256(v[4], _mm256_and_si256(h, b4));
        v[5] = _mm256_or_si256(v[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), b4));
        v[6] = _mm256_or_si256(v[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), b4));
        v[7] = _mm256_or_si256(v[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), b4));
        const __m256i ones = _mm256_set1_epi16(1);
        for (int c = 0; c < NC; ++c) {
            // Four u5·s8 pair sums per int16 stay below 4·2·31·127 = 31496.
            __m256i s0 = _mm256_maddubs_epi16(v[0], act_quad(*a[c], 0));
            __m256i s1 = _mm256_maddubs_epi16(v[4], act_quad(*a[c], 4));
            for (int j = 1; j < 4; ++j) {
                s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(v[j], act_quad(*a[c], j)));
                s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(v[j + 4], act_quad(*a[c], j + 4)));
            }
            __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
            isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(off[c]));
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
