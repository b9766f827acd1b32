// The AVX-512 decode kernel of the Q4_K 8-row layout (kernels/repacked_k.h): one activation
// column on 512-bit vectors. Included only by kernels/avx512/q4_k.cpp, after kernels/x86/k_repack.h.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/blocks.h"
#include "kernels/repacked_k.h"
#include "kernels/x86/common.h"
#include "kernels/x86/k_quants.h"
#include "kernels/x86/k_repack.h"

namespace ktd::avx512 {

// Decode (one activation column) of the Q4_K layout on 512-bit vectors, with about half the
// instructions and loads of Q4_Kx8::dot_group<1>. Measured here at one thread on the 1.5B
// model's ffn_up shape streaming from DRAM: 86% -> 94% of the read bandwidth, although
// dot_group<1> alone is ~2x faster than DRAM (from L2). Cutting only ALU work (the same loads)
// or only weight loads (the same instructions) did not help; the likely limit is how many
// prefetches the out-of-order window keeps queued behind the oldest waiting one.
//
// A 64-byte load of chunk j holds its registers 2t and 2t+1 (lanes 0-7 and 8-15, the same 8
// rows); it is dotted with a vector prepared once per call (expand_act_q4_Kx8_x1: the two 4-byte
// activation groups those registers need, each broadcast to its half). High nibbles stay in
// place (byte & 0xF0 = 16·q): their sums are multiples of 16 and are divided by 16 exactly. Per
// chunk and lane, |sum| ≤ 2·4·15·128 = 15360 for either half, so each fits the low int16 of its
// lane and vpdpwssd applies the scale (whose high int16 is 0). The integer total of each row is
// the one dot_group<1> computes, so the results are bit-identical.
constexpr int kX1VecsPerBlock = 32;  // 8 chunks × 4 register pairs (2 low-nibble, 2 high-nibble)

// xp[32b + 4j + u], u < 2: activation bytes 8u..8u+3 | 8u+4..8u+7 of chunk j of block b, each
// broadcast to 8 lanes; u ≥ 2: the same at 16 + 8(u − 2).
inline void expand_act_q4_Kx8_x1(const block_q8_K *a, int64_t nb, __m512i *xp) {
    for (int64_t b = 0; b < nb; ++b)
        for (int j = 0; j < 8; ++j)
            for (int u = 0; u < 4; ++u) {
                const int8_t *p = a[b].qs + 32 * j + (u < 2 ? 8 * u : 16 + 8 * (u - 2));
                _mm512_storeu_si512(xp + b * kX1VecsPerBlock + 4 * j + u,
                                    _mm512_inserti64x4(_mm512_castsi256_si512(bcast4(p)), bcast4(p + 4), 1));
            }
}

struct Q4_Kx8_X1 {
    static inline void dot_group(const block_q4_Kx8 &g, const block_q8_K &a, const __m512i *xp, __m256 &acc) {
        const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
        const __m512i m4z = _mm512_set1_epi8(0x0F), mf0z = _mm512_set1_epi8(int8_t(0xF0));
        // Scales and mins as in Q4_Kx8::dot_group.
        const __m256i nl = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.scl));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.sh));
        const __m256i sc_lo = _mm256_or_si256(_mm256_and_si256(nl, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
        const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nl, 4), m4),
                                              _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
        const __m256i pairs[4] = {_mm256_permute2x128_si256(sc_lo, sc_lo, 0x00), _mm256_permute2x128_si256(sc_lo, sc_lo, 0x11),
                                  _mm256_permute2x128_si256(sc_hi, sc_hi, 0x00), _mm256_permute2x128_si256(sc_hi, sc_hi, 0x11)};
        const __m256i pick_even = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,  //
                                                   4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
        const __m256i pick_odd = _mm256_add_epi8(pick_even, _mm256_setr_epi8(8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0,  //
                                                                             8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0));
        __m512i isum = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) {
            const __m256i sc = _mm256_shuffle_epi8(pairs[j / 2], j % 2 ? pick_odd : pick_even);
            const __m512i scz = _mm512_broadcast_i64x4(_mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)));
            const __m512i r0 = _mm512_loadu_si512(g.qs + 128 * j), r1 = _mm512_loadu_si512(g.qs + 128 * j + 64);
            const __m512i *x = xp + 4 * j;
            __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(r0, m4z), _mm512_loadu_si512(x));
            lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(r1, m4z), _mm512_loadu_si512(x + 1));
            __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(r0, mf0z), _mm512_loadu_si512(x + 2));
            hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(r1, mf0z), _mm512_loadu_si512(x + 3));
            isum = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum, lo, scz), _mm512_srai_epi32(hi, 4), scz);
        }
        const __m256i isum8 = _mm256_add_epi32(_mm512_castsi512_si256(isum), _mm512_extracti64x4_epi64(isum, 1));
        const __m256i ml = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.mnl));
        const __m256i mn_lo = _mm256_or_si256(_mm256_and_si256(ml, m4), _mm256_and_si256(h, m30));
        const __m256i mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ml, 4), m4),
                                              _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
        const __m256i pick_min = _mm256_setr_epi8(0, -1, 8, -1, 1, -1, 9, -1, 2, -1, 10, -1, 3, -1, 11, -1,  //
                                                  4, -1, 12, -1, 5, -1, 13, -1, 6, -1, 14, -1, 7, -1, 15, -1);
        const __m256i mins[4] = {_mm256_shuffle_epi8(_mm256_permute2x128_si256(mn_lo, mn_lo, 0x00), pick_min),
                                 _mm256_shuffle_epi8(_mm256_permute2x128_si256(mn_lo, mn_lo, 0x11), pick_min),
                                 _mm256_shuffle_epi8(_mm256_permute2x128_si256(mn_hi, mn_hi, 0x00), pick_min),
                                 _mm256_shuffle_epi8(_mm256_permute2x128_si256(mn_hi, mn_hi, 0x11), pick_min)};
        const __m256 d8 = f16x8(g.d), dmin8 = f16x8(g.dmin);
        const __m128i bs = bsums_32(a);
        __m256i msum = _mm256_madd_epi16(mins[0], _mm256_broadcastd_epi32(bs));
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[1], _mm256_broadcastd_epi32(_mm_shuffle_epi32(bs, 0x55))));
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[2], _mm256_broadcastd_epi32(_mm_shuffle_epi32(bs, 0xAA))));
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[3], _mm256_broadcastd_epi32(_mm_shuffle_epi32(bs, 0xFF))));
        const __m256 ad = _mm256_set1_ps(a.d);
        acc = _mm256_fmadd_ps(_mm256_mul_ps(d8, ad), _mm256_cvtepi32_ps(isum8), acc);
        acc = _mm256_fnmadd_ps(_mm256_mul_ps(dmin8, ad), _mm256_cvtepi32_ps(msum), acc);
    }
};

