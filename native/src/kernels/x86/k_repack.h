// Tile kernels of the K-quants' 8-row interleaved layouts (kernels/repacked_k.h), AVX2
// instructions; the AVX-512 entries compile the same code with their flags (32 registers, and the
// integer dot products as VNNI vpdpbusd on 256-bit vectors where KTD_ISA_AVX512 says so). Inline,
// in the including file's ISA namespace (kernels/x86/common.h).
//
// Register tile: the 8 rows of a group (one lane each) × up to kMaxCols activation columns. Each
// 32-element chunk of the group's weights is decoded once into eight registers and dotted with
// every column of the tile (one vpbroadcastd of 4 activation bytes + one vpmaddubsw per register
// and column), so for n ≥ kMaxCols a weight byte is decoded once per kMaxCols columns.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/repacked_k.h"
#include "kernels/x86/common.h"
#include "kernels/x86/k_quants.h"

namespace ktd::KTD_SIMD_NS {

// Σ_i v[i]·(activation bytes 4i..4i+3 of q) per row lane, int16 pair sums (caller bounds them).
inline __m256i maddubs_chunk4(const __m256i *v, const int8_t *q) {
    const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], bcast4(q)), _mm256_maddubs_epi16(v[1], bcast4(q + 4)));
    const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(v[2], bcast4(q + 8)), _mm256_maddubs_epi16(v[3], bcast4(q + 12)));
    return _mm256_add_epi16(s01, s23);
}

// The scales and mins of a block_q4_Kx8 (repacked_k.h) as the tiles use them. The 64 scales and
// mins are bytes in index order 8j + r (16-bit shifts: the masks drop the bits that cross bytes).
// Scales: sub-blocks 2p, 2p+1 are the 16 bytes of pair p, broadcast to both 128-bit halves.
inline void q4_Kx8_scale_pairs(const block_q4_Kx8 &g, __m256i pairs[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i nl = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.scl));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.sh));
    const __m256i sc_lo = _mm256_or_si256(_mm256_and_si256(nl, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
    const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nl, 4), m4),
                                          _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
    pairs[0] = _mm256_permute2x128_si256(sc_lo, sc_lo, 0x00);
    pairs[1] = _mm256_permute2x128_si256(sc_lo, sc_lo, 0x11);
    pairs[2] = _mm256_permute2x128_si256(sc_hi, sc_hi, 0x00);
    pairs[3] = _mm256_permute2x128_si256(sc_hi, sc_hi, 0x11);
}
// Sub-block j's scale of row r in lane r, as the int16 pair (s, s).
inline __m256i q4_Kx8_chunk_scale(const __m256i pairs[4], int j) {
    const __m256i pick_even = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,  //
                                               4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
    const __m256i pick_odd = _mm256_add_epi8(pick_even, _mm256_setr_epi8(8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0,  //
                                                                         8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0));
    return _mm256_shuffle_epi8(pairs[j / 2], j % 2 ? pick_odd : pick_even);
}
// Mins: mins[p] int16 [2r + h] = m[2p + h][r], for one vpmaddwd per two sub-blocks.
inline void q4_Kx8_mins(const block_q4_Kx8 &g, __m256i mins[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i ml = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.mnl));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.sh));
    const __m256i mn_lo = _mm256_or_si256(_mm256_and_si256(ml, m4), _mm256_and_si256(h, m30));
    const __m256i mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ml, 4), m4),
                                          _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
    const __m256i pick_min = _mm256_setr_epi8(0, -1, 8, -1, 1, -1, 9, -1, 2, -1, 10, -1, 3, -1, 11, -1,  //
                                              4, -1, 12, -1, 5, -1, 13, -1, 6, -1, 14, -1, 7, -1, 15, -1);
    mins[0] = _mm256_shuffle_epi8(_mm256_permute2x128_si256(mn_lo, mn_lo, 0x00), pick_min);
    mins[1] = _mm256_shuffle_epi8(_mm256_permute2x128_si256(mn_lo, mn_lo, 0x11), pick_min);
    mins[2] = _mm256_shuffle_epi8(_mm256_permute2x128_si256(mn_hi, mn_hi, 0x00), pick_min);
    mins[3] = _mm256_shuffle_epi8(_mm256_permute2x128_si256(mn_hi, mn_hi, 0x11), pick_min);
}
// acc += d·da·isum − dmin·da·Σ_j m[j]·(activation sum of sub-block j), per row lane.
inline __m256 q4_Kx8_accumulate(__m256 d8, __m256 dmin8, const __m256i mins[4], const block_q8_K &a, __m256i isum,
                                __m256 acc) {
    const __m128i bs = bsums_32(a);  // int16 × 8: sums of the 8 sub-blocks
    __m256i msum = _mm256_madd_epi16(mins[0], _mm256_broadcastd_epi32(bs));
    msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[1], _mm256_broadcastd_epi32(_mm_shuffle_epi32(bs, 0x55))));
    msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[2], _mm256_broadcastd_epi32(_mm_shuffle_epi32(bs, 0xAA))));
    msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[3], _mm256_broadcastd_epi32(_mm_shuffle_epi32(bs, 0xFF))));
    const __m256 ad = _mm256_set1_ps(a.d);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d8, ad), _mm256_cvtepi32_ps(isum), acc);
    return _mm256_fnmadd_ps(_mm256_mul_ps(dmin8, ad), _mm256_cvtepi32_ps(msum), acc);
}

