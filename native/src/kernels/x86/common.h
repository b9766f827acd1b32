// What the AVX2 and AVX-512 kernel files share: the horizontal sum, the fp16 conversion, the tile
// driver (the walk over a tile's rows and activation columns), and the small pieces around it.
//
// Everything here is inline, so it lives in the namespace of the including file's ISA (ktd::avx2
// or ktd::avx512, from the KTD_ISA_* macro CMake defines per ISA target): the same inline function
// compiled with different ISA flags in two translation units must not be merged by the linker (an
// AVX-512 copy could otherwise be called on an AVX2-only CPU). For the same reason these headers
// include no header with inline code shared with baseline translation units (common/float16.h...)
// and instantiate no out-of-line std templates (std::vector...): tests/kernels/test_isa_isolation.py checks
// the objects' weak symbols.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/blocks.h"
#include "kernels/kernels.h"

#if defined(KTD_ISA_AVX512)
#define KTD_SIMD_NS avx512
#elif defined(KTD_ISA_AVX2)
#define KTD_SIMD_NS avx2
#else
#error "kernels/x86/ headers are only for the AVX2 and AVX-512 kernel files"
#endif

namespace ktd::avx2 {
// The AVX2 Q8_0 activation quantizer (kernels/avx2/q8_0.cpp), bitwise identical to
// ref::quantize_row_q8_0. The AVX-512 entries use it too: every CPU that runs them runs AVX2.
void quantize_row_q8_0(const float *x, void *y, int64_t k);
}  // namespace ktd::avx2

namespace ktd::KTD_SIMD_NS {

// Σ of the lanes, as (l0 + l2) + (l1 + l3) after folding the 256-bit halves.
inline float hsum(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline float hsum(__m256 v) { return hsum(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); }

// fp16 → fp32 with F16C (exact, as common/float16.h's fp16_to_fp32).
inline float f16(uint16_t h) { return _cvtsh_ss(h); }
inline __m256 f16x8(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(h))); }

// Σ of the 8 int32 lanes.
inline int32_t hsum(__m256i s) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 1));
    return _mm_cvtsi128_si32(t);
}

// Σ of the 32 activation bytes of a Q8_0 block (AVX-512 VNNI has a one-instruction version,
// act_sum_vnni in kernels/avx512/q32_vnni.h).
inline int32_t act_sum(const block_q8_0 &a) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.qs));
    return hsum(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1)));
}

// Broadcast of activation bytes p[0..3] to every 32-bit lane.
inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// The nibble layout of the 8-row groups (kernels/repacked_k.h, kernels/repacked_q32.h): 128 bytes
// → v[0..7] (values 0..15), v[i] the low nibbles of bytes 32i.., v[i + 4] their high nibbles.
inline void load_nibbles(const uint8_t *qs, __m256i v[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * i));
        v[i] = _mm256_and_si256(q, m4);
        v[i + 4] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    }
}

// The decode prefetch (kernels.h k_decode_prefetch) of `bytes` starting at p, one instruction per
// 64-byte line: PF = kPrefetchL1 prefetcht0, kPrefetchL2 prefetcht1, else nothing.
//
// The l2 mode paces its prefetches: the next line's offset adds a stride loaded (relaxed) from
// g_prefetch_pace, which is never written, so the compiler can neither unroll the loop nor hoist
// the load, and every prefetch follows a load that hits L1. Measured on the Xeon where l2 pays
// (family 6 model 167, AVX-512, 480 MiB L3; 2 GiB repacked Q4_K and Q6_K GEMVs from DRAM, one
// thread, the modes alternating call by call): the same prefetcht1 lines issued back to back (the
// unrolled or the tight loop) made Q4_K 1.13x and Q6_K 1.19x slower than no prefetch; paced, 0.82x
// and 0.85-0.91x (faster). A stand-alone loop of the same shape (1152-byte blocks, a few integer
// multiply-adds per 32 bytes) behaves the same: 9.0-12 GB/s back to back, 14-15 paced, 9.6 with
// none. Pacing every other line instead (a 128-byte stride) was slower than none. Where the time
// goes between the two is not established (the line fill buffers are the likely resource); the
// l1 mode keeps the loop measured on the Zen 3.
inline std::atomic<size_t> g_prefetch_pace{64};

// How far ahead of the weight stream the decode prefetch of mode PF runs, bytes: l1_bytes (the
// layout's own l1 distance) in the l1 mode, kPrefetchL2Bytes (kernels.h, every layout) in l2.
template <int PF>
constexpr size_t prefetch_ahead(size_t l1_bytes) {
    return PF == kPrefetchL2 ? kPrefetchL2Bytes : l1_bytes;
}

