// Word transposes shared by the AVX2 repacks (kernels/avx2/repack_k.cpp, repack_q32.cpp). Included
// only by files under kernels/avx2/ (kernels/x86/common.h says why nothing here is shared with
// baseline code); internal linkage, so each object keeps its own copy.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace ktd::avx2 {
namespace {

inline void store256(uint8_t *p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), v); }

// w[r] (4 words each) → out[i] = word i of rows 0..7 (lane r = row r).
inline void transpose_8x4(const __m128i w[8], __m256i out[4]) {
    const __m256i a0 = _mm256_inserti128_si256(_mm256_castsi128_si256(w[0]), w[4], 1);
    const __m256i a1 = _mm256_inserti128_si256(_mm256_castsi128_si256(w[1]), w[5], 1);
    const __m256i a2 = _mm256_inserti128_si256(_mm256_castsi128_si256(w[2]), w[6], 1);
    const __m256i a3 = _mm256_inserti128_si256(_mm256_castsi128_si256(w[3]), w[7], 1);
    const __m256i t0 = _mm256_unpacklo_epi32(a0, a1), t1 = _mm256_unpackhi_epi32(a0, a1);
    const __m256i t2 = _mm256_unpacklo_epi32(a2, a3), t3 = _mm256_unpackhi_epi32(a2, a3);
    out[0] = _mm256_unpacklo_epi64(t0, t2);
    out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3);
    out[3] = _mm256_unpackhi_epi64(t1, t3);
}

}  // namespace
}  // namespace ktd::avx2
