// AVX-512 VNNI GEMM for the 32-element block types with Q8_0 activations (Q5_0, Q8_0), on a
// 16-row interleaved layout.
//
// A group block holds block b of 16 consecutive rows, arranged so that 32-bit lane r of a 512-bit
// register belongs to row r: register j (0..7) holds elements 4j..4j+3 of every row as unsigned
// bytes u = q + kActOffset (so w = d·(u - kActOffset)). One vpbroadcastd of 4 activation bytes
// serves all 16 rows and one vpdpbusd adds the 4 products into each row's int32 lane:
// Σ_e u_e·a_e - kActOffset·Σ_e a_e is the block's exact integer dot, as in the reference. The
// activation sums are taken once per call, the row scales are one fp16 vector per block.
//
// Decode (n ≤ 8) streams the weights once: all columns of the call are taken per weight block
// (no re-read), and the next blocks are prefetched kPrefetchBytes ahead of the stream where
// k_decode_prefetch() says so (on the Xeon this was tuned on, one core reached DRAM bandwidth only
// with more misses in flight than the hardware prefetcher keeps; on a Zen 4 it did without).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/repacked_q32.h"
#include "kernels/x86/common.h"

namespace ktd::avx512 {

constexpr int kRepackRows16 = kRepackRowsQ32x16;
// Columns per pass over a group's blocks: up to 8 accumulators + 8 weight registers + temporaries
// fit the 32 zmm registers.
constexpr int kColTile16 = 8;
// Distance of the software prefetch ahead of the weight stream, bytes (tuned on a Xeon where one
// core is latency-bound near 9 GB/s: 1 KiB < 2 KiB < 4 KiB ≈ 8 KiB on the 0.5B decode shapes).
constexpr int kPrefetchBytes = 4096;

// Broadcast of activation bytes 4j..4j+3 of a block.
inline __m512i act_quad16(const block_q8_0 &a, int j) {
    int32_t v;
    std::memcpy(&v, a.qs + 4 * j, 4);
    return _mm512_set1_epi32(v);
}

// act_sum with one vpdpbusd (the AVX2 sequence measured ~10% slower per decode call at k = 2048).
inline int32_t act_sum_vnni(const block_q8_0 &a) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs));
    return hsum(_mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), q));
}

// Traits of a 16-row layout:
//   using GroupBlock;                         // sizeof = 16 · sizeof(row block)
//   static constexpr int kActOffset;          // u = q + kActOffset
//   static void load(const GroupBlock &, __m512i v[8]);   // the 8 unsigned registers
//   static __m256i scales(const GroupBlock &);             // the 16 fp16 row scales
// PF: the prefetch mode (kernels.h; prefill always l1, decode k_decode_prefetch()).
template <typename Traits, int NC, int PF = kPrefetchL1>
inline void gemm_group16(int64_t nb, const typename Traits::GroupBlock *g, const block_q8_0 *const *a,
                         const int32_t *const *asum_off, float *y, size_t ldy, int rows_valid) {
    __m512 acc[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        // One prefetch per cache line of the block (352 or 544 bytes: whole lines only when the
        // buffer is 64-byte aligned, as the prepared weights are).
        prefetch_lines<PF>(reinterpret_cast<const char *>(g + b) + prefetch_ahead<PF>(kPrefetchBytes),
                           sizeof(typename Traits::GroupBlock));
        __m512i v[8];
        Traits::load(g[b], v);
        const __m512 dw = _mm512_cvtph_ps(Traits::scales(g[b]));
        // Fully unrolled (columns and j) so the accumulators stay in registers.
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
            const block_q8_0 &ab = a[c][b];
            // Two chains of four so the vpdpbusd latency overlaps; the first starts at -offset·Σa.
            __m512i s0 = _mm512_set1_epi32(-asum_off[c][b]);
            __m512i s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                s0 = _mm512_dpbusd_epi32(s0, v[j], act_quad16(ab, j));
                s1 = _mm512_dpbusd_epi32(s1, v[j + 4], act_quad16(ab, j + 4));
            }
            const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[c] = _mm512_fmadd_ps(p, _mm512_mul_ps(dw, _mm512_set1_ps(f16(ab.d))), acc[c]);
        }
    }
    const __mmask16 m = rows_valid >= kRepackRows16 ? __mmask16(0xFFFF) : __mmask16((1u << rows_valid) - 1);
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) _mm512_mask_storeu_ps(y + size_t(c) * ldy, m, acc[c]);
}