struct Q4_Kx8 {
    using GroupBlock = block_q4_Kx8;
    // PF = kPrefetchL2: the block at `ahead` is prefetched over this block's 8 steps
    // (gemm_group_k8); any other PF prefetches nothing here.
    template <int NC, int PF = kPrefetchOff>
    static inline void dot_group(const GroupBlock &g, const block_q8_K *const *a, __m256 *acc, const char *ahead) {
        __m256i pairs[4];
        q4_Kx8_scale_pairs(g, pairs);
        __m256i isum[NC];
        for (int c = 0; c < NC; ++c) isum[c] = _mm256_setzero_si256();
        // Unrolled: left rolled, GCC 12 kept the scale pairs on the stack, loaded pairs[j / 2]
        // through an index and branched on j's parity in every chunk. Measured hot (512 x 2048, one
        // thread, builds alternated in 10 rounds, Zen 4): the GEMV 1.12x (AVX2) and 1.06x (AVX-512
        // tier), the n = 2..128 tiles 1.09-1.10x (AVX2) and 1.01-1.07x. The same pragma on Q6_Kx8's
        // chunk loop made its AVX2 GEMV 16% slower (16 registers) and its AVX-512 one no faster.
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            if constexpr (PF == kPrefetchL2)
                prefetch_part(ahead, sizeof(GroupBlock) * j / 8, sizeof(GroupBlock) * (j + 1) / 8);
            __m256i v[8];
            load_nibbles(g.qs + 128 * j, v);
            const __m256i sc = q4_Kx8_chunk_scale(pairs, j);
#if defined(KTD_ISA_AVX512)
            // VNNI: vpdpbusd sums the 4 products of a lane in int32 (no int16 bound); the scale
            // is the low int16 of each lane of sc (its high int16 is the same byte, so mask it).
            const __m256i sc32 = _mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF));
            for (int c = 0; c < NC; ++c) {
                const int8_t *q = a[c]->qs + 32 * j;
                __m256i s = _mm256_setzero_si256();
                for (int i = 0; i < 8; ++i) s = _mm256_dpbusd_epi32(s, v[i], bcast4(q + 4 * i));
                isum[c] = _mm256_add_epi32(isum[c], _mm256_mullo_epi32(s, sc32));
            }
#else
            for (int c = 0; c < NC; ++c) {
                // 8 registers × 2 products ≤ 15·127 each: |int16 sum| ≤ 30480.
                const int8_t *q = a[c]->qs + 32 * j;
                const __m256i s = _mm256_add_epi16(maddubs_chunk4(v, q), maddubs_chunk4(v + 4, q + 16));
                isum[c] = _mm256_add_epi32(isum[c], _mm256_madd_epi16(s, sc));
            }
#endif
        }
        __m256i mins[4];
        q4_Kx8_mins(g, mins);
        const __m256 d8 = f16x8(g.d), dmin8 = f16x8(g.dmin);
        for (int c = 0; c < NC; ++c) acc[c] = q4_Kx8_accumulate(d8, dmin8, mins, *a[c], isum[c], acc[c]);
    }
};