// (The K-quant tiles spread their l2 prefetch over a block instead: prefetch_part below.)
template <int PF>
inline void prefetch_lines(const char *p, size_t bytes) {
    if constexpr (PF == kPrefetchL1)
        for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    if constexpr (PF == kPrefetchL2)
        for (size_t off = 0; off < bytes; off += g_prefetch_pace.load(std::memory_order_relaxed))
            _mm_prefetch(p + off, _MM_HINT_T1);
}

// The l2 decode prefetch (prefetcht1) of one part of a weight block: the lines that start in
// [p + lo, p + hi). A block's kernel calls it once per step of its loop with the step's share of the
// block's bytes, so the steps together request each line of the block once, a few at a time between
// the block's loads, instead of all of them in one burst before the block (prefetch_lines).
inline void prefetch_part(const char *p, size_t lo, size_t hi) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(p);
    for (uintptr_t line = (base + lo + 63) & ~uintptr_t(63); line < base + hi; line += 64)
        _mm_prefetch(reinterpret_cast<const char *>(line), _MM_HINT_T1);
}

// Stores the 8 row lanes of a group's result, only the first rows_valid (a last partial group).
inline void store_rows8(__m256 acc, float *y, int rows_valid) {
    if (rows_valid == 8) {
        _mm256_storeu_ps(y, acc);
    } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, acc);
        std::memcpy(y, tmp, size_t(rows_valid) * sizeof(float));
    }
}

// Per-thread scratch that only grows (no allocation once warm): new[]/delete[], not std::vector
// (see the top of this file).
template <typename T>
struct GrowBuffer {
    T *p = nullptr;
    size_t cap = 0;
    GrowBuffer() = default;
    GrowBuffer(const GrowBuffer &) = delete;
    GrowBuffer &operator=(const GrowBuffer &) = delete;
    ~GrowBuffer() { delete[] p; }
    T *get(size_t n) {
        if (n > cap) {
            delete[] p;
            p = new T[n];
            cap = n;
        }
        return p;
    }
};

// f.template operator()<NC>() for the runtime column count n (1 ≤ n ≤ Max, Max 4 or 8): kernels
// take their column count as a template argument so that the NC accumulators stay in registers.
// always_inline (also on for_each_tile): inlined late, the driver left GCC a different schedule
// and register allocation of the kernels' inner loops (Q8_0/IQ4_NL AVX2 repacked: 28 instead of
// 15 stack accesses per block, ~10% slower); inlined first, the loops are the hand-written ones'.
template <int Max, typename F>
__attribute__((always_inline)) inline void with_cols(int n, const F &f) {
    static_assert(Max == 4 || Max == 8);
    switch (n) {
        case 1: f.template operator()<1>(); break;
        case 2: f.template operator()<2>(); break;
        case 3: f.template operator()<3>(); break;
        default:
            if constexpr (Max == 8) {
                switch (n) {
                    case 4: f.template operator()<4>(); break;
                    case 5: f.template operator()<5>(); break;
                    case 6: f.template operator()<6>(); break;
                    case 7: f.template operator()<7>(); break;
                    default: f.template operator()<8>(); break;
                }
            } else {
                f.template operator()<4>();
            }
    }
}

// The tile driver. Walks the n_units units of a tile (weight rows, or row groups of a repacked
// layout) in chunks of `chunk` units, and for each chunk the nc activation columns in tiles of up
// to MaxCols: a chunk's weights stay in L2 while every column tile passes over them, a tile's
// activations stay in L1. For each unit u of a chunk and each column tile it calls
//   body.template operator()<NC>(u, c0, a)   columns [c0, c0 + NC), a[c] the activation row of c0 + c.
// Column c always lands in the tile of width min(MaxCols, nc − MaxCols·⌊c / MaxCols⌋), whatever the
// chunk: a kernel whose summation order depends on NC gives the same bits for every chunk size and
// thread split.
template <typename ABlock, int MaxCols, typename Body>
__attribute__((always_inline)) inline void for_each_tile(int n_units, int chunk, const void *xq, size_t x_stride, int nc,
                                                         const Body &body) {
    const char *xb = static_cast<const char *>(xq);
    for (int u0 = 0; u0 < n_units; u0 += chunk) {
        const int u1 = std::min(n_units, u0 + chunk);
        for (int c0 = 0; c0 < nc; c0 += MaxCols) {
            const int ncc = std::min(MaxCols, nc - c0);
            const ABlock *a[MaxCols];
            for (int c = 0; c < ncc; ++c) a[c] = reinterpret_cast<const ABlock *>(xb + size_t(c0 + c) * x_stride);
            for (int u = u0; u < u1; ++u)
                with_cols<MaxCols>(ncc, [&]<int NC>() { body.template operator()<NC>(u, c0, a); });
        }
    }
}

}  // namespace ktd::KTD_SIMD_NS
