// The i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) × Q8_K activations, AVX2.
// Layouts and definitions in kernels/ref/iq1.cpp, iq2.cpp, iq3.cpp.
//
// One scheme for all seven: per sub-block of 32 weights a decoder gathers the grid points (one
// 64-bit load per 8 weights, or 32-bit per 4) into one vector, applies the signs with vpsignb
// (explicit sign bytes spread over their 8 weights' bytes and tested bit by bit; 7-bit sign codes
// through a 128-entry table of ±1 bytes), and returns the 32 signed int8 weights q
// with the int16 scale of each half (16 weights). The dot is then vpmaddubsw(|q|, sign(a, q))
// (|q| ≤ 62, pairs never saturate; the decoders return |q| and the signs apart, so the weights
// themselves need no vpsignb), vpmaddwd with the scales, int32 sums per block, and one float
// multiply-add per block with d · d8 · (the type's constant factor). IQ1_S/IQ1_M fold the ±1/8
// shift into the integers: q = 8·grid ± 1 (|q| ≤ 9) and a factor 1/8, exact like the reference's
// split sum.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>

#include "kernels/blocks.h"
#include "kernels/iq_grids.h"
#include "kernels/kernels.h"
#include "kernels/x86/k_quants.h"

namespace ktd::avx2 {
namespace {

// kSigns7[c]: the 8 sign bits of a 7-bit sign code (iq_signs_from7), as a kSignBytes index.
constexpr std::array<uint8_t, 128> make_signs7() {
    std::array<uint8_t, 128> t{};
    for (int c = 0; c < 128; ++c) t[c] = iq_signs_from7(uint32_t(c));
    return t;
}
constexpr std::array<uint8_t, 128> kSigns7 = make_signs7();
// kSignCodes[c]: byte j = −1 if element j is negative under 7-bit sign code c, else +1.
constexpr std::array<uint64_t, 128> make_sign_codes() {
    std::array<uint64_t, 128> t{};
    for (int c = 0; c < 128; ++c)
        for (int j = 0; j < 8; ++j) t[c] |= uint64_t((kSigns7[c] >> j) & 1 ? 0xFF : 0x01) << (8 * j);
    return t;
}
constexpr std::array<uint64_t, 128> kSignCodes = make_sign_codes();

inline uint32_t load_u32(const void *p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

inline __m256i gather8x4(const uint64_t *grid, uint32_t i0, uint32_t i1, uint32_t i2, uint32_t i3) {
    return _mm256_set_epi64x(int64_t(grid[i3]), int64_t(grid[i2]), int64_t(grid[i1]), int64_t(grid[i0]));
}
// Sign bytes for 32 weights from 4 explicit sign bytes (bit j of byte l: weight 8l + j negative),
// in SIMD: byte l copied to the 8 bytes of its weights, each tested against its bit.
inline __m256i signs_from_bytes(uint32_t s) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(int(s)), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2,
                                                     2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bits = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits), _mm256_set1_epi8(1));
}
// ... and from 4 7-bit sign codes (one 64-bit table entry each).
inline __m256i signs_from_codes(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
    return _mm256_set_epi64x(int64_t(kSignCodes[c3]), int64_t(kSignCodes[c2]), int64_t(kSignCodes[c1]),
                             int64_t(kSignCodes[c0]));
}
inline __m256i signs_from_codes(uint32_t a) { return signs_from_codes(a & 127, (a >> 7) & 127, (a >> 14) & 127, (a >> 21) & 127); }
// int16 scales: sc0 in the low lane (weights 0..15), sc1 in the high lane (16..31).
inline __m256i half_scales(int sc0, int sc1) { return _mm256_set_m128i(_mm_set1_epi16(int16_t(sc1)), _mm_set1_epi16(int16_t(sc0))); }

// Per type: Block, kFactor (the constant in front of d · d8 · Σ), d(block) the float block scale
// in the dequantizer's form, dequant_factor for the dequantizer (y = (d·s) · (q · dequant_factor)),
// and decode(block, ib, mag, sgn, s0, s1): the 32 weights of sub-block ib as magnitudes (uint8) and
// a vector of their signs (nonzero bytes), s0/s1 the integer
// scales (2·ls + 1) of its halves.
struct IQ2XXS {
    using Block = block_iq2_xxs;
    static constexpr float kFactor = 0.125f;
    static float d(const Block &x) { return f16(x.d); }
    static void decode(const Block &x, int ib, __m256i &mag, __m256i &sgn, int &s0, int &s1) {
        const uint32_t a0 = load_u32(x.qs + 4 * ib), a1 = load_u32(x.qs + 4 * ib + 2);
        const __m256i g = gather8x4(iq2xxs_grid, a0 & 0xFF, (a0 >> 8) & 0xFF, (a0 >> 16) & 0xFF, a0 >> 24);
        mag = g;
        sgn = signs_from_codes(a1);
        s0 = s1 = 2 * int(a1 >> 28) + 1;
    }
};

