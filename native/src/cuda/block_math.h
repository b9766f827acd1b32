// The arithmetic of the GGUF block formats, written once for the CPU and the GPU: every function
// here is `__host__ __device__` under nvcc and plain inline C++ otherwise, so the CPU build
// compiles the very code the CUDA kernels run and tests it against gguf-py on every CI run, with
// or without a GPU (tests/kernels/test_cuda_block_math.py through ktd._native.cuda_math).
//
// One unit of work is 32 consecutive weights of a row (a "sub32"): a whole Q4_0/Q5_0/Q8_0 block,
// or one eighth of a Q4_K/Q5_K/Q6_K/TQ1_0/TQ2_0 super-block. Every format unpacks to the same form
//     w[i] = d[i / 16] * q[i] - m        q[i] int8, two scales (one per half), one offset
// which makes the int8 dot product with a quantized activation block (ActQ8: 32 int8 with one
// scale, the dp4a input) one code path for all formats:
//     Σ w[i]·a[i] = da · (d[0]·Σ_{i<16} q[i]·qa[i] + d[1]·Σ_{i≥16} q[i]·qa[i] − m·Σ qa[i]).
// The dequantized values are exactly gguf-py's (the same float operations in the same order).
#pragma once
#include <cstdint>

#include "common/float16.h"
#include "common/ggml_types.h"
#include "kernels/blocks.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define KTD_HD __host__ __device__ __forceinline__
#else
#define KTD_HD inline
#endif

namespace ktd::bm {

KTD_HD float half_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h));
#else
    return fp16_to_fp32(h);
#endif
}

KTD_HD float bf16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(uint32_t(h) << 16);
#else
    return bf16_to_fp32(h);
#endif
}

// Four int8 lanes of a and b multiplied and added to c (the dp4a instruction on the GPU).
KTD_HD int dot4(int a, int b, int c) {
#if defined(__CUDA_ARCH__)
    return __dp4a(a, b, c);
#else
    for (int k = 0; k < 4; ++k) c += int(int8_t(uint32_t(a) >> (8 * k))) * int(int8_t(uint32_t(b) >> (8 * k)));
    return c;
#endif
}

struct Sub32 {
    int8_t q[32];
    float d[2];  // scale of q[0..15] and of q[16..31]
    float m;     // subtracted from every weight (the K-quants' mins)
};

// A quantized activation block: a[i] = d * qs[i]; sum = Σ qs[i].
struct ActQ8 {
    float d;
    int sum;
    int8_t qs[32];
};

// --- unpacking, one format each --------------------------------------------------------------

KTD_HD void unpack(const block_q4_0 &b, int /*j*/, Sub32 &s) {
    const float d = half_to_float(b.d);
    for (int i = 0; i < 16; ++i) {
        s.q[i] = int8_t((b.qs[i] & 0xF) - 8);
        s.q[i + 16] = int8_t((b.qs[i] >> 4) - 8);
    }
    s.d[0] = s.d[1] = d;
    s.m = 0.0f;
}

KTD_HD void unpack(const block_q5_0 &b, int /*j*/, Sub32 &s) {
    const float d = half_to_float(b.d);
    const uint32_t qh = uint32_t(b.qh[0]) | uint32_t(b.qh[1]) << 8 | uint32_t(b.qh[2]) << 16 | uint32_t(b.qh[3]) << 24;
    for (int i = 0; i < 16; ++i) {
        const int lo = (b.qs[i] & 0xF) | int(((qh >> i) & 1) << 4);
        const int hi = (b.qs[i] >> 4) | int(((qh >> (i + 16)) & 1) << 4);
        s.q[i] = int8_t(lo - 16);
        s.q[i + 16] = int8_t(hi - 16);
    }
    s.d[0] = s.d[1] = d;
    s.m = 0.0f;
}

KTD_HD void unpack(const block_q8_0 &b, int /*j*/, Sub32 &s) {
    const float d = half_to_float(b.d);
    for (int i = 0; i < 32; ++i) s.q[i] = b.qs[i];
    s.d[0] = s.d[1] = d;
    s.m = 0.0f;
}

