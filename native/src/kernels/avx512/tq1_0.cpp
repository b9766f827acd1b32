// TQ1_0 weights × Q8_K activations, AVX-512 (BW + VNNI). Layout and definition in
// kernels/ref/tq1_0.cpp, the trit extraction as in kernels/avx2/tq1_0.cpp: trit i of a byte is
// ((byte · 3^i) mod 256 · 3) >> 8, done per 16-bit word with vpmullw/vpmulhuw on the even and
// odd bytes separately. The 256 trits are four vectors of 64 in element order, built from
// qs[0..31] (H), qs[32..47] (M) and qh[0..3] repeated (QH), one power of 3 per 128-bit lane (per
// word pair for QH):  [H·1, H·3], [H·9, H·27], [H·81, M·1, M·3], [M·9, M·27, M·81, QH·(1,3,9,27)].
// The unsigned trits (0..2) go straight into vpdpbusd; the −1 offset is Σ a, from the bsums.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 AVX-512 header false positives
#pragma GCC diagnostic ignored "-Wuninitialized"        // (GCC bug 105593, fixed in GCC 13)
#include <immintrin.h>

#include <cstring>

#include "kernels/x86/k_quants.h"
#include "kernels/blocks.h"
#include "kernels/avx512/ternary.h"
#include "kernels/kernels.h"

namespace ktd::avx512 {
namespace {

inline __m512i lanes(__m128i l0, __m128i l1, __m128i l2, __m128i l3) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(l1, l0)), _mm256_set_m128i(l3, l2), 1);
}

inline __m512i trits(__m512i x, __m512i pow3) {
    const __m512i three = _mm512_set1_epi16(3);
    const __m512i even = _mm512_mulhi_epu16(_mm512_mullo_epi16(_mm512_slli_epi16(x, 8), pow3), three);
    const __m512i odd = _mm512_mulhi_epu16(
        _mm512_mullo_epi16(_mm512_and_si512(x, _mm512_set1_epi16(int16_t(0xFF00))), pow3), three);
    return _mm512_or_si512(even, _mm512_slli_epi16(odd, 8));
}

// The 4 vectors of 64 trits (0..2) of a block in element order.
inline void unpack_tq1(const block_tq1_0 &x, __m512i v[4]) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x.qs));
    const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i *>(x.qs + 32));
    uint32_t qh;
    std::memcpy(&qh, x.qh, 4);
    const __m128i h0 = _mm256_castsi256_si128(h), h1 = _mm256_extracti128_si256(h, 1);
    const __m512i hh = _mm512_broadcast_i64x4(h);
    auto p = [](int16_t pow3) { return _mm_set1_epi16(pow3); };
    v[0] = trits(hh, lanes(p(1), p(1), p(3), p(3)));
    v[1] = trits(hh, lanes(p(9), p(9), p(27), p(27)));
    v[2] = trits(lanes(h0, h1, m, m), lanes(p(81), p(81), p(1), p(3)));
    v[3] = trits(lanes(m, m, m, _mm_set1_epi32(int(qh))), lanes(p(9), p(27), p(81), _mm_setr_epi16(1, 1, 3, 3, 9, 9, 27, 27)));
}

struct TQ1 {
    static void unpack(const block_tq1_0 &x, __m512i v[4]) { unpack_tq1(x, v); }
};

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX512, TypeKernels{GGMLType::TQ1_0, GGMLType::Q8_K,
                                              dequantize_row_ternary<block_tq1_0, TQ1>, quantize_row_q8_K,
                                              gemm_tile<block_tq1_0, TernaryDot<block_tq1_0, TQ1>>});

}  // namespace ktd::avx512