struct IQ2XS {
    using Block = block_iq2_xs;
    static constexpr float kFactor = 0.125f;
    static float d(const Block &x) { return f16(x.d); }
    static void decode(const Block &x, int ib, __m256i &mag, __m256i &sgn, int &s0, int &s1) {
        const uint16_t *p = x.qs + 4 * ib;
        const __m256i g = gather8x4(iq2xs_grid, p[0] & 511, p[1] & 511, p[2] & 511, p[3] & 511);
        mag = g;
        sgn = signs_from_codes(p[0] >> 9, p[1] >> 9, p[2] >> 9, p[3] >> 9);
        s0 = 2 * (x.scales[ib] & 0xF) + 1;
        s1 = 2 * (x.scales[ib] >> 4) + 1;
    }
};

struct IQ2S {
    using Block = block_iq2_s;
    static constexpr float kFactor = 0.125f;
    static float d(const Block &x) { return f16(x.d); }
    static void decode(const Block &x, int ib, __m256i &mag, __m256i &sgn, int &s0, int &s1) {
        const uint8_t *p = x.qs + 4 * ib;
        const uint32_t h = x.qh[ib];
        const __m256i g = gather8x4(iq2s_grid, p[0] | (h & 3) << 8, p[1] | ((h >> 2) & 3) << 8,
                                    p[2] | ((h >> 4) & 3) << 8, p[3] | ((h >> 6) & 3) << 8);
        mag = g;
        sgn = signs_from_bytes(load_u32(x.qs + 32 + 4 * ib));
        s0 = 2 * (x.scales[ib] & 0xF) + 1;
        s1 = 2 * (x.scales[ib] >> 4) + 1;
    }
};

struct IQ3XXS {
    using Block = block_iq3_xxs;
    static constexpr float kFactor = 0.25f;
    static float d(const Block &x) { return f16(x.d); }
    static void decode(const Block &x, int ib, __m256i &mag, __m256i &sgn, int &s0, int &s1) {
        const uint8_t *p = x.qs + 8 * ib;
        const __m256i g = _mm256_setr_epi32(int(iq3xxs_grid[p[0]]), int(iq3xxs_grid[p[1]]), int(iq3xxs_grid[p[2]]),
                                            int(iq3xxs_grid[p[3]]), int(iq3xxs_grid[p[4]]), int(iq3xxs_grid[p[5]]),
                                            int(iq3xxs_grid[p[6]]), int(iq3xxs_grid[p[7]]));
        const uint32_t a = load_u32(x.qs + 64 + 4 * ib);
        mag = g;
        sgn = signs_from_codes(a);
        s0 = s1 = 2 * int(a >> 28) + 1;
    }
};

struct IQ3S {
    using Block = block_iq3_s;
    static constexpr float kFactor = 1.0f;
    static float d(const Block &x) { return f16(x.d); }
    static void decode(const Block &x, int ib, __m256i &mag, __m256i &sgn, int &s0, int &s1) {
        const uint8_t *p = x.qs + 8 * ib;
        const uint32_t h = x.qh[ib];
        const auto gi = [&](int j) { return int(iq3s_grid[p[j] | ((h << (8 - j)) & 256)]); };
        const __m256i g = _mm256_setr_epi32(gi(0), gi(1), gi(2), gi(3), gi(4), gi(5), gi(6), gi(7));
        mag = g;
        sgn = signs_from_bytes(load_u32(x.signs + 4 * ib));
        s0 = s1 = 2 * ((x.scales[ib / 2] >> (4 * (ib % 2))) & 0xF) + 1;
    }
};

// q = 8·grid + δ (δ = ±1 per byte) for the ternary grid.
inline __m256i iq1_values(__m256i g, __m256i delta) { return _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), delta); }

struct IQ1S {
    using Block = block_iq1_s;
    static constexpr float kFactor = 0.125f;
    static float d(const Block &x) { return f16(x.d); }
    static void decode(const Block &x, int ib, __m256i &mag, __m256i &sgn, int &s0, int &s1) {
        const uint8_t *p = x.qs + 4 * ib;
        const uint32_t h = x.qh[ib];
        const __m256i g = gather8x4(iq1s_grid, p[0] | (h & 7) << 8, p[1] | ((h >> 3) & 7) << 8,
                                    p[2] | ((h >> 6) & 7) << 8, p[3] | ((h >> 9) & 7) << 8);
        sgn = iq1_values(g, _mm256_set1_epi8(int8_t(1 - int((h >> 14) & 2))));  // bit 15: −1
        mag = _mm256_sign_epi8(sgn, sgn);
        s0 = s1 = 2 * int((h >> 12) & 7) + 1;
    }
};