// Q4_K/Q5_K: scale and min j (0..7) from the 12 packed bytes (layout in kernels/k_scales.h).
KTD_HD void scale_min_k4(const uint8_t *q, int j, int &sc, int &mn) {
    if (j < 4) {
        sc = q[j] & 63;
        mn = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Sub-block j of 32 of a Q4_K super-block: bytes 32·(j/2).. hold j (low nibbles) and j+1 (high).
KTD_HD void unpack(const block_q4_K &b, int j, Sub32 &s) {
    int sc, mn;
    scale_min_k4(b.scales, j, sc, mn);
    const float d = half_to_float(b.d) * float(sc);
    const uint8_t *qs = b.qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int i = 0; i < 32; ++i) s.q[i] = int8_t((qs[i] >> shift) & 0xF);
    s.d[0] = s.d[1] = d;
    s.m = half_to_float(b.dmin) * float(mn);
}

// Q5_K: as Q4_K plus bit j of qh[i] as the fifth bit of element i of sub-block j.
KTD_HD void unpack(const block_q5_K &b, int j, Sub32 &s) {
    int sc, mn;
    scale_min_k4(b.scales, j, sc, mn);
    const float d = half_to_float(b.d) * float(sc);
    const uint8_t *qs = b.qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int i = 0; i < 32; ++i)
        s.q[i] = int8_t(((qs[i] >> shift) & 0xF) | (((b.qh[i] >> j) & 1) << 4));
    s.d[0] = s.d[1] = d;
    s.m = half_to_float(b.dmin) * float(mn);
}

// Q6_K: 256 weights in two halves of 128; in half h, element l + 32·r (r = 0..3, l = 0..31)
// takes its low 4 bits from ql[64h + l + 32·(r&1)] (low nibble for r < 2, high for r ≥ 2) and
// its high 2 bits from qh[32h + l] at bit 2r; sub-block j = 4h + r, scales[16] one per 16.
KTD_HD void unpack(const block_q6_K &b, int j, Sub32 &s) {
    const int h = j / 4, r = j % 4;
    const uint8_t *ql = b.ql + 64 * h + 32 * (r & 1);
    const uint8_t *qh = b.qh + 32 * h;
    const int lshift = r >= 2 ? 4 : 0;
    for (int l = 0; l < 32; ++l) {
        const int q = ((ql[l] >> lshift) & 0xF) | (((qh[l] >> (2 * r)) & 3) << 4);
        s.q[l] = int8_t(q - 32);
    }
    const float d = half_to_float(b.d);
    s.d[0] = d * float(b.scales[2 * j]);
    s.d[1] = d * float(b.scales[2 * j + 1]);
    s.m = 0.0f;
}

// TQ2_0 (ternary, 2 bits): 256 weights; element 128g + 32r + l (g = 0..1, r = 0..3, l = 0..31)
// is bits 2r..2r+1 of qs[32g + l], minus 1; sub-block j = 4g + r; one scale d.
KTD_HD void unpack(const block_tq2_0 &b, int j, Sub32 &s) {
    const uint8_t *qs = b.qs + 32 * (j / 4);
    const int shift = 2 * (j % 4);
    for (int l = 0; l < 32; ++l) s.q[l] = int8_t(((qs[l] >> shift) & 3) - 1);
    s.d[0] = s.d[1] = half_to_float(b.d);
    s.m = 0.0f;
}

// TQ1_0's trit of byte q at power p (1, 3, 9, 27, 81): the byte times p (mod 256) read as a
// fraction of 256, times 3, floored; minus 1.
KTD_HD int8_t tq1_trit(uint8_t q, int p) { return int8_t(((unsigned(uint8_t(q * p)) * 3u) >> 8) - 1); }

// TQ1_0 (ternary, 1.6875 bits): 256 weights, five trits a byte. Elements 0..159 are trit r of
// qs[l] at 32r + l (r < 5, l < 32); 160..239 trit r of qs[32 + l] at 160 + 16r + l (l < 16);
// 240..255 trit r of qh[l] at 240 + 4r + l (r, l < 4). One scale d.
KTD_HD void unpack(const block_tq1_0 &b, int j, Sub32 &s) {
    const int pow3[5] = {1, 3, 9, 27, 81};
    for (int l = 0; l < 32; ++l) {
        const int e = 32 * j + l;
        if (e < 160) s.q[l] = tq1_trit(b.qs[e % 32], pow3[e / 32]);
        else if (e < 240) s.q[l] = tq1_trit(b.qs[32 + (e - 160) % 16], pow3[(e - 160) / 16]);
        else s.q[l] = tq1_trit(b.qh[(e - 240) % 4], pow3[(e - 240) / 4]);
    }
    s.d[0] = s.d[1] = half_to_float(b.d);
    s.m = 0.0f;
}