// TypeKernels::gemm_repacked for a 16-row layout. Columns in tiles of kColTile16: for n ≤ 8
// (decode, batched streams) one pass, so every weight byte is read once; larger n re-reads the
// group (k·16 rows: L1/L2 resident).
template <typename Traits>
void gemm_repacked_r16(int64_t k, const void *wp, size_t group_stride, const void *xq, size_t x_stride, float *y,
                       size_t ldy, int nr, int nc) {
    const int64_t nb = k / QK8_0;
    // kActOffset·Σa per (column, block), once per call.
    thread_local GrowBuffer<int32_t> sums;
    int32_t *asum_off = sums.get(size_t(nc) * size_t(nb));
    for (int c = 0; c < nc; ++c) {
        const auto *a = reinterpret_cast<const block_q8_0 *>(static_cast<const char *>(xq) + size_t(c) * x_stride);
        for (int64_t b = 0; b < nb; ++b)
            asum_off[size_t(c) * size_t(nb) + size_t(b)] = Traits::kActOffset * act_sum_vnni(a[b]);
    }
    const int n_groups = (nr + kRepackRows16 - 1) / kRepackRows16;
    // Prefill prefetches (l1); decode (nc = 1) as k_decode_prefetch() says.
    const int decode_pf = nc > 1 ? kPrefetchL1 : k_decode_prefetch();
    // The loops written out rather than through for_each_tile, as in gemm_repacked_k8 (x86/k_repack.h):
    // the driver changed GCC 12's code for the streaming kernels.
    const char *xb = static_cast<const char *>(xq);
    for (int gi = 0; gi < n_groups; ++gi) {
        const auto *g = reinterpret_cast<const typename Traits::GroupBlock *>(static_cast<const char *>(wp) +
                                                                              size_t(gi) * group_stride);
        const int valid = std::min(kRepackRows16, nr - gi * kRepackRows16);
        for (int c0 = 0; c0 < nc; c0 += kColTile16) {
            const int ncc = std::min(kColTile16, nc - c0);
            const block_q8_0 *a[kColTile16];
            const int32_t *off[kColTile16];
            for (int c = 0; c < ncc; ++c) {
                a[c] = reinterpret_cast<const block_q8_0 *>(xb + size_t(c0 + c) * x_stride);
                off[c] = asum_off + size_t(c0 + c) * size_t(nb);
            }
            float *yg = y + size_t(c0) * ldy + size_t(gi) * kRepackRows16;
            switch (ncc) {
                case 1:
                    if (decode_pf == kPrefetchL1)
                        gemm_group16<Traits, 1, kPrefetchL1>(nb, g, a, off, yg, ldy, valid);
                    else if (decode_pf == kPrefetchL2)
                        gemm_group16<Traits, 1, kPrefetchL2>(nb, g, a, off, yg, ldy, valid);
                    else
                        gemm_group16<Traits, 1, kPrefetchOff>(nb, g, a, off, yg, ldy, valid);
                    break;
                case 2: gemm_group16<Traits, 2>(nb, g, a, off, yg, ldy, valid); break;
                case 3: gemm_group16<Traits, 3>(nb, g, a, off, yg, ldy, valid); break;
                case 4: gemm_group16<Traits, 4>(nb, g, a, off, yg, ldy, valid); break;
                case 5: gemm_group16<Traits, 5>(nb, g, a, off, yg, ldy, valid); break;
                case 6: gemm_group16<Traits, 6>(nb, g, a, off, yg, ldy, valid); break;
                case 7: gemm_group16<Traits, 7>(nb, g, a, off, yg, ldy, valid); break;
                default: gemm_group16<Traits, 8>(nb, g, a, off, yg, ldy, valid); break;
            }
        }
    }
}

// The plain-layout tile (weights not repacked): one weight row at a time; each block's 32 q are
// unpacked once as signed bytes (signed_q(block)) and multiplied into up to 4 activation columns,
// signed × signed through vpdpbusd with the sign trick (|w| unsigned, a with w's sign). Each
// column's sum runs over the blocks in order, whatever the column grouping.
template <int CN, typename Block, typename SignedQ>
inline void gemm_plain_cols(int64_t nb, const Block *wr, const block_q8_0 *const *a, float *y, size_t ldy,
                            const SignedQ &signed_q) {
    __m256 acc[CN];
    for (int c = 0; c < CN; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i q = signed_q(wr[b]);
        const __m256i aq = _mm256_abs_epi8(q);
        const float dw = f16(wr[b].d);
#pragma GCC unroll 4
        for (int c = 0; c < CN; ++c) {
            const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a[c][b].qs));
            const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aq, _mm256_sign_epi8(av, q));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw * f16(a[c][b].d)), acc[c]);
        }
    }
    for (int c = 0; c < CN; ++c) y[size_t(c) * ldy] = hsum(acc[c]);
}

template <typename Block, typename SignedQ>
inline void gemm_plain(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y,
                       size_t ldy, int nr, int nc, const SignedQ &signed_q) {
    const auto tile = [&]<int NC>(int r, int c0, const block_q8_0 *const *a) {
        const auto *wr = reinterpret_cast<const Block *>(static_cast<const char *>(w) + size_t(r) * w_stride);
        gemm_plain_cols<NC>(k / 32, wr, a, y + size_t(c0) * ldy + size_t(r), ldy, signed_q);
    };
    for_each_tile<block_q8_0, 4>(nr, 1, xq, x_stride, nc, tile);
}

}  // namespace ktd::avx512