struct IQ1M {
    using Block = block_iq1_m;
    static constexpr float kFactor = 0.125f;
    static uint16_t sc(const Block &x, int i) { return uint16_t(x.scales[2 * i] | x.scales[2 * i + 1] << 8); }
    static float d(const Block &x) {
        return f16(uint16_t((sc(x, 0) >> 12) | ((sc(x, 1) >> 8) & 0x00F0) | ((sc(x, 2) >> 4) & 0x0F00) | (sc(x, 3) & 0xF000)));
    }
    static void decode(const Block &x, int ib, __m256i &mag, __m256i &sgn, int &s0, int &s1) {
        const uint8_t *p = x.qs + 4 * ib;
        const uint32_t h = uint32_t(x.qh[2 * ib]) | uint32_t(x.qh[2 * ib + 1]) << 8;  // 4 nibbles
        const __m256i g = gather8x4(iq1s_grid, p[0] | (h & 7) << 8, p[1] | ((h >> 4) & 7) << 8,
                                    p[2] | ((h >> 8) & 7) << 8, p[3] | ((h >> 12) & 7) << 8);
        // δ of group l: −1 where bit 3 of nibble l is set (all bytes of its 64-bit lane), else +1.
        const __m256i bit3 = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(int64_t(h)), _mm256_setr_epi64x(0, 4, 8, 12)),
                                              _mm256_set1_epi64x(8));
        const __m256i neg = _mm256_cmpeq_epi64(bit3, _mm256_set1_epi64x(8));
        sgn = iq1_values(g, _mm256_or_si256(neg, _mm256_set1_epi8(1)));
        mag = _mm256_sign_epi8(sgn, sgn);
        const uint32_t s = sc(x, ib / 2) >> (6 * (ib % 2));  // scales of halves 2ib, 2ib + 1
        s0 = 2 * int(s & 7) + 1;
        s1 = 2 * int((s >> 3) & 7) + 1;
    }
};

template <typename T>
void dequantize_row(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const typename T::Block *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = T::d(x[b]);
        for (int ib = 0; ib < 8; ++ib) {
            __m256i mag, sgn;
            int s0, s1;
            T::decode(x[b], ib, mag, sgn, s0, s1);
            __m256 v[4];
            cvt_x32_ps<true>(_mm256_sign_epi8(mag, sgn), v);
            float *out = y + b * QK_K + 32 * ib;
            // gguf-py: (d·(0.5 + ls)·0.25)·grid·sign (IQ2), (d·(0.5 + ls)·0.5)·... (IQ3_XXS),
            // (d·(1 + 2ls))·... (IQ3_S), (d·(2s + 1))·(grid + δ) (IQ1): the sub-block scale below
            // is the same float product, and q·(1/8) is exactly grid + δ for IQ1.
            for (int i = 0; i < 4; ++i) {
                const int s = i < 2 ? s0 : s1;
                float ds;
                __m256 vi = v[i];
                if constexpr (std::is_same_v<T, IQ1S> || std::is_same_v<T, IQ1M>) {
                    ds = d * float(s);
                    vi = _mm256_mul_ps(vi, _mm256_set1_ps(0.125f));
                } else if constexpr (std::is_same_v<T, IQ3S>) {
                    ds = d * float(s);
                } else {
                    ds = d * (0.5f + float((s - 1) / 2)) * (std::is_same_v<T, IQ3XXS> ? 0.5f : 0.25f);
                }
                _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_set1_ps(ds), vi));
            }
        }
    }
}

template <typename T>
struct Dot {
    template <int NC>
    static void dot(int64_t nb, const typename T::Block *w, const block_q8_K *const *a, float *out) {
        __m256 acc[NC];
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m256i sumi[NC];
            for (int c = 0; c < NC; ++c) sumi[c] = _mm256_setzero_si256();
            for (int ib = 0; ib < 8; ++ib) {
                __m256i mag, sgn;
                int s0, s1;
                T::decode(w[b], ib, mag, sgn, s0, s1);
                const __m256i sc = half_scales(s0, s1);
                for (int c = 0; c < NC; ++c) {
                    const __m256i p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(load256(a[c][b].qs + 32 * ib), sgn));
                    sumi[c] = _mm256_add_epi32(sumi[c], _mm256_madd_epi16(p, sc));
                }
            }
            const float d = T::d(w[b]) * T::kFactor;
            for (int c = 0; c < NC; ++c)
                acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[c][b].d), _mm256_cvtepi32_ps(sumi[c]), acc[c]);
        }
        for (int c = 0; c < NC; ++c) out[c] = hsum(acc[c]);
    }
};

