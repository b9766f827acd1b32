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
        const __m512i m4z = _mm512_set1_epi8(0x0F), mf0z = _mm512_set1_epi8(int8_t(0xF0));
        __m256i pairs[4];
        q4_Kx8_scale_pairs(g, pairs);
        __m512i isum = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) {
            const __m256i sc = q4_Kx8_chunk_scale(pairs, j);
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
        __m256i mins[4];
        q4_Kx8_mins(g, mins);
        acc = q4_Kx8_accumulate(f16x8(g.d), f16x8(g.dmin), mins, a, isum8, acc);
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