// --- what the kernels compute -----------------------------------------------------------------

KTD_HD void dequantize(const Sub32 &s, float *out) {
    for (int i = 0; i < 32; ++i) out[i] = s.d[i / 16] * float(s.q[i]) - s.m;
}

// Σ w[i]·a[i] over one sub32 and one activation block, the integer products through dot4.
KTD_HD float dot(const Sub32 &s, const ActQ8 &a) {
    int sums[2] = {0, 0};
    for (int half = 0; half < 2; ++half)
        for (int k = 0; k < 16; k += 4) {
            const int i = 16 * half + k;
            const int wq = int(uint32_t(uint8_t(s.q[i])) | uint32_t(uint8_t(s.q[i + 1])) << 8 |
                               uint32_t(uint8_t(s.q[i + 2])) << 16 | uint32_t(uint8_t(s.q[i + 3])) << 24);
            const int aq = int(uint32_t(uint8_t(a.qs[i])) | uint32_t(uint8_t(a.qs[i + 1])) << 8 |
                               uint32_t(uint8_t(a.qs[i + 2])) << 16 | uint32_t(uint8_t(a.qs[i + 3])) << 24);
            sums[half] = dot4(wq, aq, sums[half]);
        }
    return a.d * (s.d[0] * float(sums[0]) + s.d[1] * float(sums[1]) - s.m * float(a.sum));
}

// 32 floats → an activation block: d = max|x| / 127, qs = round(x / d) (ties away from zero).
KTD_HD void quantize_act(const float *x, ActQ8 &a) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = x[i] < 0 ? (-x[i] > amax ? -x[i] : amax) : (x[i] > amax ? x[i] : amax);
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
        const float v = x[i] * id;
        const int q = int(v < 0 ? v - 0.5f : v + 0.5f);
        a.qs[i] = int8_t(q);
        sum += q;
    }
    a.d = d;
    a.sum = sum;
}

// Sub-blocks of 32 per block of each format (a row of k weights has k / 32 of them).
template <class Block> struct SubsPerBlock;
template <> struct SubsPerBlock<block_q4_0> { static constexpr int value = 1; };
template <> struct SubsPerBlock<block_q5_0> { static constexpr int value = 1; };
template <> struct SubsPerBlock<block_q8_0> { static constexpr int value = 1; };
template <> struct SubsPerBlock<block_q4_K> { static constexpr int value = 8; };
template <> struct SubsPerBlock<block_q5_K> { static constexpr int value = 8; };
template <> struct SubsPerBlock<block_q6_K> { static constexpr int value = 8; };
template <> struct SubsPerBlock<block_tq1_0> { static constexpr int value = 8; };
template <> struct SubsPerBlock<block_tq2_0> { static constexpr int value = 8; };

// The block formats with a kernel, as listed in messages.
inline constexpr const char *kBlockTypeNames = "Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, TQ1_0, TQ2_0";

// f(Block{}) for the block struct of GGML type t; false (f not called) when t has no kernel here.
// The one list of block formats every dispatch (the CUDA launches, the emulation, the tests) uses.
template <class F>
bool visit_block_type(GGMLType t, F &&f) {
    switch (t) {
        case GGMLType::Q4_0: f(block_q4_0{}); return true;
        case GGMLType::Q5_0: f(block_q5_0{}); return true;
        case GGMLType::Q8_0: f(block_q8_0{}); return true;
        case GGMLType::Q4_K: f(block_q4_K{}); return true;
        case GGMLType::Q5_K: f(block_q5_K{}); return true;
        case GGMLType::Q6_K: f(block_q6_K{}); return true;
        case GGMLType::TQ1_0: f(block_tq1_0{}); return true;
        case GGMLType::TQ2_0: f(block_tq2_0{}); return true;
        default: return false;
    }
}

// Sub-block t (0-based over the row) of a row of blocks.
template <class Block>
KTD_HD void unpack_row_sub(const Block *row, int64_t t, Sub32 &s) {
    constexpr int n = SubsPerBlock<Block>::value;
    unpack(row[t / n], int(t % n), s);
}

}  // namespace ktd::bm