// Q6_K: per chunk s (32 elements of the 8 rows, one contiguous block_q6_Kx8_chunk), the two
// sub-blocks h = 0, 1 one after the other: three loaded registers give the sub-block's four
// registers of q (the low 6 bits of each, and register 3 from their top 2 bits: 11 operations,
// repacked_k.h), dotted with every column and scaled by that sub-block's scales. Taking the
// halves in turn keeps 4 weight registers live instead of 8, and the −32 offset is summed after
// the chunk loop (from the scales again, in L1), so the loop holds NC accumulators, not 2·NC:
// at NC = 1 version 1's loop kept both accumulators and a weight register on the stack (AVX2,
// 16 registers). Integer sums only, so the order does not change the result.
struct Q6_Kx8 {
    using GroupBlock = block_q6_Kx8;
    template <int NC, int PF = kPrefetchOff>  // PF, ahead: as Q4_Kx8's
    static inline void dot_group(const GroupBlock &g, const block_q8_K *const *a, __m256 *acc, const char *ahead) {
        const __m256i m3f = _mm256_set1_epi8(0x3F), mc0 = _mm256_set1_epi8(char(0xC0));
        __m256i isum[NC];
        for (int c = 0; c < NC; ++c) isum[c] = _mm256_setzero_si256();
        for (int s = 0; s < 8; ++s) {
            if constexpr (PF == kPrefetchL2)
                prefetch_part(ahead, sizeof(GroupBlock) * s / 8, sizeof(GroupBlock) * (s + 1) / 8);
            const block_q6_Kx8_chunk &ch = g.c[s];
            // int16 [2r + h] → lane r = that int16 in both halves.
            const __m256i sc2 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(ch.scales)));
            for (int h = 0; h < 2; ++h) {
                const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,  //
                                                      0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
                const __m256i sc = _mm256_shuffle_epi8(sc2, _mm256_add_epi8(pick, _mm256_set1_epi8(char(2 * h))));
                const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(ch.q + 96 * h));
                const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(ch.q + 96 * h + 32));
                const __m256i b2 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(ch.q + 96 * h + 64));
                // Register 3: bits 6-7 of b0, b1, b2 to bits 0-1, 2-3, 4-5, Horner-wise (16-bit
                // shifts; masked first, so no bit crosses into the byte below).
                __m256i t = _mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(b0, mc0), 2), _mm256_and_si256(b1, mc0));
                t = _mm256_or_si256(_mm256_srli_epi16(t, 2), _mm256_and_si256(b2, mc0));
                const __m256i v[4] = {_mm256_and_si256(b0, m3f), _mm256_and_si256(b1, m3f), _mm256_and_si256(b2, m3f),
                                      _mm256_srli_epi16(t, 2)};
#if defined(KTD_ISA_AVX512)
                // VNNI: the sub-block's 16 products per lane in int32, times the int32 scale (the
                // sign-extended low int16 of each lane of sc).
                const __m256i sc32 = _mm256_srai_epi32(_mm256_slli_epi32(sc, 16), 16);
                for (int c = 0; c < NC; ++c) {
                    const int8_t *q = a[c]->qs + 32 * s + 16 * h;
                    __m256i e = _mm256_setzero_si256();
                    for (int i = 0; i < 4; ++i) e = _mm256_dpbusd_epi32(e, v[i], bcast4(q + 4 * i));
                    isum[c] = _mm256_add_epi32(isum[c], _mm256_mullo_epi32(e, sc32));
                }
#else
                for (int c = 0; c < NC; ++c) {
                    // q ≤ 63: two registers' products per int16 sum, ≤ 4·63·127 = 32004.
                    const int8_t *q = a[c]->qs + 32 * s + 16 * h;
                    const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], bcast4(q)), _mm256_maddubs_epi16(v[1], bcast4(q + 4)));
                    const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(v[2], bcast4(q + 8)), _mm256_maddubs_epi16(v[3], bcast4(q + 12)));
                    isum[c] = _mm256_add_epi32(isum[c], _mm256_add_epi32(_mm256_madd_epi16(p0, sc), _mm256_madd_epi16(p1, sc)));
                }
#endif
            }
        }
        const __m256 d8 = f16x8(g.d);
        for (int c = 0; c < NC; ++c) {
            // Σ sc·(q − 32)·a = Σ sc·q·a − 32·Σ_sb sc_sb·(activation sum of sub-block sb).
            __m256i osum = _mm256_setzero_si256();
            for (int s = 0; s < 8; ++s) {
                const __m256i sc2 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(g.c[s].scales)));
                int32_t bs;
                std::memcpy(&bs, a[c]->bsums + 2 * s, 4);
                osum = _mm256_add_epi32(osum, _mm256_madd_epi16(sc2, _mm256_set1_epi32(bs)));
            }
            const __m256i sumi = _mm256_sub_epi32(isum[c], _mm256_slli_epi32(osum, 5));
            acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(a[c]->d)), _mm256_cvtepi32_ps(sumi), acc[c]);
        }
    }
};