// Q4_K decode (nc = 1) through Q4_Kx8_X1: the activation row expanded once per call into this
// thread's buffer (2 KiB per super-block, kept between calls), then the groups in order with
// the same prefetch as gemm_group_k8.
inline void gemm_repacked_q4_Kx8_x1(int64_t nb, const char *wb, size_t group_stride, const block_q8_K *a, float *y,
                                    int nr) {
    thread_local GrowBuffer<uint8_t> buf;
    uint8_t *p = buf.get(size_t(nb) * kX1VecsPerBlock * sizeof(__m512i) + 64);
    auto *xp = reinterpret_cast<__m512i *>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
    expand_act_q4_Kx8_x1(a, nb, xp);
    const int n_groups = (nr + kRepackRowsK - 1) / kRepackRowsK;
    for (int gi = 0; gi < n_groups; ++gi) {
        const auto *g = reinterpret_cast<const block_q4_Kx8 *>(wb + size_t(gi) * group_stride);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const char *pf = reinterpret_cast<const char *>(g + b) + kPrefetchBytes;
            for (size_t off = 0; off < sizeof(block_q4_Kx8) + 63; off += 64) _mm_prefetch(pf + off, _MM_HINT_T0);
            Q4_Kx8_X1::dot_group(g[b], a[b], xp + b * kX1VecsPerBlock, acc);
        }
        store_rows8(acc, y + size_t(gi) * kRepackRowsK, std::min(kRepackRowsK, nr - gi * kRepackRowsK));
    }
}

// TypeKernels::gemm_repacked of the AVX-512 Q4_K entry: decode through Q4_Kx8_X1, every other
// column count through the shared 8-row tile.
inline void gemm_repacked_q4_K(int64_t k, const void *wp, size_t group_stride, const void *xq, size_t x_stride,
                               float *y, size_t ldy, int nr, int nc) {
    if (nc != 1) return gemm_repacked_k8<Q4_Kx8>(k, wp, group_stride, xq, x_stride, y, ldy, nr, nc);
    const char *wb = static_cast<const char *>(wp);
    prefetch_head(wb, nr, group_stride);
    gemm_repacked_q4_Kx8_x1(k / QK_K, wb, group_stride, static_cast<const block_q8_K *>(xq), y, nr);
}

}  // namespace ktd::avx512