// The tile. Up to kMaxCols activation columns (decode): Dot<T> on each row, the weights decoded
// in registers as they stream in. More (prefill): the decoding would be repeated for every group of
// kMaxCols columns, and it costs more than the dot products, so each row is decoded once per block
// of kPrefillCols columns into a per-thread buffer (magnitudes, signs and int16 scales per
// sub-block, 3 bytes per weight: an L1/L2-sized row) and every column group of the block reads it from
// there. The arithmetic and its order are Dot<T>'s, so the result is the same bits either way.
constexpr int kPrefillCols = 64;
struct DecodedSub {
    __m256i mag, sgn, sc;
};

template <typename T>
void gemm_tile_iq(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y, size_t ldy,
                  int nr, int nc) {
    using Block = typename T::Block;
    if (nc <= kMaxCols) {
        gemm_tile<Block, Dot<T>>(k, w, w_stride, xq, x_stride, y, ldy, nr, nc);
        return;
    }
    const int64_t nb = k / QK_K;
    thread_local GrowBuffer<DecodedSub> qbuf;
    thread_local GrowBuffer<float> dbuf;
    DecodedSub *dec = qbuf.get(size_t(nb) * 8);
    float *ds = dbuf.get(size_t(nb));
    const char *xb = static_cast<const char *>(xq);
    for (int cb = 0; cb < nc; cb += kPrefillCols) {
        const int cb_end = std::min(nc, cb + kPrefillCols);
        for (int r = 0; r < nr; ++r) {
            const auto *wr = reinterpret_cast<const Block *>(static_cast<const char *>(w) + size_t(r) * w_stride);
            for (int64_t b = 0; b < nb; ++b) {
                ds[b] = T::d(wr[b]) * T::kFactor;
                for (int ib = 0; ib < 8; ++ib) {
                    int s0, s1;
                    T::decode(wr[b], ib, dec[b * 8 + ib].mag, dec[b * 8 + ib].sgn, s0, s1);
                    dec[b * 8 + ib].sc = half_scales(s0, s1);
                }
            }
            for (int c0 = cb; c0 < cb_end; c0 += kMaxCols) {
                const int ncc = std::min(kMaxCols, cb_end - c0);
                const block_q8_K *a[kMaxCols];
                for (int c = 0; c < ncc; ++c) a[c] = reinterpret_cast<const block_q8_K *>(xb + size_t(c0 + c) * x_stride);
                with_cols<kMaxCols>(ncc, [&]<int NC>() {
                    __m256 acc[NC];
                    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
                    for (int64_t b = 0; b < nb; ++b) {
                        __m256i sumi[NC];
                        for (int c = 0; c < NC; ++c) sumi[c] = _mm256_setzero_si256();
                        for (int ib = 0; ib < 8; ++ib) {
                            const DecodedSub &d = dec[b * 8 + ib];
                            for (int c = 0; c < NC; ++c) {
                                const __m256i p = _mm256_maddubs_epi16(d.mag, _mm256_sign_epi8(load256(a[c][b].qs + 32 * ib), d.sgn));
                                sumi[c] = _mm256_add_epi32(sumi[c], _mm256_madd_epi16(p, d.sc));
                            }
                        }
                        for (int c = 0; c < NC; ++c)
                            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(ds[b] * a[c][b].d), _mm256_cvtepi32_ps(sumi[c]), acc[c]);
                    }
                    for (int c = 0; c < NC; ++c) y[size_t(c0 + c) * ldy + size_t(r)] = hsum(acc[c]);
                });
            }
        }
    }
}

template <typename T>
constexpr TypeKernels entry(GGMLType type) {
    return TypeKernels{type, GGMLType::Q8_K, dequantize_row<T>, quantize_row_q8_K, gemm_tile_iq<T>};
}

}  // namespace

KTD_REGISTER_KERNELS(Isa::AVX2, entry<IQ2XXS>(GGMLType::IQ2_XXS));
KTD_REGISTER_KERNELS(Isa::AVX2, entry<IQ2XS>(GGMLType::IQ2_XS));
KTD_REGISTER_KERNELS(Isa::AVX2, entry<IQ2S>(GGMLType::IQ2_S));
KTD_REGISTER_KERNELS(Isa::AVX2, entry<IQ3XXS>(GGMLType::IQ3_XXS));
KTD_REGISTER_KERNELS(Isa::AVX2, entry<IQ3S>(GGMLType::IQ3_S));
KTD_REGISTER_KERNELS(Isa::AVX2, entry<IQ1S>(GGMLType::IQ1_S));
KTD_REGISTER_KERNELS(Isa::AVX2, entry<IQ1M>(GGMLType::IQ1_M));

}  // namespace ktd::avx2