// Software prefetch of the weight stream in the decode (nc = 1) GEMV, where k_decode_prefetch()
// says so (kernels/kernels.h): prefetch_ahead (kPrefetchBytes in l1, kPrefetchL2Bytes in l2), and
// each tile's head (prefetch_head). Whether it pays depends on the core: on an AMD Zen 3 the l1
// prefetch lifts the one-thread GEMV from DRAM from about 80% of the read bandwidth to about
// 100%; on an AMD Zen 4 the same prefetch makes it slower, in both tiers; on an Intel Xeon where
// l1 is slower, prefetcht1 4-32 KiB ahead (the l2 mode) is faster than none and prefetcht0 at any
// distance slower, as is prefetching every other line only (docs/perf/, per CPU). Not across a
// whole prefill GEMM (nc > 1): it is compute-bound there, and prefetching in every tile cost the
// n = 128 GEMM up to 30% at one thread; in prefill only the first column tile of each chunk
// prefetches (gemm_repacked_k8). The l1 distance: 4-16 KiB ahead all streamed 1.4-1.8x faster
// than no prefetch when first measured (under load), 2 KiB less so; _MM_HINT_NTA was slower than
// none.
// In l2 the K-quant tiles spread a block's prefetches over its 8 steps (prefetch_part: 2-4 lines
// between the loads of each step) instead of issuing its 18 (Q4_K) or 27 (Q6_K) lines in one
// burst before it: the burst starved the loads (a Q4_K GEMV at about 0.88x the read loop's
// bandwidth with it, 0.96-1.00x spread; docs/perf/2026-12-05-intel-xeon-300mib-l3.md). The l1
// mode keeps its burst: it is the one measured on the Zen 3.
constexpr size_t kPrefetchBytes = 8192;

// The 8 rows of group `g` (rows_valid of them real) × NC columns over all nb super-blocks; PF:
// the decode prefetch mode (kernels.h).
template <typename Traits, int NC, int PF = kPrefetchOff>
inline void gemm_group_k8(int64_t nb, const typename Traits::GroupBlock *g, const block_q8_K *const *a, float *y,
                          size_t ldy, int rows_valid) {
    __m256 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    const block_q8_K *p[NC];
    for (int64_t b = 0; b < nb; ++b) {
        // Software prefetch ahead of the weight stream (groups are contiguous, so this runs on
        // into the next group): on a Zen 3 one core's hardware prefetchers alone keep too few
        // lines in flight to reach DRAM bandwidth. The lines of the block a distance ahead are
        // requested once each: in l1, all of them before block b (the + 63 covers a block that
        // does not start a line); in l2, spread over block b's 8 steps (prefetch_part).
        const char *ahead = reinterpret_cast<const char *>(g + b) + prefetch_ahead<PF>(kPrefetchBytes);
        for (int c = 0; c < NC; ++c) p[c] = a[c] + b;
        if constexpr (PF == kPrefetchL2) {
            Traits::template dot_group<NC, PF>(g[b], p, acc, ahead);
        } else {
            prefetch_lines<PF>(ahead, sizeof(typename Traits::GroupBlock) + 63);
            Traits::template dot_group<NC>(g[b], p, acc, nullptr);
        }
    }
    for (int c = 0; c < NC; ++c) store_rows8(acc[c], y + size_t(c) * ldy, rows_valid);
}

// Prefetches the first distance of a tile's groups, which the prefetch inside gemm_group_k8 runs
// ahead of: decode reads many small matrices in turn (MoE experts), each starting cold.
template <int PF = kPrefetchL1>
inline void prefetch_head(const char *wb, int nr, size_t group_stride) {
    const int n_groups = (nr + kRepackRowsK - 1) / kRepackRowsK;
    if constexpr (PF != kPrefetchOff)
        prefetch_lines<kPrefetchL1>(wb, std::min(prefetch_ahead<PF>(kPrefetchBytes), size_t(n_groups) * group_stride));
}

// TypeKernels::gemm_repacked for the K-quant 8-row layouts. Groups are taken in chunks of about
// kRowChunkBytes so a chunk stays in L2 while every tile of kMaxCols columns passes over it.
// Decode (nc = 1) prefetches where k_decode_prefetch() says so; the same arithmetic either way.
template <typename Traits>
void gemm_repacked_k8(int64_t k, const void *wp, size_t group_stride, const void *xq, size_t x_stride, float *y,
                      size_t ldy, int nr, int nc) {
    using GroupBlock = typename Traits::GroupBlock;
    const int64_t nb = k / QK_K;
    const char *wb = static_cast<const char *>(wp);
    const int n_groups = (nr + kRepackRowsK - 1) / kRepackRowsK;
    const char *xb = static_cast<const char *>(xq);
    if (nc == 1) {
        const block_q8_K *a[1] = {reinterpret_cast<const block_q8_K *>(xb)};
        const auto decode = [&]<int PF>() {
            prefetch_head<PF>(wb, nr, group_stride);
            for (int gi = 0; gi < n_groups; ++gi)
                gemm_group_k8<Traits, 1, PF>(nb, reinterpret_cast<const GroupBlock *>(wb + size_t(gi) * group_stride),
                                             a, y + size_t(gi) * kRepackRowsK, ldy,
                                             std::min(kRepackRowsK, nr - gi * kRepackRowsK));
        };
        switch (k_decode_prefetch()) {
            case kPrefetchL1: decode.template operator()<kPrefetchL1>(); break;
            case kPrefetchL2: decode.template operator()<kPrefetchL2>(); break;
            default: decode.template operator()<kPrefetchOff>(); break;
        }
        return;
    }
    prefetch_head(wb, nr, group_stride);  // prefill keeps the head prefetch it always had
    const int chunk = group_stride >= kRowChunkBytes ? 1 : int(kRowChunkBytes / group_stride);
    // The first column tile of a chunk streams the chunk's weights from DRAM (the later tiles
    // find them in L2). With a few columns, as an MoE expert has in prefill (Qwen3-MoE pp128:
    // ~8 tokens each), that tile is as much memory-bound as compute-bound, so where the decode
    // prefetches (k_decode_prefetch) it prefetches too, and the other tiles do not. Measured on
    // the Zen 3 above, 96 cold expert-sized matrices per call, with and without alternating 8
    // times, 12 cases at 1 and 2 threads, every median faster: Q4_K 768 x 2048 at n = 4, 8, 12
    // 1.6-12% faster, Q6_K 2048 x 768 at n = 8 4-6%; whole forwards (medians and paired medians
    // of alternating runs), Qwen3-MoE bench file pp128 0.99-1.05x and pp512 1.00-1.02x,
    // Qwen2.5-Coder-1.5B pp128 1.02-1.10x. The arithmetic is the same either way.
    const int prefetch_first = k_decode_prefetch();
    // The loops written out rather than through for_each_tile: with the driver, GCC 12 folded the
    // Q6_K weight loads into the shifts and the 172 MB Q6_K output head of the deepseek2 bench file
    // decoded ~60% slower at one thread (perf: 8.1k -> 13.8k samples over 200 steps).
    const auto tiles = [&]<int PF>(int g0, int g1, int c0) {
        const int ncc = std::min(kMaxCols, nc - c0);
        const block_q8_K *a[kMaxCols];
        for (int c = 0; c < ncc; ++c) a[c] = reinterpret_cast<const block_q8_K *>(xb + size_t(c0 + c) * x_stride);
        for (int gi = g0; gi < g1; ++gi) {
            const auto *g = reinterpret_cast<const GroupBlock *>(wb + size_t(gi) * group_stride);
            const int valid = std::min(kRepackRowsK, nr - gi * kRepackRowsK);
            float *yg = y + size_t(c0) * ldy + size_t(gi) * kRepackRowsK;
            switch (ncc) {
                case 1: gemm_group_k8<Traits, 1, PF>(nb, g, a, yg, ldy, valid); break;
                case 2: gemm_group_k8<Traits, 2, PF>(nb, g, a, yg, ldy, valid); break;
                case 3: gemm_group_k8<Traits, 3, PF>(nb, g, a, yg, ldy, valid); break;
                default: gemm_group_k8<Traits, 4, PF>(nb, g, a, yg, ldy, valid); break;
            }
        }
    };
    for (int g0 = 0; g0 < n_groups; g0 += chunk) {
        const int g1 = std::min(n_groups, g0 + chunk);
        for (int c0 = 0; c0 < nc; c0 += kMaxCols) {
            if (c0 == 0 && prefetch_first == kPrefetchL1)
                tiles.template operator()<kPrefetchL1>(g0, g1, c0);
            else if (c0 == 0 && prefetch_first == kPrefetchL2)
                tiles.template operator()<kPrefetchL2>(g0, g1, c0);
            else
                tiles.template operator()<kPrefetchOff>(g0, g1, c0);
        }
    }
}

}  // namespace ktd::KTD_SIMD_NS
